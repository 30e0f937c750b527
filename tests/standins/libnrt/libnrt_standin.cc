// A stand-in for libnrt, the Neuron runtime's C library (the real one needs Neuron hardware and cannot be installed
// here). It implements the subset of nrt.h / nrt_experimental.h that neuronbuild's runtime loader calls, with the
// public header's exact signatures and NRT_STATUS codes (NRT major version 2; nrt_instance_info_t with arch_name and
// device_revision; nrt_dtype_t's hexadecimal codes), and enforces the contract a caller must keep:
//   - nrt_init before anything else (NRT_UNINITIALIZED), nothing after nrt_close (NRT_CLOSED);
//   - a NEFF is loaded onto a visible NeuronCore (NEURON_RT_VISIBLE_CORES, else NRT_STANDIN_CORES, default 4);
//   - collectives: every rank of a group loads the same NEFF with the same device count, a distinct device id and
//     its own NeuronCore; a group executes only when complete, every rank calling nrt_execute (concurrently);
//   - nrt_execute: every tensor of the NEFF's I/O table is in the sets, by its name, with its exact size, allocated
//     on the model's NeuronCore, still alive; no unknown names;
//   - tensors are freed once, never while a live tensor set holds them; reads and writes stay in bounds;
//   - nrt_close only once every model is unloaded and every tensor and tensor set freed.
// A broken rule is a "contract violation": one line on stderr, counted (nrt_standin_state), and the call fails with
// the status the real runtime documents for it (NRT_INVALID, NRT_INVALID_HANDLE, ...) when it returns one.
//
// The stand-in NEFF (what tests/standins/neuronx-cc writes) carries the HLO module and the I/O table; nrt_execute
// computes by calling back into the process that loaded this library: the function registered with the stand-in-only
// nrt_standin_set_executor (the test process runs the HLO on XLA:CPU). Stand-in-only entry points (not in nrt.h):
// nrt_standin_set_executor, nrt_standin_fail (the nth next call of a function returns a given status),
// nrt_standin_state (live models, tensors, sets, violations, executions, bytes written to tensors), nrt_standin_last_violation.
// It proves the caller keeps this contract; it does not prove the real libnrt's behaviour or the real NEFF format.

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

