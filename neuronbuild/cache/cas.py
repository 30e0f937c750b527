"""Content-addressed blob store: <root>/cas/<first two hex>/<blake3 digest>, immutable once written, verified on read.

Every read (copy out, link into a sandbox, ingest from another tier) re-hashes the bytes. A blob's last full
verification is remembered as a stamp <root>/verified/<xx>/<digest> holding its (inode, size, mtime_ns), so a lookup
can tell cheaply that a blob was modified or truncated since it was last hashed (then it is re-hashed)."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

import blake3

from neuronbuild.atomic import atomic_write_bytes, atomic_writer, fsync_path, umask_mode
from neuronbuild.digests import StatMemo, copy_hashing, stat_key

_CHUNK = 4 << 20


# copy_out's in-flight temporary files, next to their destination until renamed onto it.
COPY_TEMP_PREFIX = ".nb-"


@contextlib.contextmanager
def _removed_on_failure(tmp: str) -> Iterator[None]:
    """A staged or temporary file the block fills: removed if the block fails, so no half-written name is left."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def remove_entry(p: Path) -> None:
    """Remove `p` whatever it is: a file, a link, or a directory where a blob or record belongs (damage), whole; a
    failure is ignored (the next check finds what is left)."""
    with contextlib.suppress(OSError):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            os.unlink(p)


