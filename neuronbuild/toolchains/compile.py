"""The cpu compile step: an exported program -> a canonical AOTInductor package and its weights (constants)."""

from __future__ import annotations

import functools
import io
import os
import shutil
import tempfile
import threading
import zipfile
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from neuronbuild import envvars
from neuronbuild.platforms import SHARED_TMP_VAR, THREADS_VAR, host_cores
from neuronbuild.plugin_api.actions import PROGRAM_CONSTANTS
from neuronbuild.plugin_api.toolchain import StepDirs
from neuronbuild.runtime.aoti_loader import IN_PLACE_KEY, OUT_SPEC_KEY  # package metadata the loader reads
from neuronbuild.toolchains.errors import ToolchainError
from neuronbuild.toolchains.model_import import example_inputs
from neuronbuild.toolchains.passes import apply_passes
from neuronbuild.toolchains.trace import load_program, strip_unstable_meta
from neuronbuild.toolchains.weights import read_header

# Inductor's working files go to a fresh dir per compile, whatever TORCHINDUCTOR_CACHE_DIR says (restored after):
# inside the compile's own output dir (removed before its outputs are stored), which no other action can write; a
# warm-up's, beside the precompiled headers (actions only read there). Never a dir shared between actions: inductor
# keeps a source file it finds under its content-hash name, so a model could otherwise plant or change what a later
# compile of any workspace builds (issue #31; tests/test_security_escape.py). The objects do not name the dir
# (-ffile-prefix-map below maps it to /inductor and torch's headers to /torch), so artifact bytes depend neither on
# the sandbox nor on the cache or venv location (tested: two cache dirs, identical packages).
# Note: the ISA pin and the flag patch are process-global monkeypatches held for the duration of one compile: compile
# one graph at a time per process (the worker model), not from several threads.
# Inductor's precompiled headers (~10 s of a process's first compile, ~140 MB each) live in its own dir under the
# temp dir (torchinductor_$USER/precompiled_headers), named by a hash of the full compile command (our -march and
# prefix maps included), the preprocessed header (the torch version's headers) and the compiler version, so one
# built for another ISA, flag set, torch or g++ is never used; warm_up_cpu builds them ahead of the first compile.
TORCH_DIR = Path(torch.__file__).resolve().parent
PACKAGE_MODEL_NAME = "model"
CONSTANTS_FILE = "constants.safetensors"  # the model's weights by FQN (the weights action's, shipped beside)
_ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)
_KERNEL_NOTE = "// Triton kernels are embedded as comments in "  # how inductor opens an AOT kernel source


@dataclass(frozen=True)
class IsaTarget:
    """How one x86-64 micro-architecture level maps onto inductor: -march value and the SIMD ISA codegen uses."""

    march: str
    vec_isa: str | None  # "avx2", "avx512" or None (scalar C++; the compiler may still auto-vectorise to SSE)
    simdlen: int


ISA_TARGETS: dict[str, IsaTarget] = {
    "x86-64": IsaTarget("x86-64", None, 0),
    "x86-64-v2": IsaTarget("x86-64-v2", None, 0),
    "x86-64-v3": IsaTarget("x86-64-v3", "avx2", 256),
    "x86-64-v4": IsaTarget("x86-64-v4", "avx512", 512),
}

def _program_and_args(spec: Mapping[str, Any], sandbox: Path) -> tuple[torch.export.ExportedProgram, tuple[Any, ...]]:
    ep = load_program(Path(sandbox) / str(spec["program"]))
    args = example_inputs(spec.get("inputs") or {}, spec.get("bucket") or {})
    _check_inputs(ep, args)
    return ep, args


def run_cpu_compile(spec: dict[str, Any], sandbox: Path, out_dir: Path) -> dict[str, Any]:
    """Compile spec["program"] (relative to sandbox) into an AOTInductor package for spec["isa"] in out_dir, from
    shapes only (the program holds no weight values, and none is inlined: _weights_never_inlined), with the
    program's own tensors (program_constants.safetensors). The model's weights file is the weights action's, which
    ships beside the package (Action.ships) and is bound at load: a weights-only change never re-runs this."""
    from neuronbuild.toolchains.trace import write_program_constants

    ep, args = _program_and_args(spec, sandbox)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    write_program_constants(ep, Path(out_dir) / PROGRAM_CONSTANTS)
    return compile_cpu(ep, args, str(spec.get("isa", "")), spec.get("options") or {}, Path(out_dir),
                       in_place=[(int(p[1]), int(p[3])) for p in spec.get("in_place") or ()])