extern "C" {

typedef enum {
    NRT_SUCCESS = 0,
    NRT_FAILURE = 1,
    NRT_INVALID = 2,
    NRT_INVALID_HANDLE = 3,
    NRT_RESOURCE = 4,
    NRT_TIMEOUT = 5,
    NRT_HW_ERROR = 6,
    NRT_QUEUE_FULL = 7,
    NRT_LOAD_NOT_ENOUGH_NC = 9,
    NRT_UNSUPPORTED_NEFF_VERSION = 10,
    NRT_FAIL_HOST_MEM_ALLOC = 11,
    NRT_UNINITIALIZED = 13,
    NRT_CLOSED = 14,
    NRT_QUEUE_EMPTY = 15,
    NRT_EXEC_UNIT_UNRECOVERABLE = 101,
    NRT_EXEC_BAD_INPUT = 1002,
    NRT_EXEC_COMPLETED_WITH_NUM_ERR = 1003,
    NRT_EXEC_COMPLETED_WITH_ERR = 1004,
    NRT_EXEC_NC_BUSY = 1005,
    NRT_EXEC_OOB = 1006,
    NRT_COLL_PENDING = 1100,
    NRT_EXEC_HW_ERR_COLLECTIVES = 1200,
} NRT_STATUS;

typedef enum {
    NRT_TENSOR_PLACEMENT_DEVICE,
    NRT_TENSOR_PLACEMENT_HOST,
    NRT_TENSOR_PLACEMENT_VIRTUAL,
} nrt_tensor_placement_t;

typedef enum {
    NRT_FRAMEWORK_TYPE_INVALID = 0,
    NRT_FRAMEWORK_TYPE_NO_FW = 1,
    NRT_FRAMEWORK_TYPE_TENSORFLOW,
    NRT_FRAMEWORK_TYPE_PYTORCH,
    NRT_FRAMEWORK_TYPE_MXNET,
    NRT_FRAMEWORK_TYPE_PRECHECK,
} nrt_framework_type_t;

enum {
    NRT_INSTANCE_UNKNOWN = 0,
    NRT_INSTANCE_INF1 = 1,
    NRT_INSTANCE_TRN1 = 2,
    NRT_INSTANCE_TRN1N = 3,
    NRT_INSTANCE_INF2 = 4,
    NRT_INSTANCE_TRN2 = 5,
    NRT_INSTANCE_TRN3 = 14,
};

enum { NRT_INSTANCE_SIZE_48XL = 7, NRT_INSTANCE_SIZE_UNKNOWN = 9 };

typedef enum nrt_dtype {
    NRT_DTYPE_UNKNOWN = 0x0,
    NRT_DTYPE_FP8_E4 = 0xE,
    NRT_DTYPE_FP8_E5 = 0xF,
    NRT_DTYPE_FLOAT16 = 0x7,
    NRT_DTYPE_BFLOAT16 = 0x6,
    NRT_DTYPE_FLOAT32 = 0xA,
    NRT_DTYPE_UINT8 = 0x3,
    NRT_DTYPE_UINT16 = 0x5,
    NRT_DTYPE_UINT32 = 0x9,
    NRT_DTYPE_UINT64 = 0x1,
    NRT_DTYPE_INT8 = 0x2,
    NRT_DTYPE_INT16 = 0x4,
    NRT_DTYPE_INT32 = 0x8,
    NRT_DTYPE_INT64 = 0xC,
} nrt_dtype_t;

typedef struct nrt_instance_info {
    uint32_t family;
    uint32_t size;
    char arch_name[16];
    char device_revision[8];
} nrt_instance_info_t;

typedef enum nrt_tensor_usage {
    NRT_TENSOR_USAGE_INPUT = 0,
    NRT_TENSOR_USAGE_OUTPUT,
} nrt_tensor_usage_t;

#define NRT_TENSOR_NAME_MAX 256

typedef struct nrt_tensor_info {
    char name[NRT_TENSOR_NAME_MAX];
    nrt_tensor_usage_t usage;
    size_t size;
    nrt_dtype_t dtype;
    uint32_t *shape;
    uint32_t ndim;
} nrt_tensor_info_t;

typedef struct nrt_tensor_info_array {
    uint64_t tensor_count;
    nrt_tensor_info_t tensor_array[];
} nrt_tensor_info_array_t;

typedef struct nrt_model nrt_model_t;
typedef struct nrt_tensor nrt_tensor_t;
typedef void nrt_tensor_set_t;

// The stand-in's executor: computes one execution of a NEFF on `ranks` ranks. For rank r and the NEFF's i-th tensor
// (I/O table order), bufs[r * n + i] is its bytes (sizes[...] long); inputs are read, outputs written. 0 = success,
// anything else is returned by nrt_execute as its status.
typedef int (*nrt_standin_exec_fn)(const void *neff, size_t neff_size, uint32_t ranks, uint32_t n_tensors,
                                   void **bufs, const size_t *sizes);

}  // extern "C"

