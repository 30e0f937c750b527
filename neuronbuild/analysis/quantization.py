"""A model's `quantization` attribute checked and normalised at analysis (no torch): the same rules the toolchain's
QuantSpec.parse applies (toolchains/quantize.py calls this), so a bad value fails at its BUILD line."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

DTYPES = ("int8", "float8_e4m3", "float8_e5m2")
SCHEMES = ("per_tensor", "per_channel", "blockwise")
KEYS = ("dtype", "scheme", "block_size", "modules_to_not_convert")


def normalize(raw: Any) -> dict[str, Any]:
    """{"dtype", "scheme"[, "block_size"][, "modules_to_not_convert"]}; ValueError naming the bad field."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"quantization must be a dict, got {type(raw).__name__}")
    extra = sorted(set(map(str, raw)) - set(KEYS))
    if extra:
        raise ValueError(f"quantization: unknown key(s) {', '.join(extra)} (known: {', '.join(KEYS)})")
    dtype, scheme = raw.get("dtype"), raw.get("scheme") or "per_channel"
    if dtype not in DTYPES:
        raise ValueError(f"quantization: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if scheme not in SCHEMES:
        raise ValueError(f"quantization: scheme {scheme!r} is not one of {', '.join(SCHEMES)}")
    out: dict[str, Any] = {"dtype": dtype, "scheme": scheme}
    block = raw.get("block_size")
    if scheme == "blockwise":
        if not isinstance(block, int) or isinstance(block, bool) or block < 1:
            raise ValueError(f"quantization: scheme blockwise needs a positive int block_size, got {block!r}")
        out["block_size"] = block
    elif block is not None:
        raise ValueError(f"quantization: block_size is for scheme blockwise only (scheme is {scheme})")
    skip = raw.get("modules_to_not_convert") or ()
    if isinstance(skip, str) or not all(isinstance(s, str) and s for s in skip):
        raise ValueError("quantization: modules_to_not_convert must be a list of module name patterns")
    if skip:
        out["modules_to_not_convert"] = list(skip)
    return out