def _check_inputs(ep: torch.export.ExportedProgram, args: tuple[torch.Tensor, ...]) -> None:
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    expected = [placeholders[s.arg.name].meta.get("val") for s in ep.graph_signature.input_specs
                if s.kind == torch.export.graph_signature.InputKind.USER_INPUT and hasattr(s.arg, "name")]
    if len(expected) != len(args):
        raise ToolchainError(f"the program takes {len(expected)} input(s), the input spec declares {len(args)}")
    for i, (val, arg) in enumerate(zip(expected, args, strict=True)):
        if isinstance(val, torch.Tensor) and (tuple(val.shape) != tuple(arg.shape) or val.dtype != arg.dtype):
            raise ToolchainError(
                f"input {i}: the program was traced with {str(val.dtype).removeprefix('torch.')}{list(val.shape)}, "
                f"the spec gives {str(arg.dtype).removeprefix('torch.')}{list(arg.shape)}"
            )


# ---------------------------------------------------------------------------------------------------------------- cpu


def compile_cpu(
    ep: torch.export.ExportedProgram,
    args: tuple[torch.Tensor, ...],
    isa: str,
    options: Mapping[str, Any],
    out_dir: Path,
    in_place: list[tuple[int, int]] | None = None,
) -> dict[str, Any]:
    """`in_place`: (output index, input index) pairs (declared aliases): each such output that is one scatter into
    its input (_scatters_into_input) is compiled as an update of the input in place (write_in_place), and the
    package's metadata names the pairs for the loader; the others stay fresh outputs."""
    target = isa_target(isa)
    strip_unstable_meta(ep)  # the trace's source lines serve Neuron lowering errors; the package never holds them
    ep = apply_passes(ep, options, args)
    metadata: dict[str, str] = {}
    in_place = [p for p in in_place or () if _scatters_into_input(ep, *p)]
    if in_place:
        metadata = write_in_place(ep, in_place)
    from torch._inductor import aoti_compile_and_package

    # Inductor's working dir and the raw package live in the action's own output dir, which no other action can write
    # (a shared working dir let a model plant or change the sources a later compile of any workspace builds: inductor
    # keeps a source file it finds under its content-hash name). Removed before the outputs are stored. Its temp files
    # too.
    with _private_dir(out_dir) as tmp, _compile_environment(isa, target, tmp / "inductor"), _temp_dir(tmp), \
            _fake_constants_by_storage(), _weights_never_inlined():
        raw = tmp / f"{PACKAGE_MODEL_NAME}.pt2"
        with torch.no_grad():
            aoti_compile_and_package(ep, package_path=str(raw),
                                     inductor_configs={**inductor_configs(target),
                                                       **({"aot_inductor.metadata": metadata} if metadata else {})})
        data = canonical_package(raw.read_bytes())
        # The program's state (what the weights action writes: the same module's parameters and persistent
        # buffers by FQN) and its own tensors hold every tensor the package asks for at load.
        own = out_dir / PROGRAM_CONSTANTS
        held = {*ep.state_dict, *(read_header(own) if own.is_file() else {})}
        loader = torch._C._aoti.AOTIModelPackageLoader(str(raw), PACKAGE_MODEL_NAME, False, 1, -1)
        missing = [n for n in sorted(str(n) for n in loader.get_constant_fqns()) if n not in held]
        if missing:
            raise ToolchainError(f"the compiled package needs constant(s) the model's {CONSTANTS_FILE} does not "
                                 f"hold: {', '.join(missing[:5])}")
    (out_dir / "model.pt2").write_bytes(data)
    return {"artifact": "model.pt2", "bytes": len(data), "isa": isa, "constants": CONSTANTS_FILE,
            **({"in_place": [list(p) for p in in_place]} if in_place else {})}


# What makes an aliased output worth writing in place: one op writing into the input itself (a scatter of the new
# values: the serving graphs' one index_put into kv). Any other output (e.g. the static token graph's stack of
# per-layer index_copy results) would be computed into a buffer and then copied into the input: measured 2x slower
# than a fresh output at max_seq 1024 (docs/benchmarks.md, #42), so it stays a fresh output.
_SCATTERS = ("index_put", "index_copy", "scatter", "slice_scatter", "select_scatter")


