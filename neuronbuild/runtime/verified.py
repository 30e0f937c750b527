"""Reading deployed artifacts so that every byte used is the byte the manifest names: hashed while read, in one pass.

A file is read once into memory (or copied once into a private temporary file, for loaders that need a path, such as
an AOTInductor package whose shared library is loaded by the C++ loader) while its sha256 is computed; it is used only
if that digest and size match the manifest. A file changed after the check cannot reach the loader: what was checked is
the private copy it reads."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from neuronbuild.runtime.layout import FileRef

_CHUNK = 1 << 20


class DigestMismatch(OSError):
    """A deployed file whose bytes differ from its manifest entry (tampered or damaged)."""


def _check(path: Path, ref: FileRef, sha: str, size: int) -> None:
    if size != ref.size or sha != ref.sha256:
        raise DigestMismatch(f"{path}: contents differ from the manifest (sha256 {sha[:16]}..., {size} bytes; "
                             f"expected {ref.sha256[:16]}..., {ref.size} bytes): tampered or damaged")


def read_verified(path: Path, ref: FileRef) -> bytes:
    """The file's bytes, once their sha256 and size match `ref` (DigestMismatch otherwise)."""
    h = hashlib.sha256()
    buf = bytearray()
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size != ref.size:
            _check(path, ref, "size differs", os.fstat(f.fileno()).st_size)
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            buf += chunk
            if len(buf) > ref.size:
                break
    _check(path, ref, h.hexdigest(), len(buf))
    return bytes(buf)


def private_copy(path: Path, ref: FileRef, tmp_dir: Path) -> Path:
    """A copy of the file in a fresh private (0700) directory under `tmp_dir`, made while hashing; returned only when
    it matches `ref`. The caller removes its parent directory when done."""
    d = Path(tempfile.mkdtemp(prefix="nb-verified-", dir=tmp_dir))
    out = d / path.name
    h, n = hashlib.sha256(), 0
    try:
        with open(path, "rb") as f, open(out, "xb") as w:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
                w.write(chunk)
                n += len(chunk)
                if n > ref.size:
                    break
        _check(path, ref, h.hexdigest(), n)
    except BaseException:
        import shutil

        shutil.rmtree(d, ignore_errors=True)
        raise
    return out
