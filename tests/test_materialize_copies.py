"""Materialised outputs that several buckets share (a model's weights file): the target's directory holds one copy,
every bucket's name a hard link to it (#28: one weights copy per output target); below LINK_MIN_BYTES never a link to
the cache, so editing it never reaches the cache (bigger ones are read-only links the cache does not trust); a blob that no longer matches its digest is never copied out (the first copy of each
blob in a materialisation is verified)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers import _ENV_AT_START, run_cli, write_ws

MODEL = '''import torch


def build(config):
    return torch.nn.Linear(64, 32)
'''

BUILD = '''neuron_model(name = "m", srcs = ["m.py"], entry = "m:build", inputs = {"x": "float32[b, n]"})
neuron_buckets(name = "bk", dims = {"b": [1, 2, 4], "n": [64]})
neuron_target(name = "t", platform = "trn2")
neuron_compile(name = "c", model = ":m", buckets = [":bk"], target = ":t")
'''

WEIGHTS = "constants.safetensors"


def _weights(ws: Path) -> dict[str, Path]:
    out = ws / "neuronbuild-out" / "pkg" / "c"
    return {p.parent.name: p for p in sorted(out.glob(f"*/{WEIGHTS}"))}


def _blob(cache: Path, digest: str) -> Path:
    (found,) = [p for p in (cache / "v1" / "cas").glob(f"*/{digest}") if p.is_file()]
    return found


def test_buckets_sharing_a_blob_share_one_verified_copy_apart_from_the_cache(tmp_path: Path) -> None:
    ws = write_ws(tmp_path / "ws", {"pkg/BUILD": BUILD, "pkg/m.py": MODEL})
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k in _ENV_AT_START or not k.startswith("TORCHINDUCTOR_")}
    proc = subprocess.run(["sh", "-c", 'umask 027; exec "$0" -m neuronbuild "$@"', sys.executable, "build",
                           "//pkg:c", "--jobs", "1", "--cache-dir", str(cache)], cwd=ws, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    files = _weights(ws)
    assert len(files) == 3, files
    manifest = json.loads((ws / "neuronbuild-out" / "pkg" / "c" / "manifest.json").read_text())
    digests = {b["outputs"][WEIGHTS]["digest"] for b in manifest["buckets"]}
    assert len(digests) == 1  # one blob, three buckets: the case copied once verified, then as it is
    (digest,) = digests
    blob = _blob(cache, digest)
    data = blob.read_bytes()
    inodes = {p.stat().st_ino for p in files.values()}
    assert len(inodes) == 1 and blob.stat().st_ino not in inodes  # one copy for the target, not the cache's file
    assert all(p.stat().st_nlink == 3 and p.read_bytes() == data for p in files.values())
    assert {oct(p.stat().st_mode & 0o777) for p in files.values()} == {"0o640"}  # the umask, as copy_blob's

    # Editing the target's weights in place does not reach the cache; the next build puts the right bytes back.
    edited = files["b2_n64"]
    with open(edited, "r+b") as f:
        f.write(b"\0" * 64)
    assert blob.read_bytes() == data
    assert run_cli(["cache", "verify", "--cache-dir", str(cache)], ws).returncode == 0
    for p in files.values():
        p.unlink()
    assert run_cli(["build", "//pkg:c", "--jobs", "1", "--cache-dir", str(cache)], ws).returncode == 0
    assert all(p.read_bytes() == data for p in _weights(ws).values())

    # A blob that no longer matches its digest is never copied out to any bucket, however many share it.
    for p in files.values():
        p.unlink()
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 0xFF
    blob.chmod(0o644)
    blob.write_bytes(bytes(bad))
    third = run_cli(["build", "//pkg:c", "--jobs", "1", "--cache-dir", str(cache)], ws)
    assert third.returncode == 0 and "Traceback" not in third.stderr, third.stdout + third.stderr
    assert "corrupt" in third.stderr  # seen, not served: the actions ran again and stored the right bytes
    again = _weights(ws)
    assert len(again) == 3 and all(p.read_bytes() == data for p in again.values()), third.stdout + third.stderr


def test_big_outputs_are_read_only_links_the_cache_does_not_trust(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """An output at least LINK_MIN_BYTES big (a model's weights) is a read-only hard link to the cache's blob: one
    copy on disk for cache and output target. A change made through it (chmod, write, the mtime put back) is found
    by the cache's next check: the blob is found corrupt there (callers evict it), never handed out again as it is."""
    from neuronbuild.cache.local import LocalCache
    from neuronbuild.packaging import materialize

    monkeypatch.setattr(materialize, "LINK_MIN_BYTES", 1024)
    cache = LocalCache(tmp_path / "cache")
    src = tmp_path / "w.bin"
    src.write_bytes(os.urandom(4096))
    digest, size = cache.put_file(src)
    small = tmp_path / "s.bin"
    small.write_bytes(b"x" * 100)
    sdigest, ssize = cache.put_file(small)
    out = tmp_path / "out" / "c"
    manifest = {"buckets": [{"name": b, "outputs": {"constants.safetensors": {"digest": digest, "size": size},
                                                    "params.json": {"digest": sdigest, "size": ssize}}}
                            for b in ("b1", "b2")]}
    materialize._write_target(out, manifest, cache, set())
    blob = cache.blobs.path(digest)
    big = [out / b / "constants.safetensors" for b in ("b1", "b2")]
    assert all(p.stat().st_ino == blob.stat().st_ino for p in big)  # no copy: the cache's blob itself
    assert all(p.stat().st_mode & 0o777 == 0o444 for p in big)
    assert (out / "b1" / "params.json").stat().st_ino != cache.blobs.path(sdigest).stat().st_ino  # small: a copy
    assert cache.blobs.check(digest, size) == "ok"  # verified when linked: no second hash

    # Changed through the output's name, its mtime put back: the cache notices (ctime) and never uses the bytes.
    st = big[0].stat()
    os.chmod(big[0], 0o644)
    with open(big[0], "r+b") as f:
        f.write(b"\0" * 16)
    os.utime(big[0], ns=(st.st_atime_ns, st.st_mtime_ns))
    assert cache.blobs.check(digest, size) == "corrupt"