def _scatters_into_input(ep: torch.export.ExportedProgram, out_i: int, in_i: int) -> bool:
    """Whether user output `out_i` is one scatter-like op whose destination is user input `in_i` itself."""
    from torch.export.graph_signature import InputKind, OutputKind

    sig = ep.graph_signature
    user_in = [s.arg.name for s in sig.input_specs if s.kind == InputKind.USER_INPUT]
    user_pos = [i for i, s in enumerate(sig.output_specs) if s.kind == OutputKind.USER_OUTPUT]
    if not (0 <= out_i < len(user_pos) and 0 <= in_i < len(user_in)):
        return False
    node = next(n for n in reversed(ep.graph.nodes) if n.op == "output")
    value = node.args[0][user_pos[out_i]]
    if not isinstance(value, torch.fx.Node) or value.op != "call_function" or not value.args:
        return False
    op = getattr(getattr(value.target, "_overloadpacket", None), "__name__", "")
    dest = value.args[0]
    return op in _SCATTERS and isinstance(dest, torch.fx.Node) and dest.op == "placeholder" \
        and dest.name == user_in[in_i]


def write_in_place(ep: torch.export.ExportedProgram, pairs: list[tuple[int, int]]) -> dict[str, str]:
    """Turn each (output index, input index) pair of user outputs and inputs into an update of that input in place
    (in place: the program is changed): the output's value becomes a USER_INPUT_MUTATION of the input, as export
    records `x.copy_(...)`, so AOTInductor writes it into the caller's tensor (the serving graphs' one scatter into
    `kv`: in place, no copy of the cache) and returns the other outputs only. The output must have the input's shape
    and dtype. Returns the package metadata naming the pairs and the original output structure (the runtime loader,
    aoti_loader.LoadedPackage, puts each input back at its output's position)."""
    import json

    import torch.utils._pytree as pytree
    from torch.export.graph_signature import InputKind, OutputKind, OutputSpec

    sig = ep.graph_signature
    user_in = [s for s in sig.input_specs if s.kind == InputKind.USER_INPUT]
    specs = list(sig.output_specs)
    user_pos = [i for i, s in enumerate(specs) if s.kind == OutputKind.USER_OUTPUT]
    node = next(n for n in reversed(ep.graph.nodes) if n.op == "output")
    values = list(node.args[0])
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    moved: dict[int, tuple[OutputSpec, Any]] = {}
    for out_i, in_i in pairs:
        if not (0 <= out_i < len(user_pos) and 0 <= in_i < len(user_in)):
            raise ToolchainError(f"in-place output {out_i} -> input {in_i}: the program has {len(user_pos)} "
                                 f"output(s) and {len(user_in)} input(s)")
        pos, target = user_pos[out_i], user_in[in_i].arg.name
        got = getattr(values[pos], "meta", {}).get("val")
        want = placeholders[target].meta.get("val")
        if not (isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor) and got.shape == want.shape
                and got.dtype == want.dtype):
            describe = lambda t: f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" \
                if isinstance(t, torch.Tensor) else type(t).__name__  # noqa: E731
            raise ToolchainError(f"output {out_i} ({describe(got)}) cannot be written in place into input {in_i} "
                                 f"{target!r} ({describe(want)}): an aliased output needs its input's shape and dtype")
        moved[pos] = (OutputSpec(OutputKind.USER_INPUT_MUTATION, specs[pos].arg, target), values[pos])
    kept = [(s, v) for i, (s, v) in enumerate(zip(specs, values, strict=True)) if i not in moved]
    first_user = next((i for i, (s, _v) in enumerate(kept) if s.kind == OutputKind.USER_OUTPUT), len(kept))
    order = kept[:first_user] + [moved[p] for p in sorted(moved)] + kept[first_user:]  # mutations, then outputs
    node.args = (tuple(v for _s, v in order),)
    ep.graph_module.recompile()
    ep._graph_signature = type(sig)(sig.input_specs, [s for s, _v in order])
    call = ep.module_call_graph[0].signature
    assert call is not None
    original = call.out_spec
    left = len(user_pos) - len(moved)
    gone = {out_i for out_i, _in in pairs}
    if call.outputs:
        call.outputs = [o for i, o in enumerate(call.outputs) if i not in gone]
    call.out_spec = pytree.tree_flatten(tuple(range(left)))[1]
    return {IN_PLACE_KEY: json.dumps([[int(o), int(i)] for o, i in sorted(pairs)]),
            OUT_SPEC_KEY: pytree.treespec_dumps(original)}


