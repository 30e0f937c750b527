"""The cpu compile step: an exported program -> a canonical AOTInductor package and its weights (constants)."""

from __future__ import annotations

import io
import tempfile
import zipfile
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from neuronbuild.toolchains.errors import ToolchainError
from neuronbuild.toolchains.model_import import example_inputs
from neuronbuild.toolchains.passes import apply_passes
from neuronbuild.toolchains.trace import load_program, strip_unstable_meta

# Inductor's working files go to this fixed per-machine dir whatever TORCHINDUCTOR_CACHE_DIR says (restored after),
# shared by every worker process (inductor takes file locks) and safe to delete at any time. The objects do not name
# it (-ffile-prefix-map below maps it to /inductor and torch's headers to /torch), so artifact bytes depend neither on
# the sandbox nor on the cache or venv location; a warm and a fresh cache gave identical packages. The "-1" suffix
# versions our flag patches. Note: the ISA pin and the flag patch are process-global monkeypatches held for the
# duration of one compile: compile one graph at a time per process (the worker model), not from several threads.
INDUCTOR_CACHE_DIR = Path("/tmp/neuronbuild-inductor") / f"torch-{torch.__version__}-1"
TORCH_DIR = Path(torch.__file__).resolve().parent
PACKAGE_MODEL_NAME = "model"
CONSTANTS_FILE = "constants.safetensors"  # the cpu compile's second output: the package's weights by FQN  # the top folder inside the canonical model.pt2 and the name load_package asks for
_ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)


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
    """Compile spec["program"] (relative to sandbox) into an AOTInductor package for spec["isa"] in out_dir."""
    ep, args = _program_and_args(spec, sandbox)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    return compile_cpu(ep, args, str(spec.get("isa", "")), spec.get("options") or {}, Path(out_dir))


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
) -> dict[str, Any]:
    if isa not in ISA_TARGETS:
        raise ToolchainError(f"unknown cpu isa {isa!r} (expected one of {', '.join(ISA_TARGETS)})")
    target = ISA_TARGETS[isa]
    strip_unstable_meta(ep)  # the trace's source lines serve Neuron lowering errors; the package never holds them
    ep = apply_passes(ep, options, args)
    from torch._inductor import aoti_compile_and_package

    inductor_configs: dict[str, Any] = {
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
    with (
        tempfile.TemporaryDirectory(prefix="neuronbuild-aoti-") as tmp,
        _pinned_vec_isa(target),
        _fixed_cache_dir(),
        _path_free_objects(),
    ):
        raw = Path(tmp) / f"{PACKAGE_MODEL_NAME}.pt2"
        with torch.no_grad():
            aoti_compile_and_package(ep, package_path=str(raw), inductor_configs=inductor_configs)
        data = canonical_package(raw.read_bytes())
        # Every tensor the program holds (a superset of what the package asks for: inductor folds some buffers in),
        # so the file is the same bytes as the Neuron lowering's: one weights file per model for all graphs/targets.
        held = set(ep.state_dict) | {k for k, v in ep.constants.items() if isinstance(v, torch.Tensor)}
        constants = constants_bytes(ep, sorted(held | set(_constant_fqns(raw))))
    (out_dir / "model.pt2").write_bytes(data)
    (out_dir / CONSTANTS_FILE).write_bytes(constants)
    return {"artifact": "model.pt2", "bytes": len(data), "isa": isa, "constants": CONSTANTS_FILE,
            "constants_bytes": len(constants)}


def _constant_fqns(package: Path) -> list[str]:
    loader = torch._C._aoti.AOTIModelPackageLoader(str(package), PACKAGE_MODEL_NAME, False, 1, -1)
    return sorted(str(n) for n in loader.get_constant_fqns())


def constants_bytes(ep: torch.export.ExportedProgram, fqns: list[str]) -> bytes:
    """The constants a constants-free package needs (parameters, buffers, lifted constants by FQN) as safetensors.

    Bytes depend only on the tensors (sorted names, no metadata), so every bucket of a model yields the same file."""
    from safetensors.torch import save

    available: dict[str, torch.Tensor] = {**dict(ep.state_dict), **{k: v for k, v in ep.constants.items()
                                                                     if isinstance(v, torch.Tensor)}}
    missing = [n for n in fqns if n not in available]
    if missing:
        raise ToolchainError(f"the compiled package needs constant(s) the program does not hold: {', '.join(missing[:5])}")
    # Clone: tied weights share storage, which safetensors refuses to save.
    return save({n: available[n].detach().contiguous().clone() for n in fqns})


@contextmanager
def _fixed_cache_dir() -> Iterator[None]:
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    INDUCTOR_CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with temporary_cache_dir(str(INDUCTOR_CACHE_DIR)):
        yield


@contextmanager
def _path_free_objects() -> Iterator[None]:
    """Add -ffile-prefix-map so __FILE__ strings in the .so name neither the venv (torch headers) nor the cache dir."""
    from torch._inductor import cpp_builder

    original = cpp_builder._get_optimization_cflags
    maps = [f"ffile-prefix-map={TORCH_DIR}=/torch", f"ffile-prefix-map={INDUCTOR_CACHE_DIR}=/inductor"]

    def patched(cpp_compiler: str, min_optimize: bool = False) -> tuple[list[str], list[str]]:
        cflags, ldflags = original(cpp_compiler, min_optimize)
        return [*cflags, *maps], ldflags

    cpp_builder._get_optimization_cflags = patched
    try:
        yield
    finally:
        cpp_builder._get_optimization_cflags = original


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
