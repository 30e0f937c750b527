"""Content digests (BLAKE3) of files and bytes, with an in-process cache keyed by (path, size, mtime, inode)."""

from __future__ import annotations

import os
from pathlib import Path

import blake3

DIGEST_ALGO = "blake3"
_MMAP_THRESHOLD = 4 << 20
_stat_cache: dict[str, tuple[tuple[int, int, int], str]] = {}


def digest_bytes(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def digest_file(path: Path | str) -> str:
    """BLAKE3 hex digest of a file's contents; large files are hashed multi-threaded through mmap."""
    p = str(path)
    st = os.stat(p)
    key = (st.st_size, st.st_mtime_ns, st.st_ino)
    hit = _stat_cache.get(p)
    if hit is not None and hit[0] == key:
        return hit[1]
    if st.st_size >= _MMAP_THRESHOLD:
        h = blake3.blake3(max_threads=blake3.blake3.AUTO)
        h.update_mmap(p)
    else:
        h = blake3.blake3()
        with open(p, "rb") as f:
            h.update(f.read())
    d = h.hexdigest()
    _stat_cache[p] = (key, d)
    return d
