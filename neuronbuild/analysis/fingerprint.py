"""Canonical input records and their digests: an action's fingerprint is the BLAKE3 of its canonical JSON record
(canonical_json and fingerprint live in the base layer, digests.py, so `cache verify` re-derives fingerprints too)."""

from __future__ import annotations

from typing import Any

from neuronbuild.digests import canonical_json as canonical_json
from neuronbuild.digests import fingerprint as fingerprint


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
