"""libnrt, the Neuron runtime's C library, through ctypes: the calls the serving runtime makes (nrt.h, NRT major version
2), their status codes turned into errors naming the call, one initialised session per process, and what the host
reports (instance family, visible NeuronCores). Standard library only: loading a library needs neither torch nor jax.

`NEURONBUILD_LIBNRT` names the library (default /opt/aws/neuron/lib/libnrt.so, where Neuron hosts have it); the
tests point it at the stand-in built from tests/standins/libnrt/. Signatures and codes follow the public headers
(nrt/nrt.h, nrt/nrt_experimental.h, nrt/nrt_status.h): `nrt_load(neff, size, vnc, vnc_count=-1, &model)`,
`nrt_load_collectives(neff, size, vnc, -1, device_id, device_count, &model)`, `nrt_tensor_allocate(placement, vnc,
size, name, &tensor)`, `nrt_tensor_info_t {char name[256]; usage; size_t size; dtype; uint32_t *shape; uint32_t
ndim}`, `nrt_instance_info_t {uint32_t family, size; char arch_name[16]; char device_revision[8]}`."""

from __future__ import annotations

import atexit
import ctypes
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuronbuild import envvars
from neuronbuild.vocabulary import NEURON_INSTANCE_FAMILIES

LIBNRT_ENV = "NEURONBUILD_LIBNRT"
DEFAULT_LIBNRT = "/opt/aws/neuron/lib/libnrt.so"

STATUS = {0: "NRT_SUCCESS", 1: "NRT_FAILURE", 2: "NRT_INVALID", 3: "NRT_INVALID_HANDLE", 4: "NRT_RESOURCE",
          5: "NRT_TIMEOUT", 6: "NRT_HW_ERROR", 7: "NRT_QUEUE_FULL", 9: "NRT_LOAD_NOT_ENOUGH_NC",
          10: "NRT_UNSUPPORTED_NEFF_VERSION", 11: "NRT_FAIL_HOST_MEM_ALLOC", 13: "NRT_UNINITIALIZED", 14: "NRT_CLOSED",
          15: "NRT_QUEUE_EMPTY", 101: "NRT_EXEC_UNIT_UNRECOVERABLE", 1002: "NRT_EXEC_BAD_INPUT",
          1003: "NRT_EXEC_COMPLETED_WITH_NUM_ERR", 1004: "NRT_EXEC_COMPLETED_WITH_ERR", 1005: "NRT_EXEC_NC_BUSY",
          1006: "NRT_EXEC_OOB", 1100: "NRT_COLL_PENDING", 1200: "NRT_EXEC_HW_ERR_COLLECTIVES",
          1201: "NRT_EXEC_HW_ERR_HBM_UE", 1202: "NRT_EXEC_HW_ERR_NC_UE", 1203: "NRT_EXEC_HW_ERR_DMA_ABORT",
          1204: "NRT_EXEC_SW_NQ_OVERFLOW", 1205: "NRT_EXEC_HW_ERR_REPAIRABLE_HBM_UE", 1206: "NRT_NETWORK_PROXY_FAILURE"}
NRT_FRAMEWORK_TYPE_NO_FW = 1
PLACEMENT_DEVICE = 0
USAGE_INPUT, USAGE_OUTPUT = 0, 1
# nrt_dtype_t (nrt.h) by the dtype names params.json uses (torch's)
DTYPES = {"float32": 0xA, "bfloat16": 0x6, "float16": 0x7, "int32": 0x8, "int64": 0xC, "int16": 0x4, "int8": 0x2,
          "uint8": 0x3, "bool": 0x3, "uint16": 0x5, "uint32": 0x9, "uint64": 0x1, "float8_e4m3fn": 0xE,
          "float8_e5m2": 0xF}
