"""Reading deployed artifacts so that every byte used is the byte the manifest names: hashed while read, in one pass.

A file is read once, in 1 MiB chunks hashed as each arrives (the bytes are still in the CPU cache), into the buffer
that is then used; it is used only if the digest and size match the manifest. Weights become tensors over that very
buffer (no second copy, as safetensors' own loader would make). Loaders that need a path (an AOTInductor package,
whose shared library the C++ loader dlopens) get a private copy of the checked bytes (an anonymous memory file that
the file is read straight into, chunk by chunk as it is hashed), so a file changed after the check cannot reach the
loader. A strict open that loads many packages reuses one such memory file (a Scratch, its pages allocated once up
front): a fresh one per package spent more time page-faulting its memory in than reading and hashing the bytes.

The digest: the manifest's BLAKE3 of the file when it has one (every graph artifact and weights file of bundles built
since BLAKE3 digests entered manifests; about 3x faster than SHA-256 on one core, multi-threaded on large files),
else its SHA-256 (older bundles). Both are in the manifest that signing and `expect=` pin, so either authenticates the
bytes (deployed.py makes a pinned graph use the pin's digest)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from neuronbuild.runtime.layout import DRAFT_PREFIX, DRAFT_WEIGHTS, FileRef

_CHUNK = 1 << 20
_PARALLEL_MIN = 64 << 20  # files at least this large are hashed by BLAKE3 on all cores, in bigger chunks
_PARALLEL_CHUNK = 16 << 20


class DigestMismatch(OSError):
    """A deployed file whose bytes differ from its manifest entry (tampered or damaged)."""


def _hasher(ref: FileRef) -> tuple[Any, str, str, int]:
    """(hash object, expected hex digest, algorithm name, chunk size) for checking a file against `ref`."""
    if ref.blake3:
        try:
            import blake3
        except ImportError:  # a runtime-only install without it: the manifest's SHA-256 is as good, only slower
            pass
        else:
            if ref.size >= _PARALLEL_MIN:
                return blake3.blake3(max_threads=blake3.blake3.AUTO), ref.blake3, "blake3", _PARALLEL_CHUNK
            return blake3.blake3(), ref.blake3, "blake3", _CHUNK
    return hashlib.sha256(), ref.sha256, "sha256", _CHUNK


def _check(path: Path, ref: FileRef, algo: str, want: str, got: str, size: int) -> None:
    if size != ref.size or got != want:
        raise DigestMismatch(f"{path}: contents differ from the manifest ({algo} {got[:16]}..., {size} bytes; "
                             f"expected {want[:16]}..., {ref.size} bytes): tampered or damaged")


def _read_hashing(path: Path, ref: FileRef, view: memoryview) -> None:
    """Read the file into `view` (exactly ref.size bytes long), hashing each chunk as it arrives; DigestMismatch
    unless the file is exactly those bytes."""
    h, want, algo, chunk = _hasher(ref)
    n = 0
    with open(path, "rb", buffering=0) as f:
        while n < ref.size:
            k = f.readinto(view[n:n + chunk])
            if not k:
                break
            h.update(view[n:n + k])
            n += k
        extra = len(f.read(1))  # never more than the manifest's size plus one byte
    _check(path, ref, algo, want, h.hexdigest(), n + extra)


def _read_into(path: Path, ref: FileRef) -> bytearray:
    """The file read once into a buffer of the manifest's size, hashed chunk by chunk as read; checked."""
    buf = bytearray(ref.size)
    with memoryview(buf) as view:
        _read_hashing(path, ref, view)
    return buf


def _anonymous(size: int) -> bytearray | mmap.mmap:
    """A writable buffer of `size` bytes to read a file into: large ones are private anonymous memory with every page
    mapped up front (MAP_POPULATE: one call instead of a fault per page, and no zero-filling pass as bytearray's)."""
    if size < _CHUNK // 8 or not hasattr(mmap, "MAP_ANONYMOUS"):
        return bytearray(size)
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))


def read_verified(path: Path, ref: FileRef) -> bytes:
    """The file's bytes (read once), returned only when their digest and size match `ref` (DigestMismatch otherwise)."""
    return bytes(_read_into(path, ref))


