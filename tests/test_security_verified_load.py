"""Verified weights are read once, hashed as read, and used in place: tensors over the checked bytes, equal to what
safetensors loads; tampered files and malformed headers whose digest matches are refused with a clear error."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import blake3
import pytest
import torch
from safetensors.torch import load_file, save_file

from neuronbuild.runtime.layout import FileRef
from neuronbuild.runtime.verified import (
    BadWeights,
    DigestMismatch,
    Scratch,
    load_weights_verified,
    read_verified,
    verified_path,
)


def _ref(p: Path, with_blake3: bool = False) -> FileRef:
    data = p.read_bytes()
    return FileRef(p.name, hashlib.sha256(data).hexdigest(), len(data),
                   blake3.blake3(data).hexdigest() if with_blake3 else None)


def test_weights_are_tensors_over_the_checked_bytes_and_equal_safetensors(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(300, 700, generator=g), "b": torch.arange(5, dtype=torch.int64),
               "h": torch.randn(3, 4, generator=g).to(torch.bfloat16), "e": torch.empty(0, 4)}
    p = tmp_path / "weights.safetensors"
    save_file(tensors, str(p))
    got = load_weights_verified(p, _ref(p))
    want = load_file(str(p))
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k])
    # one buffer: every tensor lies inside the one region the file was read into (no per-tensor copy)
    live = [t for t in got.values() if t.numel()]
    lo = min(t.data_ptr() for t in live)
    hi = max(t.data_ptr() + t.numel() * t.element_size() for t in live)
    assert hi - lo <= _ref(p).size


def test_tampered_and_malformed_weights_are_refused(tmp_path: Path) -> None:
    p = tmp_path / "weights.safetensors"
    save_file({"w": torch.ones(64, 64)}, str(p))
    ref = _ref(p)
    data = bytearray(p.read_bytes())
    data[-1] ^= 1  # same size, one bit changed
    p.write_bytes(bytes(data))
    with pytest.raises(DigestMismatch, match="contents differ from the manifest"):
        load_weights_verified(p, ref)
    with pytest.raises(DigestMismatch), verified_path(p, ref, tmp_path):
        pass
    p.write_bytes(bytes(data) + b"x")  # longer than the manifest says
    with pytest.raises(DigestMismatch):
        load_weights_verified(p, ref)
    # digest matches (a manifest made for it) but the offsets point past the end: an error, not a crash
    header = json.dumps({"w": {"dtype": "F32", "shape": [64, 64], "data_offsets": [0, 1 << 30]}}).encode()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    with pytest.raises(BadWeights, match="do not fit"):
        load_weights_verified(bad, _ref(bad))


@pytest.mark.parametrize("size", [0, 1, (1 << 20) + 7])
def test_the_digest_checked_is_the_manifests_blake3_when_given_else_its_sha256(tmp_path: Path, size: int) -> None:
    p = tmp_path / "model.pt2"
    data = bytes((i * 7 + 3) % 251 for i in range(size))
    p.write_bytes(data)
    both, sha_only = _ref(p, with_blake3=True), _ref(p)
    for ref in (both, sha_only):
        with verified_path(p, ref, tmp_path) as q:
            assert q.read_bytes() == data  # the private copy the loader gets holds exactly the checked bytes
        assert read_verified(p, ref) == data
    # A manifest whose BLAKE3 does not fit the bytes is refused even though its sha256 does: BLAKE3 is what is
    # checked when given (and SHA-256 when not: a wrong sha256 with no BLAKE3 is refused too).
    wrong_b3 = FileRef(p.name, both.sha256, size, "0" * 64)
    wrong_sha = FileRef(p.name, "0" * 64, size, None)
    for bad, algo in ((wrong_b3, "blake3"), (wrong_sha, "sha256")):
        with pytest.raises(DigestMismatch, match=f"contents differ from the manifest \\({algo} "):
            with verified_path(p, bad, tmp_path):
                pass
    if size:
        tampered = bytearray(data)
        tampered[size // 2] ^= 1
        p.write_bytes(bytes(tampered))
        with pytest.raises(DigestMismatch, match="blake3"), verified_path(p, both, tmp_path):
            pass


def test_a_reused_scratch_file_holds_each_checked_copy_in_turn(tmp_path: Path) -> None:
    # A strict open reads every package into one reused memory file. Each copy is still checked in full before the
    # block runs, a refused copy never reaches the block, and a copy needed while the scratch is held (another
    # thread's load) goes to a fresh memory file of its own.
    big, small = tmp_path / "big.pt2", tmp_path / "small.pt2"
    big.write_bytes(bytes(range(256)) * 4000)
    small.write_bytes(b"small package bytes" * 1000)
    refs = {p: _ref(p, with_blake3=True) for p in (big, small)}
    scratch = Scratch.create(refs[big].size)
    assert scratch is not None
    with scratch:
        for p in (big, small, big, small):  # the file shrinks and grows back: each copy is exactly its own bytes
            with verified_path(p, refs[p], tmp_path, scratch) as q:
                assert q.read_bytes() == p.read_bytes() and q.stat().st_size == refs[p].size
                held = q
                with verified_path(big, refs[big], tmp_path, scratch) as other:
                    assert other != held and other.read_bytes() == big.read_bytes()
                assert q.read_bytes() == p.read_bytes()  # untouched by the other copy
        tampered = bytearray(big.read_bytes())
        tampered[12345] ^= 1
        big.write_bytes(bytes(tampered))
        with pytest.raises(DigestMismatch), verified_path(big, refs[big], tmp_path, scratch):
            raise AssertionError("a tampered copy reached the loader")
        with verified_path(small, refs[small], tmp_path, scratch) as q:  # released after the refusal, reused
            assert q.read_bytes() == small.read_bytes()
        too_big = tmp_path / "too_big.pt2"
        too_big.write_bytes(b"x" * (refs[big].size + 1))
        with verified_path(too_big, _ref(too_big), tmp_path, scratch) as q:  # does not fit: a fresh file
            assert q.read_bytes() == too_big.read_bytes()
    with verified_path(small, refs[small], tmp_path, scratch) as q:  # closed: a fresh file
        assert q.read_bytes() == small.read_bytes()
