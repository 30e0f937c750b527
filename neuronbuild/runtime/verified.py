"""Reading deployed artifacts so that every byte used is the byte the manifest names: hashed while read, in one pass.

A file is read once, in 1 MiB chunks hashed as each arrives (the bytes are still in the CPU cache), into the buffer
that is then used; it is used only if the sha256 and size match the manifest. Weights become tensors over that very
buffer (no second copy, as safetensors' own loader would make). Loaders that need a path (an AOTInductor package,
whose shared library the C++ loader dlopens) get a private copy of the checked bytes (an anonymous memory file,
written chunk by chunk as it is hashed), so a file changed after the check cannot reach the loader."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from neuronbuild.runtime.layout import FileRef

_CHUNK = 1 << 20


class DigestMismatch(OSError):
    """A deployed file whose bytes differ from its manifest entry (tampered or damaged)."""


def _check(path: Path, ref: FileRef, sha: str, size: int) -> None:
    if size != ref.size or sha != ref.sha256:
        raise DigestMismatch(f"{path}: contents differ from the manifest (sha256 {sha[:16]}..., {size} bytes; "
                             f"expected {ref.sha256[:16]}..., {ref.size} bytes): tampered or damaged")


def _read_into(path: Path, ref: FileRef) -> bytearray:
    """The file read once into a buffer of the manifest's size, hashed chunk by chunk as read; checked."""
    buf = bytearray(ref.size)
    view = memoryview(buf)
    h = hashlib.sha256()
    n = 0
    with open(path, "rb", buffering=0) as f:
        while n < ref.size:
            k = f.readinto(view[n:n + _CHUNK])
            if not k:
                break
            h.update(view[n:n + k])
            n += k
        extra = len(f.read(1))  # never more than the manifest's size plus one byte
    view.release()
    _check(path, ref, h.hexdigest(), n + extra)
    return buf


def read_verified(path: Path, ref: FileRef) -> bytes:
    """The file's bytes (read once), returned only when their sha256 and size match `ref` (DigestMismatch otherwise)."""
    return bytes(_read_into(path, ref))


_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
           "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn",
           "F8_E5M2": "float8_e5m2"}
_MAX_HEADER = 100 << 20


class BadWeights(ValueError):
    """A weights file whose bytes match the manifest but are not a well-formed safetensors file."""


def load_weights_verified(path: Path, ref: FileRef) -> dict[str, Any]:
    """A safetensors file as {name: tensor}, read once and checked against `ref`; the tensors are views over the
    checked buffer itself (safetensors.torch.load would copy every byte again)."""
    import torch

    buf = _read_into(path, ref)
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
        itemsize = torch.empty((), dtype=dtype).element_size()
        if min(shape, default=0) < 0 or not 0 <= start <= stop or base + stop > end or stop - start != count * itemsize:
            raise BadWeights(f"{path}: tensor {name!r}: offsets {start}..{stop} do not fit its shape or the file")
        if count == 0:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        out[name] = torch.frombuffer(buf, dtype=dtype, count=count, offset=base + start).reshape(shape)
    return out


@contextlib.contextmanager
def verified_path(path: Path, ref: FileRef, tmp_dir: Path) -> Iterator[Path]:
    """A path to a private copy of the file whose bytes matched `ref`, for loaders that open a path themselves (the
    AOTInductor package loader, which dlopens the shared library inside). Linux: an anonymous memory file
    (memfd, /proc/self/fd/N) holding the verified bytes; elsewhere a copy in a fresh private directory."""
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
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            _copy_hashing(path, ref, fd)
        finally:
            os.close(fd)
        yield out
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _copy_hashing(path: Path, ref: FileRef, fd: int) -> None:
    """Copy the file to `fd` chunk by chunk, hashing each chunk as it passes; DigestMismatch (after the copy, which
    is then never used) when the bytes are not the manifest's."""
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    n = 0
    with open(path, "rb", buffering=0) as f:
        while n <= ref.size:
            k = f.readinto(view)
            if not k:
                break
            h.update(view[:k])
            out = view[:k]
            while out:
                out = out[os.write(fd, out):]
            n += k
    view.release()
    _check(path, ref, h.hexdigest(), n)
