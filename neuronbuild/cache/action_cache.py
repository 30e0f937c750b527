"""Action records: fingerprint -> output digests, the full input record, timing; stored as JSON under <root>/ac."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neuronbuild.atomic import atomic_write_bytes

RECORD_VERSION = 1


@dataclass(frozen=True)
class OutputRef:
    """One output file of an action: its digest and size."""

    digest: str
    size: int


@dataclass(frozen=True)
class ActionResult:
    """A successful action's cached result."""

    fingerprint: str
    identity: str
    outputs: Mapping[str, OutputRef] = field(hash=False)
    record: Mapping[str, Any] = field(hash=False, compare=False)
    duration_s: float = 0.0
    metadata: Mapping[str, Any] = field(default_factory=dict, hash=False, compare=False)
    created: float = 0.0

    def to_json(self) -> bytes:
        return json.dumps({
            "version": RECORD_VERSION,
            "fingerprint": self.fingerprint,
            "identity": self.identity,
            "outputs": {k: {"digest": v.digest, "size": v.size} for k, v in sorted(self.outputs.items())},
            "record": self.record,
            "duration_s": round(self.duration_s, 3),
            "metadata": self.metadata,
            "created": round(self.created, 3),
        }, sort_keys=True, indent=1).encode()

    @staticmethod
    def from_json(data: bytes) -> ActionResult:
        d = json.loads(data)
        if d.get("version") != RECORD_VERSION:
            raise ValueError("unknown record version")
        return ActionResult(
            d["fingerprint"], d["identity"],
            {k: OutputRef(v["digest"], int(v["size"])) for k, v in d["outputs"].items()},
            d["record"], float(d["duration_s"]), d.get("metadata", {}), float(d.get("created", 0.0)),
        )


class ActionCache:
    """Records under <root>/ac/<first two hex>/<fingerprint>.json; an unreadable record counts as a miss."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.dir = root / "ac"
        self.tmp = root / "tmp"

    def path(self, fp: str) -> Path:
        return self.dir / fp[:2] / f"{fp}.json"

    def get(self, fp: str) -> ActionResult | None:
        p = self.path(fp)
        try:
            data = p.read_bytes()
        except OSError:
            return None
        try:
            res = ActionResult.from_json(data)
        except (ValueError, KeyError, TypeError):
            with contextlib.suppress(OSError):
                os.unlink(p)
            return None
        return res if res.fingerprint == fp else None

    def put(self, result: ActionResult) -> None:
        atomic_write_bytes(self.path(result.fingerprint), result.to_json(), self.tmp)
