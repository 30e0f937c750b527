"""Imports a user's model factory from a sandbox, builds the eager nn.Module and makes example inputs."""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch

from neuronbuild import vocabulary
from neuronbuild.toolchains.errors import ToolchainError, source_frame

_ENTRY_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*):([A-Za-z_][A-Za-z0-9_]*)$")

BUILTIN_PREFIX = "neuronbuild.toolchains."  # entries in shipped wrapper modules (kinds/model.py BUILTIN_PREFIX)
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in vocabulary.DTYPES}


def parse_entry(entry: str) -> tuple[str, str]:
    """'pkg.module:factory' -> ('pkg.module', 'factory'); ToolchainError when malformed."""
    match = _ENTRY_RE.match(entry) if isinstance(entry, str) else None
    if match is None:
        raise ToolchainError(f"bad model entry {entry!r}: expected 'module:function', e.g. 'llama:build_model'")
    return match.group(1), match.group(2)


def _module_file(package_dir: Path, module: str) -> Path:
    base = package_dir.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    raise ToolchainError(f"model module {module!r} not found under {package_dir.name}/ (looked for {base.name}.py)")


def _stable_module_name(package: str, module: str) -> str:
    # Stable (not random): the name ends up in export metadata (nn_module_stack types), which must not vary run to run.
    clean = re.sub(r"[^A-Za-z0-9_]", "_", f"{package}__{module}")
    return f"neuronbuild_user__{clean}"


@contextmanager
def _isolated_import_path(*dirs: Path) -> Iterator[None]:
    """Put dirs on sys.path (first first); afterwards drop them and every module imported from under them, so the
    next action in this worker sees none of this model's modules."""
    before = set(sys.modules)
    entries = [str(d) for d in dirs]
    sys.path[:0] = entries
    importlib.invalidate_caches()
    try:
        yield
    finally:
        for entry in entries:
            try:
                sys.path.remove(entry)
            except ValueError:
                pass
        roots = [d.resolve() for d in dirs]
        for name in set(sys.modules) - before:
            mod = sys.modules.get(name)
            file = getattr(mod, "__file__", None)
            if name.startswith("neuronbuild_user__") or (file and any(_is_under(Path(file), r) for r in roots)):
                sys.modules.pop(name, None)
        importlib.invalidate_caches()


def _is_under(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root)
    except (ValueError, OSError):
        return False
    return True


