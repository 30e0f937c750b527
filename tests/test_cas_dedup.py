"""Storing a large output whose blob the CAS holds already (every graph of a model writes the same weights file) does
not copy it again, and never trusts a stored blob that no longer matches its digest."""

from __future__ import annotations

import os
from pathlib import Path

from neuronbuild.cache.cas import BlobStore, hash_file

SIZE = 6 << 20  # above the size from which put_file hashes before copying


def _weights(tmp: Path, name: str, seed: int) -> Path:
    p = tmp / name
    p.write_bytes(bytes((i * seed) & 0xFF for i in range(256)) * (SIZE // 256))
    return p


def test_a_stored_large_blob_is_not_copied_again(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "cache")
    first = _weights(tmp_path, "a.safetensors", 7)
    digest, size = store.put_file(first)
    assert (digest, size) == hash_file(first)
    inode = store.path(digest).stat().st_ino
    again = _weights(tmp_path, "b.safetensors", 7)  # another graph's file, the same bytes
    assert store.put_file(again) == (digest, size)
    assert store.path(digest).stat().st_ino == inode  # the stored blob was kept, not replaced by a copy
    assert not list((tmp_path / "cache" / "tmp").glob(".blob-*"))


def test_a_corrupt_stored_blob_is_replaced_not_trusted(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "cache")
    src = _weights(tmp_path, "a.safetensors", 3)
    digest, size = store.put_file(src)
    blob = store.path(digest)
    os.chmod(blob, 0o644)
    data = bytearray(blob.read_bytes())
    data[SIZE // 2] ^= 0xFF  # same size, other bytes (a disk error, a stray write)
    blob.write_bytes(bytes(data))
    assert store.put_file(src) == (digest, size)
    assert hash_file(store.path(digest)) == (digest, size)
    assert store.check(digest, size) == "ok"
