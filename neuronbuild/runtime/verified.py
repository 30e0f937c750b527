"""Reading deployed artifacts so that every byte used is the byte the manifest names: hashed while read, in one pass.

A file is read once into memory and its sha256 computed; it is used only if that digest and size match the manifest.
Loaders that need a path (an AOTInductor package, whose shared library the C++ loader dlopens) get a private copy of
the checked bytes (an anonymous memory file), so a file changed after the check cannot reach the loader."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
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
    """The file's bytes (read once), returned only when their sha256 and size match `ref` (DigestMismatch otherwise)."""
    with open(path, "rb") as f:
        data = f.read(ref.size + 1)  # one read: never more than the manifest's size plus one byte
    _check(path, ref, hashlib.sha256(data).hexdigest(), len(data))
    return data


@contextlib.contextmanager
def verified_path(path: Path, ref: FileRef, tmp_dir: Path) -> Iterator[Path]:
    """A path to a private copy of the file whose bytes matched `ref`, for loaders that open a path themselves (the
    AOTInductor package loader, which dlopens the shared library inside). Linux: an anonymous memory file
    (memfd, /proc/self/fd/N) holding the verified bytes; elsewhere a copy in a fresh private directory."""
    data = read_verified(path, ref)
    if hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd"):
        fd = os.memfd_create(path.name, os.MFD_CLOEXEC)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            yield Path(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)
        return
    d = Path(tempfile.mkdtemp(prefix="nb-verified-", dir=tmp_dir))
    try:
        out = d / path.name
        with open(out, "xb") as w:
            w.write(data)
        yield out
    finally:
        shutil.rmtree(d, ignore_errors=True)
