"""Named key components: an action's record as named parts (sources, config, bucket, target, options, toolchain
versions, ...), each with its own digest, and which parts differ from another record (`explain --key`).

The parts are read off the record the fingerprint digests (its top-level fields; a model record one level deeper:
`model.srcs`, `model.config`, ...), so naming them changes no fingerprint: every cached result keeps its record, and
with it its parts."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from neuronbuild.digests import fingerprint

SPLIT = ("model",)  # record fields shown one entry per part (a model record: srcs, config, seed, inputs, ...)
_ABSENT = "(absent)"


@dataclass(frozen=True)
class KeyPart:
    name: str
    digest: str  # the BLAKE3 of the part's canonical JSON ({name: value})
    value: Any

    def text(self, width: int = 70) -> str:
        s = json.dumps(self.value, sort_keys=True, default=str)
        return s if len(s) <= width else s[:width - 3] + "..."


def key_parts(record: Mapping[str, Any]) -> list[KeyPart]:
    """The record's named parts, in name order."""
    out = []
    for k in sorted(record):
        v = record[k]
        if k in SPLIT and isinstance(v, Mapping):
            out += [KeyPart(f"{k}.{sub}", fingerprint({f"{k}.{sub}": v[sub]}), v[sub]) for sub in sorted(v)]
        else:
            out.append(KeyPart(k, fingerprint({k: v}), v))
    return out


def differing(parts: list[KeyPart], other: Mapping[str, Any]) -> list[str]:
    """The names of the parts (of either record) whose digests differ from `other`'s, in name order."""
    theirs = {p.name: p.digest for p in key_parts(other)}
    mine = {p.name: p.digest for p in parts}
    return sorted(n for n in set(mine) | set(theirs) if mine.get(n, _ABSENT) != theirs.get(n, _ABSENT))
