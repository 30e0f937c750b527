"""The block count a serving host asks for, checked against the block layout its graphs were compiled for
(hf_causal_lm kv_layout = "block", docs/llm.md "Block KV cache"). The pool's shape is baked into the graphs (as NxD
Inference, which "does not support using different kv cache sizes at compile vs. runtime"; vLLM users set
`num_gpu_blocks_override` by hand and nothing checks it): `verify --host`, a strict `open_cache` and
`causal_lm(label)` refuse a host configuration asking for another count, naming both. No torch here.

The host configuration: `$NEURONBUILD_NUM_BLOCKS` (or open_cache(num_blocks=...), verify --num-blocks): `N` for every
block-layout model (line-layout models are not concerned), or `LABEL=N[,LABEL=N...]` per model (a label so named
must have been compiled with the block layout)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from neuronbuild.plugin_api.loader import Mismatch
from neuronbuild.runtime.layout import Graph

NUM_BLOCKS_ENV = "NEURONBUILD_NUM_BLOCKS"
FIELD = "kv_layout.num_blocks"

Asked = int | dict[str, int]


class BlockLayoutMismatch(ValueError):
    """A host configuration asking for another block layout than the one the graphs were compiled for."""


def _count(text: str, what: str) -> int:
    try:
        n = int(text.strip())
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{what}: {text.strip()!r} is not a block count (a positive int)")
    return n


def parse_num_blocks(value: str | int | Mapping[str, int] | None, what: str = NUM_BLOCKS_ENV) -> Asked | None:
    """`N`, `LABEL=N,LABEL=N`, an int or a {label: N} mapping as asked; None: nothing asked. ValueError naming `what`
    on anything else."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, bool):
        raise ValueError(f"{what}: {value!r} is not a block count (a positive int)")
    if isinstance(value, int):
        return _count(str(value), what)
    if isinstance(value, Mapping):
        return {str(k): _count(str(v), f"{what} [{k}]") for k, v in value.items()}
    if "=" not in value:
        return _count(value, what)
    out: dict[str, int] = {}
    for part in value.split(","):
        label, sep, n = part.partition("=")
        if not sep or not label.strip().startswith("//"):
            raise ValueError(f"{what}: {part.strip()!r} is not LABEL=N (e.g. //models:llama_cpu=64)")
        out[label.strip()] = _count(n, f"{what} [{label.strip()}]")
    return out


def compiled_layout(g: Graph) -> dict[str, Any] | None:
    """The block layout a graph was compiled for ({"kind": "block", "block_size", "num_blocks"[, "max_batch"]}, from
    its trace record, as the bundle's manifest holds it), or None (a cache of sequence lines, or not an LLM)."""
    layout = ((g.trace_record.get("model") or {}).get("config") or {}).get("kv_layout")
    return dict(layout) if isinstance(layout, Mapping) and layout.get("kind") == "block" else None


def served_layout(g: Any) -> dict[str, Any] | None:
    """The block layout of a block-layout token graph (a deployed layout.Graph, or validate's over loaded artifacts)
    as the bundle's manifest records it (its inputs, its trace record), or None: block_size,
    num_blocks (the pool's blocks, its scratch block aside), blocks_per_seq, kv_dtype, shape (the whole pool, as
    callers hold it), tp_degree and rank_shape (the pool each rank's graph holds: the kv heads split over the ranks
    at tp_degree > 1, from the traced program's own inputs), max_batch (the engine's cap, None: num_blocks)."""
    if "block_table" not in g.inputs:
        return None
    dims = [int(d) for d in dict(g.inputs["kv"])["dims"]]
    model = g.trace_record.get("model") or {}
    traced = (model.get("config") or {}).get("kv_layout") or {}
    degree = int((model.get("tp") or {}).get("degree") or 1)
    # the traced program's own kv input: one rank's at tp_degree > 1
    rank = [int(d) for d in dict(model.get("inputs") or [])["kv"]["dims"]] if degree > 1 else dims
    return {"block_size": dims[4], "num_blocks": dims[2] - 1, "blocks_per_seq": int(g.inputs["block_table"]["dims"][1]),
            "kv_dtype": str(dict(g.inputs["kv"])["dtype"]), "shape": dims, "tp_degree": degree, "rank_shape": rank,
            "max_batch": traced.get("max_batch")}


def _mismatch(label: str, layout: Mapping[str, Any] | None, n: int, source: str) -> Mismatch:
    built = ("a contiguous cache of sequence lines (no kv_layout = \"block\")" if layout is None
             else f"num_blocks={layout['num_blocks']} (block_size {layout['block_size']})")
    return Mismatch(label, FIELD, built, f"num_blocks={n} asked by {source}")


def block_count_mismatches(graphs: Iterable[Graph], asked: Asked | None, source: str) -> list[Mismatch]:
    """One Mismatch per model whose compiled block count is not the one asked (an int: every block-layout model; a
    mapping: the models it names, which must have the block layout)."""
    if asked is None:
        return []
    layouts: dict[str, dict[str, Any] | None] = {}
    for g in graphs:
        if layouts.get(g.label) is None:
            layouts[g.label] = compiled_layout(g)
    out = []
    for label, layout in layouts.items():
        n = asked if isinstance(asked, int) else asked.get(label)
        if n is None or (layout is None and isinstance(asked, int)):
            continue
        if layout is None or int(layout["num_blocks"]) != n:
            out.append(_mismatch(label, layout, n, source))
    return out


def check_label(label: str, graphs: Iterable[Graph], asked: Asked | None, source: str) -> None:
    """BlockLayoutMismatch when the host asks `label` for another block count than its graphs'."""
    found = block_count_mismatches([g for g in graphs if g.label == label], asked, source)
    if found:
        m = found[0]
        raise BlockLayoutMismatch(f"{label}: {m.here.replace(' asked by', ' requested by')}, but its graphs were "
                                  f"compiled for {m.built}; the block count is part of the graphs' shapes")
