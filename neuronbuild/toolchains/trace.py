"""The trace step: export a user model at one bucket's static shape and save it as a byte-stable program.pt2."""

from __future__ import annotations

import io
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from neuronbuild.toolchains.errors import ToolchainError, source_frame, workspace_paths
from neuronbuild.toolchains.model_import import (
    build_shape_model,
    example_inputs,
    input_pairs,
    rank_values,
    state_values,
    tied_aliases,
    without_values,
)
from neuronbuild.toolchains.outputs import FlatForward, declared_follows, describe, inferred_follows

# Node metadata that holds source paths, line numbers or process-dependent values ("from_node" provenance records
# id(graph), a memory address, once a program has been through run_decompositions or a re-export).
_UNSTABLE_META_KEYS = ("stack_trace", "source_location", "custom", "from_node")


def strip_unstable_meta(ep: torch.export.ExportedProgram, keep_stack_traces: bool = False) -> None:
    """Drop path/line-dependent node metadata from every graph in the program (in place); keep_stack_traces keeps
    stack traces already made workspace-relative by relative_stack_traces."""
    keys = tuple(k for k in _UNSTABLE_META_KEYS if not (keep_stack_traces and k == "stack_trace"))
    for node in _nodes(ep):
        for key in keys:
            node.meta.pop(key, None)


def _nodes(ep: torch.export.ExportedProgram) -> Iterator[torch.fx.Node]:
    """Every node of every graph in the program."""
    for gm in ep.graph_module.modules():
        graph = getattr(gm, "graph", None)
        if isinstance(graph, torch.fx.Graph):
            yield from graph.nodes


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in ([^\n]+)\n([^\n]*)')


def relative_stack_traces(ep: torch.export.ExportedProgram, root: Path) -> None:
    """Rewrite each node's stack trace to its frames in files under `root` (the sandbox), named relative to it: the
    model source lines a lowering error can cite, the same bytes wherever the workspace is."""
    base = root.resolve()
    for node in _nodes(ep):
        kept = []
        for path, line, func, code in _FRAME.findall(node.meta.get("stack_trace") or ""):
            try:
                rel = Path(path).resolve().relative_to(base).as_posix()
            except (ValueError, OSError):
                continue
            kept.append(f'File "{rel}", line {line}, in {func}\n    {code.strip()}')
        if kept:
            node.meta["stack_trace"] = "\n".join(kept)
        else:
            node.meta.pop("stack_trace", None)


def program_bytes(ep: torch.export.ExportedProgram, keep_stack_traces: bool = False) -> bytes:
    """Serialise with torch.export.save to memory (the archive's folder name is then fixed, not the file's name)."""
    strip_unstable_meta(ep, keep_stack_traces)
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    return buf.getvalue()


WEIGHTS_FILE = "constants.safetensors"  # the weights action's output: the model's state by FQN (tied once)


def cause_line(exc: BaseException) -> str:
    """'Type: first line' of the innermost exception `exc` was raised from (or during): the cause a user can act on."""
    seen = {id(exc)}
    while (inner := exc.__cause__ or exc.__context__) is not None and id(inner) not in seen:
        seen.add(id(inner))
        exc = inner
    first = (str(exc).strip().splitlines() or [""])[0]
    first = first if len(first) <= 300 else first[:300] + " ..."
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def load_program(path: Path) -> torch.export.ExportedProgram:
    """A program.pt2 as the trace wrote it: its parameters and persistent buffers are shapes only (meta tensors in the
    archive, no bytes), made fake CPU tensors of the graph's own FakeTensorMode here, so lowering and compiling see
    shapes and dtypes and never allocate a weight. Lifted constants and non-persistent buffers keep their values."""
    from torch._export.utils import _detect_fake_mode_from_gm
    from torch._subclasses.fake_tensor import FakeTensorMode

    if not path.is_file():
        raise ToolchainError(f"program {path.name} not found")
    try:  # torch.export.load logs the real error and raises a generic one: read the archive ourselves first
        from torch.export.pt2_archive._package import load_pt2

        contents = load_pt2(str(path))
    except ImportError:
        contents = None
    except Exception as exc:
        raise ToolchainError(f"cannot load the traced program {path.name}: {cause_line(exc)}") from exc
    if contents is not None and "model" in contents.exported_programs:
        ep = contents.exported_programs["model"]
    else:
        ep = torch.export.load(str(path))
    mode = _detect_fake_mode_from_gm(ep.graph_module) or FakeTensorMode(allow_non_fake_inputs=True)
    made: dict[int, torch.Tensor] = {}
    for name, t in list(ep.state_dict.items()):
        if t.device.type == "meta":
            ep.state_dict[name] = without_values(t, made, mode)
    return ep