_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
           "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn",
           "F8_E5M2": "float8_e5m2"}
_MAX_HEADER = 100 << 20


# A weights file's `__metadata__` entry naming tied tensors stored once: JSON {alias FQN: stored FQN}
# (lm_head.weight = model.embed_tokens.weight). Readers bind the alias to the stored tensor itself.
TIED_KEY = "neuronbuild.tied"


def tied_names(metadata: Mapping[str, Any] | None) -> dict[str, str]:
    """{alias: stored name} from a safetensors header's `__metadata__` (empty when it names none); ValueError when
    the entry is not a JSON object of names (the file is then malformed)."""
    raw = (metadata or {}).get(TIED_KEY) if isinstance(metadata, Mapping) else None
    if raw is None:
        return {}
    try:
        tied = json.loads(raw) if isinstance(raw, str) else None
    except (ValueError, RecursionError):
        tied = None
    if not isinstance(tied, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in tied.items()):
        raise ValueError(f"metadata {TIED_KEY} is not an object of tensor names")
    return tied


def with_tied(tensors: dict[str, Any], metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """`tensors` plus each tied alias bound to its stored tensor (the same tensor, not a copy); ValueError when an
    alias names a tensor the file does not hold or shadows one it does."""
    for alias, stored in tied_names(metadata).items():
        if stored not in tensors or alias in tensors:
            raise ValueError(f"metadata {TIED_KEY}: {alias!r} -> {stored!r} does not name one stored tensor")
        tensors[alias] = tensors[stored]
    return tensors


class BadWeights(ValueError):
    """A weights file whose bytes match the manifest but are not a well-formed safetensors file."""


def load_weights_verified(path: Path, ref: FileRef) -> dict[str, Any]:
    """A safetensors file as {name: tensor}, read once and checked against `ref`; the tensors are views over the
    checked buffer itself (safetensors.torch.load would copy every byte again), writable as safetensors' are."""
    import torch

    buf = _anonymous(ref.size)
    with memoryview(buf) as view:
        _read_hashing(path, ref, view)
    if len(buf) < 8:
        raise BadWeights(f"{path}: not a safetensors file (too short)")
    n = int.from_bytes(buf[:8], "little")
    if n > min(_MAX_HEADER, len(buf) - 8):
        raise BadWeights(f"{path}: not a safetensors file (header length {n})")
    try:
        header = json.loads(bytes(buf[8:8 + n]))
    except (ValueError, RecursionError) as e:
        raise BadWeights(f"{path}: not a safetensors file (header: {e})") from None
    if not isinstance(header, dict):
        raise BadWeights(f"{path}: not a safetensors file (header is not an object)")
    base, end = 8 + n, len(buf)
    out: dict[str, Any] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = getattr(torch, _DTYPES[info["dtype"]])
            shape = [int(d) for d in info["shape"]]
            start, stop = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError, AttributeError):
            raise BadWeights(f"{path}: tensor {name!r}: bad header entry") from None
        count = 1
        for d in shape:
            count *= d
        itemsize = dtype.itemsize
        if min(shape, default=0) < 0 or not 0 <= start <= stop or base + stop > end or stop - start != count * itemsize:
            raise BadWeights(f"{path}: tensor {name!r}: offsets {start}..{stop} do not fit its shape or the file")
        if count == 0:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        out[name] = torch.frombuffer(buf, dtype=dtype, count=count, offset=base + start).reshape(shape)
    try:
        return with_tied(out, header.get("__metadata__"))
    except ValueError as e:
        raise BadWeights(f"{path}: not a well-formed weights file ({e})") from None


