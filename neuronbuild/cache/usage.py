"""Bytes on disk under a cache directory, by part (blobs, records, compiler scratch, logs, ...), for stats and gc.

Everything neuronbuild keeps under the cache directory is counted, so `cache stats` agrees with `du` and
`cache gc --max-size` bounds the whole directory, the compiler scratch dir (toolchain-tmp: inductor's caches and
precompiled headers, which actions use as TMPDIR) included."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

SCRATCH = "toolchain-tmp"
HEADERS = "toolchain-headers"  # inductor's precompiled headers: scratch too, kept apart (read-only to actions)
# Parts of <cache>/v1, by directory name; anything else is counted as "other".
PARTS = {"cas": "blobs", "ac": "action records", SCRATCH: "compiler scratch (toolchain-tmp)", "logs": "logs",
         "sandbox": "sandboxes", "failures": "failure records", "identities": "history", "state": "workspace state",
         "verified": "verified marks", "stats": "build stats", "roots": "workspace roots",
         "pins": "pins", HEADERS: "compiler scratch (toolchain-tmp)"}


def tree_bytes(path: Path) -> int:
    """Disk space (allocated blocks) of a file or directory tree; symlinks are not followed."""
    total = 0
    try:
        st = path.lstat()
    except OSError:
        return 0
    total += st.st_blocks * 512
    if not path.is_dir() or path.is_symlink():
        return total
    for dirpath, dirnames, filenames in os.walk(path):
        for n in dirnames + filenames:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, n)).st_blocks * 512
    return total


@dataclass(frozen=True)
class DiskUsage:
    """Bytes on disk under one cache directory: the total and (label, bytes) per part, largest first."""

    base: Path
    parts: tuple[tuple[str, int], ...]

    @property
    def total(self) -> int:
        return sum(b for _p, b in self.parts)


def disk_usage(base: Path) -> DiskUsage:
    by: dict[str, int] = {}
    if base.is_dir():
        for top in base.iterdir():
            if top.name == "v1" and top.is_dir() and not top.is_symlink():
                for p in top.iterdir():
                    label = PARTS.get(p.name, "other")
                    by[label] = by.get(label, 0) + tree_bytes(p)
            else:
                by["other"] = by.get("other", 0) + tree_bytes(top)
    return DiskUsage(base, tuple(sorted(by.items(), key=lambda kv: (-kv[1], kv[0]))))


def clear_scratch(root: Path, now: float, grace_s: float) -> int:
    """Remove compiler scratch files not modified within grace_s (a running build may be using newer ones).

    Returns the bytes freed. Safe while builds run: a file an open compile holds stays readable until closed, and
    what is removed is rebuilt on demand (a slower first compile)."""
    freed = 0
    for part in (SCRATCH, HEADERS):
        if (root / part).is_dir():
            freed += _clear_tree(root / part, now, grace_s)
    return freed


def _clear_tree(scratch: Path, now: float, grace_s: float) -> int:
    freed = 0
    for dirpath, dirnames, filenames in os.walk(scratch, topdown=False):
        for n in filenames:
            p = os.path.join(dirpath, n)
            with contextlib.suppress(OSError):
                st = os.lstat(p)
                if now - st.st_mtime > grace_s:
                    os.unlink(p)
                    freed += st.st_blocks * 512
        for n in dirnames:
            p = os.path.join(dirpath, n)
            if os.path.islink(p):
                continue
            with contextlib.suppress(OSError):
                before = os.lstat(p).st_blocks * 512
                os.rmdir(p)  # only when empty
                freed += before
    return freed
