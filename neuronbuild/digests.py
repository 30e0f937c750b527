"""Content digests (BLAKE3) of files and bytes; `StatMemo`, the one rule by which the process keeps what it made from a
file's bytes (a digest, a parse) by the file's stat; the digest cache, kept in process and on disk (`load_persistent` /
`save_persistent`: a new process skips re-reading unchanged large weights, its entries checked as the process's own)."""

from __future__ import annotations

import contextlib
import contextvars
import json
import marshal
import os
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Generic, TypeVar

import blake3

from neuronbuild.atomic import atomic_write_bytes, read_own_state

if TYPE_CHECKING:
    from concurrent.futures import Future, ThreadPoolExecutor

_MMAP_THRESHOLD = 4 << 20
# Kernel file timestamps come from a coarse clock (one jiffy, <= 10 ms behind); twice that is the racy window.
RACY_NS = 20_000_000
_PERSIST_FORMAT = "nb-digests-1"

StatKey = tuple[int, int, int, int]  # size, mtime_ns, inode, ctime_ns
V = TypeVar("V")
_dirty = False
# The files digested in this thread while a `recording()` is open (analysis memoisation keys on them).
_recording: contextvars.ContextVar[list[tuple[str, str]] | None] = contextvars.ContextVar("digests_read", default=None)


@contextlib.contextmanager
def recording() -> Iterator[list[tuple[str, str]]]:
    """Collect (path, digest) of every digest_file call made in this thread meanwhile (nested: the innermost)."""
    files: list[tuple[str, str]] = []
    token = _recording.set(files)
    try:
        yield files
    finally:
        _recording.reset(token)


