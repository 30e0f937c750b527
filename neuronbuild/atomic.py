"""Atomic file writes (temp file in the same directory tree, optional fsync, rename) and advisory file locks.

Shared by every phase (cache entries, persistent loading/digest caches, no-op stamps, deploy indexes)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


def atomic_write_bytes(dest: Path, data: bytes, tmp_dir: Path, *, durable: bool = True,
                       mode: int | None = None) -> None:
    """Write `data` to `dest` so that readers see either nothing or the whole file.

    `durable=False` skips the fsync (for caches that are only a speed-up); `mode` sets the permissions (mkstemp's
    default is 0600)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=tmp_dir, prefix=".w-")
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def file_lock(path: Path, shared: bool = False) -> Iterator[None]:
    """An flock-based lock on `path` (created if missing); released when the block ends or the process dies."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield
    finally:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def read_own_state(path: Path | str) -> bytes:
    """A state file's bytes, only if this user wrote it (in a cache shared between users, another user's no-op stamp
    or digest cache could claim that changed files are unchanged): OSError otherwise."""
    return read_own_state_stat(path)[0]


def read_own_state_stat(path: Path | str) -> tuple[bytes, os.stat_result]:
    """read_own_state, with the stat of the file read."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise PermissionError(f"{path}: not written by this user; ignored")
        return f.read(), st