class Scratch:
    """An anonymous memory file (Linux memfd) reused for the verified copies of successive packages: its pages are
    allocated and mapped once (fallocate + MAP_POPULATE), not page-faulted in anew for every package. It holds one
    copy at a time, for as long as the `verified_path` block that filled it runs: a loader must be done reading the
    copy when the block ends (the AOTInductor loader extracts the package in its constructor), and the next copy
    overwrites it. Each copy is read and checked in full, exactly as into a fresh memory file. (Allocating it on a
    thread of its own while the weights are read was tried: no faster under load; see docs/benchmarks.md.)"""

    def __init__(self, fd: int, capacity: int) -> None:
        self.capacity = capacity
        self._fd = fd
        self._lock = threading.Lock()
        self._map: mmap.mmap | None = mmap.mmap(fd, capacity, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))

    @classmethod
    def create(cls, capacity: int) -> Scratch | None:
        """A scratch file for copies of up to `capacity` bytes, its memory allocated now; None without memfd (or when
        it cannot be allocated: copies then go to fresh memory files)."""
        if capacity <= 0 or not hasattr(os, "memfd_create") or not os.path.isdir("/proc/self/fd"):
            return None
        try:
            fd = os.memfd_create("neuronbuild-verified", os.MFD_CLOEXEC)
        except OSError:
            return None
        try:
            try:
                os.posix_fallocate(fd, 0, capacity)  # every page allocated in one call, not one fault at a time
            except OSError:
                os.ftruncate(fd, capacity)
            return cls(fd, capacity)
        except (OSError, ValueError):
            os.close(fd)
            return None

    def close(self) -> None:
        with self._lock:
            if self._map is not None:
                self._map.close()
                self._map = None
                os.close(self._fd)

    def __enter__(self) -> Scratch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _take(self, ref: FileRef) -> bool:
        """Whether a copy of `ref` can use this file now (it fits, and no other load holds it); taken if so."""
        if ref.size > self.capacity or not self._lock.acquire(blocking=False):
            return False
        if self._map is None:  # closed
            self._lock.release()
            return False
        return True

    def _fill(self, path: Path, ref: FileRef) -> Path:
        assert self._map is not None
        os.ftruncate(self._fd, self.capacity)  # the previous copy left the file at its own size
        with memoryview(self._map) as whole, whole[:ref.size] as view:
            _read_hashing(path, ref, view)
        os.ftruncate(self._fd, ref.size)  # loaders read to the file's end (a zip's directory is there)
        return Path(f"/proc/self/fd/{self._fd}")


