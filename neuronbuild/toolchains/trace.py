"""The trace step: export a user model at one bucket's static shape and save it as a byte-stable program.pt2."""

from __future__ import annotations

import io
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from neuronbuild.toolchains.errors import ToolchainError
from neuronbuild.toolchains.model_import import build_eager_model, example_inputs
from neuronbuild.toolchains.outputs import FlatForward, declared_follows, describe, inferred_follows

# Node metadata that holds source paths, line numbers or process-dependent values ("from_node" provenance records
# id(graph), a memory address, once a program has been through run_decompositions or a re-export).
_UNSTABLE_META_KEYS = ("stack_trace", "source_location", "custom", "from_node")


def strip_unstable_meta(ep: torch.export.ExportedProgram, keep_stack_traces: bool = False) -> None:
    """Drop path/line-dependent node metadata from every graph in the program (in place); keep_stack_traces keeps
    stack traces already made workspace-relative by relative_stack_traces."""
    keys = tuple(k for k in _UNSTABLE_META_KEYS if not (keep_stack_traces and k == "stack_trace"))
    for gm in ep.graph_module.modules():
        graph = getattr(gm, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        for node in graph.nodes:
            for key in keys:
                node.meta.pop(key, None)


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in ([^\n]+)\n([^\n]*)')


def relative_stack_traces(ep: torch.export.ExportedProgram, root: Path) -> None:
    """Rewrite each node's stack trace to its frames in files under `root` (the sandbox), named relative to it: the
    model source lines a lowering error can cite, the same bytes wherever the workspace is."""
    base = root.resolve()
    for gm in ep.graph_module.modules():
        graph = getattr(gm, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        for node in graph.nodes:
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
    if not path.is_file():
        raise ToolchainError(f"program {path.name} not found")
    try:  # torch.export.load logs the real error and raises a generic one: read the archive ourselves first
        from torch.export.pt2_archive._package import load_pt2
    except ImportError:
        return torch.export.load(str(path))
    try:
        contents = load_pt2(str(path))
    except Exception as exc:
        raise ToolchainError(f"cannot load the traced program {path.name}: {cause_line(exc)}") from exc
    if "model" in contents.exported_programs:
        return contents.exported_programs["model"]
    return torch.export.load(str(path))


def run_trace(spec: dict[str, Any], sandbox: Path, out_dir: Path) -> dict[str, Any]:
    """Export spec["model"] at spec["bucket"] (zeros example inputs) to out_dir/program.pt2; returns metadata, with
    the flattened outputs (names, shapes, which dims follow which bucket dim)."""
    sandbox, out_dir = Path(sandbox), Path(out_dir)
    model_spec = spec["model"]
    module = build_eager_model(model_spec, sandbox)
    inputs = spec.get("inputs") or []
    bucket = dict(spec.get("bucket") or {})
    args = example_inputs(inputs, bucket)
    flat = FlatForward(module)
    with torch.no_grad():
        try:
            ep = torch.export.export(module, args, strict=False)
        except (TypeError, ValueError) as exc:
            # Typically the input spec does not match forward()'s signature.
            raise ToolchainError(f"export failed, check the inputs against forward(): {cause_line(exc)}") from exc
    relative_stack_traces(ep, sandbox)
    data = program_bytes(ep, keep_stack_traces=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "program.pt2").write_bytes(data)
    n_params = sum(int(p.numel()) for p in module.parameters())

    def run(sizes: Mapping[str, int]) -> list[tuple[str, torch.Tensor]]:
        with torch.no_grad():
            out = module(*example_inputs(inputs, dict(sizes)))
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
        "nodes": len(ep.graph.nodes),
        "parameters": n_params,
        "bytes": len(data),
        "outputs": describe(named, follows),
        "output_tree": "tensor" if single else "tuple",
    }
