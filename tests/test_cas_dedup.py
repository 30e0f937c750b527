"""Storing a large output whose blob the CAS holds already (every graph of a model writes the same weights file) does
not copy it again, and never trusts a stored blob that no longer matches its digest."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

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


def test_copy_out_of_a_blob_verified_moments_ago_falls_back_to_a_verified_copy(tmp_path: Path) -> None:
    """copy_out's `verified_size` (the caller hashed this blob moments ago: another bucket's copy of the same weights)
    copies without hashing again, yet a blob that is not of that size by now is copied verified: a shrunken blob is
    never copied out as it is, and the copy left in place is a file of its own with no temporary left behind."""
    store = BlobStore(tmp_path / "cache")
    digest, size = store.put_file(_weights(tmp_path, "a.safetensors", 5))
    out = tmp_path / "out"
    assert store.copy_out(digest, out / "b1" / "w", size) == size
    assert (out / "b1" / "w").read_bytes() == store.path(digest).read_bytes()
    assert (out / "b1" / "w").stat().st_ino != store.path(digest).stat().st_ino
    blob = store.path(digest)
    os.chmod(blob, 0o644)
    blob.write_bytes(blob.read_bytes()[: size // 2])  # truncated since it was verified
    try:
        store.copy_out(digest, out / "b2" / "w", size)
    except Exception as e:  # noqa: BLE001  (the verified copy refuses it)
        assert "corrupt" in str(e)
    else:
        raise AssertionError("a blob not of its verified size was copied out")
    assert not (out / "b2" / "w").exists() and not list((out / "b2").glob("*"))
    assert not store.path(digest).exists()  # evicted: the next build runs the actions again


def test_a_blob_marked_used_keeps_its_verification_so_later_stores_do_not_hash_it_again(tmp_path: Path,
                                                                                         monkeypatch: Any) -> None:
    store = BlobStore(tmp_path / "cache")
    digest, size = store.put_file(_weights(tmp_path, "a.safetensors", 5))
    blob = store.path(digest)
    old = blob.stat().st_mtime - 3600  # stored an hour ago, verified since (as a later build's check would)
    os.utime(blob, (old, old))
    assert store.check(digest, size) == "ok"
    verified: list[str] = []
    real = BlobStore.verify
    monkeypatch.setattr(BlobStore, "verify", lambda self, d: verified.append(d) or real(self, d))
    assert store.put_file(_weights(tmp_path, "b.safetensors", 5)) == (digest, size)
    assert blob.stat().st_mtime > old + 3000  # marked used: a concurrent gc's grace period protects it again
    for name in ("c.safetensors", "d.safetensors"):  # more graphs of the model, the same weights
        assert store.put_file(_weights(tmp_path, name, 5)) == (digest, size)
    assert store.adopt(tmp_path / "a farm worker's copy, not needed", digest) == size
    assert verified == []  # the stored blob was not read again: its stamp followed its new mtime


def test_adopting_a_blob_the_store_lacks_verifies_it(tmp_path: Path) -> None:
    store, other = BlobStore(tmp_path / "cache"), BlobStore(tmp_path / "farm")
    digest, size = other.put_file(_weights(tmp_path, "a.safetensors", 9))
    assert store.adopt(other.path(digest), "0" * 64) is None  # not the digest its worker reported: nothing stored
    assert store.check("0" * 64) == "missing" and store.check(digest) == "missing"
    assert store.adopt(other.path(digest), digest) == size
    assert hash_file(store.path(digest)) == (digest, size)


def test_a_bundle_member_hashed_once_is_not_read_again_until_it_changes(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A bundle's members need their sha256 (the manifest's digests): a blob hashed by one bundle is not read again by
    the next while it is unchanged (a re-bundle of a model's weights costs no pass over them); once it changed (same
    size, even with its mtime put back), it is read again and refused as corrupt."""
    import hashlib

    from neuronbuild.cache.cas import CorruptBlob
    from neuronbuild.cache.local import LocalCache
    from neuronbuild.packaging import manifest

    cache = LocalCache(tmp_path / "cache")
    data = os.urandom(10_000)
    (tmp_path / "w").write_bytes(data)
    digest, size = cache.put_file(tmp_path / "w")
    assert manifest._hash_blob(cache, digest) == (hashlib.sha256(data).hexdigest(), size)

    def unread(*_a: object, **_k: object) -> None:
        raise AssertionError("the blob was read again")

    monkeypatch.setattr(manifest, "open", unread, raising=False)
    assert manifest._hash_blob(cache, digest) == (hashlib.sha256(data).hexdigest(), size)
    monkeypatch.undo()

    blob = cache.blobs.path(digest)
    st = blob.stat()
    os.chmod(blob, 0o644)
    blob.write_bytes(bytes([data[0] ^ 1]) + data[1:])
    os.utime(blob, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(CorruptBlob):
        manifest._hash_blob(cache, digest)


def test_a_blob_this_process_stored_is_placed_in_a_sandbox_without_hashing_it_again(tmp_path: Path,
                                                                                    monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A trace's program, stored moments ago (hashed then), is copied into each lowering's sandbox by the kernel, not
    hashed again; a blob changed since it was hashed (same size, other bytes: its ctime moved) is hashed, found
    corrupt and evicted, never placed."""
    from neuronbuild.cache import cas

    hashed: list[int] = []
    real = cas.copy_hashing

    def counting(src: Any, out: Any) -> tuple[str, int]:
        hashed.append(1)
        return real(src, out)

    monkeypatch.setattr(cas, "copy_hashing", counting)
    store = BlobStore(tmp_path / "cache")
    out = tmp_path / "out"
    out.mkdir()
    program = _weights(out, "program.pt2", 5)
    digest, _size = store.put_file(program, scratch=True)  # (a sandbox's output: linked in, hashed once)
    for i in range(2):
        dest = tmp_path / f"sandbox{i}" / "in" / "program.pt2"
        store.copy_read_only(digest, dest)
        assert hash_file(dest)[0] == digest and not os.stat(dest).st_mode & 0o222
    assert not hashed
    blob = store.path(digest)
    blob.chmod(0o644)
    data = bytearray(blob.read_bytes())
    data[100] ^= 0xFF
    blob.write_bytes(bytes(data))  # damaged in place (through a link an output target holds, say)
    with pytest.raises(cas.CorruptBlob):
        store.copy_read_only(digest, tmp_path / "sandbox2" / "in" / "program.pt2")
    assert hashed and not blob.exists() and not (tmp_path / "sandbox2" / "in" / "program.pt2").exists()


def test_an_actions_outputs_are_synced_together_and_a_stored_one_is_not_synced_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """#53, group commits: put_files stores each of an action's outputs intact (hashed, read-only in the store, no
    staged file left), syncing each new blob once (all at once, before any is named in the store) and an output
    whose blob the store holds already not at all."""
    from neuronbuild.cache import cas

    store = BlobStore(tmp_path / "cache")
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "old").write_bytes(b"stored before")
    store.put_file(tmp_path / "old")
    for name, data in (("a.pt2", b"program"), ("b.json", b"{}"), ("c.bin", b"stored before")):
        (out / name).write_bytes(data)
    synced: list[str] = []
    real_sync_all = cas._sync_all

    def counting(paths: Any) -> None:
        assert not any(store.path(hash_file(Path(p))[0]).exists() for p in paths)  # synced before named
        synced.extend(paths)
        real_sync_all(paths)

    monkeypatch.setattr(cas, "_sync_all", counting)
    names = ("a.pt2", "b.json", "c.bin")
    want = [hash_file(out / n) for n in names]
    got = store.put_files([out / n for n in names], scratch=True)
    assert got == want
    assert all(store.check(d, n) == "ok" and store.path(d).stat().st_mode & 0o222 == 0 for d, n in got)
    assert all(store.path(d).read_bytes() == (out / name).read_bytes()
               for (d, _n), name in zip(got, names, strict=True))
    assert len(synced) == 2  # the two new blobs, in one group; the third was stored already
    assert not list((tmp_path / "cache" / "tmp").glob(".link-*"))
    assert not list((tmp_path / "cache" / "tmp").glob(".blob-*"))