@contextlib.contextmanager
def verified_path(path: Path, ref: FileRef, tmp_dir: Path, scratch: Scratch | None = None) -> Iterator[Path]:
    """A path to a private copy of the file whose bytes matched `ref`, for loaders that open a path themselves (the
    AOTInductor package loader, which dlopens the shared library inside), valid inside the block only. Linux: an
    anonymous memory file (memfd, /proc/self/fd/N) the file is read into, `scratch`'s when given and free, else a
    fresh one; elsewhere a copy in a fresh private directory."""
    if scratch is not None and scratch._take(ref):
        try:
            yield scratch._fill(path, ref)
        finally:
            scratch._lock.release()
        return
    if hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd"):
        fd = os.memfd_create(path.name, os.MFD_CLOEXEC)
        try:
            _copy_hashing(path, ref, fd)
            yield Path(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)
        return
    d = Path(tempfile.mkdtemp(prefix="nb-verified-", dir=tmp_dir))
    try:
        out = d / path.name
        fd = os.open(out, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            _copy_hashing(path, ref, fd)
        finally:
            os.close(fd)
        yield out
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _copy_hashing(path: Path, ref: FileRef, fd: int) -> None:
    """Read the file straight into `fd` (sized to the manifest's size and mapped: one copy, no write calls), hashing
    each chunk as it arrives; DigestMismatch (the copy is then never used) when the bytes are not the manifest's."""
    os.ftruncate(fd, ref.size)
    if ref.size == 0:
        _read_hashing(path, ref, memoryview(b""))
        return
    with mmap.mmap(fd, ref.size) as m, memoryview(m) as view:
        _read_hashing(path, ref, view)


_RANK_FILE = re.compile(r"rank_(0|[1-9][0-9]*)\.safetensors")


def _header_state(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """A safetensors file's tensors from its header alone: name -> (dtype, shape), tied aliases resolved; BadWeights
    when it is not a safetensors file."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < n <= _MAX_HEADER:
                raise BadWeights(f"{path.name}: not a safetensors file (header length {n})")
            header = json.loads(f.read(n))
    except OSError as e:
        raise BadWeights(f"{path.name}: cannot read it ({e.strerror or e})") from None
    except (ValueError, RecursionError) as e:
        raise BadWeights(f"{path.name}: not a safetensors file (header: {e})") from None
    if not isinstance(header, dict):
        raise BadWeights(f"{path.name}: not a safetensors file (header is not an object)")
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            out[name] = (_DTYPES.get(info["dtype"], str(info["dtype"])), tuple(int(d) for d in info["shape"]))
        except (KeyError, TypeError, ValueError):
            raise BadWeights(f"{path.name}: tensor {name!r}: bad header entry") from None
    try:
        for alias, stored in tied_names(header.get("__metadata__")).items():
            if stored in out:
                out.setdefault(alias, out[stored])
    except ValueError as e:
        raise BadWeights(f"{path.name}: {e}") from None
    return out


def _spec(dtype: str, shape: tuple[int, ...]) -> str:
    return f"{dtype}[{', '.join(map(str, shape))}]"


def weights_mismatch(g: Any, root: Path) -> str | None:
    """Why the weights a graph `g` (a layout.Graph) ships with cannot be its weights, in one line, or None: the graph's
    declared state (`g.state`: the names, dtypes and shapes it binds; one rank's at tp > 1) against each weights file's
    header (under `root`), and the number of rank shards against its tensor-parallel degree. (Graphs and weights may
    be built apart, #51: this is where a pair that does not fit is refused, before anything is served.) A graph
    without a recorded state (bundles made before it was recorded) is not checked here (loading still is)."""
    state: Mapping[str, tuple[str, tuple[int, ...]]] = g.state
    if not state:
        return None
    degree = int(g.tp.get("degree") or 1) if g.tp else 1
    ranks = sorted((n for n in g.artifacts if _RANK_FILE.fullmatch(n)), key=lambda n: int(n[5:-12]))
    if degree > 1 and (g.weights is not None or len(ranks) != degree):
        held = f"{len(ranks)} rank shard(s)" if ranks else "one unsharded weights file (tp_degree 1)"
        return f"its weights hold {held}; the graph is tensor-parallel at degree {degree} (tp_degree {degree} weights)"
    if degree <= 1 and ranks:
        return (f"its weights are {len(ranks)} rank shards (tp_degree {len(ranks)}); the graph takes one unsharded "
                "weights file (tp_degree 1 weights)")
    files = [g.artifacts[n] for n in ranks] if degree > 1 else ([g.weights] if g.weights is not None else [])
    if not files:
        return "it ships no weights (built without weights: bundle it with a model_weights target)"
    draft = g.artifacts.get(DRAFT_WEIGHTS)
    if draft is not None:  # a fused speculation graph: its draft's names are checked against the draft's own file
        own = {k: v for k, v in state.items() if not k.startswith(DRAFT_PREFIX)}
        problem = _state_mismatch({k: v for k, v in state.items() if k not in own}, root, draft, "draft weights file",
                                  DRAFT_PREFIX)
        if problem:
            return problem
        state = own
    for ref in files:
        problem = _state_mismatch(state, root, ref, "weights file")
        if problem:
            return problem
    return None


def _state_mismatch(state: Mapping[str, tuple[str, tuple[int, ...]]], root: Path, ref: FileRef, what: str,
                    prefix: str = "") -> str | None:
    """The first of the graph's parameters (names under `prefix` are the file's without it) that the weights file's
    header lacks or holds with another dtype or shape, in one line; None when it holds them all."""
    found = _header_state(Path(root) / ref.path)
    for name, (dtype, shape) in state.items():
        have = found.get(name[len(prefix):])
        if have is None:
            return f"parameter {name} ({_spec(dtype, shape)}) is not in its {what} {ref.path}"
        if have != (dtype, tuple(shape)):
            return f"parameter {name}: the graph takes {_spec(dtype, shape)}, its {what} {ref.path} holds {_spec(*have)}"
    return None
