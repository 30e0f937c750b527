"""Content-addressed blob store: <root>/cas/<first two hex>/<blake3 digest>, immutable once written, verified on read.

Every read (copy out, link into a sandbox, ingest from another tier) re-hashes the bytes. A blob's last full
verification is remembered as a stamp <root>/verified/<xx>/<digest> holding its (inode, size, mtime_ns), so a lookup
can tell cheaply that a blob was modified or truncated since it was last hashed (then it is re-hashed)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import blake3

from neuronbuild.digests import copy_hashing

_CHUNK = 4 << 20


# copy_out's in-flight temporary files, next to their destination until renamed onto it.
COPY_TEMP_PREFIX = ".nb-"


def _umask() -> int:
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
    return base & ~_umask()


def _hasher() -> blake3.blake3:
    return blake3.blake3()


class CorruptBlob(OSError):
    """A blob whose bytes no longer match its digest (it has been removed from the store)."""


def _signature(st: os.stat_result) -> str:
    return f"{st.st_ino} {st.st_size} {st.st_mtime_ns}"


# Blobs this process verified (hashed, or found with a verification stamp matching them), by path: the signature
# they had then. A blob with the same signature now passes `check` without reading its stamp again: the same test the
# stamp makes (a build server checks ~7,000 blobs per build at 1,000 graphs: one stat each).
_verified: dict[str, str] = {}
_MAX_VERIFIED = 200_000  # ~250 bytes each: at most ~50 MiB


def _remember(path: str, sig: str) -> None:
    if path in _verified or len(_verified) < _MAX_VERIFIED:  # full: the blobs kept first stay kept
        _verified[path] = sig


def hash_file(path: Path) -> tuple[str, int]:
    h = _hasher()
    size = 0
    with open(path, "rb") as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(view):
            h.update(view[:n])
            size += n
    return h.hexdigest(), size


class BlobStore:
    """Blobs named by their BLAKE3 digest. Writers stage in <root>/tmp and rename into place."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.cas = root / "cas"
        self.tmp = root / "tmp"
        self.stamps = root / "verified"
        self._cas = str(self.cas)
        self._stamps = str(self.stamps)

    def path(self, digest: str) -> Path:
        return self.cas / digest[:2] / digest

    def path_str(self, digest: str) -> str:
        return f"{self._cas}/{digest[:2]}/{digest}"

    def stamp_path(self, digest: str) -> Path:
        return self.stamps / digest[:2] / digest

    def has(self, digest: str) -> bool:
        return self.path(digest).is_file()

    def digests(self) -> Iterator[tuple[str, Path]]:
        """Every blob in the store (name, path); skips anything that is not a well-formed blob name."""
        if not self.cas.is_dir():
            return
        for sub in sorted(self.cas.iterdir()):
            if not sub.is_dir():
                continue
            for p in sorted(sub.iterdir()):
                if len(p.name) == 64 and p.name[:2] == sub.name:
                    yield p.name, p

    def _stage(self) -> tuple[int, str]:
        self.tmp.mkdir(parents=True, exist_ok=True)
        return tempfile.mkstemp(dir=self.tmp, prefix=".blob-")

    def _commit(self, tmp: str, digest: str) -> None:
        dest = self.path(digest)
        if dest.is_file() and self.check(digest, os.path.getsize(tmp)) == "ok":
            os.unlink(tmp)
            with contextlib.suppress(OSError):
                os.utime(dest)  # recently used: protects it from a concurrent gc's grace period
            return
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(tmp, 0o444)
        os.replace(tmp, dest)
        self._write_stamp(digest)

    def put_file(self, src: Path) -> tuple[str, int]:
        """Copy `src` into the store (hashing while copying); returns (digest, size). A large file whose blob is
        stored (and intact) already is hashed, not copied and synced again: every graph of a model writes the same
        weights file."""
        with contextlib.suppress(OSError):
            if os.path.getsize(src) >= _CHUNK:
                digest, size = hash_file(src)
                if self.check(digest, size) == "ok":
                    with contextlib.suppress(OSError):
                        os.utime(self.path(digest))  # recently used: protects it from a concurrent gc's grace period
                    return digest, size
        fd, tmp = self._stage()
        try:
            with os.fdopen(fd, "wb") as out, open(src, "rb") as f:
                digest, size = copy_hashing(f, out)
                out.flush()
                os.fsync(out.fileno())
            self._commit(tmp, digest)
            return digest, size
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def ingest(self, src: BinaryIO, digest: str) -> int | None:
        """Store the bytes of `src` as blob `digest` if they hash to it; None (nothing stored) if they do not."""
        fd, tmp = self._stage()
        try:
            with os.fdopen(fd, "wb") as out:
                got, size = copy_hashing(src, out)
                out.flush()
                os.fsync(out.fileno())
            if got != digest:
                os.unlink(tmp)
                return None
            self._commit(tmp, digest)
            return size
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def check(self, digest: str, size: int | None = None) -> str:
        """'ok', 'missing' or 'corrupt'. Cheap when the blob is unchanged since its last verification."""
        p = f"{self._cas}/{digest[:2]}/{digest}"
        try:
            st = os.stat(p)
        except OSError:
            return "missing"
        if size is not None and st.st_size != size:
            return "corrupt"
        sig = _signature(st)
        if _verified.get(p) == sig:
            return "ok"
        try:
            with open(f"{self._stamps}/{digest[:2]}/{digest}", encoding="utf-8") as f:
                if f.read() == sig:
                    _remember(p, sig)
                    return "ok"
        except (OSError, ValueError):
            pass
        if not self.verify(digest):
            return "corrupt"
        self._write_stamp(digest)
        return "ok"

    def _write_stamp(self, digest: str) -> None:
        """Record that the blob, as it is now, was just verified (the caller hashed it)."""
        with contextlib.suppress(OSError):
            sig = _signature(self.path(digest).stat())
            _remember(str(self.path(digest)), sig)
            p = self.stamp_path(digest)
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp = p.with_name(f".{p.name}.{os.getpid()}")
            tmp.write_text(sig)
            os.replace(tmp, p)

    def copy_out(self, digest: str, dest: Path, verified_size: int | None = None) -> int:
        """Copy a blob to `dest` atomically, verifying its digest on the way; a corrupt blob is evicted.

        `verified_size`: the caller read and hashed this blob moments ago (another copy of it, e.g. the weights file
        every bucket of a model holds): the kernel copies it (sendfile) without hashing again, and a copy not of that
        size falls back to the verified copy. Either way a file of its own (never a link: editing an output must not
        reach the cache) with the umask's mode."""
        src = self.path(digest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=COPY_TEMP_PREFIX)
        try:
            os.fchmod(fd, umask_mode())  # outputs users see follow the umask, like any file they would write
            if verified_size is not None:
                with contextlib.suppress(FileNotFoundError):
                    shutil.copyfile(src, tmp)
                    if os.stat(tmp).st_size == verified_size:
                        os.close(fd)
                        os.replace(tmp, dest)
                        return verified_size
                os.ftruncate(fd, 0)
                os.lseek(fd, 0, os.SEEK_SET)
            with os.fdopen(fd, "wb") as out, open(src, "rb") as f:
                got, size = copy_hashing(f, out)
            if got != digest:
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
            return hash_file(self.path(digest))[0] == digest
        except OSError:
            return False

    def evict(self, digest: str) -> None:
        _verified.pop(str(self.path(digest)), None)
        for p in (self.path(digest), self.stamp_path(digest)):
            with contextlib.suppress(OSError):
                if p.is_dir() and not p.is_symlink():  # a directory where a blob belongs (damage): remove it whole
                    shutil.rmtree(p)
                else:
                    os.unlink(p)

    def link_or_copy(self, digest: str, dest: Path) -> None:
        """Place a verified read-only copy of a blob at `dest` (sandbox inputs)."""
        if not self.verify(digest):
            self.evict(digest)
            raise CorruptBlob(f"blob {digest[:16]} is corrupt (digest mismatch); evicted")
        self._write_stamp(digest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(self.path(digest), dest)
        except OSError:
            shutil.copyfile(self.path(digest), dest)