def _shapes_only(ep: torch.export.ExportedProgram, args: tuple[torch.Tensor, ...]) -> None:
    """Make `ep` serialisable without weights: state tensors become meta tensors (the archive stores their shape,
    dtype and stride, no bytes; tied ones stay one tensor), example inputs the real zeros of the bucket."""
    made: dict[int, torch.Tensor] = {}
    for name, t in list(ep.state_dict.items()):
        ep.state_dict[name] = without_values(t, made)
    ep.example_inputs = (tuple(args), {})


def trace_failure(exc: BaseException, inputs: Any, args: Sequence[Any], sandbox: Path) -> str:
    """One line: torch's message (first line), where in the model's sources, and each declared input spec with the
    shape it was traced at (`x: float32[batch, 16] traced as [4, 16]`)."""
    text = str(exc).strip()
    first = workspace_paths(text.splitlines()[0], sandbox) if text else "(no message)"
    at = source_frame(exc, sandbox)
    traced = "; ".join(
        f"{name}: {spec.get('dtype')}[{', '.join(map(str, spec.get('dims', ())))}] traced as "
        f"[{', '.join(map(str, getattr(t, 'shape', ())))}]"
        for (name, spec), t in zip(input_pairs(inputs), args, strict=False))
    return (f"tracing failed: {type(exc).__name__}: {first}{f' (at {at})' if at else ''}; the declared inputs "
            f"(check them against forward()): {traced}")


def _write_shards(out_dir: Path, tp: int, entries: list[Any], constants: Mapping[str, torch.Tensor],
                  state: Mapping[str, Any], part: Any, stored_as: Mapping[str, str]) -> int:
    """rank_<r>.safetensors for every rank: each tensor of the rank's program, its part of the whole one
    (model_import.rank_values: one tensor at a time, never the whole model in memory); returns the bytes written."""
    from neuronbuild.plugin_api.actions import rank_weights
    from neuronbuild.toolchains.tp_ops import is_rank_buffer, rank_value
    from neuronbuild.toolchains.weights import write_safetensors

    total = 0
    for rank in range(tp):
        def value(e: Any, rank: int = rank) -> Any:
            if is_rank_buffer(e.name):  # the program's rank id: each rank's own
                return rank_value(rank)
            if e.name not in state:
                return constants[e.name]
            try:
                return part(e.name, tuple(e.shape), rank)
            except ValueError as exc:
                raise ToolchainError(f"weight {e.name}: {exc}") from None

        total += write_safetensors(out_dir / rank_weights(rank), entries, value, stored_as)
    return total


def write_program_constants(ep: torch.export.ExportedProgram, path: Path) -> int:
    """The program's own tensors (non-persistent buffers, lifted constants: computed by the factory or the forward,
    never a checkpoint's values; the archive holds them) by FQN to `path` as safetensors; returns its size."""
    from neuronbuild.toolchains.weights import Entry, write_safetensors

    constants = {k: v for k, v in ep.constants.items() if isinstance(v, torch.Tensor)}
    return write_safetensors(path, [Entry(k, t.dtype, tuple(t.shape)) for k, t in constants.items()],
                             lambda e: constants[e.name])


def _rank_module(spec: Mapping[str, Any], sandbox: Path) -> tuple[torch.nn.Module, Any]:
    """The module a trace or weights action works on, from shapes only (build_shape_model), and its fake mode. At
    tp_degree > 1 it is one rank's: the factory builds that rank's model (its config's tp_degree), or a plain model's
    declared tp_plan makes its parameters one rank's shards."""
    model_spec = spec["model"]
    tp = int(spec.get("tp_degree") or 1)
    plan = dict(model_spec.get("tp_plan") or {}) if tp > 1 else {}
    if tp > 1 and not plan:
        model_spec = {**model_spec, "config": {**dict(model_spec.get("config") or {}), "tp_degree": tp}}
    module, mode = build_shape_model(model_spec, sandbox, tp)
    if plan:
        from neuronbuild.toolchains.tp_ops import apply_plan

        try:
            apply_plan(module, mode, plan, tp)
        except ValueError as exc:
            raise ToolchainError(str(exc)) from None
    return module, mode