def isa_target(isa: str) -> IsaTarget:
    if isa not in ISA_TARGETS:
        raise ToolchainError(f"unknown cpu isa {isa!r} (expected one of {', '.join(ISA_TARGETS)})")
    return ISA_TARGETS[isa]


def inductor_configs(target: IsaTarget) -> dict[str, Any]:
    """The inductor configs of every cpu compile for `target` (they enter inductor's compile commands)."""
    return {
        "cpp.march": target.march,
        "cpp.simdlen": target.simdlen,
        # Kernels read the thread count at run time instead of baking in the build machine's core count.
        "cpp.dynamic_threads": True,
        # Weights stay out of the package (one constants file per graph, identical across a model's buckets, so the
        # CAS and bundles store them once); loaders must call load_constants before the first run (else a crash).
        "aot_inductor.package_constants_in_so": False,
        # Debug line tables carry source paths and make the .so ~25% larger.
        "aot_inductor.enable_line_tables": False,
    }


def toolchain_scratch() -> Path:
    """Where this process keeps compiler working files: its temp dir when one is set (workers: the cache's
    toolchain-tmp), else $XDG_CACHE_HOME/neuronbuild/toolchain-tmp (never a fixed name in a shared /tmp)."""
    if any(os.environ.get(v) for v in ("TMPDIR", "TEMP", "TMP")):
        return Path(tempfile.gettempdir())
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "neuronbuild" / "toolchain-tmp"


def shared_scratch() -> Path:
    """The machine's toolchain scratch dir shared by its workers (their $TMPDIR, the cache's toolchain-tmp), also in
    an action's process, whose own $TMPDIR is private (SHARED_TMP_VAR names the shared one there)."""
    shared = envvars.current().text(SHARED_TMP_VAR)
    return Path(shared) if shared and os.path.isabs(shared) else toolchain_scratch()


def header_dir() -> Path:
    """Where inductor's precompiled headers live: beside the shared toolchain scratch dir, not in it (in workers
    <cache>/v1/toolchain-headers). Only toolchain warm-ups (run in the worker itself) write there; actions, whose
    TMPDIR is private, may only read it (execution/worker.py: read-only in the Landlock policy), so no model
    can change a header that a later compile of any workspace includes."""
    scratch = shared_scratch()
    return scratch.parent / "toolchain-headers" if scratch.name == "toolchain-tmp" else scratch / "neuronbuild-headers"


def header_lock_dir() -> Path:
    """Inductor's per-header lock files: in the shared scratch dir, which actions can neither write nor read (their
    $TMPDIR is private; a file an action could open, even read-only, it could flock and hold, stalling every warm-up
    of the machine). Only warm-ups, in workers, take them; a compile finds its headers in the memo it inherits."""
    return shared_scratch() / "neuronbuild-header-locks"


def inductor_dirs() -> StepDirs:
    """What a step compiling with inductor uses besides its sandbox (Toolchain.step_dirs): the precompiled headers
    (read-only), created here. Its working files go to its own output dir and $TMPDIR (private)."""
    headers = header_dir()
    headers.mkdir(parents=True, exist_ok=True)
    return StepDirs(read=(str(headers),))


def _use_header_dir() -> None:
    """Point inductor's precompiled headers at header_dir() and their lock files at header_lock_dir()."""
    import torch._inductor.codecache as cc

    cc._HEADER_DIR = str(header_dir())
    cc._HEADER_LOCK_DIR = str(header_lock_dir())


@contextmanager
def _private_dir(parent: Path) -> Iterator[Path]:
    """A fresh directory under `parent` (a compile's output dir, a warm-up's header dir: written by nothing but this
    process), removed afterwards: inductor's working files, never shared between compiles (see the note at the top)."""
    parent.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=".neuronbuild-inductor-", dir=parent))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def compile_jobs() -> int:
    """How many C++ compiler processes one compile (or warm-up) in this process may run at once: the worker's thread
    budget (THREADS_VAR, set by execution/env.py in every worker's environment; unset: 1). Only the compiler's concurrency follows it, never codegen (torch's own thread count, which inductor's
    codegen reads, stays at OMP_NUM_THREADS=1 in workers: artifacts must not depend on --jobs)."""
    try:
        return max(1, envvars.current().integer(THREADS_VAR))
    except ValueError:
        return 1


