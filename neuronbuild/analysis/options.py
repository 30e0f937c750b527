"""Effective compiler options: deps merged in order, the target's own values win; flags concatenate."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from neuronbuild.loading.labels import Label
from neuronbuild.loading.targets import Target

OPTION_KEYS = ("opt_level", "auto_cast", "model_type", "flags")
DEFAULTS: dict[str, Any] = {"opt_level": 2, "auto_cast": "none", "model_type": None, "flags": []}


def _own(target: Target) -> dict[str, Any]:
    return {k: target.attrs[k] for k in OPTION_KEYS if target.attrs.get(k) is not None}


def _merge(targets: Mapping[Label, Target], label: Label, memo: dict[Label, dict[str, Any]]) -> dict[str, Any]:
    if label in memo:
        return memo[label]
    t = targets[label]
    merged: dict[str, Any] = {}
    flags: list[str] = []
    for dep in t.attrs.get("deps") or ():
        d = _merge(targets, dep, memo)
        flags.extend(d.get("flags", []))
        merged.update({k: v for k, v in d.items() if k != "flags"})
    own = _own(t)
    flags.extend(own.pop("flags", ()))
    merged.update(own)
    if flags:
        merged["flags"] = flags
    memo[label] = merged
    return merged


def effective_options(targets: Mapping[Label, Target], label: Label | None) -> dict[str, Any]:
    """The resolved option set (defaults filled in) that enters the fingerprint and that the toolchain sees."""
    out = dict(DEFAULTS)
    out["flags"] = []
    if label is not None:
        out.update(_merge(targets, label, {}))
    out["flags"] = list(out["flags"])
    return out