def load_factory(model: Mapping[str, Any], sandbox: Path) -> Callable[..., Any]:
    """Import the entry module from sandbox/<package> and return its factory (call inside the import context)."""
    module_name, attr = parse_entry(model.get("entry", ""))
    if module_name.startswith(BUILTIN_PREFIX):  # a wrapper neuronbuild ships (its digest is in the model record)
        try:
            builtin = importlib.import_module(module_name)
        except ImportError as exc:
            raise ToolchainError(f"cannot import {module_name}: {exc}") from exc
        factory = getattr(builtin, attr, None)
        if not callable(factory):
            raise ToolchainError(f"{module_name} has no factory {attr!r}")
        return factory  # type: ignore[no-any-return]
    package = str(model.get("package", ""))
    package_dir = (sandbox / package) if package else sandbox
    path = _module_file(package_dir, module_name)
    unique = _stable_module_name(package, module_name)
    spec = importlib.util.spec_from_file_location(unique, path)
    if spec is None or spec.loader is None:
        raise ToolchainError(f"cannot import model module {module_name!r} from {path.name}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[unique] = mod  # dataclasses and friends look the module up while it executes
    spec.loader.exec_module(mod)
    factory = getattr(mod, attr, None)
    if factory is None:
        raise ToolchainError(f"model module {module_name!r} has no factory {attr!r}")
    if not callable(factory):
        raise ToolchainError(f"{module_name}:{attr} is not callable")
    return factory  # type: ignore[no-any-return]


def _factory_module(model: Mapping[str, Any], sandbox: Path, shapes_only: bool = False) -> torch.nn.Module:
    """The seeded factory(config)'s eval-mode module, a plain model's `quantization` applied (`shapes_only`: its
    parameters registered without values, _parameters_without_values)."""
    package = str(model.get("package", ""))
    package_dir = (sandbox / package) if package else sandbox
    # Libraries (neuron_py_library deps) import by workspace path: the sandbox root goes on sys.path after the package.
    dirs = (package_dir, sandbox) if model.get("libraries") else (package_dir,)
    with _isolated_import_path(*dirs):
        factory = load_factory(model, sandbox)
        torch.manual_seed(int(model.get("seed", 0) or 0))
        config = dict(model.get("config") or {})
        with _parameters_without_values() if shapes_only else nullcontext():
            try:
                module = factory(config)
            except KeyError as e:
                missing = _missing_config_key(e, model, config, sandbox)
                if missing is None:
                    raise
                raise missing from e
            _quantize_plain(module, model)
    if not isinstance(module, torch.nn.Module):
        raise ToolchainError(f"factory {model.get('entry')} returned {type(module).__name__}, not a torch.nn.Module")
    return module.eval()


def build_eager_model(model: dict[str, Any], sandbox: Path) -> torch.nn.Module:
    """Seeded factory(config) -> eval-mode nn.Module, with the model's weight files loaded (strict: keys and shapes
    checked) when it names any: a quantized model's quantized weights and scales through the view the weights action
    writes them with (toolchains/quantize.py, the dequantized reference), the rest as stored."""
    from neuronbuild.toolchains.quantize import open_checkpoint
    from neuronbuild.toolchains.weights import check_against

    sandbox = Path(sandbox)
    module = _factory_module(model, sandbox)
    files = _weight_files(model, sandbox)
    if files is not None:
        held = module.state_dict()
        ckpt = open_checkpoint(model, files[0], files[1], {k: v.dtype for k, v in held.items()})
        check_against({k: tuple(v.shape) for k, v in held.items()}, tied_aliases(module), ckpt)
        state = {k: ckpt.tensor(k).to(v.dtype) for k, v in held.items() if k in ckpt.index}
        module.load_state_dict(state, strict=not (set(held) - set(state)))
    return module


def _quantize_plain(module: Any, model: Mapping[str, Any]) -> None:
    """A plain neuron_model's `quantization` (in its config, as hf_causal_lm's): its nn.Linear layers made
    QuantLinear (toolchains/quantize.py), the weights action then writing their quantized values and scales. An
    hf_causal_lm's graphs quantize their decoder layers themselves (hf_causal_lm.hf_model)."""
    config = model.get("config") or {}
    if not isinstance(module, torch.nn.Module) or not config.get("quantization") or \
            str(model.get("entry") or "").startswith("neuronbuild.toolchains.hf_causal_lm:"):
        return
    from neuronbuild.toolchains.quantize import quantize_linears

    try:
        quantize_linears(module, config, every_linear=True)
    except ValueError as e:
        raise ToolchainError(str(e)) from None


def _missing_config_key(e: KeyError, model: Mapping[str, Any], config: Mapping[str, Any],
                        sandbox: Path) -> ToolchainError | None:
    """A KeyError naming a key the model's `config` lacks, raised while its factory ran: the key, where the factory
    read it and what the BUILD file's config does set (None for any other KeyError)."""
    key = e.args[0] if len(e.args) == 1 else None
    if not isinstance(key, str) or key in config:
        return None
    at = source_frame(e, sandbox)
    sets = ", ".join(sorted(map(str, config))) or "nothing"
    return ToolchainError(f"config key {key!r} is read by the factory {model.get('entry')}"
                          f"{f' at {at}' if at else ''} but not set in the neuron_model's `config` in BUILD (it "
                          f"sets: {sets})")


def _weight_files(model: Mapping[str, Any], sandbox: Path) -> tuple[list[Path], str] | None:
    """The model's weight files (sandbox paths; an index.json is only read at analysis) and the label errors use."""
    weights = model.get("weights")
    if not weights:
        return None
    if isinstance(weights, Mapping):  # the model record's weights: one file, or shards (index.json first)
        shards = [str(p) for p, _d in weights.get("shards") or ()] or [str(weights["path"])]
    else:
        shards = [str(weights)]
    return [sandbox / p for p in shards if not p.endswith(".json")], shards[0]


@contextmanager
def _parameters_without_values() -> Iterator[None]:
    """While the factory runs, every parameter a module registers becomes a meta tensor of its shape and dtype (the
    CPU tensor it was made from is dropped at once, before any initialiser touches it: `torch.empty` never commits
    its pages). Buffers are left as they are: a value computed in __init__ (rotary tables) is needed."""
    original = torch.nn.Module.register_parameter

    def register(self: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        original(self, name, param)

    torch.nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original  # type: ignore[method-assign]


def build_shape_model(model: dict[str, Any], sandbox: Path, tp: int = 1) -> tuple[torch.nn.Module, Any]:
    """The factory's module without weight values: parameters and persistent buffers are fake CPU tensors (shapes and
    dtypes, no storage) of the returned FakeTensorMode; non-persistent buffers keep the values __init__ computed.
    The model's weight files are checked against it (keys, shapes) from their headers only. Tied weights stay tied."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from neuronbuild.toolchains.quantize import open_checkpoint
    from neuronbuild.toolchains.weights import check_against

    sandbox = Path(sandbox)
    module = _factory_module(model, sandbox, shapes_only=True)
    files = _weight_files(model, sandbox)
    if files is not None:
        held = module.state_dict(keep_vars=True)
        expected = {k: tuple(v.shape) for k, v in held.items()}
        from neuronbuild.toolchains.tp_ops import fused_params

        check_against(expected, tied_aliases(module),
                      open_checkpoint(model, files[0], files[1], {k: v.dtype for k, v in held.items()}), tp,
                      fused_params(module))
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes: dict[int, torch.Tensor] = {}
    for mod in module.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None:
                mod._parameters[name] = without_values(p, fakes, mode)  # type: ignore[assignment]
        for name, b in list(mod._buffers.items()):
            if b is not None and name not in mod._non_persistent_buffers_set:
                mod._buffers[name] = without_values(b, fakes, mode)
    return module, mode


def without_values(t: torch.Tensor, made: dict[int, torch.Tensor], mode: Any = None) -> torch.Tensor:
    """A tensor of `t`'s shape, stride and dtype holding no values: a fake CPU tensor of FakeTensorMode `mode`, or
    (mode None) a meta tensor; a Parameter when `t` is one. One per tensor in `made` (tied tensors stay one)."""
    new = made.get(id(t))
    if new is None:
        with mode if mode is not None else nullcontext():
            new = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype,
                                      device=None if mode is not None else "meta")
        if isinstance(t, torch.nn.Parameter):
            new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
        made[id(t)] = new
    return new


def state_values(model: dict[str, Any], sandbox: Path, wanted: Mapping[str, torch.dtype],
                 tied: Mapping[str, set[str]]) -> Callable[[str], torch.Tensor | Iterator[torch.Tensor]]:
    """name -> the value of one parameter / persistent buffer in the dtype `wanted` names, one tensor at a time: read
    from the model's weight files (a tied key through a key it shares its tensor with), or, for a model without
    weight files, from the factory's own seeded initialisation (the module is then built for real: small models).
    From weight files, a value comes as consecutive flat pieces (write_safetensors takes either)."""
    from neuronbuild.toolchains.quantize import open_checkpoint

    files = _weight_files(model, sandbox)
    if files is None:
        state = build_eager_model(model, sandbox).state_dict()
        return lambda name: state[name].detach()
    ckpt = open_checkpoint(model, files[0], files[1], wanted)

    def value(name: str) -> Iterator[torch.Tensor]:
        key = name if name in ckpt.index else next((k for k in sorted(tied.get(name, ())) if k in ckpt.index), name)
        return ckpt.pieces(key, wanted[name])  # converted piece by piece: never the stored and converted copy whole

    return value


def rank_values(model: dict[str, Any], sandbox: Path, wanted: Mapping[str, torch.dtype],
                tied: Mapping[str, set[str]], tp: int, fused: Mapping[str, Any] | None = None
                ) -> Callable[[str, tuple[int, ...], int], torch.Tensor | Iterator[torch.Tensor]]:
    """(name, the rank's shape, rank) -> that rank's part of the tensor in the dtype `wanted` names, one tensor at a
    time (tp_ops.shard_rule: the rank's shape against the whole one), from the model's weight files or, without them,
    the factory's seeded initialisation of `model`. A replicated tensor (a norm) streams as converted pieces, like
    state_values; one split along dim 0 (column-parallel, the vocabulary) reads only the rank's rows; one split along
    another dim (row-parallel) is read whole and sliced; a fused one (`fused`, tp_ops.FUSED_ATTR: q|k|v, gate|up) is
    read whole and each part sliced. ValueError when the shapes admit no split."""
    from neuronbuild.toolchains.quantize import open_checkpoint
    from neuronbuild.toolchains.tp_ops import block, fused_shard, padded, shard

    fused = dict(fused or {})
    files = _weight_files(model, sandbox)
    if files is None:
        state = build_eager_model(model, sandbox).state_dict()

        def own(name: str, shape: tuple[int, ...], rank: int) -> torch.Tensor:
            t = state[name].detach().to(wanted[name])
            if name in fused:
                return fused_shard(t, shape, rank, tp, *fused[name]).contiguous()
            return shard(t, shape, rank, tp).contiguous()

        return own
    ckpt = open_checkpoint(model, files[0], files[1], wanted)

    def value(name: str, shape: tuple[int, ...], rank: int) -> torch.Tensor | Iterator[torch.Tensor]:
        key = name if name in ckpt.index else next((k for k in sorted(tied.get(name, ())) if k in ckpt.index), name)
        if name in fused:
            return fused_shard(ckpt.tensor(key).to(wanted[name]), shape, rank, tp, *fused[name]).contiguous()
        dim, start, held = block(ckpt.shape(key), shape, rank, tp)
        if dim < 0:
            return ckpt.pieces(key, wanted[name])
        if dim == 0:
            return padded(ckpt.rows(key, start, held).to(wanted[name]), shape, 0)
        return shard(ckpt.tensor(key).to(wanted[name]), shape, rank, tp).contiguous()

    return value


def tied_aliases(module: torch.nn.Module) -> dict[str, set[str]]:
    """State-dict key -> the other keys sharing its tensor (tied weights, e.g. lm_head.weight = embed_tokens.weight)."""
    by_tensor: dict[int, set[str]] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        by_tensor.setdefault(id(t), set()).add(name)
    return {k: group - {k} for group in by_tensor.values() for k in group}


def input_pairs(inputs: Any) -> list[tuple[str, Any]]:
    """Input specs as (name, spec) pairs in positional order: records hold [name, spec] pairs (older ones a dict)."""
    if isinstance(inputs, Mapping):
        return list(inputs.items())
    try:
        return [(str(k), v) for k, v in inputs]
    except (TypeError, ValueError):
        raise ToolchainError("inputs must be a list of [name, spec] pairs") from None


def input_shapes(inputs: Any, bucket: Mapping[str, Any]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) per input, in declaration order; dims are bucket names or literal ints."""
    result = []
    for name, spec in input_pairs(inputs):
        if not isinstance(spec, Mapping):
            raise ToolchainError(f"input {name!r}: spec must be a dict with 'dtype' and 'dims'")
        dtype_name = str(spec.get("dtype", "float32"))
        if dtype_name not in DTYPES:
            raise ToolchainError(f"input {name!r}: unknown dtype {dtype_name!r} (known: {', '.join(sorted(DTYPES))})")
        shape = []
        for dim in spec.get("dims", ()):
            if isinstance(dim, int) and not isinstance(dim, bool):
                size = dim
            elif isinstance(dim, str) and dim in bucket:
                size = bucket[dim]
            else:
                raise ToolchainError(f"input {name!r}: dim {dim!r} is not in the bucket ({', '.join(sorted(bucket))})")
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise ToolchainError(f"input {name!r}: dim {dim!r} has bad size {size!r}")
            shape.append(size)
        result.append((str(name), DTYPES[dtype_name], tuple(shape)))
    return result


def int_range(name: str, dtype: torch.dtype, config: Mapping[str, Any] | None,
              ranges: Mapping[str, Any] | None) -> tuple[int, int]:
    """[low, high) of the random values of an integer input: `input_ranges`, else from config keys (token_type_ids:
    type_vocab_size, else 2; masks: ones; other ids: vocab_size / vocab, else [0, 100)); clipped to the dtype."""
    config = config or {}

    def key(*names: str) -> int | None:
        for n in names:
            v = config.get(n)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
        return None

    if ranges and name in ranges:
        low, high = (int(x) for x in ranges[name])
    elif "token_type" in name:
        low, high = 0, key("type_vocab_size") or 2  # BERT's default type vocabulary
    elif "mask" in name:
        low, high = 1, 2  # attend everywhere: random masks can blank whole rows (NaN in eager and compiled alike)
    else:
        low, high = 0, key("vocab_size", "vocab") or 100
    info = torch.iinfo(dtype)
    low, high = max(low, int(info.min)), min(high, int(info.max) + 1)
    if low >= high:
        raise ToolchainError(f"input {name!r}: empty value range [{low}, {high}) for {dtype}")
    return low, high


def example_inputs(
    inputs: Any,
    bucket: dict[str, Any],
    *,
    seed: int | None = None,
    config: Mapping[str, Any] | None = None,
    ranges: Mapping[str, Any] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Positional example tensors for a bucket: zeros when seed is None, else seeded random values."""
    shapes = input_shapes(inputs, bucket)
    if seed is None:
        return tuple(torch.zeros(shape, dtype=dtype) for _, dtype, shape in shapes)
    gen = torch.Generator().manual_seed(int(seed))
    out = []
    for name, dtype, shape in shapes:
        if dtype == torch.bool:
            out.append(torch.randint(0, 2, shape, generator=gen).to(torch.bool))
        elif dtype.is_floating_point:
            out.append(torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype))
        else:
            low, high = int_range(name, dtype, config, ranges)
            out.append(torch.randint(low, high, shape, generator=gen, dtype=dtype))
    return tuple(out)
