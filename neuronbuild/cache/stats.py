"""Per-build cache counters (hits per tier, misses, errors, saves, uploads), persisted under <root>/stats/ for `cache stats`."""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from neuronbuild import jsondata
from neuronbuild.atomic import atomic_write_bytes

KEEP_BUILDS = 50


@dataclass(frozen=True)
class BuildStats:
    """What one build did with the cache. A fingerprint counts once: as a hit (served from a tier) or else a miss."""

    started: float
    finished: float
    hits_local: int = 0
    hits_shared: int = 0
    misses: int = 0
    saves: int = 0
    uploads: int = 0
    errors: int = 0
    shared: str = ""
    # What the build's summary counted (`N executed, M cached`; -1: not recorded, by builds before this field)
    executed: int = -1
    cached: int = -1

    @property
    def hits(self) -> int:
        return self.hits_local + self.hits_shared


class StatsCounter:
    """Accumulates one process's cache activity; `snapshot()` turns it into a BuildStats."""

    def __init__(self) -> None:
        self.started = time.time()
        self.served: dict[str, str] = {}  # fp -> "local" | "shared"
        self.missed: set[str] = set()
        self.saved: set[str] = set()
        self.uploaded: set[str] = set()
        self.errors = 0
        self.summary: tuple[int, int] = (-1, -1)  # (executed, cached) as the build's summary says, once it ends

    def hit(self, fp: str, tier: str) -> None:
        if fp not in self.saved:
            self.served.setdefault(fp, tier)

    def miss(self, fp: str) -> None:
        self.missed.add(fp)

    def save(self, fp: str) -> None:
        self.saved.add(fp)
        self.served.pop(fp, None)

    def snapshot(self, shared: str = "") -> BuildStats:
        served = {fp: t for fp, t in self.served.items() if fp not in self.saved}
        misses = (self.missed | self.saved) - set(served)
        return BuildStats(self.started, time.time(), sum(1 for t in served.values() if t == "local"),
                          sum(1 for t in served.values() if t == "shared"), len(misses), len(self.saved),
                          len(self.uploaded), self.errors, shared, *self.summary)

    @property
    def empty(self) -> bool:
        return not (self.served or self.missed or self.saved or self.errors)


def stats_dir(root: Path) -> Path:
    return root / "stats"


def persist(root: Path, stats: BuildStats) -> None:
    """Write one build's counters and keep only the most recent KEEP_BUILDS files."""
    d = stats_dir(root)
    name = f"{int(stats.started * 1000):015d}-{os.getpid()}.json"
    # Not durable: counters lost in a crash cost nothing, an fsync costs every no-op milliseconds.
    atomic_write_bytes(d / name, json.dumps(asdict(stats), sort_keys=True).encode(), root / "tmp", durable=False)
    files = sorted(d.glob("*.json"))
    for old in files[:-KEEP_BUILDS]:
        with contextlib.suppress(OSError):
            old.unlink()


def recent(root: Path, n: int = 10) -> list[BuildStats]:
    out: list[BuildStats] = []
    for p in sorted(stats_dir(root).glob("*.json"))[-n:]:
        try:
            out.append(BuildStats(**jsondata.loads(p.read_text())))
        except (OSError, ValueError, TypeError):
            continue
    return out