# nrt.h's NRT_INSTANCE_<NAME> values; the family is the vocabulary's instance family the name starts with (TRN2P: trn2)
INSTANCES = {1: "INF1", 2: "TRN1", 3: "TRN1N", 4: "INF2", 5: "TRN2", 6: "TRN2N", 7: "INF2E", 8: "TRN2P", 9: "TRN2U",
             10: "TRN2E", 11: "TRN2EU", 12: "TRN2AC", 13: "TRN2UAC", 14: "TRN3", 15: "TRN3PDS98"}


def instance_family(code: int) -> str | None:
    """The instance family (vocabulary.NEURON_INSTANCE_FAMILIES) of an nrt_instance_info_t.family value."""
    name = INSTANCES.get(code, "").lower()
    found = [f for f in NEURON_INSTANCE_FAMILIES if name.startswith(f)]
    return max(found, key=len) if found else None


class NrtError(RuntimeError):
    """A libnrt call failed: the message names the call and its NRT_STATUS."""

    def __init__(self, call: str, status: int, what: str = "") -> None:
        self.call, self.status = call, status
        super().__init__(f"{call} returned {STATUS.get(status, 'NRT status')} ({status})" + (f" {what}" if what else ""))


class LibnrtUnavailable(RuntimeError):
    """No usable libnrt at the configured path."""


class TensorInfo(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char * 256), ("usage", ctypes.c_int), ("size", ctypes.c_size_t),
                ("dtype", ctypes.c_int), ("shape", ctypes.POINTER(ctypes.c_uint32)), ("ndim", ctypes.c_uint32)]


class TensorInfoArray(ctypes.Structure):
    _fields_ = [("tensor_count", ctypes.c_uint64), ("tensor_array", TensorInfo * 0)]


class InstanceInfo(ctypes.Structure):
    _fields_ = [("family", ctypes.c_uint32), ("size", ctypes.c_uint32), ("arch_name", ctypes.c_char * 16),
                ("device_revision", ctypes.c_char * 8)]


_P = ctypes.c_void_p
_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "nrt_init": (ctypes.c_int, [ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p]),
    "nrt_close": (None, []),
    "nrt_load": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int32, ctypes.c_int32,
                                ctypes.POINTER(_P)]),
    "nrt_load_collectives": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int32, ctypes.c_int32,
                                            ctypes.c_uint32, ctypes.c_uint32, ctypes.POINTER(_P)]),
    "nrt_unload": (ctypes.c_int, [_P]),
    "nrt_get_model_tensor_info": (ctypes.c_int, [_P, ctypes.POINTER(ctypes.POINTER(TensorInfoArray))]),
    "nrt_free_model_tensor_info": (ctypes.c_int, [ctypes.POINTER(TensorInfoArray)]),
    "nrt_tensor_allocate": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.c_size_t, ctypes.c_char_p,
                                           ctypes.POINTER(_P)]),
    "nrt_tensor_free": (None, [ctypes.POINTER(_P)]),
    "nrt_tensor_write": (ctypes.c_int, [_P, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]),
    "nrt_tensor_read": (ctypes.c_int, [_P, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]),
    "nrt_allocate_tensor_set": (ctypes.c_int, [ctypes.POINTER(_P)]),
    "nrt_destroy_tensor_set": (None, [ctypes.POINTER(_P)]),
    "nrt_add_tensor_to_tensor_set": (ctypes.c_int, [_P, ctypes.c_char_p, _P]),
    "nrt_execute": (ctypes.c_int, [_P, _P, _P]),
    "nrt_get_instance_info": (ctypes.c_int, [ctypes.POINTER(InstanceInfo), ctypes.c_size_t]),
    "nrt_get_visible_vnc_count": (ctypes.c_int, [ctypes.POINTER(ctypes.c_uint32)]),
}


def library_path() -> str:
    return envvars.current().text(LIBNRT_ENV) or DEFAULT_LIBNRT


_libs: dict[str, ctypes.CDLL] = {}


