"""Content-addressed blob store: <root>/cas/<first two hex>/<blake3 digest>, immutable once written."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import blake3

_CHUNK = 1 << 20


class CorruptBlob(Exception):
    """A blob whose bytes no longer match its digest (it has been removed from the store)."""


class BlobStore:
    """Blobs named by their BLAKE3 digest. Writers stage in <root>/tmp and rename into place."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.cas = root / "cas"
        self.tmp = root / "tmp"

    def path(self, digest: str) -> Path:
        return self.cas / digest[:2] / digest

    def has(self, digest: str) -> bool:
        return self.path(digest).is_file()

    def put_file(self, src: Path) -> tuple[str, int]:
        """Copy `src` into the store (hashing while copying); returns (digest, size)."""
        self.tmp.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.tmp, prefix=".blob-")
        h = blake3.blake3()
        size = 0
        try:
            with os.fdopen(fd, "wb") as out, open(src, "rb") as f:
                while chunk := f.read(_CHUNK):
                    h.update(chunk)
                    out.write(chunk)
                    size += len(chunk)
                out.flush()
                os.fsync(out.fileno())
            digest = h.hexdigest()
            dest = self.path(digest)
            if dest.is_file():
                os.unlink(tmp)
            else:
                dest.parent.mkdir(parents=True, exist_ok=True)
                os.chmod(tmp, 0o444)
                os.replace(tmp, dest)
            return digest, size
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def copy_out(self, digest: str, dest: Path) -> int:
        """Copy a blob to `dest` atomically, verifying its digest on the way; a corrupt blob is evicted."""
        src = self.path(digest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".nb-")
        h = blake3.blake3()
        size = 0
        try:
            with os.fdopen(fd, "wb") as out, open(src, "rb") as f:
                while chunk := f.read(_CHUNK):
                    h.update(chunk)
                    out.write(chunk)
                    size += len(chunk)
            if h.hexdigest() != digest:
                self.evict(digest)
                raise CorruptBlob(f"blob {digest[:16]} is corrupt (digest mismatch); evicted")
            os.replace(tmp, dest)
            return size
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def verify(self, digest: str) -> bool:
        try:
            h = blake3.blake3()
            with open(self.path(digest), "rb") as f:
                while chunk := f.read(_CHUNK):
                    h.update(chunk)
            return h.hexdigest() == digest
        except OSError:
            return False

    def evict(self, digest: str) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.path(digest))

    def link_or_copy(self, digest: str, dest: Path) -> None:
        """Place a verified read-only copy of a blob at `dest` (sandbox inputs)."""
        if not self.verify(digest):
            self.evict(digest)
            raise CorruptBlob(f"blob {digest[:16]} is corrupt (digest mismatch); evicted")
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(self.path(digest), dest)
        except OSError:
            shutil.copyfile(self.path(digest), dest)