@contextmanager
def _compile_environment(isa: str, target: IsaTarget, cache_dir: Path) -> Iterator[Path]:
    """The pinned vector ISA, inductor's working dir (`cache_dir`, private to this compile) and path-free objects,
    for one compile."""
    _use_header_dir()
    with _pinned_vec_isa(target), _fixed_cache_dir(cache_dir), _path_free_objects(cache_dir, compile_jobs()):
        yield cache_dir


def warm_up_cpu(isa: str) -> dict[str, Any]:
    """Build (or find) the precompiled headers every AOTInductor compile for `isa` in this process will ask for, with
    the very arguments inductor's AotCodeCompiler.compile passes (same compile command, hence the same files), under
    inductor's own per-header file lock: concurrent warm-ups and compiles on one machine build each header once.
    Also fills this process's in-memory memo of them, so its next compile skips even the preprocessing.
    Returns {"isa", "headers": [file names], "built": how many were made now (here or by a concurrent process),
    "seconds"}."""
    import time

    start, wall = time.perf_counter(), time.time()
    target = isa_target(isa)
    import torch._inductor.codecache as cc
    from torch._inductor import config
    from torch._inductor.cpp_builder import CppBuilder, CppTorchDeviceOptions
    from torch._inductor.utils import determine_aoti_mmap_flags

    # The warm-up runs in the worker, unconfined: its working files (and the preprocessed headers inductor hashes to
    # name a precompiled header) go where actions cannot write (beside the headers), not into their $TMPDIR.
    with _private_dir(header_dir()) as work, _compile_environment(isa, target, work / "inductor"), \
            config.patch(inductor_configs(target)), _temp_dir(work):
        if not config.aot_inductor.precompile_headers:
            return {"isa": isa, "headers": [], "built": 0, "codegen_s": warm_codegen(),
                    "seconds": round(time.perf_counter() - start, 3)}
        picked = cc.pick_vec_isa()
        cmd = repr(CppBuilder(name="o", sources="i", BuildOption=CppTorchDeviceOptions(
            vec_isa=picked, device_type="cpu", aot_mode=True)).get_command_line())
        # A constants-free package serialises no weights: consts_size 0.
        use_external_weights, use_mmap_weights = determine_aoti_mmap_flags(0)
        command: dict[str, Any] = {"aot_mode": True, "device_type": "cpu", "use_mmap_weights": use_mmap_weights,
                                   "use_mmap_weights_external": use_external_weights, "use_relative_path": False,
                                   "vec_isa": picked}
        wanted = [(cc._get_cpp_wrapper_header("cpu", aot_mode=True),
                   {"min_optimize": not config.aot_inductor.package_cpp_only, **command})]
        if prefix := cc._get_cpp_prefix_header("cpu"):
            wanted.append((prefix, command))

        def build(item: tuple[str, dict[str, Any]]) -> Path:
            # Inductor's config patches are per thread: a pool thread patches its own (else -march=native, -g1).
            # Keyword order matters: the memo (functools.cache) keys on it, as inductor's call site passes them.
            with config.patch(inductor_configs(target)):
                return Path(cc._precompile_header(item[0], cmd, **item[1]))

        # The headers are independent: their compiles run at once, up to the machine's cores whatever this worker's
        # share (every compile waits for them: a few seconds of oversubscription beside the traces cost less than
        # a serial critical path). The threads only wait for g++ and are joined before returning (workers fork
        # after this).
        # Meanwhile, on this thread (while the header threads wait for g++, or for another worker's header lock; with
        # one thread, before the headers): what every compile's codegen initialises once per process
        # (warm_codegen), so each compile forked from this worker starts with it done.
        jobs = min(host_cores(), len(wanted))
        if jobs > 1:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(jobs, thread_name_prefix="neuronbuild-pch") as pool:
                pending = pool.map(build, wanted)
                codegen_s = warm_codegen()
                paths = list(pending)
        else:
            codegen_s = warm_codegen()
            paths = [build(item) for item in wanted]
        headers = [p.name for p in paths]
        built = sum(int(p.with_name(p.name + ".gch").stat().st_mtime >= wall - 1.0) for p in paths)  # made now
    return {"isa": isa, "headers": headers, "built": built, "seconds": round(time.perf_counter() - start, 3),
            "jobs": jobs, "codegen_s": codegen_s}