@contextlib.contextmanager
def linked_beside(src: Path, dest: Path) -> Iterator[Path | None]:
    """A hard link to `src` made beside `dest` for the block, then renamed onto it (a directory there removed); None
    where the filesystem cannot link. A missing `src` is FileNotFoundError; if the block fails, the link goes."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f"{COPY_TEMP_PREFIX}{dest.name}.{os.getpid()}")
    linked = True
    try:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        os.link(src, tmp)
    except FileNotFoundError:
        raise
    except OSError:
        linked = False
    if not linked:
        yield None
        return
    with _removed_on_failure(str(tmp)):
        yield tmp
        if dest.is_dir() and not dest.is_symlink():
            shutil.rmtree(dest)
        os.replace(tmp, dest)


def _sync_all(paths: Sequence[str]) -> None:
    """fsync every file of `paths`, issued at once from a thread each (a group commit: the filesystem's journal
    takes them in one commit). Raises the first failure, after every sync ended."""
    if len(paths) < 2:
        for path in paths:
            fsync_path(path)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(8, len(paths)), thread_name_prefix="neuronbuild-sync") as ex:
        for f in [ex.submit(fsync_path, path) for path in paths]:
            f.result()


class CorruptBlob(OSError):
    """A blob whose bytes no longer match its digest (it has been removed from the store); `digest`: its name, when
    the raiser names it for another store to evict it."""

    def __init__(self, message: str, digest: str = "") -> None:
        super().__init__(message)
        self.digest = digest


def _signature(st: os.stat_result) -> str:
    # ctime too: a blob may have another name (an output target's read-only link, BlobStore.link_out), and any
    # change through it (chmod, a write, even with the mtime put back) moves the ctime, which no caller can set.
    return f"{st.st_ino} {st.st_size} {st.st_mtime_ns} {st.st_ctime_ns}"


# Blobs this process verified (by stat key: its signature's fields; kept racy or not, a blob is never written in
# place): True where it hashed them itself (stored, or verified reading them), False where their stamp matched. `check`
# passes them without reading the stamp (a build server checks ~7,000 blobs per build at 1,000 graphs: one stat each);
# copy_read_only copies one it hashed through the kernel, not hashing it again (a trace's program, placed in each of
# its lowerings' sandboxes moments after the trace stored it). At most 200,000: ~250 bytes each, ~50 MiB.
_verified: StatMemo[bool] = StatMemo(200_000)
_TOUCH_NS = 60 * 1_000_000_000  # a blob marked used this recently is not marked again (as local.TOUCH_NS for records)


def hash_file(path: Path) -> tuple[str, int]:
    h = blake3.blake3()
    size = 0
    with open(path, "rb") as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(view):
            h.update(view[:n])
            size += n
    return h.hexdigest(), size


def _kernel_copy(src: BinaryIO, out: BinaryIO) -> bool:
    """Copy the open file `src` (whole) to the empty `out` in the kernel (copy_file_range); False if it cannot."""
    try:
        size = os.fstat(src.fileno()).st_size
        done = 0
        while done < size:
            n = os.copy_file_range(src.fileno(), out.fileno(), size - done, done, done)
            if n <= 0:
                return False
            done += n
        return os.fstat(out.fileno()).st_size == size
    except (OSError, AttributeError):
        return False


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

    def sha256_path(self, digest: str) -> Path:
        return self.root / "sha256" / digest[:2] / digest

    def known_sha256(self, digest: str) -> tuple[str, int] | None:
        """(sha256, size) of a blob recorded by `remember_sha256` when it was last hashed whole (a bundle's member),
        if the blob is unchanged since: its stat signature now (ctime included) is the one recorded with it."""
        try:
            sig, sha = self.sha256_path(digest).read_text(encoding="utf-8").rsplit(" ", 1)
            st = os.stat(self.path(digest))
        except (OSError, ValueError):
            return None
        return (sha, st.st_size) if sig == _signature(st) and len(sha) == 64 else None

    def remember_sha256(self, digest: str, sha: str, before: os.stat_result) -> None:
        """Record a blob's sha256, hashed (with its BLAKE3 digest verified) from the state `before` describes."""
        with contextlib.suppress(OSError):
            atomic_write_bytes(self.sha256_path(digest), f"{_signature(before)} {sha}".encode(), durable=False,
                               mode=umask_mode())

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

    def _touch(self, digest: str) -> None:
        """Mark a stored blob recently used (its mtime: protects it from a concurrent gc's grace period), unless it was
        marked in the last minute. Called right after the blob passed `check`, so its verification stamp is rewritten
        for the new mtime: the stamp stays valid and the next check does not hash the blob again (every graph of a
        model stores the same weights file)."""
        with contextlib.suppress(OSError):
            if time.time_ns() - os.stat(self.path(digest)).st_mtime_ns < _TOUCH_NS:
                return
            os.utime(self.path(digest))
            self._write_stamp(digest, hashed=False)

    def _commit(self, tmp: str, digest: str) -> None:
        dest = self.path(digest)
        if dest.is_file() and self.check(digest, os.path.getsize(tmp)) == "ok":
            os.unlink(tmp)
            self._touch(digest)
            return
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(tmp, 0o444)
        os.replace(tmp, dest)
        self._write_stamp(digest)

    def _link_staged(self, src: Path, sole: bool) -> str | None:
        """A new name for `src` in the staging dir (a hard link: no bytes copied), or None when it must be copied: not
        a regular file of this user's (another user could change its bytes under the store), another filesystem, or
        (`sole`) a file with other names (a user's file an action linked into its outputs)."""
        try:
            st = os.lstat(src)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or (sole and st.st_nlink != 1):
                return None
            self.tmp.mkdir(parents=True, exist_ok=True)
            tmp = f"{self.tmp}/.link-{uuid.uuid4().hex}"
            os.link(src, tmp, follow_symlinks=False)
            return tmp
        except OSError:
            return None

    def _commit_linked(self, tmp: str, expect: str | None = None) -> tuple[str, int] | None:
        """Hash a linked file, then store it as its blob (synced; nothing copied): (digest, size), or None (nothing
        stored) when it is not blob `expect`."""
        with _removed_on_failure(tmp):
            digest, size = hash_file(Path(tmp))
            if expect is not None and digest != expect:
                os.unlink(tmp)
                return None
            if self.check(digest, size) == "ok":  # stored already: this name goes
                os.unlink(tmp)
                self._touch(digest)
                return digest, size
            fsync_path(tmp)  # an action's fresh output is in the page cache only; a synced blob returns at once
            self._commit(tmp, digest)
            return digest, size

    def put_files(self, srcs: Sequence[Path], scratch: bool = False) -> list[tuple[str, int]]:
        """put_file for each of an action's outputs, with one group commit (#53): with `scratch`, the files it can
        link are linked and hashed first, then the new blobs among them are synced all at once (one thread each, so
        the filesystem writes them in one journal commit, not one commit per file after another), then stored. A
        blob is still in the store only once its bytes are synced, and its record is written after all of them."""
        if not scratch or len(srcs) < 2:
            return [self.put_file(src, scratch) for src in srcs]
        out: list[tuple[str, int] | None] = [None] * len(srcs)
        staged: list[tuple[int, str, str, int]] = []  # (index, staged name, digest, size): to sync and store
        try:
            for i, src in enumerate(srcs):
                tmp = self._link_staged(src, sole=True)
                if tmp is not None:
                    with _removed_on_failure(tmp):
                        digest, size = hash_file(Path(tmp))
                else:  # copied (put_file's way, but the sync)
                    known = self._stored_large(src)
                    if known is not None:
                        out[i] = known
                        continue
                    fd, tmp = self._stage()
                    with _removed_on_failure(tmp), os.fdopen(fd, "wb") as o, open(src, "rb") as f:
                        digest, size = copy_hashing(f, o)
                if self.check(digest, size) == "ok":  # stored already: this name goes
                    os.unlink(tmp)
                    self._touch(digest)
                    out[i] = (digest, size)
                    continue
                staged.append((i, tmp, digest, size))
            _sync_all([tmp for _i, tmp, _d, _n in staged])
            while staged:
                i, tmp, digest, size = staged[0]
                self._commit(tmp, digest)
                staged.pop(0)
                out[i] = (digest, size)
        finally:
            for _i, tmp, _d, _n in staged:  # (a failure: nothing half-stored is left staged)
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
        return [o for o in out if o is not None]

    def _stored_large(self, src: Path) -> tuple[str, int] | None:
        """(digest, size) of `src`, a large file whose blob is stored intact already (hashed, not copied), else None."""
        with contextlib.suppress(OSError):
            if os.path.getsize(src) >= _CHUNK:
                digest, size = hash_file(src)
                if self.check(digest, size) == "ok":
                    self._touch(digest)
                    return digest, size
        return None

    def put_file(self, src: Path, scratch: bool = False) -> tuple[str, int]:
        """Copy `src` into the store (hashing while copying); returns (digest, size). A large file whose blob is
        stored (and intact) already is hashed, not copied and synced again: every graph of a model writes the same
        weights file. `scratch`: `src` is the caller's scratch file, removed after this (an action's output in its
        sandbox): when it is this user's, its only name and on this filesystem, it is linked into the store instead
        of copied (hashed once, synced)."""
        if scratch:
            tmp = self._link_staged(src, sole=True)
            if tmp is not None:
                done = self._commit_linked(tmp)
                assert done is not None
                return done
        known = self._stored_large(src)
        if known is not None:
            return known
        fd, tmp = self._stage()
        with _removed_on_failure(tmp):
            with os.fdopen(fd, "wb") as out, open(src, "rb") as f:
                digest, size = copy_hashing(f, out)
                out.flush()
                os.fsync(out.fileno())
            self._commit(tmp, digest)
            return digest, size

    def adopt(self, src: Path, digest: str) -> int | None:
        """Store `src`, a file holding blob `digest` under another store's name (a farm worker put it into the
        farm's shared directory), if its bytes hash to `digest`; None (nothing stored) if they do not. Linked, not
        copied, when it is this user's file on this filesystem (the worker synced it); else copied and verified. A
        blob this store holds intact already (every graph of a model has the same weights file) is not read again:
        `src` is not needed then."""
        if self.check(digest) == "ok":
            with contextlib.suppress(OSError):
                size = os.stat(self.path(digest)).st_size
                self._touch(digest)
                return size
        tmp = self._link_staged(src, sole=False)
        if tmp is not None:
            done = self._commit_linked(tmp, digest)
            return None if done is None else done[1]
        with open(src, "rb") as f:
            return self.ingest(f, digest)

    def ingest(self, src: BinaryIO, digest: str) -> int | None:
        """Store the bytes of `src` as blob `digest` if they hash to it; None (nothing stored) if they do not."""
        fd, tmp = self._stage()
        with _removed_on_failure(tmp):
            with os.fdopen(fd, "wb") as out:
                got, size = copy_hashing(src, out)
                out.flush()
                os.fsync(out.fileno())
            if got != digest:
                os.unlink(tmp)
                return None
            self._commit(tmp, digest)
            return size

    def check(self, digest: str, size: int | None = None) -> str:
        """'ok', 'missing' or 'corrupt'. Cheap when the blob is unchanged since its last verification."""
        p = f"{self._cas}/{digest[:2]}/{digest}"
        try:
            st = os.stat(p)
        except OSError:
            return "missing"
        if size is not None and st.st_size != size:
            return "corrupt"
        key = stat_key(st)
        if _verified.get(p, key) is not None:
            return "ok"
        try:
            with open(f"{self._stamps}/{digest[:2]}/{digest}", encoding="utf-8") as f:
                if f.read() == _signature(st):
                    _verified.put(p, key, False, None)
                    return "ok"
        except (OSError, ValueError):
            pass
        if not self.verify(digest):
            return "corrupt"
        self._write_stamp(digest)
        return "ok"

    def _write_stamp(self, digest: str, hashed: bool = True) -> None:
        """Record that the blob, as it is now, was just verified (the caller hashed it; not `hashed`: it passed
        `check` and only its times were changed since)."""
        with contextlib.suppress(OSError):
            st = self.path(digest).stat()
            _verified.put(str(self.path(digest)), stat_key(st), hashed, None)
            atomic_write_bytes(self.stamp_path(digest), _signature(st).encode(), durable=False, mode=umask_mode())

    def copy_out(self, digest: str, dest: Path, verified_size: int | None = None) -> int:
        """Copy a blob to `dest` atomically, verifying its digest on the way; a corrupt blob is evicted.

        `verified_size`: the caller read and hashed this blob moments ago (another copy of it, e.g. the weights file
        every bucket of a model holds): the kernel copies it (sendfile) without hashing again, and a copy not of that
        size falls back to the verified copy. Either way a file of its own (never a link: editing an output must not
        reach the cache) with the umask's mode."""
        src = self.path(digest)
        # outputs users see follow the umask, like any file they would write
        with atomic_writer(dest, durable=False, mode=umask_mode(), prefix=COPY_TEMP_PREFIX) as out:
            if verified_size is not None:
                with contextlib.suppress(FileNotFoundError):
                    shutil.copyfile(src, out.name)
                    if os.stat(out.name).st_size == verified_size:
                        return verified_size
                out.truncate(0)
                out.seek(0)
            with open(src, "rb") as f:
                got, size = copy_hashing(f, out)
            if got != digest:
                self.evict(digest)
                raise CorruptBlob(f"blob {digest[:16]} is corrupt (digest mismatch); evicted")
            return size

    def verify(self, digest: str) -> bool:
        try:
            return hash_file(self.path(digest))[0] == digest
        except OSError:
            return False

    def evict(self, digest: str) -> None:
        _verified.forget(str(self.path(digest)))
        for p in (self.path(digest), self.stamp_path(digest), self.sha256_path(digest)):
            remove_entry(p)

    def link_unverified(self, digest: str, dest: Path) -> None:
        """A hard link (else a copy) of a blob at `dest`, not read: the caller verifies it (BlobStore.adopt)."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(self.path(digest), dest)
        except FileNotFoundError:
            raise
        except OSError:
            shutil.copyfile(self.path(digest), dest)

    def link_out(self, digest: str, dest: Path) -> int | None:
        """`dest` made a read-only hard link to the blob (an output target's big file: no second copy on disk); None
        where the filesystem cannot link (the caller copies). The cache does not trust the link: the blob is hashed
        after it is made, and the stamp then written holds its ctime, which anything done through the link moves (the
        next check hashes it again: a changed blob is found corrupt and evicted, never used)."""
        with linked_beside(self.path(digest), dest) as tmp:
            if tmp is None:
                return None
            if os.stat(tmp).st_mode & 0o222:
                os.chmod(tmp, 0o444)
            got, size = hash_file(tmp)
            if got != digest:
                self.evict(digest)
                raise CorruptBlob(f"blob {digest[:16]} is corrupt (digest mismatch); evicted")
            self._write_stamp(digest)
        return size

    def copy_read_only(self, digest: str, dest: Path) -> None:
        """Place a verified read-only copy of a blob at `dest` (sandbox inputs), hashed as it is written. A copy,
        never a hard link: the sandbox is writable by the action, which owns its files and could make a linked
        blob writable again (chmod is no Landlock right) and change the cache's bytes. Sandbox inputs are small
        (programs, HLO modules): no step reads a model's weights file (they ship beside its outputs).

        A blob this process hashed itself (stored it, or verified it reading it) and unchanged since (its stat
        signature, ctime included, the same before and after the copy) is copied by the kernel, not hashed again."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        p = self.path_str(digest)
        with open(p, "rb") as src, open(dest, "wb") as out:
            key = stat_key(os.fstat(src.fileno()))
            if _verified.get(p, key) and _kernel_copy(src, out) and stat_key(os.fstat(src.fileno())) == key:
                got = digest
            else:
                src.seek(0)
                out.seek(0)
                out.truncate()
                got, _size = copy_hashing(src, out)
        if got != digest:
            with contextlib.suppress(OSError):
                dest.unlink()
            self.evict(digest)
            raise CorruptBlob(f"blob {digest[:16]} is corrupt (digest mismatch); evicted")
        os.chmod(dest, 0o444)