def run_trace(spec: dict[str, Any], sandbox: Path, out_dir: Path) -> dict[str, Any]:
    """Export spec["model"] at spec["bucket"] (zeros example inputs) from shapes only (build_shape_model) to
    out_dir/program.pt2. No weight file is read or written here (the sandbox holds none): the model's weights action
    (run_weights) streams them once for every graph and bucket. Returns metadata, with the flattened outputs
    (names, shapes, which dims follow which bucket dim)."""
    sandbox, out_dir = Path(sandbox), Path(out_dir)
    module, mode = _rank_module(spec, sandbox)
    # The weights the graph binds at load, as the weights action writes them (its state: parameters and persistent
    # buffers by name, one rank's shapes at tp > 1): bundles record them, deploy and strict open_cache check a
    # weights file against them (#51: graphs and weights may be built apart).
    state = {k: [str(t.dtype).removeprefix("torch."), list(t.shape)] for k, t in module.state_dict(keep_vars=True).items()}
    inputs = spec.get("inputs") or []
    bucket = dict(spec.get("bucket") or {})
    args = example_inputs(inputs, bucket)
    flat = FlatForward(module)
    with torch.no_grad():
        try:
            ep = torch.export.export(module, tuple(mode.from_tensor(a) for a in args), strict=False)
        except (OSError, ToolchainError):
            raise  # (an undeclared file read, a confined write: the worker explains those)
        except Exception as exc:  # noqa: BLE001 - torch's message, with what was traced beside it
            # Typically the input spec does not match forward()'s signature or the layers' shapes.
            raise ToolchainError(trace_failure(exc, inputs, args, sandbox)) from exc
    relative_stack_traces(ep, sandbox)
    nodes = len(ep.graph.nodes)
    _shapes_only(ep, args)
    data = program_bytes(ep, keep_stack_traces=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "program.pt2").write_bytes(data)
    n_params = sum(int(p.numel()) for p in module.parameters())

    def run(sizes: Mapping[str, int]) -> list[tuple[str, torch.Tensor]]:
        with torch.no_grad(), mode:
            out = module(*(mode.from_tensor(a) for a in example_inputs(inputs, dict(sizes))))
        tensors = [out] if isinstance(out, torch.Tensor) else list(out)
        return list(zip(flat.names, tensors, strict=True))

    named = run(bucket)
    declared = spec.get("outputs") or []
    if declared:
        names, follows = declared_follows(list(declared), named, bucket)
        named = [(n, t) for n, (_p, t) in zip(names, named, strict=True)]
    else:
        follows = inferred_follows(run, named, bucket)
    single = flat.single
    flat.undo()
    return {
        "nodes": nodes,
        "parameters": n_params,
        "bytes": len(data),
        "outputs": describe(named, follows),
        "output_tree": "tensor" if single else "tuple",
        "state": state,
    }


def run_weights(spec: dict[str, Any], sandbox: Path, out_dir: Path) -> dict[str, Any]:
    """The weights action: the model's state (parameters, persistent buffers; from shapes: build_shape_model, which
    checks the checkpoint's keys and shapes from its headers) streamed from its weight files one tensor at a time, in
    the dtype the module holds each (a bf16 model's stay bf16), to out_dir/constants.safetensors, or one shard per
    rank (rank_<r>.safetensors) at tp_degree > 1; tied ones stored once. A model without weight files: the factory's
    own seeded values. Returns the bytes written."""
    from neuronbuild.toolchains.weights import Entry, write_safetensors

    sandbox, out_dir = Path(sandbox), Path(out_dir)
    module, _mode = _rank_module(spec, sandbox)
    tp = int(spec.get("tp_degree") or 1)
    tied = tied_aliases(module)
    held = module.state_dict(keep_vars=True)
    state = {name: (t.dtype, tuple(t.shape)) for name, t in held.items()}
    # Tied weights (one tensor under several names, e.g. lm_head.weight = model.embed_tokens.weight) are stored once,
    # under the name the module lists first; the others are aliases in the file's metadata.
    by_tensor: dict[int, list[str]] = {}
    for name, t in held.items():
        by_tensor.setdefault(id(t), []).append(name)
    stored_as = {alias: names[0] for names in by_tensor.values() for alias in names[1:]}
    del held
    entries = [Entry(k, dt, shape) for k, (dt, shape) in state.items() if k not in stored_as]
    wanted = {k: dt for k, (dt, _s) in state.items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    if tp > 1:
        # A rank's shard also holds the module's non-persistent buffers (small; computed in __init__): where a rank
        # has its own value of one, the shard's wins over the graph's program constants at load.
        own = {k: b.detach() for k, b in module.named_buffers() if k not in state and isinstance(b, torch.Tensor)}
        entries += [Entry(k, b.dtype, tuple(b.shape)) for k, b in own.items()]
        from neuronbuild.toolchains.tp_ops import fused_params

        size = _write_shards(out_dir, tp, entries, own, state,
                             rank_values(spec["model"], sandbox, wanted, tied, tp, fused_params(module)), stored_as)
    else:
        value = state_values(spec["model"], sandbox, wanted, tied)
        size = write_safetensors(out_dir / WEIGHTS_FILE, entries, lambda e: value(e.name), stored_as)
    return {"tensors": len(entries), "tied": len(stored_as), "weights_bytes": size,
            **({"tp_degree": tp} if tp > 1 else {})}