def warm_codegen() -> float:
    """Initialise in this process what the first AOTInductor compile of a process initialises and every later one
    reuses: the code generators' backend registration, the pattern matcher's pattern tables (traced at first use,
    ~0.4 s), and the modules codegen and packaging import on first use (sympy's units among them, ~0.1 s). A compile
    forked from a worker that did this spends ~0.4 s less CPU (measured: 2.4 -> 2.0 s of Python); one process
    compiling graph after graph (the serial script) pays it once as well. It registers the same patterns with the same arguments as a compile's first use
    (the cpu device; the post-grad table without arguments), so later compiles see the same tables either way.
    Starts no thread and runs tensor ops only under FakeTensorMode (a worker forks after it). Returns its seconds."""
    import time

    start = time.perf_counter()
    import sympy.physics.units  # noqa: F401  (what sympy's simplify imports on first use)
    import torch._dynamo.repro.aoti  # noqa: F401
    import torch._inductor.bounds  # noqa: F401
    import torch._inductor.choices  # noqa: F401
    import torch._inductor.codegen.segmented_tree  # noqa: F401
    import torch._inductor.package.package  # noqa: F401
    from torch._inductor.codegen.common import get_device_op_overrides, init_backend_registration
    from torch._inductor.fx_passes import joint_graph, post_grad

    init_backend_registration()
    get_device_op_overrides("cpu")
    # The arguments a compile passes: joint_graph_passes(gm, input_device) with the inputs' device, and post_grad's
    # lazy_init() without any (both memoised by functools.cache on their arguments).
    joint_graph.lazy_init(torch.device("cpu"))
    post_grad.lazy_init()
    return round(time.perf_counter() - start, 3)


def held_tensors(ep: torch.export.ExportedProgram) -> dict[str, torch.Tensor]:
    """Every tensor a program holds by FQN: parameters, buffers and lifted tensor constants."""
    return {**dict(ep.state_dict), **{k: v for k, v in ep.constants.items() if isinstance(v, torch.Tensor)}}


@contextmanager
def _weights_never_inlined() -> Iterator[None]:
    """Inductor inlines 0-d and <= 8-element 1-d constants into the generated code (`GraphLowering.get_attr`); a
    program's weights are fake tensors here (no values), so each is kept a constant bound at load instead
    (`always_keep_tensor_constants` for that one attribute): the package is a function of the program's shapes and
    never needs a weight value. Constants inductor makes itself (real tensors) are inlined as before."""
    import torch._inductor.graph as graph
    from torch._inductor import config
    from torch._subclasses.fake_tensor import FakeTensor

    original = graph.GraphLowering.get_attr

    def get_attr(self: Any, target: Any, args: Any, kwargs: Any) -> Any:
        if isinstance(graph.getattr_recursive(self.module, target), FakeTensor):
            with config.patch(always_keep_tensor_constants=True):
                return original(self, target, args, kwargs)
        return original(self, target, args, kwargs)

    graph.GraphLowering.get_attr = get_attr  # type: ignore[method-assign]
    try:
        yield
    finally:
        graph.GraphLowering.get_attr = original  # type: ignore[method-assign]


@contextmanager
def _fake_constants_by_storage() -> Iterator[None]:
    """Inductor dedups constants by storage address (`is_same_tensor`: one constant for tied weights); a program's
    weights are fake tensors here (no storage, address 0), so two distinct weights of one shape would become one.
    For fake tensors, compare the storages themselves (tied weights share one, as real ones share an address)."""
    import torch._inductor.codegen.cpp_gemm_template as gemm
    import torch._inductor.graph as graph
    from torch._subclasses.fake_tensor import FakeTensor

    original = graph.is_same_tensor

    def same(data: torch.Tensor, value: torch.Tensor) -> bool:
        if not (isinstance(data, FakeTensor) or isinstance(value, FakeTensor)):
            return bool(original(data, value))
        return (isinstance(data, FakeTensor) and isinstance(value, FakeTensor) and data.size() == value.size()
                and data.stride() == value.stride() and data.dtype == value.dtype and data.device == value.device
                and data.untyped_storage()._cdata == value.untyped_storage()._cdata
                and data.storage_offset() == value.storage_offset())

    with ExitStack() as stack:
        for mod in (graph, gemm):
            stack.callback(setattr, mod, "is_same_tensor", mod.is_same_tensor)
            mod.is_same_tensor = same  # type: ignore[attr-defined]
        yield