namespace {

struct IoEntry {
    std::string name;
    bool output;
    std::string dtype;
    size_t size;
    std::vector<uint32_t> shape;
};

struct Tensor {
    nrt_tensor_placement_t placement;
    int vnc;
    size_t size;
    std::string name;
    unsigned char *data;
    int in_sets;
};

struct Set {
    std::map<std::string, Tensor *> tensors;
};

struct Group;

struct Model {
    std::vector<unsigned char> neff;
    std::vector<IoEntry> io;
    int vnc;
    Group *group;  // collectives only
    uint32_t rank;
};

struct Pending {
    Model *model;
    const Set *in;
    Set *out;
};

struct Group {
    std::vector<unsigned char> neff;
    uint32_t count;
    std::map<uint32_t, Model *> ranks;
    std::map<uint32_t, Pending> arrived;
    uint64_t generation = 0;
    int status = NRT_SUCCESS;
};

std::recursive_mutex mu;
pthread_mutex_t exec_mu = PTHREAD_MUTEX_INITIALIZER;
pthread_cond_t exec_cv = PTHREAD_COND_INITIALIZER;
enum State { START, READY, CLOSED } state = START;
int visible_cores = 0;
std::set<Model *> models;
std::set<Tensor *> tensors;
std::set<Set *> sets;
std::set<nrt_tensor_info_array_t *> infos;
std::vector<Group *> groups;
uint64_t violations = 0, executions = 0, written = 0;
std::string last_violation;
nrt_standin_exec_fn executor = nullptr;
std::string fail_call;
int fail_nth = 0, fail_status = 0;

void violation(const char *call, const std::string &what) {
    last_violation = std::string(call) + ": " + what;
    violations++;
    fprintf(stderr, "libnrt stand-in: contract violation: %s\n", last_violation.c_str());
    fflush(stderr);
}

// The armed failure (nrt_standin_fail): the nth call of `call` from now returns the armed status.
bool injected(const char *call, int *status) {
    if (fail_nth <= 0 || fail_call != call) return false;
    if (--fail_nth > 0) return false;
    *status = fail_status;
    fprintf(stderr, "libnrt stand-in: %s fails with status %d (injected)\n", call, fail_status);
    return true;
}

#define GUARD(call)                                                   \
    std::lock_guard<std::recursive_mutex> lock(mu);                   \
    if (state == START) {                                             \
        violation(call, "called before nrt_init");                    \
        return NRT_UNINITIALIZED;                                     \
    }                                                                 \
    if (state == CLOSED) {                                            \
        violation(call, "called after nrt_close");                    \
        return NRT_CLOSED;                                            \
    }                                                                 \
    {                                                                 \
        int injected_status;                                          \
        if (injected(call, &injected_status)) return (NRT_STATUS)injected_status; \
    }

int count_cores() {
    const char *v = getenv("NEURON_RT_VISIBLE_CORES");
    if (v && *v) {  // "0-3", "1,3", "2"
        int n = 0;
        std::string s(v);
        size_t pos = 0;
        while (pos <= s.size()) {
            size_t end = s.find(',', pos);
            std::string part = s.substr(pos, end == std::string::npos ? std::string::npos : end - pos);
            int a, b;
            if (sscanf(part.c_str(), "%d-%d", &a, &b) == 2 && b >= a) n += b - a + 1;
            else if (sscanf(part.c_str(), "%d", &a) == 1) n += 1;
            if (end == std::string::npos) break;
            pos = end + 1;
        }
        return n;
    }
    const char *c = getenv("NRT_STANDIN_CORES");
    return c && *c ? atoi(c) : 4;
}

// The stand-in NEFF: "NEFF\0standin\n" + one JSON line holding "nrt_io": "name:in|out:dtype:bytes:d0xd1;...".
bool parse_neff(const void *bytes, size_t size, std::vector<IoEntry> *io, std::string *why) {
    static const char magic[] = "NEFF\0standin\n";
    if (!bytes || size < sizeof(magic) - 1 || memcmp(bytes, magic, sizeof(magic) - 1) != 0) {
        *why = "not a NEFF (no NEFF header)";
        return false;
    }
    std::string text((const char *)bytes + sizeof(magic) - 1, size - (sizeof(magic) - 1));
    size_t at = text.find("\"nrt_io\": \"");
    if (at == std::string::npos) {
        *why = "the NEFF has no I/O table";
        return false;
    }
    at += strlen("\"nrt_io\": \"");
    size_t end = text.find('"', at);
    std::string table = text.substr(at, end - at);
    size_t pos = 0;
    while (pos < table.size()) {
        size_t stop = table.find(';', pos);
        std::string row = table.substr(pos, stop == std::string::npos ? std::string::npos : stop - pos);
        IoEntry e;
        char name[NRT_TENSOR_NAME_MAX], usage[8], dtype[16], dims[1024] = "";
        size_t bytes_;
        if (sscanf(row.c_str(), "%255[^:]:%7[^:]:%15[^:]:%zu:%1023s", name, usage, dtype, &bytes_, dims) < 4) {
            *why = "malformed I/O table entry '" + row + "'";
            return false;
        }
        e.name = name;
        e.output = strcmp(usage, "out") == 0;
        e.dtype = dtype;
        e.size = bytes_;
        for (char *d = strtok(dims, "x"); d; d = strtok(nullptr, "x")) e.shape.push_back((uint32_t)atoi(d));
        io->push_back(e);
        if (stop == std::string::npos) break;
        pos = stop + 1;
    }
    return true;
}

nrt_dtype_t dtype_code(const std::string &d) {
    static const std::map<std::string, nrt_dtype_t> codes = {
        {"f32", NRT_DTYPE_FLOAT32}, {"bf16", NRT_DTYPE_BFLOAT16}, {"f16", NRT_DTYPE_FLOAT16},
        {"s32", NRT_DTYPE_INT32},   {"s64", NRT_DTYPE_INT64},     {"s16", NRT_DTYPE_INT16},
        {"s8", NRT_DTYPE_INT8},     {"u8", NRT_DTYPE_UINT8},      {"pred", NRT_DTYPE_UINT8},
        {"u16", NRT_DTYPE_UINT16},  {"u32", NRT_DTYPE_UINT32},    {"u64", NRT_DTYPE_UINT64},
        {"f8e4m3fn", NRT_DTYPE_FP8_E4}, {"f8e5m2", NRT_DTYPE_FP8_E5}};
    auto it = codes.find(d);
    return it == codes.end() ? NRT_DTYPE_UNKNOWN : it->second;
}

NRT_STATUS load(const char *call, const void *neff_bytes, size_t size, int32_t vnc, int32_t vnc_count, bool coll,
                uint32_t id, uint32_t count, nrt_model_t **model) {
    if (!model) {
        violation(call, "model is NULL");
        return NRT_INVALID;
    }
    if (vnc_count != -1 && vnc_count != 1) {
        violation(call, "vnc_count must be -1 (deprecated argument), got " + std::to_string(vnc_count));
        return NRT_INVALID;
    }
    if (vnc == -1) vnc = 0;
    if (vnc < 0 || vnc >= visible_cores) {
        violation(call, "NeuronCore " + std::to_string(vnc) + " is not visible (" + std::to_string(visible_cores) +
                            " visible)");
        return NRT_LOAD_NOT_ENOUGH_NC;
    }
    auto *m = new Model();
    std::string why;
    if (!parse_neff(neff_bytes, size, &m->io, &why)) {
        delete m;
        violation(call, why);
        return NRT_INVALID;
    }
    m->neff.assign((const unsigned char *)neff_bytes, (const unsigned char *)neff_bytes + size);
    m->vnc = vnc;
    m->group = nullptr;
    m->rank = id;
    if (coll) {
        if (count == 0 || id >= count) {
            delete m;
            violation(call, "device id " + std::to_string(id) + " is not below the device count " +
                                std::to_string(count));
            return NRT_INVALID;
        }
        Group *g = nullptr;
        for (Group *cand : groups) {
            if (cand->neff == m->neff && cand->ranks.size() < cand->count && !cand->ranks.count(id)) {
                g = cand;
                break;
            }
        }
        if (!g) {
            for (Group *cand : groups) {
                if (cand->ranks.size() < cand->count && cand->count != count && cand->neff == m->neff) {
                    delete m;
                    violation(call, "inconsistent collectives group: device count " + std::to_string(count) +
                                        " where its other ranks said " + std::to_string(cand->count));
                    return NRT_INVALID;
                }
            }
            g = new Group();
            g->neff = m->neff;
            g->count = count;
            groups.push_back(g);
        } else if (g->count != count) {
            delete m;
            violation(call, "inconsistent collectives group: device count " + std::to_string(count) +
                                " where its other ranks said " + std::to_string(g->count));
            return NRT_INVALID;
        }
        for (auto &kv : g->ranks) {
            if (kv.second->vnc == vnc) {
                delete m;
                violation(call, "ranks " + std::to_string(kv.first) + " and " + std::to_string(id) +
                                    " of one collectives group on the same NeuronCore " + std::to_string(vnc));
                return NRT_INVALID;
            }
        }
        g->ranks[id] = m;
        m->group = g;
    }
    models.insert(m);
    *model = (nrt_model_t *)m;
    return NRT_SUCCESS;
}

bool check_set(const char *call, Model *m, const Set *s, bool outputs, std::string *why) {
    if (!sets.count((Set *)s)) {
        *why = std::string(outputs ? "output" : "input") + " tensor set is not a live tensor set";
        return false;
    }
    size_t expected = 0;
    for (const IoEntry &e : m->io) {
        if (e.output != outputs) continue;
        expected++;
        auto it = s->tensors.find(e.name);
        if (it == s->tensors.end()) {
            *why = "the " + std::string(outputs ? "output" : "input") + " set lacks the NEFF's tensor " + e.name;
            return false;
        }
        Tensor *t = it->second;
        if (!tensors.count(t)) {
            *why = "tensor " + e.name + " was freed";
            return false;
        }
        if (t->size != e.size) {
            *why = "tensor " + e.name + " has " + std::to_string(t->size) + " bytes, the NEFF takes " +
                   std::to_string(e.size);
            return false;
        }
        if (t->placement != NRT_TENSOR_PLACEMENT_DEVICE || t->vnc != m->vnc) {
            *why = "tensor " + e.name + " is not on the model's NeuronCore " + std::to_string(m->vnc) +
                   " (placement " + std::to_string(t->placement) + ", NeuronCore " + std::to_string(t->vnc) + ")";
            return false;
        }
    }
    if (s->tensors.size() != expected) {
        for (auto &kv : s->tensors) {
            bool known = false;
            for (const IoEntry &e : m->io) known |= e.output == outputs && e.name == kv.first;
            if (!known) {
                *why = "the " + std::string(outputs ? "output" : "input") + " set holds " + kv.first +
                       ", which the NEFF does not take";
                return false;
            }
        }
    }
    (void)call;
    return true;
}

// Runs the executor over the ranks' sets (every rank's Pending filled in). Called with `mu` not held.
int run(const std::vector<unsigned char> &neff, const std::vector<Pending> &ranks) {
    if (!executor) {
        fprintf(stderr, "libnrt stand-in: nrt_execute: no executor registered (nrt_standin_set_executor)\n");
        return NRT_FAILURE;
    }
    const std::vector<IoEntry> &io = ranks[0].model->io;
    std::vector<void *> bufs;
    std::vector<size_t> sizes;
    for (const Pending &p : ranks) {
        for (const IoEntry &e : io) {
            const Set *s = e.output ? p.out : p.in;
            Tensor *t = s->tensors.at(e.name);
            bufs.push_back(t->data);
            sizes.push_back(t->size);
        }
    }
    return executor(neff.data(), neff.size(), (uint32_t)ranks.size(), (uint32_t)io.size(), bufs.data(), sizes.data());
}

}  // namespace