def digest_bytes(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


# Canonical JSON records and their fingerprints (analysis makes records; cache verify re-derives fingerprints).
def _unserialisable(o: Any) -> Any:
    raise TypeError(f"Object of type {o.__class__.__name__} is not JSON serializable")


def _c_encoder() -> Callable[[Any, int], list[str]] | None:
    """json's C encoder made once with json.dumps's canonical options below (json.dumps makes an encoder object and
    a C encoder per call: a third of its time on a record); None where json has no C accelerator. Records hold no
    reference cycles (made by analysis from checked attribute values), so no circular-reference check."""
    try:
        import _json
    except ImportError:  # pragma: no cover - CPython has it
        return None
    return _json.make_encoder(None, _unserialisable, _json.encode_basestring_ascii,  # type: ignore[no-any-return]
                              None, ":", ",", True, False, False)


_ENCODE = _c_encoder()


def canonical_json(record: Mapping[str, Any]) -> bytes:
    """Sorted keys, no whitespace, ASCII: the same record always gives the same bytes (exactly json.dumps's)."""
    if _ENCODE is not None:
        return "".join(_ENCODE(record, 0)).encode()
    return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def fingerprint(record: Mapping[str, Any]) -> str:
    """An action's fingerprint: the BLAKE3 of its canonical input record."""
    return digest_bytes(canonical_json(record))


def stat_key(st: os.stat_result) -> StatKey:
    return (st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)


def is_racy(key: StatKey, now_ns: int) -> bool:
    """True when the file changed so recently that a further write could keep the same key."""
    return max(key[1], key[3]) >= now_ns - RACY_NS


class StatMemo(Generic[V]):
    """Values made from files' bytes (a digest, a parse) by path, each returned while the file has the stat key
    (`stat_key`) it was read with: such a file holds the bytes read then (a write in place moves its mtime and ctime,
    and ctime no user tool can set: `cp -p`, `touch -d` or `rsync -t` cannot fake an unchanged file; a replacement is
    a new inode), unless written within RACY_NS of the read ("racily clean", as git calls it: a second write in the
    same timestamp tick could keep its key), which is not kept. At most `size` paths (None: no bound); full, the paths
    kept first stay kept (a build reading more files than fit, in the same order each time, still finds those)."""

    def __init__(self, size: int | None = None) -> None:
        self._entries: dict[str, tuple[StatKey, V]] = {}
        self.size = size

    def get(self, path: str, key: StatKey) -> V | None:
        """The value kept for `path` if `key` (the file's stat key now) is the one it was read with."""
        hit = self._entries.get(path)
        return hit[1] if hit is not None and hit[0] == key else None

    def put(self, path: str, key: StatKey, value: V, read_ns: int | None) -> bool:
        """Keep `value`, made from the bytes of `path` read with stat key `key` (its stat or fstat, taken after
        `read_ns`, time.time_ns(), and before the read); `read_ns` None: the caller vouches for the bytes whatever the
        window (a content-addressed blob, never written in place; a file whose times it just set itself). Returns
        whether it is kept."""
        kept = (read_ns is None or not is_racy(key, read_ns)) and \
            (self.size is None or len(self._entries) < self.size or path in self._entries)
        if kept:
            self._entries[path] = (key, value)
        return kept

    def forget(self, path: str) -> None:
        self._entries.pop(path, None)


# The digest cache: each file's BLAKE3 digest (ever growing; persisted by save_persistent).
_stat_cache: StatMemo[str] = StatMemo()


def _hash_path(p: str, size: int) -> str:
    if size >= _MMAP_THRESHOLD:
        h = blake3.blake3(max_threads=blake3.blake3.AUTO)
        h.update_mmap(p)
    else:
        h = blake3.blake3()
        with open(p, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def digest_file(path: Path | str) -> str:
    """BLAKE3 hex digest of a file's contents; large files are hashed multi-threaded through mmap.

    Unchanged files (same stat key as when they were hashed) are not read again."""
    global _dirty
    p = str(path)
    now = time.time_ns()
    st = os.stat(p)
    key = stat_key(st)
    d = _stat_cache.get(p, key)
    if d is None:
        d = _hash_path(p, st.st_size)
        if stat_key(os.stat(p)) == key and _stat_cache.put(p, key, d, now):
            _dirty = True
    rec = _recording.get()
    if rec is not None:
        rec.append((p, d))
    return d


def load_persistent(file: Path) -> None:
    """Merge a digest cache written by `save_persistent` into this process's cache (a bad file counts as empty)."""
    try:
        data = marshal.loads(read_own_state(file))
    except (OSError, EOFError, ValueError, TypeError):
        return
    if not isinstance(data, dict) or data.get("format") != _PERSIST_FORMAT:
        return
    entries = data.get("entries")
    if isinstance(entries, dict):
        for p, (key, d) in entries.items():
            _stat_cache._entries.setdefault(p, (tuple(key), d))  # type: ignore[arg-type]


def save_persistent(file: Path, under: Path) -> None:
    """Write the cached digests of files under `under` to `file` atomically (skipped when nothing new was hashed)."""
    global _dirty
    if not _dirty:
        return
    prefix = str(under).rstrip("/") + "/"
    entries = {p: v for p, v in _stat_cache._entries.items() if p.startswith(prefix)}
    blob = marshal.dumps({"format": _PERSIST_FORMAT, "entries": entries})
    atomic_write_bytes(file, blob, file.parent, durable=False)  # a speed-up only: no fsync
    _dirty = False


_CHUNK = 4 << 20
_hash_pool: ThreadPoolExecutor | None = None  # (made at the first copy: concurrent.futures imports logging)


def copy_hashing(src: BinaryIO, out: BinaryIO) -> tuple[str, int]:
    """Copy a stream to another, returning the BLAKE3 digest and size of the bytes copied.

    Each chunk is read once; it is hashed on a helper thread (BLAKE3 releases the GIL) while it is written, so a
    verified copy costs about as much as a plain one when a second core is free. A file smaller than a chunk gets
    buffers of its size (most copies are of small files: zeroing two 4 MiB buffers cost more than copying them)."""
    global _hash_pool
    if _hash_pool is None:  # (two threads may each make one: a pool never used starts no thread)
        from concurrent.futures import ThreadPoolExecutor
        _hash_pool = ThreadPoolExecutor(1, thread_name_prefix="neuronbuild-hash")
    pool = _hash_pool
    h = blake3.blake3()
    size = 0
    chunk = _CHUNK
    with contextlib.suppress(AttributeError, OSError, ValueError):  # (a stream with no file descriptor: full chunks)
        chunk = max(1, min(_CHUNK, os.fstat(src.fileno()).st_size - src.tell() + 1))  # (+1: the read that sees EOF)
    bufs = (memoryview(bytearray(chunk)), memoryview(bytearray(chunk)))
    k = 0
    pending: Future[object] | None = None
    try:
        while True:
            view = bufs[k]
            n = src.readinto(view) if hasattr(src, "readinto") else _read_into(src, view)
            if pending is not None:
                pending.result()
                pending = None
            if not n:
                break
            pending = pool.submit(h.update, view[:n])
            out.write(view[:n])
            size += n
            k ^= 1
    finally:
        if pending is not None:
            pending.result()
    return h.hexdigest(), size


def _read_into(src: BinaryIO, view: memoryview) -> int:
    data = src.read(len(view))
    view[:len(data)] = data
    return len(data)