@contextmanager
def _temp_dir(path: Path) -> Iterator[None]:
    """tempfile's directory is `path` meanwhile (this thread's and the pool threads' temp files: the warm-up's)."""
    before = tempfile.tempdir
    tempfile.tempdir = str(path)
    try:
        yield
    finally:
        tempfile.tempdir = before


@contextmanager
def _fixed_cache_dir(cache_dir: Path) -> Iterator[None]:
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    cache_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    with temporary_cache_dir(str(cache_dir)):
        yield


def _is_object_compile(cmd_line: str) -> bool:
    """A compile of AOTInductor's generated wrapper or kernel source into its object file (`-c`): sources that stay
    on disk until the package is written. Not a link, a preprocessing (-E), a header, or the constants object
    (inductor deletes its source as soon as the compile command returns)."""
    args = cmd_line.split()
    return "-c" in args and "-E" not in args and "c++-header" not in args and \
        any(a.endswith((".wrapper.cpp", ".kernel.cpp")) for a in args)


class _ObjectCompiles:
    """Runs up to `jobs` object compiles (inductor's wrapper, kernel and constants objects) at once: each starts in
    the background and the caller goes on; any other command (the link) first waits for every one of them, as does
    the end of the compile. The same commands and files as one at a time: only the order of the waits changes.
    Started only from the thread that opened the compile (warm-up threads build headers, never objects)."""

    def __init__(self, jobs: int) -> None:
        self.jobs = jobs
        self.owner = threading.get_ident()
        self.pending: list[tuple[Any, list[str], Any]] = []

    def defer(self, cmd_line: str) -> bool:
        return self.jobs > 1 and threading.get_ident() == self.owner and _is_object_compile(cmd_line)

    def start(self, cmd_line: str, cwd: str) -> None:
        import shlex
        import subprocess

        self.drain(self.jobs - 1)
        out = tempfile.TemporaryFile()
        cmd = shlex.split(cmd_line)
        try:
            # The build's own dir (inductor removes the empty per-command dir `cwd` when this returns); every path
            # in the command is absolute.
            proc = subprocess.Popen(cmd, cwd=os.path.dirname(cwd.rstrip("/")) or cwd, stdout=out,
                                    stderr=subprocess.STDOUT)
        except BaseException:
            out.close()
            raise
        self.pending.append((proc, cmd, out))

    def drain(self, keep: int = 0) -> None:
        """Wait (oldest first) until at most `keep` compiles run; a failed one raises inductor's CppCompileError."""
        from torch._inductor.exc import CppCompileError

        while len(self.pending) > keep:
            proc, cmd, out = self.pending.pop(0)
            with out:
                code = proc.wait()
                if code != 0:
                    out.seek(0)
                    raise CppCompileError(cmd, out.read().decode("utf-8", "replace"))

    def abandon(self) -> None:
        for proc, _cmd, out in self.pending:
            with suppress(OSError):
                proc.kill()
            proc.wait()
            out.close()
        self.pending.clear()


