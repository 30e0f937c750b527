"""Numerical validation: a built graph's artifact against the eager model on seeded inputs (max abs / rel error)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Comparison:
    """Errors of one graph against eager: max |out - ref| and that divided by max |ref|."""

    max_abs: float
    max_rel: float
    shape: tuple[int, ...]


def eager_model(model_spec: Mapping[str, Any], workspace: Path) -> Callable[..., Any]:
    """The eager model a trace record describes, built from the workspace's sources and weights."""
    from neuronbuild.toolchains.model_import import build_eager_model

    return build_eager_model(dict(model_spec), workspace)


def compare(fn: Callable[..., Any], model: Callable[..., Any], inputs: Mapping[str, Any], bucket: Mapping[str, int],
            config: Mapping[str, Any], seed: int) -> Comparison:
    import torch

    from neuronbuild.toolchains.model_import import example_inputs

    args = example_inputs(dict(inputs), dict(bucket), seed=seed, config=dict(config))
    with torch.no_grad():
        ref = model(*args)
        out = fn(*args)
    ref_t = torch.cat([t.reshape(-1).float() for t in torch.utils._pytree.tree_leaves(ref)])
    out_t = torch.cat([t.reshape(-1).float() for t in torch.utils._pytree.tree_leaves(out)])
    if ref_t.shape != out_t.shape:
        return Comparison(float("inf"), float("inf"), tuple(out_t.shape))
    max_abs = float((out_t - ref_t).abs().max()) if ref_t.numel() else 0.0
    scale = float(ref_t.abs().max()) if ref_t.numel() else 0.0
    return Comparison(max_abs, max_abs / scale if scale > 0 else max_abs, tuple(ref_t.shape))
