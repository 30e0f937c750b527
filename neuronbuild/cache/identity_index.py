"""The per-identity history store: action identity (label + bucket + target) -> its most recent result (fingerprint,
duration, peak memory), used for explanations, estimates and scheduling.

Layout: <root>/identities/<h(group)>/<h(identity)>.json, one small file per identity, written atomically when a
result is stored (last writer wins), so a group (every bucket of one label and target) is one directory listing.
Losing the index loses only explanations, never results."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

from neuronbuild import jsondata
from neuronbuild.atomic import atomic_write_bytes
from neuronbuild.cache.action_cache import ActionCache, ActionResult
from neuronbuild.digests import digest_bytes, is_racy, stat_key
from neuronbuild.history import LatestEntry, PastResult, identity_group


def _h(text: str) -> str:
    return digest_bytes(text.encode())[:24]


class IdentityIndex:
    """Read and update the index under a cache layout root (<cache>/v1)."""

    def __init__(self, root: Path) -> None:
        self.dir = root / "identities"
        self.tmp = root / "tmp"

    def path(self, identity: str) -> Path:
        return self.dir / _h(identity_group(identity)) / f"{_h(identity)}.json"

    def record(self, res: ActionResult) -> None:
        """Make `res` its identity's most recent result. Never raises for I/O: the index is advisory."""
        bucket = res.record.get("bucket") if isinstance(res.record, dict) else None
        peak = res.metadata.get("peak_rss_mb") if isinstance(res.metadata, dict) else None
        data = json.dumps({"identity": res.identity, "fingerprint": res.fingerprint, "bucket": bucket or {},
                           "duration_s": round(res.duration_s, 3), "created": round(res.created, 3),
                           "peak_rss_mb": round(float(peak), 1) if isinstance(peak, (int, float)) else 0.0},
                          sort_keys=True).encode()
        with contextlib.suppress(OSError):  # (not synced: advisory, and a file a crash cut reads as no entry)
            atomic_write_bytes(self.path(res.identity), data, self.tmp, durable=False)

    def _read(self, p: Path) -> LatestEntry | None:
        try:
            d = jsondata.loads(p.read_bytes())
            return LatestEntry(str(d["identity"]), str(d["fingerprint"]), dict(d.get("bucket") or {}),
                               float(d.get("duration_s", 0.0)), float(d.get("created", 0.0)),
                               float(d.get("peak_rss_mb", 0.0)))
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
            return None

    def latest(self, identity: str) -> LatestEntry | None:
        e = self._read(self.path(identity))
        return e if e is not None and e.identity == identity else None

    def group(self, identity: str) -> Iterator[LatestEntry]:
        group = identity_group(identity)
        d = self.dir / _h(group)
        for p in sorted(d.glob("*.json")) if d.is_dir() else ():
            e = self._read(p)
            if e is not None and identity_group(e.identity) == group:
                yield e

    def entries(self) -> Iterator[LatestEntry]:
        for p in sorted(self.dir.glob("*/*.json")) if self.dir.is_dir() else ():
            e = self._read(p)
            if e is not None:
                yield e


class CacheHistory:
    """neuronbuild.history.History over a cache layout root: action records plus the identity index.

    One instance serves one command: after LISTING_AFTER questions it lists directories (each record shard, the
    index's group directories) once and answers "nothing recorded" from those listings without trying to open a
    file per action (a plan of 100,000 unbuilt actions asked ~500,000 such questions)."""

    LISTING_AFTER = 256

    def __init__(self, root: Path) -> None:
        self.actions = ActionCache(root)
        self.index = IdentityIndex(root)
        self._entries: list[LatestEntry] | None = None
        self._asked = 0
        self._shards: dict[str, frozenset[str]] = {}
        self._groups: frozenset[str] | None = None
        self._group_h: dict[str, str] = {}
        self._identity_known: dict[str, bool] = {}

    def stamp(self) -> tuple[object, ...] | None:
        """A stamp of everything this history reads: history_stamp() of its root."""
        return history_stamp(self.actions.root)

    def _listing(self) -> bool:
        self._asked += 1
        return self._asked > self.LISTING_AFTER

    def _has_record(self, fp: str) -> bool:
        shard = fp[:2]
        names = self._shards.get(shard)
        if names is None:
            try:
                names = frozenset(os.listdir(self.actions.dir / shard))
            except OSError:
                names = frozenset()
            self._shards[shard] = names
        return f"{fp}.json" in names

    def _has_group(self, identity: str) -> bool:
        known = self._identity_known.get(identity)
        if known is None:
            known = self._identity_known[identity] = self._group_listed(identity)
        return known

    def _group_listed(self, identity: str) -> bool:
        if self._groups is None:
            try:
                self._groups = frozenset(os.listdir(self.index.dir))
            except OSError:
                self._groups = frozenset()
        if not self._groups:
            return False  # nothing recorded at all (a first plan): no digest per identity
        group = identity_group(identity)
        h = self._group_h.get(group)
        if h is None:
            h = self._group_h[group] = _h(group)
        return h in self._groups

    def result(self, fp: str) -> PastResult | None:
        if self._listing() and not self._has_record(fp):
            return None
        res = self.actions.get(fp)
        if res is None:
            return None
        return PastResult(res.fingerprint, res.identity, res.record, res.duration_s, res.created)

    def latest(self, identity: str) -> LatestEntry | None:
        if self._listing() and not self._has_group(identity):
            return None
        return self.index.latest(identity)

    def group(self, identity: str) -> list[LatestEntry]:
        if self._listing() and not self._has_group(identity):
            return []
        return list(self.index.group(identity))

    def entries(self) -> list[LatestEntry]:
        if self._entries is None:
            self._entries = list(self.index.entries())
        return self._entries


def history_stamp(root: Path) -> tuple[object, ...] | None:
    """A value that changes whenever what a CacheHistory over `root` answers can change: the stat (inode, mtime and
    ctime) of the record directory, of each of its shard directories, of the identity index and of each of its group
    directories. Records and index entries are only ever added, replaced (a rename) or removed, and each of those
    changes the directory holding them; a file rewritten in place is not an entry (utime of a record for LRU changes
    no answer). None when one of them changed within RACY_NS of now: a further change in the same timestamp tick
    could keep its stamp, so nothing may be reused on the strength of it.

    Taken before the history is read: a change made meanwhile shows in the next stamp (the reads may have seen it or
    not; the next command reads afresh)."""
    now = time.time_ns()
    out: list[object] = [str(root)]
    for top in (root / "ac", root / "identities"):
        try:
            st = os.stat(top)
            names = sorted(os.listdir(top))
        except FileNotFoundError:
            out.append(None)
            continue
        except OSError:
            return None
        if is_racy(stat_key(st), now):
            return None
        out.append((st.st_ino, st.st_mtime_ns, st.st_ctime_ns))
        base = f"{top}/"
        for name in names:
            try:
                sub = os.stat(base + name)
            except OSError:
                return None
            if is_racy(stat_key(sub), now):
                return None
            out.append((name, sub.st_ino, sub.st_mtime_ns, sub.st_ctime_ns))
    return tuple(out)
