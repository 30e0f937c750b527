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
    error: str = ""  # set when running either side failed (e.g. an input value out of the model's range)


def value_config(model_spec: Mapping[str, Any], workspace: Path) -> dict[str, Any]:
    """The keys that size random integer inputs: the model's `config`, over the top-level keys of any declared
    `config.json` data file (HF models read theirs from there)."""
    import json

    merged: dict[str, Any] = {}
    for path in sorted(model_spec.get("data") or {}):
        if not str(path).endswith("config.json"):
            continue
        try:
            data = json.loads((Path(workspace) / path).read_bytes()[: 1 << 20])
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            merged.update({k: v for k, v in data.items() if isinstance(v, int) and not isinstance(v, bool)})
    return merged | dict(model_spec.get("config") or {})


def eager_model(model_spec: Mapping[str, Any], workspace: Path) -> Callable[..., Any]:
    """The eager model a trace record describes, built from the workspace's sources and weights."""
    from neuronbuild.toolchains.model_import import build_eager_model

    return build_eager_model(dict(model_spec), workspace)


def compare(fn: Callable[..., Any], model: Callable[..., Any], inputs: Any, bucket: Mapping[str, int],
            config: Mapping[str, Any], seed: int, ranges: Mapping[str, Any] | None = None) -> Comparison:
    """Run both on the same seeded inputs; every output tensor (flattened by name, as traced) is compared."""
    import torch

    from neuronbuild.toolchains.model_import import example_inputs
    from neuronbuild.toolchains.outputs import flatten

    args = example_inputs(inputs, dict(bucket), seed=seed, config=dict(config), ranges=ranges)
    try:
        with torch.no_grad():
            ref = [t for _n, t in flatten(model(*args))]
            out = [t for _n, t in flatten(fn(*args))]
    except Exception as exc:  # noqa: BLE001 - reported as this graph's result, with how to fix the usual cause
        first = (str(exc).strip().splitlines() or [""])[0]
        hint = " (integer inputs out of range? set the model's input_ranges)" if isinstance(exc, IndexError) else ""
        return Comparison(float("inf"), float("inf"), (), f"{type(exc).__name__}: {first}{hint}")
    if len(ref) != len(out) or any(tuple(r.shape) != tuple(o.shape) for r, o in zip(ref, out, strict=False)):
        return Comparison(float("inf"), float("inf"), tuple(int(o.numel()) for o in out))
    ref_t = torch.cat([t.reshape(-1).float() for t in ref]) if ref else torch.zeros(0)
    out_t = torch.cat([t.reshape(-1).float() for t in out]) if out else torch.zeros(0)
    max_abs = float((out_t - ref_t).abs().max()) if ref_t.numel() else 0.0
    scale = float(ref_t.abs().max()) if ref_t.numel() else 0.0
    return Comparison(max_abs, max_abs / scale if scale > 0 else max_abs, tuple(ref_t.shape))
