"""Atomic file writes (a temp file beside the destination, optional fsync, rename) and advisory file locks.

The one place that writes a file atomically (`atomic_write_bytes`; `atomic_writer` streams large files) and takes a
host-local lock (`file_lock`, `try_lock`/`unlock`): shared by every phase (cache entries and blobs, persistent
loading/digest caches, no-op stamps, bundles, deploy indexes, profiles, the build server's state). Locks are flock(2):
released when the block ends or the holding process dies, never left held by a crash. Cross-machine locks on a shared
filesystem, where flock is unreliable, are `cache/locks.py`'s lock files. The build server's thin client takes its
start lock with fcntl directly (it imports the standard library only, to start fast: docs/server.md)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


def current_umask() -> int:
    """This process's umask (read without changing it where Linux allows)."""
    try:  # Linux: read it without changing it (os.umask would, for a moment, for every thread)
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def umask_mode(base: int = 0o666) -> int:
    """`base` as the process umask leaves it: the mode a plain open() would give a new file."""
    return base & ~current_umask()


@contextlib.contextmanager
def atomic_writer(dest: Path | str, tmp_dir: Path | str | None = None, *, durable: bool = True,
                  mode: int | None = None, prefix: str = ".w-") -> Iterator[BinaryIO]:
    """A file to stream `dest`'s new contents into: when the block ends normally it is flushed (fsynced unless
    `durable=False`) and renamed onto `dest`, so readers see either the old file or the whole new one; when the block
    raises, the temp file is removed and `dest` is untouched.

    The temp file (`prefix` + random, in `tmp_dir`, default `dest`'s directory: it must be on the same filesystem)
    is the yielded file's `name`. `mode` sets the permissions (default mkstemp's 0600)."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = dest.parent if tmp_dir is None else Path(tmp_dir)
    tmp_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=tmp_dir, prefix=prefix)
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        with open(fd, "wb") as f:
            f.raw.name = tmp  # type: ignore[attr-defined]  # (a file opened from a descriptor is named by its number)
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write_bytes(dest: Path | str, data: bytes, tmp_dir: Path | str | None = None, *, durable: bool = True,
                       mode: int | None = None) -> None:
    """Write `data` to `dest` so that readers see either nothing (or the old file) or the whole file.

    `durable=False` skips the fsync (for caches that are only a speed-up); `mode` sets the permissions (mkstemp's
    default is 0600); `tmp_dir` (default `dest`'s directory) holds the temp file until the rename."""
    with atomic_writer(dest, tmp_dir, durable=durable, mode=mode) as f:
        f.write(data)


def fsync_path(path: Path | str) -> None:
    """fsync the file or directory (its entries: a rename into it) at `path`."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def try_lock(path: Path | str, *, shared: bool = False, blocking: bool = True, directory: bool = False) -> int | None:
    """An flock on `path` held by the returned descriptor until `unlock(fd)` (or the process dies); None when
    `blocking=False` and another holder has it. `path` is created if missing, unless `directory=True`: then the
    existing directory itself is locked (no lock file is left behind; a symlink is refused with OSError)."""
    if directory:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    else:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if blocking else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def unlock(fd: int) -> None:
    """Release a lock `try_lock` returned."""
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


@contextlib.contextmanager
def file_lock(path: Path | str, shared: bool = False, *, directory: bool = False) -> Iterator[None]:
    """A blocking flock on `path` for the block (see `try_lock`)."""
    fd = try_lock(path, shared=shared, directory=directory)
    assert fd is not None
    try:
        yield
    finally:
        unlock(fd)


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
