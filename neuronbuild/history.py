"""Per-identity history: the values and the read interface of past results (stored by cache/identity_index.py,
read by the one estimator, analysis/estimate.py, for plan, explain, upgrade-impact, scheduling and the live ETA)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

_BUCKET_RE = re.compile(r" \[[^\]]*\]")


def identity_group(identity: str) -> str:
    """An action identity without its bucket: 'compile //m:x [batch=1, seq=8] for trn2' -> 'compile //m:x for trn2'."""
    return _BUCKET_RE.sub("", identity, count=1)


@dataclass(frozen=True)
class PastResult:
    """A stored result as introspection sees it: fingerprint, identity, full input record, duration, time stored."""

    fingerprint: str
    identity: str
    record: Mapping[str, Any] = field(hash=False, compare=False)
    duration_s: float = 0.0
    created: float = 0.0


@dataclass(frozen=True)
class LatestEntry:
    """The identity index's entry: the most recent fingerprint stored for an identity (the record may be evicted)."""

    identity: str
    fingerprint: str
    bucket: Mapping[str, int] = field(hash=False, compare=False)
    duration_s: float = 0.0
    created: float = 0.0
    peak_rss_mb: float = 0.0  # 0: not recorded


class History(Protocol):
    """Past results (implemented over the cache by neuronbuild.cache.identity_index.CacheHistory)."""

    def result(self, fp: str) -> PastResult | None:
        """The stored record of fingerprint `fp` (even if its output blobs are gone), or None."""

    def latest(self, identity: str) -> LatestEntry | None:
        """The most recent result stored for this identity, or None."""

    def group(self, identity: str) -> Iterable[LatestEntry]:
        """Latest entries of every bucket of this identity's group (same kind, label and target)."""

    def entries(self) -> Iterable[LatestEntry]:
        """Every identity's latest entry."""