@contextmanager
def _path_free_objects(cache_dir: Path, jobs: int = 1) -> Iterator[None]:
    """Add -ffile-prefix-map so __FILE__ strings in the .so name neither the venv (torch headers) nor the cache dir;
    with `jobs` > 1, run up to that many object compiles at once (_ObjectCompiles).

    The flags go onto the compiler command lines as they run, not into inductor's cflags: inductor names its
    generated files (and so the symbols and build-id inside the .so) by a hash of the cflags, which must not depend
    on where the working dir is (two cache dirs must give identical packages)."""
    import shlex

    import torch._inductor.codecache as codecache
    from torch._inductor import cpp_builder

    run, write = cpp_builder._run_compile_cmd, codecache.write
    maps = " ".join(shlex.quote(f"-ffile-prefix-map={src}={dst}") for src, dst in ((TORCH_DIR, "/torch"),
                                                                                  (cache_dir, "/inductor")))
    objects = _ObjectCompiles(jobs)

    def run_mapped(cmd_line: str, cwd: str) -> None:
        line = f"{cmd_line} {maps}"
        if objects.defer(cmd_line):
            objects.start(line, cwd)
            return
        if threading.get_ident() == objects.owner:
            objects.drain()  # a link reads the objects
        run(line, cwd)

    def write_path_free(content: str | bytes, extension: str, extra: str = "", hash_type: str = "code",
                        specified_dir: str = "", key: str | None = None) -> tuple[str, str]:
        # The kernel source opens with a comment naming the wrapper's absolute path, and its hash names the kernel
        # file (and symbols in the .so): name the working dir the way the prefix map does.
        if key is None and isinstance(content, str) and content.startswith(_KERNEL_NOTE):
            first, nl, rest = content.partition("\n")
            content = first.replace(str(cache_dir), "/inductor") + nl + rest
        return write(content, extension, extra, hash_type, specified_dir, key)

    cpp_builder._run_compile_cmd = run_mapped
    codecache.write = write_path_free
    try:
        yield
        objects.drain()
    finally:
        objects.abandon()
        cpp_builder._run_compile_cmd = run
        codecache.write = write


@functools.cache  # one instance per ISA: inductor's memo of precompiled headers keys on it (equality needs the class)
def _pinned_isa_instance(target: IsaTarget) -> Any:
    from torch._inductor import cpu_vec_isa as v

    if target.vec_isa is None:
        return v.invalid_vec_isa

    # Subclasses that skip inductor's host probes: the ISA is what the target says, not what this machine has
    # (the stock pick would take AMX / AVX512-VNNI / AVX512-BF16 extensions when the build machine has them).
    if target.vec_isa == "avx2":

        class PinnedAVX2(v.VecAVX2):  # type: ignore[misc]
            def __bool__(self) -> bool:
                return True

        return PinnedAVX2()

    class PinnedAVX512(v.VecAVX512):  # type: ignore[misc]
        def __bool__(self) -> bool:  # type: ignore[override]
            return True

        def is_avx512_bf16_supported(self) -> bool:  # type: ignore[override]
            return False

        def build_arch_flags(self) -> str:
            return str(v.VecAVX512._arch_flags)

    return PinnedAVX512()


@contextmanager
def _pinned_vec_isa(target: IsaTarget) -> Iterator[None]:
    """Make every inductor call site of pick_vec_isa() return the target's ISA for the duration of a compile."""
    import torch._inductor.compile_fx  # noqa: F401, I001  (import first: cpp_micro_gemm alone hits an import cycle)
    import torch._inductor.codecache as codecache
    import torch._inductor.codegen.cpp_micro_gemm as micro_gemm
    from torch._inductor import cpu_vec_isa

    isa = _pinned_isa_instance(target)

    def pick() -> Any:
        return isa

    with ExitStack() as stack:
        for mod in (cpu_vec_isa, codecache, micro_gemm):
            original = mod.pick_vec_isa
            stack.callback(setattr, mod, "pick_vec_isa", original)
            mod.pick_vec_isa = pick  # type: ignore[attr-defined]
        yield


def canonical_package(raw: bytes) -> bytes:
    """Rewrite an AOTI package zip deterministically: generated C++ sources, build-flag files and serialization_id
    dropped, top folder renamed to PACKAGE_MODEL_NAME, members sorted, 1980-01-01 timestamps, stored."""
    members: dict[str, bytes] = {}
    with zipfile.ZipFile(io.BytesIO(raw)) as zin:
        for info in zin.infolist():
            if info.is_dir():
                continue
            _, _, rest = info.filename.partition("/")
            if not rest or _dropped_member(rest):
                continue
            members[f"{PACKAGE_MODEL_NAME}/{rest}"] = zin.read(info)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as zout:
        for name in sorted(members):
            info = zipfile.ZipInfo(name, date_time=_ZIP_EPOCH)
            info.compress_type = zipfile.ZIP_STORED
            info.external_attr = 0o644 << 16
            info.create_system = 3
            zout.writestr(info, members[name])
    return out.getvalue()


def _dropped_member(rest: str) -> bool:
    name = rest.rsplit("/", 1)[-1]
    return (
        name.endswith((".cpp", ".h"))
        or name.endswith(("_compile_flags.json", "_linker_flags.json"))
        or rest == ".data/serialization_id"
    )
