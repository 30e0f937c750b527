"""Recorded durations and peak memory of past actions, by identity, for ordering work and estimating ETAs and memory.

Kept in <cache>/v1/stats/history.json (the scheduler's own file beside the cache, not a cache entry): identity ->
{"duration_s", "peak_rss_mb"}. Identity (label + bucket + target) survives edits, so an edited model's compiles are
still known to be the slow ones."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from neuronbuild.analysis.actions import TRACE, Action
from neuronbuild.atomic import atomic_write_bytes, file_lock

# Durations (s) assumed when nothing was recorded: a trace, an AOTInductor compile, a Neuron CPU-compile path compile.
ESTIMATE_S = {"trace": 4.0, "compile:cpu": 15.0, "compile": 4.0}
_MAX_ENTRIES = 20_000


def estimate_s(action: Action) -> float:
    if action.kind == TRACE:
        return ESTIMATE_S["trace"]
    return ESTIMATE_S["compile:cpu"] if action.platform == "cpu" else ESTIMATE_S["compile"]


@dataclass(frozen=True)
class Sample:
    """One identity's most recent measurements."""

    duration_s: float
    peak_rss_mb: float = 0.0


@dataclass(frozen=True)
class History:
    """Samples by action identity, read once per build."""

    path: Path
    samples: Mapping[str, Sample] = field(default_factory=dict)

    @staticmethod
    def load(cache_root: Path) -> History:
        path = cache_root / "stats" / "history.json"
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            samples = {k: Sample(float(v["duration_s"]), float(v.get("peak_rss_mb", 0.0))) for k, v in raw.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            samples = {}
        return History(path, samples)

    def duration(self, action: Action) -> float:
        s = self.samples.get(action.identity)
        return s.duration_s if s is not None else estimate_s(action)

    def peak_mb(self, action: Action) -> float | None:
        s = self.samples.get(action.identity)
        return s.peak_rss_mb if s is not None and s.peak_rss_mb > 0 else None

    def save(self, new: Mapping[str, Sample]) -> None:
        """Merge this build's samples into the file (under a lock: concurrent builds merge, not overwrite)."""
        if not new:
            return
        with file_lock(self.path.with_suffix(".lock")):
            try:
                raw = json.loads(self.path.read_text(encoding="utf-8"))
                if not isinstance(raw, dict):
                    raw = {}
            except (OSError, ValueError):
                raw = {}
            for k, s in new.items():
                raw.pop(k, None)
                raw[k] = {"duration_s": round(s.duration_s, 3), "peak_rss_mb": round(s.peak_rss_mb, 1)}
            if len(raw) > _MAX_ENTRIES:  # oldest first (insertion order): drop them
                raw = dict(list(raw.items())[-_MAX_ENTRIES:])
            atomic_write_bytes(self.path, json.dumps(raw, indent=0).encode(), self.path.parent / "tmp")