extern "C" {

NRT_STATUS nrt_get_instance_info(nrt_instance_info_t *info, size_t instance_info_len) {
    std::lock_guard<std::recursive_mutex> lock(mu);
    if (!info || instance_info_len < sizeof(nrt_instance_info_t)) {
        violation("nrt_get_instance_info", "info is NULL or smaller than nrt_instance_info_t");
        return NRT_INVALID;
    }
    const char *fam = getenv("NRT_STANDIN_FAMILY");
    std::string f = fam && *fam ? fam : "trn2";
    memset(info, 0, sizeof(*info));
    info->family = f == "trn2" ? NRT_INSTANCE_TRN2 : f == "trn1" ? NRT_INSTANCE_TRN1 : f == "trn1n" ? NRT_INSTANCE_TRN1N
                 : f == "inf2" ? NRT_INSTANCE_INF2 : f == "trn3" ? NRT_INSTANCE_TRN3 : f == "inf1" ? NRT_INSTANCE_INF1
                 : NRT_INSTANCE_UNKNOWN;
    info->size = info->family == NRT_INSTANCE_UNKNOWN ? NRT_INSTANCE_SIZE_UNKNOWN : NRT_INSTANCE_SIZE_48XL;
    snprintf(info->arch_name, sizeof(info->arch_name), "standin-%s", f.c_str());
    snprintf(info->device_revision, sizeof(info->device_revision), "0");
    return NRT_SUCCESS;
}

NRT_STATUS nrt_get_visible_vnc_count(uint32_t *vnc_count) {  // may be called before nrt_init
    std::lock_guard<std::recursive_mutex> lock(mu);
    if (!vnc_count) return NRT_INVALID;
    *vnc_count = (uint32_t)count_cores();
    return NRT_SUCCESS;
}

NRT_STATUS nrt_init(nrt_framework_type_t framework, const char *fw_version, const char *fal_version) {
    std::lock_guard<std::recursive_mutex> lock(mu);
    int st;
    if (injected("nrt_init", &st)) return (NRT_STATUS)st;
    if (state == READY) {
        violation("nrt_init", "called twice without nrt_close");
        return NRT_INVALID;
    }
    if (framework == NRT_FRAMEWORK_TYPE_INVALID || framework > NRT_FRAMEWORK_TYPE_PRECHECK || !fw_version ||
        !fal_version) {
        violation("nrt_init", "invalid framework type or NULL version strings");
        return NRT_INVALID;
    }
    visible_cores = count_cores();
    if (visible_cores <= 0) return NRT_LOAD_NOT_ENOUGH_NC;
    state = READY;  // (the stand-in allows nrt_init again after nrt_close: tests close and reopen in one process)
    return NRT_SUCCESS;
}

void nrt_close() {
    std::lock_guard<std::recursive_mutex> lock(mu);
    if (state != READY) {
        violation("nrt_close", "called without a successful nrt_init");
        return;
    }
    if (!models.empty() || !tensors.empty() || !sets.empty()) {
        violation("nrt_close", std::to_string(models.size()) + " model(s) still loaded, " +
                                   std::to_string(tensors.size()) + " tensor(s) and " + std::to_string(sets.size()) +
                                   " tensor set(s) not freed");
    }
    state = CLOSED;
}

NRT_STATUS nrt_load(const void *neff_bytes, size_t size, int32_t vnc, int32_t vnc_count, nrt_model_t **model) {
    GUARD("nrt_load");
    return load("nrt_load", neff_bytes, size, vnc, vnc_count, false, 0, 1, model);
}

NRT_STATUS nrt_load_collectives(const void *neff_bytes, size_t size, int32_t vnc, int32_t vnc_count,
                                uint32_t ctx_device_id, uint32_t ctx_device_count, nrt_model_t **model) {
    GUARD("nrt_load_collectives");
    return load("nrt_load_collectives", neff_bytes, size, vnc, vnc_count, true, ctx_device_id, ctx_device_count,
                model);
}

NRT_STATUS nrt_unload(nrt_model_t *model) {
    GUARD("nrt_unload");
    Model *m = (Model *)model;
    if (!models.count(m)) {
        violation("nrt_unload", "not a loaded model (unloaded twice?)");
        return NRT_INVALID_HANDLE;
    }
    if (m->group) {
        Group *g = m->group;
        g->ranks.erase(m->rank);
        if (g->ranks.empty()) {
            for (size_t i = 0; i < groups.size(); i++) {
                if (groups[i] == g) {
                    groups.erase(groups.begin() + (long)i);
                    break;
                }
            }
            delete g;
        }
    }
    models.erase(m);
    delete m;
    return NRT_SUCCESS;
}

NRT_STATUS nrt_get_model_tensor_info(nrt_model_t *model, nrt_tensor_info_array_t **tensor_info) {
    GUARD("nrt_get_model_tensor_info");
    Model *m = (Model *)model;
    if (!models.count(m) || !tensor_info) {
        violation("nrt_get_model_tensor_info", "not a loaded model, or tensor_info is NULL");
        return NRT_INVALID_HANDLE;
    }
    size_t n = m->io.size();
    auto *arr = (nrt_tensor_info_array_t *)calloc(1, sizeof(nrt_tensor_info_array_t) + n * sizeof(nrt_tensor_info_t));
    arr->tensor_count = n;
    for (size_t i = 0; i < n; i++) {
        const IoEntry &e = m->io[i];
        nrt_tensor_info_t &t = arr->tensor_array[i];
        snprintf(t.name, NRT_TENSOR_NAME_MAX, "%s", e.name.c_str());
        t.usage = e.output ? NRT_TENSOR_USAGE_OUTPUT : NRT_TENSOR_USAGE_INPUT;
        t.size = e.size;
        t.dtype = dtype_code(e.dtype);
        t.ndim = (uint32_t)e.shape.size();
        t.shape = (uint32_t *)calloc(e.shape.size() + 1, sizeof(uint32_t));
        for (size_t d = 0; d < e.shape.size(); d++) t.shape[d] = e.shape[d];
    }
    infos.insert(arr);
    *tensor_info = arr;
    return NRT_SUCCESS;
}

NRT_STATUS nrt_free_model_tensor_info(nrt_tensor_info_array_t *tensor_info) {
    GUARD("nrt_free_model_tensor_info");
    if (!infos.count(tensor_info)) {
        violation("nrt_free_model_tensor_info", "not a tensor info array from nrt_get_model_tensor_info");
        return NRT_INVALID;
    }
    for (uint64_t i = 0; i < tensor_info->tensor_count; i++) free(tensor_info->tensor_array[i].shape);
    infos.erase(tensor_info);
    free(tensor_info);
    return NRT_SUCCESS;
}

NRT_STATUS nrt_get_visible_nc_count(uint32_t *nc_count) { return nrt_get_visible_vnc_count(nc_count); }

NRT_STATUS nrt_tensor_allocate(nrt_tensor_placement_t tensor_placement, int vnc, size_t size, const char *name,
                               nrt_tensor_t **tensor) {
    GUARD("nrt_tensor_allocate");
    if (!tensor || size == 0) {
        violation("nrt_tensor_allocate", "tensor is NULL or size is 0");
        return NRT_INVALID;
    }
    if (tensor_placement == NRT_TENSOR_PLACEMENT_DEVICE && (vnc < 0 || vnc >= visible_cores)) {
        violation("nrt_tensor_allocate", "device tensor on NeuronCore " + std::to_string(vnc) + ", which is not "
                                         "visible (" + std::to_string(visible_cores) + " visible)");
        return NRT_INVALID;
    }
    auto *t = new Tensor();
    t->placement = tensor_placement;
    t->vnc = tensor_placement == NRT_TENSOR_PLACEMENT_DEVICE ? vnc : -1;
    t->size = size;
    t->name = name ? name : "";
    t->data = (unsigned char *)calloc(size, 1);
    t->in_sets = 0;
    if (!t->data) {
        delete t;
        return NRT_RESOURCE;
    }
    tensors.insert(t);
    *tensor = (nrt_tensor_t *)t;
    return NRT_SUCCESS;
}

void nrt_tensor_free(nrt_tensor_t **tensor) {
    std::lock_guard<std::recursive_mutex> lock(mu);
    if (state != READY) {
        violation("nrt_tensor_free", "called outside nrt_init .. nrt_close");
        return;
    }
    if (!tensor || !tensors.count((Tensor *)*tensor)) {
        violation("nrt_tensor_free", "not a live tensor (freed twice?)");
        return;
    }
    Tensor *t = (Tensor *)*tensor;
    if (t->in_sets > 0) {
        violation("nrt_tensor_free", "tensor '" + t->name + "' is freed while " + std::to_string(t->in_sets) +
                                         " live tensor set(s) hold it");
        return;
    }
    tensors.erase(t);
    free(t->data);
    delete t;
    *tensor = nullptr;
}

NRT_STATUS nrt_tensor_write(nrt_tensor_t *tensor, const void *buf, size_t offset, size_t size) {
    GUARD("nrt_tensor_write");
    Tensor *t = (Tensor *)tensor;
    if (!tensors.count(t) || !buf || offset + size > t->size) {
        violation("nrt_tensor_write", "not a live tensor, NULL buffer, or out of bounds");
        return NRT_INVALID;
    }
    memcpy(t->data + offset, buf, size);
    written += size;
    return NRT_SUCCESS;
}

NRT_STATUS nrt_tensor_read(const nrt_tensor_t *tensor, void *buf, size_t offset, size_t size) {
    GUARD("nrt_tensor_read");
    Tensor *t = (Tensor *)tensor;
    if (!tensors.count(t) || !buf || offset + size > t->size) {
        violation("nrt_tensor_read", "not a live tensor, NULL buffer, or out of bounds");
        return NRT_INVALID;
    }
    memcpy(buf, t->data + offset, size);
    return NRT_SUCCESS;
}

size_t nrt_tensor_get_size(const nrt_tensor_t *tensor) {
    std::lock_guard<std::recursive_mutex> lock(mu);
    Tensor *t = (Tensor *)tensor;
    return tensors.count(t) ? t->size : 0;
}

NRT_STATUS nrt_allocate_tensor_set(nrt_tensor_set_t **result) {
    GUARD("nrt_allocate_tensor_set");
    if (!result) return NRT_INVALID;
    Set *s = new Set();
    sets.insert(s);
    *result = (nrt_tensor_set_t *)s;
    return NRT_SUCCESS;
}

void nrt_destroy_tensor_set(nrt_tensor_set_t **tensor_set) {
    std::lock_guard<std::recursive_mutex> lock(mu);
    if (!tensor_set || !sets.count((Set *)*tensor_set)) {
        violation("nrt_destroy_tensor_set", "not a live tensor set (destroyed twice?)");
        return;
    }
    Set *s = (Set *)*tensor_set;
    for (auto &kv : s->tensors) kv.second->in_sets--;
    sets.erase(s);
    delete s;
    *tensor_set = nullptr;
}

NRT_STATUS nrt_add_tensor_to_tensor_set(nrt_tensor_set_t *tensor_set, const char *tensor_name,
                                        nrt_tensor_t *tensor) {
    GUARD("nrt_add_tensor_to_tensor_set");
    Set *s = (Set *)tensor_set;
    Tensor *t = (Tensor *)tensor;
    if (!sets.count(s) || !tensors.count(t) || !tensor_name) {
        violation("nrt_add_tensor_to_tensor_set", "not a live tensor set or tensor, or no name");
        return NRT_INVALID;
    }
    auto it = s->tensors.find(tensor_name);
    if (it != s->tensors.end()) it->second->in_sets--;  // add/replace
    s->tensors[tensor_name] = t;
    t->in_sets++;
    return NRT_SUCCESS;
}

NRT_STATUS nrt_get_tensor_from_tensor_set(nrt_tensor_set_t *tensor_set, const char *tensor_name,
                                          nrt_tensor_t **tensor) {
    GUARD("nrt_get_tensor_from_tensor_set");
    Set *s = (Set *)tensor_set;
    if (!sets.count(s) || !tensor_name || !tensor) return NRT_INVALID;
    auto it = s->tensors.find(tensor_name);
    if (it == s->tensors.end()) return NRT_INVALID;
    *tensor = (nrt_tensor_t *)it->second;
    return NRT_SUCCESS;
}

NRT_STATUS nrt_execute(nrt_model_t *model, const nrt_tensor_set_t *input_set, nrt_tensor_set_t *output_set) {
    Group *g;
    std::vector<unsigned char> neff;
    std::vector<Pending> ranks;
    {
        GUARD("nrt_execute");
        Model *m = (Model *)model;
        if (!models.count(m)) {
            violation("nrt_execute", "not a loaded model");
            return NRT_INVALID_HANDLE;
        }
        std::string why;
        if (!check_set("nrt_execute", m, (const Set *)input_set, false, &why) ||
            !check_set("nrt_execute", m, (Set *)output_set, true, &why)) {
            violation("nrt_execute", why);
            return NRT_EXEC_BAD_INPUT;
        }
        g = m->group;
        if (!g) {
            neff = m->neff;
            ranks.push_back(Pending{m, (const Set *)input_set, (Set *)output_set});
            executions++;
        } else if (g->ranks.size() != g->count) {
            violation("nrt_execute", "collectives group incomplete: " + std::to_string(g->ranks.size()) + " of " +
                                         std::to_string(g->count) + " ranks loaded");
            return NRT_COLL_PENDING;
        }
    }
    if (!g) {
        int st = run(neff, ranks);
        return (NRT_STATUS)st;
    }
    // A collectives group: every rank calls nrt_execute; the last to arrive runs the executor for all of them.
    pthread_mutex_lock(&exec_mu);
    Model *m = (Model *)model;
    if (g->arrived.count(m->rank)) {
        pthread_mutex_unlock(&exec_mu);
        std::lock_guard<std::recursive_mutex> lock(mu);
        violation("nrt_execute", "rank " + std::to_string(m->rank) + " executes again before its group finished");
        return NRT_INVALID;
    }
    g->arrived[m->rank] = Pending{m, (const Set *)input_set, (Set *)output_set};
    uint64_t gen = g->generation;
    if (g->arrived.size() == g->count) {
        for (uint32_t r = 0; r < g->count; r++) ranks.push_back(g->arrived[r]);
        neff = g->neff;
        g->status = run(neff, ranks);
        {
            std::lock_guard<std::recursive_mutex> lock(mu);
            executions++;
        }
        g->arrived.clear();
        g->generation++;
        pthread_cond_broadcast(&exec_cv);
        int st = g->status;
        pthread_mutex_unlock(&exec_mu);
        return (NRT_STATUS)st;
    }
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += 120;
    while (g->generation == gen) {
        if (pthread_cond_timedwait(&exec_cv, &exec_mu, &deadline) != 0) {
            g->arrived.erase(m->rank);
            pthread_mutex_unlock(&exec_mu);
            std::lock_guard<std::recursive_mutex> lock(mu);
            violation("nrt_execute", "rank " + std::to_string(m->rank) + " waited 120 s for the other ranks of its "
                                     "collectives group to execute");
            return NRT_EXEC_HW_ERR_COLLECTIVES;
        }
    }
    int st = g->status;
    pthread_mutex_unlock(&exec_mu);
    return (NRT_STATUS)st;
}

// ---- stand-in-only entry points (not part of nrt.h) ------------------------------------------------------------

void nrt_standin_set_executor(nrt_standin_exec_fn fn) {
    std::lock_guard<std::recursive_mutex> lock(mu);
    executor = fn;
}

void nrt_standin_fail(const char *call, int nth, int status) {
    std::lock_guard<std::recursive_mutex> lock(mu);
    fail_call = call ? call : "";
    fail_nth = nth;
    fail_status = status;
}

void nrt_standin_state(uint64_t *out6) {  // live models, tensors, tensor sets; violations; executions; bytes written
    std::lock_guard<std::recursive_mutex> lock(mu);
    out6[0] = models.size();
    out6[1] = tensors.size();
    out6[2] = sets.size();
    out6[3] = violations;
    out6[4] = executions;
    out6[5] = written;
}

const char *nrt_standin_last_violation() {
    std::lock_guard<std::recursive_mutex> lock(mu);
    return last_violation.c_str();
}

}  // extern "C"
