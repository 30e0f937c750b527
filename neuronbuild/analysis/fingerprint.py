"""Canonical input records and their digests: an action's fingerprint is the BLAKE3 of its canonical JSON record."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from neuronbuild.digests import digest_bytes


def _unserialisable(o: Any) -> Any:
    raise TypeError(f"Object of type {o.__class__.__name__} is not JSON serializable")


def _c_encoder() -> Callable[[Any, int], list[str]] | None:
    """json's C encoder made once with json.dumps's canonical options below (json.dumps makes an encoder object and
    a C encoder per call: a third of its time on a record); None where json has no C accelerator. Records hold no
    reference cycles (made by analysis from checked attribute values), so no circular-reference check."""
    try:
        import _json
    except ImportError:  # pragma: no cover - CPython has it
        return None
    return _json.make_encoder(None, _unserialisable, _json.encode_basestring_ascii,  # type: ignore[no-any-return]
                              None, ":", ",", True, False, False)


_ENCODE = _c_encoder()


def canonical_json(record: Mapping[str, Any]) -> bytes:
    """Sorted keys, no whitespace, ASCII: the same record always gives the same bytes (exactly json.dumps's)."""
    if _ENCODE is not None:
        return "".join(_ENCODE(record, 0)).encode()
    return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def fingerprint(record: Mapping[str, Any]) -> str:
    return digest_bytes(canonical_json(record))


def diff_records(old: Any, new: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """Field-by-field differences between two records: [(dotted.path, old, new)]."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[tuple[str, Any, Any]] = []
        for k in sorted(set(old) | set(new)):
            path = f"{prefix}.{k}" if prefix else str(k)
            if k not in old:
                out.append((path, None, new[k]))
            elif k not in new:
                out.append((path, old[k], None))
            else:
                out.extend(diff_records(old[k], new[k], path))
        return out
    return [] if old == new else [(prefix, old, new)]
