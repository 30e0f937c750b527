"""neuron_bundle with `compression = "gzip"`: a real, reproducible gzip'd tar holding what the zstd bundle holds, that
`verify` accepts and `deploy` installs for the strict runtime."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import zstandard
from helpers import copy_example, run_cli

GZ_RULE = ('\nneuron_bundle(name = "release_gz", srcs = [":llama_cpu", ":llama_trn2"], compression = "gzip")\n')
OUT = Path("neuronbuild-out/models")

SERVE = r"""
import sys, torch
from neuronbuild.runtime import open_cache
cache = open_cache(sys.argv[1], strict=True, require=["//models:llama_cpu"])
lm = cache.causal_lm("//models:llama_cpu")
for prompts in ([[1, 2, 3]], [[1, 2, 3], [4, 5], [6]]):
    out = lm.generate(prompts, max_new_tokens=4)
    print(list(out.shape), bool(((out >= 0) & (out < 512)).all()))
"""


def _gz_workspace(dest: Path) -> Path:
    ws = copy_example(dest)
    with open(ws / "models" / "BUILD", "a") as f:
        f.write(GZ_RULE)
    return ws


def _tar_members(raw: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]


def test_gzip_bundle_is_a_reproducible_gzip_tar_that_verifies_and_deploys(
        built_example, cache_dir: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    zstd_ws, _ = built_example
    ws = _gz_workspace(tmp_path / "ws")
    proc = run_cli(["build", "//models:release_gz", "--cache-dir", str(cache_dir)], ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The graphs come from the cache; only packaging ran.
    assert re.search(r"^(\d+) actions: 0 executed, \1 cached", proc.stdout, re.M), proc.stdout
    archive = ws / OUT / "release_gz.tar.gz"
    assert "Bundle //models:release_gz" in proc.stderr and not (ws / OUT / "release_gz.tar.zst").exists()

    data = archive.read_bytes()
    assert data[:3] == b"\x1f\x8b\x08" and data[4:8] == b"\0\0\0\0"  # gzip, deflate, mtime 0 (reproducible)
    members = _tar_members(gzip.decompress(data))
    names = list(members)
    assert names[0] == "manifest.json" and names[1:] == sorted(names[1:])
    manifest = json.loads(members["manifest.json"])
    assert manifest["label"] == "//models:release_gz" and len(manifest["graphs"]) == 8
    for name, content in members.items():
        if name != "manifest.json":
            assert hashlib.sha256(content).hexdigest() == manifest["files"][name]["sha256"], name
    sha = (ws / OUT / "release_gz.tar.gz.sha256").read_text().split()[0]
    assert sha == hashlib.sha256(data).hexdigest()
    # The same graphs and weights, byte for byte, as the zstd bundle of the same srcs.
    zstd_raw = zstandard.ZstdDecompressor().stream_reader(
        io.BytesIO((zstd_ws / OUT / "release.tar.zst").read_bytes()), read_across_frames=True).read()
    zstd_members = _tar_members(zstd_raw)
    payload = [n for n in names if n.startswith(("graphs/", "weights/"))]
    assert payload and set(payload) == {n for n in zstd_members if n.startswith(("graphs/", "weights/"))}
    assert all(members[n] == zstd_members[n] for n in payload)

    # Byte-identical when built from another checkout path.
    other = _gz_workspace(tmp_path / "elsewhere" / "checkout")
    again = run_cli(["build", "//models:release_gz", "--cache-dir", str(cache_dir)], other)
    assert again.returncode == 0, again.stderr
    assert (other / OUT / "release_gz.tar.gz").read_bytes() == data

    ok = run_cli(["verify", str(archive)], ws)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "//models:release_gz: 8 graph(s)" in ok.stdout and "every digest matches" in ok.stdout
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(data[: len(data) // 2])
    bad = run_cli(["verify", str(cut)], ws)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr, bad.stderr

    serve = tmp_path / "serve"
    dep = run_cli(["deploy", str(archive), "--cache-dir", str(serve)], ws)
    assert dep.returncode == 0, dep.stdout + dep.stderr
    index = json.loads((serve / "neuronbuild-deploy.json").read_text())
    assert [r["label"] for r in index["releases"]] == ["//models:release_gz"]
    release = serve / "releases" / index["releases"][0]["id"]
    for name, meta in manifest["files"].items():
        assert hashlib.sha256((release / name).read_bytes()).hexdigest() == meta["sha256"], name
    # The strict runtime serves the deployed cpu graphs (no compilation, no cache miss allowed).
    run = subprocess.run([sys.executable, "-c", SERVE, str(serve)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[:2] == ["[1, 7] True", "[3, 7] True"]
