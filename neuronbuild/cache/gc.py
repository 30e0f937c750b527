"""Garbage collection of the local cache: least-recently-used eviction under a size cap and an age limit.

An entry's last use is its record's mtime (touched on a hit, unless touched in the last minute: local.TOUCH_NS).
Entries referenced by the caller's keep set (the workspace's current targets) or by a pin are never evicted, nor are blobs they reference. Entries and blobs used within
GRACE_S are left alone too, so a concurrent build never loses what it has just looked up or stored."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from neuronbuild import envvars, jsondata
from neuronbuild.atomic import file_lock
from neuronbuild.cache.pins import pinned
from neuronbuild.cache.roots import live_roots
from neuronbuild.cache.usage import clear_scratch, disk_usage

if TYPE_CHECKING:
    from neuronbuild.cache.local import LocalCache

def grace_s() -> float:
    return envvars.current().seconds("NEURONBUILD_CACHE_GC_GRACE_S")
SANDBOX_MAX_AGE_S = 24 * 3600.0
CONFIG = "config.json"
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_AGES = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_size(text: str) -> int:
    """'20G', '500M', '1.5T', '123' (bytes) -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.I)
    if not m:
        raise ValueError(f"bad size '{text}' (expected e.g. 500M, 20G, 1.5T)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def parse_age(text: str) -> float:
    """'30d', '12h', '45m', '90s', '2w' -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text)
    if not m:
        raise ValueError(f"bad age '{text}' (expected e.g. 30d, 12h, 45m)")
    return float(m.group(1)) * _AGES[m.group(2)]


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


@dataclass(frozen=True)
class GcResult:
    """What a collection found and freed."""

    entries_before: int
    bytes_before: int
    entries_removed: int
    blobs_removed: int
    bytes_freed: int
    kept_referenced: int
    over_cap: bool = False
    scratch_freed: int = 0

    def summary(self) -> str:
        scratch = f", {human(self.scratch_freed)} of it compiler scratch" if self.scratch_freed else ""
        s = (f"gc: removed {self.entries_removed} of {self.entries_before} entries and {self.blobs_removed} blobs, "
             f"freed {human(self.bytes_freed)}{scratch} (on disk {human(self.bytes_before)} -> "
             f"{human(self.bytes_before - self.bytes_freed)}); kept {self.kept_referenced} referenced entries")
        if self.over_cap:
            s += "; still over the size cap (the rest is referenced or in use)"
        return s


@dataclass(frozen=True)
class _Entry:
    fp: str
    path: Path
    last_used: float
    digests: tuple[str, ...]


def _scan_records(ac: Path) -> tuple[list[_Entry], list[Path]]:
    entries: list[_Entry] = []
    broken: list[Path] = []
    if not ac.is_dir():
        return entries, broken
    for p in ac.glob("*/*.json"):
        try:
            st = p.stat()
            d = jsondata.loads(p.read_bytes())
            digests = tuple(str(o["digest"]) for o in d["outputs"].values())
        except FileNotFoundError:
            continue
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            broken.append(p)
            continue
        entries.append(_Entry(p.stem, p, st.st_mtime, digests))
    return entries, broken


def collect(cache: LocalCache, max_size: int | None = None, max_age: float | None = None,
            keep: set[str] | frozenset[str] = frozenset(), now: float | None = None,
            protect_roots: bool = True) -> GcResult:
    """Evict unreferenced entries older than `max_age`, then, while the whole cache directory is over `max_size`,
    the compiler scratch and then least recently used entries.

    Protected: `keep`, pins and (with `protect_roots`) what the last successful build of every live workspace
    referenced (cache/roots.py), whatever flags that build ran with."""
    now = time.time() if now is None else now
    grace = grace_s()
    root = cache.root
    with file_lock(root / "gc.lock"):
        pin_fps, pin_digests = pinned(root)
        if protect_roots:
            keep = set(keep) | live_roots(root)[0]
        entries, broken = _scan_records(root / "ac")
        blobs: dict[str, tuple[int, float]] = {}
        for digest, p in cache.blobs.digests():
            with contextlib.suppress(OSError):
                st = p.stat()
                blobs[digest] = (st.st_size, st.st_mtime)
        total = disk_usage(cache.base).total  # everything on disk, not only blobs
        bytes_before = total
        protected_fps = (set(keep) | pin_fps)
        refcount: dict[str, int] = {}
        for e in entries:
            for dg in e.digests:
                refcount[dg] = refcount.get(dg, 0) + 1
        protected_digests = set(pin_digests)
        for e in entries:
            if e.fp in protected_fps:
                protected_digests.update(e.digests)
        kept = sum(1 for e in entries if e.fp in protected_fps)
        candidates = sorted((e for e in entries if e.fp not in protected_fps and now - e.last_used > grace),
                            key=lambda e: e.last_used)
        removed_entries = 0
        removed_blobs = 0
        freed = 0

        def drop_blob(dg: str) -> None:
            nonlocal total, freed, removed_blobs
            size, mtime = blobs.get(dg, (0, now))
            if dg in protected_digests or refcount.get(dg, 0) > 0 or now - mtime <= grace or dg not in blobs:
                return
            cache.blobs.evict(dg)
            del blobs[dg]
            total -= size
            freed += size
            removed_blobs += 1

        def drop_entry(e: _Entry) -> None:
            nonlocal removed_entries
            with contextlib.suppress(OSError):
                os.unlink(e.path)
            with contextlib.suppress(OSError):
                os.unlink(cache.logs / e.fp[:2] / f"{e.fp}.log")
            removed_entries += 1
            for dg in e.digests:
                refcount[dg] -= 1
            for dg in e.digests:
                drop_blob(dg)

        for p in broken:
            with contextlib.suppress(OSError):
                os.unlink(p)
        rest: list[_Entry] = []
        for e in candidates:
            if max_age is not None and now - e.last_used > max_age:
                drop_entry(e)
            else:
                rest.append(e)
        for dg in list(blobs):  # orphans: referenced by no record and no pin (e.g. from a killed build)
            drop_blob(dg)
        scratch = 0
        if max_size is not None and total > max_size:
            scratch = clear_scratch(root, now, grace)
            total -= scratch
            freed += scratch
        for e in rest:
            if max_size is None or total <= max_size:
                break
            drop_entry(e)
        _sweep(cache, now, max_age)
        return GcResult(len(entries), bytes_before, removed_entries, removed_blobs, freed, kept,
                        max_size is not None and total > max_size, scratch)


def _sweep(cache: LocalCache, now: float, max_age: float | None) -> None:
    """Leftovers of killed builds (staging files, sandboxes) and old failure records."""
    for d, limit in ((cache.root / "tmp", grace_s()), (cache.scratch, SANDBOX_MAX_AGE_S)):
        if not d.is_dir():
            continue
        for p in d.iterdir():
            with contextlib.suppress(OSError):
                if now - p.lstat().st_mtime > limit:
                    if p.is_dir() and not p.is_symlink():
                        shutil.rmtree(p, ignore_errors=True)
                    else:
                        p.unlink()
    if max_age is not None and cache.failures.is_dir():
        for p in cache.failures.glob("*/*.json"):
            with contextlib.suppress(OSError):
                if now - p.stat().st_mtime > max_age:
                    p.unlink()


def configured_limits(cache: LocalCache) -> tuple[int | None, float | None]:
    """The automatic limits: $NEURONBUILD_CACHE_MAX_SIZE / _MAX_AGE, else <cache>/config.json {"max_size", "max_age"}."""
    conf: dict[str, str] = {}
    with contextlib.suppress(OSError, ValueError):
        data = jsondata.loads((cache.base / CONFIG).read_text())
        if isinstance(data, dict):
            conf = {k: str(v) for k, v in data.items()}
    size = envvars.current().text("NEURONBUILD_CACHE_MAX_SIZE") or conf.get("max_size")
    age = envvars.current().text("NEURONBUILD_CACHE_MAX_AGE") or conf.get("max_age")
    try:
        return (parse_size(size) if size else None), (parse_age(age) if age else None)
    except ValueError as e:
        cache.warn_once("gc-config", f"warning: cache: ignoring the automatic gc limit: {e}")
        return None, None


def auto_gc(cache: LocalCache, keep: set[str]) -> GcResult | None:
    """After a build: apply the configured limits, at most once per AUTO_INTERVAL_S; says what it freed."""
    max_size, max_age = configured_limits(cache)
    if max_size is None and max_age is None:
        return None
    marker = cache.root / "gc.last"
    with contextlib.suppress(OSError):
        if time.time() - marker.stat().st_mtime < envvars.current().seconds("NEURONBUILD_CACHE_GC_INTERVAL_S"):
            return None
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
        result = collect(cache, max_size, max_age, keep)
    except (OSError, ValueError) as e:
        cache.warn_once("gc-failed", f"warning: cache: automatic gc skipped: {e}")
        return None
    if result.entries_removed or result.blobs_removed:
        cache.report(result.summary())
    return result