def load_library(path: str | None = None) -> ctypes.CDLL:
    """The libnrt at `path` (default: $NEURONBUILD_LIBNRT, else the standard path), its functions typed."""
    path = path or library_path()
    if path not in _libs:
        if not Path(path).is_file():
            raise LibnrtUnavailable(f"no Neuron runtime library at {path} (install aws-neuronx-runtime-lib, or set "
                                    f"${LIBNRT_ENV})")
        try:
            lib = ctypes.CDLL(path)
            for name, (restype, argtypes) in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = restype, argtypes
        except (OSError, AttributeError) as e:
            raise LibnrtUnavailable(f"{path} is not a usable libnrt: {e}") from None
        _libs[path] = lib
    return _libs[path]


def check(call: str, status: int, what: str = "") -> None:
    if status != 0:
        raise NrtError(call, status, what)


@dataclass(frozen=True)
class NeuronHostInfo:
    """What libnrt reports about this host: instance family (a platform name, None when unknown) and NeuronCores."""

    family: str | None
    cores: int
    arch: str


def host_info(path: str | None = None) -> NeuronHostInfo | None:
    """The host as libnrt reports it (callable before nrt_init), or None when no libnrt can be loaded."""
    try:
        lib = load_library(path)
    except LibnrtUnavailable:
        return None
    info = InstanceInfo()
    # (nrt.h documents the core counts as callable before nrt_init, not the instance info: when it refuses, the
    # family is left to the caller's other sources: /dev/neuron* and the DMI product name)
    known = lib.nrt_get_instance_info(ctypes.byref(info), ctypes.sizeof(info)) == 0
    cores = ctypes.c_uint32()
    check("nrt_get_visible_vnc_count", lib.nrt_get_visible_vnc_count(ctypes.byref(cores)))
    return NeuronHostInfo(instance_family(info.family) if known else None, int(cores.value),
                          info.arch_name.decode(errors="replace") if known else "")


