"""Canonical input records and their digests: an action's fingerprint is the BLAKE3 of its canonical JSON record."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from neuronbuild.digests import digest_bytes


def canonical_json(record: Mapping[str, Any]) -> bytes:
    """Sorted keys, no whitespace, ASCII: the same record always gives the same bytes."""
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
