"""Shared-directory tier (NFS/FSx): the local cache's layout on a mount many machines share; link()-based lock files."""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

from neuronbuild.atomic import atomic_write_bytes
from neuronbuild.cache.action_cache import ActionCache, listed_records
from neuronbuild.cache.cas import BlobStore, remove_entry
from neuronbuild.cache.locks import LockDir, LockFile
from neuronbuild.cache.tier import MAX_RECORD_BYTES, SharedTier, TierReadOnly, TierUnavailable

LAYOUT = "v1"
_READ_ONLY = {errno.EROFS, errno.EACCES, errno.EPERM}


class SharedDirTier(SharedTier):
    """A shared cache directory. The directory itself must exist (a missing mount is 'unreachable', not created)."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.url = str(base)
        self.root = base / LAYOUT
        self.blobstore = BlobStore(self.root)
        self.locks = LockDir(self.root / "locks", self.root / "tmp")
        self._checked = False

    def _ready(self) -> None:
        if self._checked:
            return
        if not self.base.is_dir():
            raise TierUnavailable(f"directory {self.base} does not exist")
        self._checked = True

    def _write(self, fn, *args):  # type: ignore[no-untyped-def]
        self._ready()
        try:
            return fn(*args)
        except OSError as e:
            if e.errno in _READ_ONLY:
                raise TierReadOnly(str(e)) from e
            raise

    def record_path(self, fp: str) -> Path:
        return self.root / "ac" / fp[:2] / f"{fp}.json"

    def get_record(self, fp: str) -> bytes | None:
        self._ready()
        try:
            return _read_capped(self.record_path(fp))
        except FileNotFoundError:
            return None

    def records_among(self, fps: Sequence[str]) -> set[str]:
        """From one listing of each shard asked, once more than ActionCache.LISTING_AFTER are asked."""
        self._ready()
        if len(fps) <= ActionCache.LISTING_AFTER:
            return set(fps)
        return set(listed_records(str(self.root / "ac"), fps))

    @contextlib.contextmanager
    def open_blob(self, digest: str) -> Iterator[BinaryIO]:
        self._ready()
        with open(self.blobstore.path(digest), "rb") as f:
            yield f

    def has_blob(self, digest: str, size: int) -> bool:
        self._ready()
        try:
            return self.blobstore.path(digest).stat().st_size == size
        except FileNotFoundError:
            return False

    def put_blob(self, digest: str, src: Path) -> None:
        got, _size = self._write(self.blobstore.put_file, src)
        if got != digest:
            raise OSError(f"{src} changed while uploading it")

    def put_record(self, fp: str, data: bytes) -> None:
        self._write(atomic_write_bytes, self.record_path(fp), data, self.root / "tmp")

    def evict_blob(self, digest: str) -> None:
        with contextlib.suppress(OSError):
            self.blobstore.evict(digest)

    def evict_record(self, fp: str) -> None:
        remove_entry(self.record_path(fp))

    def try_claim(self, fp: str) -> LockFile | None:
        return self._write(self.locks.try_acquire, fp)  # type: ignore[no-any-return]

    def records(self) -> Iterator[tuple[str, bytes]]:
        self._ready()
        ac = self.root / "ac"
        if not ac.is_dir():
            return
        for p in sorted(ac.glob("*/*.json")):
            try:
                data = _read_capped(p)
            except FileNotFoundError:
                continue  # removed meanwhile (gc)
            except OSError:
                data = b""  # unreadable (e.g. a directory where a record belongs): reported by verify, not skipped
            yield p.stem, data

    def blobs(self) -> Iterator[tuple[str, int]]:
        self._ready()
        for digest, p in self.blobstore.digests():
            with contextlib.suppress(OSError):
                yield digest, p.stat().st_size


def _read_capped(p: Path) -> bytes:
    """A record's bytes; b"" (unreadable: a miss, a bad record for verify) when it is over MAX_RECORD_BYTES."""
    with open(p, "rb") as f:
        data = f.read(MAX_RECORD_BYTES + 1)
    return b"" if len(data) > MAX_RECORD_BYTES else data