class Session:
    """libnrt initialised once in this process; everything loaded through it is released (models unloaded, tensor
    sets destroyed, tensors freed) before nrt_close, which runs at exit (or `close()`)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        check("nrt_init", lib.nrt_init(NRT_FRAMEWORK_TYPE_NO_FW, b"", b""))
        cores = ctypes.c_uint32()
        check("nrt_get_visible_vnc_count", lib.nrt_get_visible_vnc_count(ctypes.byref(cores)))
        self.cores = int(cores.value)
        self.lock = threading.Lock()
        # shared device tensors: key -> [tensor handle, users]; e.g. a weight on one NeuronCore, used by every bucket
        self._shared: dict[Any, list[Any]] = {}
        self._owners: dict[int, Callable[[], None]] = {}  # id -> release function of everything loaded and alive
        self.closed = False

    # -- raw calls ---------------------------------------------------------------------------------------------------
    def allocate(self, vnc: int, size: int, name: str) -> int:
        t = _P()
        check("nrt_tensor_allocate", self.lib.nrt_tensor_allocate(PLACEMENT_DEVICE, vnc, size, name.encode()[:255],
                                                                  ctypes.byref(t)), f"(tensor {name}, {size} bytes)")
        return int(t.value or 0)

    def free(self, tensor: int) -> None:
        self.lib.nrt_tensor_free(ctypes.byref(_P(tensor)))

    def write(self, tensor: int, ptr: int, size: int, name: str) -> None:
        check("nrt_tensor_write", self.lib.nrt_tensor_write(_P(tensor), _P(ptr), 0, size), f"(tensor {name})")

    def read(self, tensor: int, ptr: int, size: int, name: str) -> None:
        check("nrt_tensor_read", self.lib.nrt_tensor_read(_P(tensor), _P(ptr), 0, size), f"(tensor {name})")

    def new_set(self) -> int:
        s = _P()
        check("nrt_allocate_tensor_set", self.lib.nrt_allocate_tensor_set(ctypes.byref(s)))
        return int(s.value or 0)

    def destroy_set(self, tset: int) -> None:
        self.lib.nrt_destroy_tensor_set(ctypes.byref(_P(tset)))

    def bind(self, tset: int, name: str, tensor: int) -> None:
        check("nrt_add_tensor_to_tensor_set", self.lib.nrt_add_tensor_to_tensor_set(_P(tset), name.encode(),
                                                                                    _P(tensor)), f"(tensor {name})")

    def load(self, neff: bytes, vnc: int, rank: int, ranks: int) -> int:
        m = _P()
        if ranks == 1:
            check("nrt_load", self.lib.nrt_load(neff, len(neff), vnc, -1, ctypes.byref(m)), f"(NeuronCore {vnc})")
        else:
            check("nrt_load_collectives", self.lib.nrt_load_collectives(neff, len(neff), vnc, -1, rank, ranks,
                                                                        ctypes.byref(m)),
                  f"(rank {rank} of {ranks}, NeuronCore {vnc})")
        return int(m.value or 0)

    def unload(self, model: int) -> None:
        check("nrt_unload", self.lib.nrt_unload(_P(model)))

    def tensor_info(self, model: int) -> list[tuple[str, int, int, int, tuple[int, ...]]]:
        """The model's tensors as libnrt reports them: (name, usage, bytes, dtype code, shape)."""
        arr = ctypes.POINTER(TensorInfoArray)()
        check("nrt_get_model_tensor_info", self.lib.nrt_get_model_tensor_info(_P(model), ctypes.byref(arr)))
        try:
            n = int(arr.contents.tensor_count)
            infos = ctypes.cast(ctypes.addressof(arr.contents.tensor_array), ctypes.POINTER(TensorInfo * n)).contents
            return [(i.name.decode(errors="replace"), int(i.usage), int(i.size), int(i.dtype),
                     tuple(int(i.shape[d]) for d in range(i.ndim))) for i in infos]
        finally:
            check("nrt_free_model_tensor_info", self.lib.nrt_free_model_tensor_info(arr))

    def execute(self, model: int, inputs: int, outputs: int) -> int:
        return int(self.lib.nrt_execute(_P(model), _P(inputs), _P(outputs)))

    # -- shared device tensors ---------------------------------------------------------------------------------------
    def shared(self, key: Any, vnc: int, size: int, name: str, fill: Callable[[int], None]) -> int:
        """A device tensor shared by every user asking with `key` (allocated and filled by the first, freed when the
        last releases it)."""
        entry = self._shared.get(key)
        if entry is None:
            t = self.allocate(vnc, size, name)
            try:
                fill(t)
            except BaseException:
                self.free(t)
                raise
            entry = self._shared[key] = [t, 0]
        entry[1] += 1
        return int(entry[0])

    def release_shared(self, key: Any) -> None:
        entry = self._shared.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del self._shared[key]
            self.free(entry[0])

    def own(self, token: int, release: Callable[[], None]) -> None:
        self._owners[token] = release

    def disown(self, token: int) -> None:
        self._owners.pop(token, None)

    def close(self) -> None:
        """Release everything still loaded, then nrt_close."""
        if self.closed:
            return
        for release in list(self._owners.values()):
            try:
                release()
            except RuntimeError:  # (an NrtError: that graph's resources may stay, nrt_close still runs)
                pass
        self._owners.clear()
        for key in list(self._shared):
            self._shared[key][1] = 0
            self.release_shared(key)
        self.lib.nrt_close()
        self.closed = True


_session: Session | None = None
_session_lock = threading.Lock()


def session() -> Session:
    """This process's libnrt session (nrt_init on first use; closed at exit)."""
    global _session
    with _session_lock:
        if _session is None or _session.closed:
            _session = Session(load_library())
            atexit.register(_session.close)
        return _session


def close_session() -> None:
    """Unload everything loaded through libnrt and nrt_close (the next load initialises it again)."""
    with _session_lock:
        if _session is not None:
            _session.close()
