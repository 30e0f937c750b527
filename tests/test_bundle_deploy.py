"""neuron_bundle archives: contents, reproducibility, cache reuse, and deploy refusing hostile or broken bundles."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import tarfile
from pathlib import Path

import pytest
import zstandard
from helpers import copy_example, run_cli, write_ws

from neuronbuild.packaging.deploy import BundleError, deploy

BUNDLE = Path("neuronbuild-out/models/release.tar.zst")


def _members(archive: Path) -> list[tuple[tarfile.TarInfo, bytes]]:
    raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(archive.read_bytes()), read_across_frames=True).read()
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tar:
        return [(m, tar.extractfile(m).read()) for m in tar.getmembers()]  # type: ignore[union-attr]


def _write(dest: Path, members: list[tuple[tarfile.TarInfo, bytes]]) -> Path:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    dest.write_bytes(zstandard.ZstdCompressor().compress(buf.getvalue()))
    return dest


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else b"<dir>")
            for p in sorted(root.rglob("*"))}


def test_bundle_holds_every_graph_and_weights_once(built_example) -> None:  # type: ignore[no-untyped-def]
    ws, proc = built_example
    archive = ws / BUNDLE
    assert "Bundle //models:release" in proc.stderr
    manifest = json.loads((ws / "neuronbuild-out/models/release.manifest.json").read_text())
    assert manifest["bundle_format"] == 1 and manifest["label"] == "//models:release"
    graphs = manifest["graphs"]
    assert sorted((g["label"], g["bucket_name"]) for g in graphs) == sorted(
        [(f"//models:llama_{t}", b) for t in ("cpu", "trn2")
         for b in ("context_batch1_seq32", "context_batch4_seq32", "token_batch1", "token_batch4")])
    cpu = [g for g in graphs if g["target"]["platform"] == "cpu"]
    trn2 = [g for g in graphs if g["target"]["platform"] == "trn2"]
    # One weights file for the model, shared by its cpu and trn2 graphs (weights once); neither the packages nor the
    # HLO modules carry weights (a Neuron graph takes them as parameters).
    assert len({g["weights"]["path"] for g in graphs}) == 1
    assert list(manifest["weights"].values()) == [["//models:llama"]]
    weights_size = cpu[0]["weights"]["size"]
    assert all(g["artifacts"]["model.pt2"]["size"] < weights_size for g in cpu)
    assert all(set(g["artifacts"]) == {"model.hlo.pb", "params.json", "compile_flags.json",
                                       "program_constants.safetensors"} for g in trn2)
    # a graph's own tensors (the rotary tables transformers computes in __init__): small, beside it
    assert all(g["artifacts"]["program_constants.safetensors"]["size"] < weights_size / 100 for g in graphs)
    assert all(g["format"] == "neuron-hlo" and g["artifacts"]["model.hlo.pb"]["size"] < weights_size / 8
               for g in trn2)
    for g in graphs:  # records and toolchain versions travel with each graph
        assert g["record"]["options"] == g["options"] and g["toolchain"]["torch"]
        assert g["trace_record"]["model"]["entry"] == f"neuronbuild.toolchains.hf_causal_lm:{g['graph']}"
    members = _members(archive)
    names = [m.name for m, _ in members]
    assert names[0] == "manifest.json" and names[1:] == sorted(names[1:])
    assert {"README.md", "neuronbuild.env"} <= set(names)
    assert sum(n.startswith("weights/") for n in names) == 1
    assert all(m.mtime == 0 and m.uid == 0 and m.mode == 0o644 and m.isreg() for m, _ in members)
    for m, data in members[1:]:
        assert hashlib.sha256(data).hexdigest() == manifest["files"][m.name]["sha256"]
    env = dict(members)[next(m for m, _ in members if m.name == "neuronbuild.env")].decode()
    assert "NEURONBUILD_REQUIRE='//models:llama_cpu,//models:llama_trn2'" in env
    sha = (ws / "neuronbuild-out/models/release.tar.zst.sha256").read_text().split()[0]
    assert sha == hashlib.sha256(archive.read_bytes()).hexdigest()
    assert str(ws) not in archive.with_suffix("").with_suffix(".manifest.json").read_text()


def test_bundle_from_another_path_is_byte_identical_and_compiles_nothing(built_example, cache_dir: Path,
                                                                          tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ws, _ = built_example
    other = copy_example(tmp_path / "elsewhere" / "checkout")
    proc = run_cli(["build", "//models:release", "--cache-dir", str(cache_dir)], other)
    assert proc.returncode == 0, proc.stderr
    assert " 0 executed" in proc.stdout
    assert (other / BUNDLE).read_bytes() == (ws / BUNDLE).read_bytes()
    # The bundle's graphs and blobs are pinned for the cache's GC.
    pins = list((cache_dir / "v1" / "pins").glob("bundle-models__release-*.json"))
    assert len(pins) >= 2
    pin = json.loads(pins[0].read_text())
    planned = json.loads(run_cli(["plan", "//models:release", "--cache-dir", str(cache_dir), "--output", "json"],
                                 other).stdout)
    assert len(pin["fingerprints"]) == planned["total"] and pin["digests"]  # every action the graphs came from
    assert all((cache_dir / "v1" / "cas" / d[:2] / d).is_file() for d in pin["digests"])


def test_deploy_installs_atomically_and_is_idempotent(built_example, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ws, _ = built_example
    dest = tmp_path / "serve"
    proc = run_cli(["deploy", str(ws / BUNDLE), "--cache-dir", str(dest)], ws)
    assert proc.returncode == 0, proc.stderr
    index = json.loads((dest / "neuronbuild-deploy.json").read_text())
    rid = index["releases"][0]["id"]
    assert sorted(p.name for p in dest.iterdir()) == ["neuronbuild-deploy.json", "releases"]
    assert (dest / "releases" / rid / "manifest.json").is_file()
    before = _snapshot(dest)
    again = deploy(ws / BUNDLE, dest)
    assert again.already and again.id == rid
    assert _snapshot(dest) == before
    sha = (ws / "neuronbuild-out/models/release.tar.zst.sha256").read_text().split()[0]
    with pytest.raises(BundleError, match="differs from the expected"):
        deploy(ws / BUNDLE, dest, expect_sha256="0" * 64)
    assert deploy(ws / BUNDLE, dest, expect_sha256=sha).id == rid


def _hostile(kind: str, members: list[tuple[tarfile.TarInfo, bytes]]) -> list[tuple[tarfile.TarInfo, bytes]]:
    out = [(tarfile.TarInfo(m.name), d) for m, d in members]
    for info, data in out:
        info.size = len(data)
    weights_i = next(i for i, (m, _) in enumerate(out) if m.name.startswith("weights/"))
    if kind == "tampered":
        info, data = out[weights_i]
        out[weights_i] = (info, bytes([data[0] ^ 1]) + data[1:])
    elif kind in ("dotdot", "absolute"):
        name = "../escaped.txt" if kind == "dotdot" else "/tmp/neuronbuild-absolute-escape.txt"
        info = tarfile.TarInfo(name)
        info.size = 4
        out.insert(1, (info, b"evil"))
    elif kind in ("symlink", "hardlink"):
        info = tarfile.TarInfo("graphs/link")
        info.type = tarfile.SYMTYPE if kind == "symlink" else tarfile.LNKTYPE
        info.linkname = "/etc/passwd" if kind == "symlink" else "manifest.json"
        out.insert(1, (info, b""))
    elif kind == "device":
        info = tarfile.TarInfo("dev/null")
        info.type = tarfile.CHRTYPE
        info.devmajor, info.devminor = 1, 3
        out.insert(1, (info, b""))
    elif kind == "unlisted":
        info = tarfile.TarInfo("extra.txt")
        info.size = 1
        out.append((info, b"x"))
    return out


@pytest.mark.parametrize("kind,message", [
    ("tampered", "sha256 differs"), ("dotdot", "'..'"), ("absolute", "absolute path"), ("symlink", "symlink"),
    ("hardlink", "hard link"), ("device", "device"), ("unlisted", "not listed"), ("truncated", "truncated"),
])
def test_hostile_bundles_are_refused_and_change_nothing(built_example, tmp_path: Path, kind: str,
                                                        message: str) -> None:  # type: ignore[no-untyped-def]
    ws, _ = built_example
    dest = tmp_path / "a" / "serve"
    deploy(ws / BUNDLE, dest)  # an existing release must survive a refused deploy untouched
    before = _snapshot(tmp_path)
    if kind == "truncated":
        data = (ws / BUNDLE).read_bytes()
        bad = tmp_path / "bad.tar.zst"
        bad.write_bytes(data[: len(data) * 2 // 3])
    else:
        bad = _write(tmp_path / "bad.tar.zst", _hostile(kind, _members(ws / BUNDLE)))
    before[bad.name] = bad.read_bytes()
    with pytest.raises(BundleError, match=re.escape(message)):
        deploy(bad, dest)
    assert _snapshot(tmp_path) == before
    assert not Path("/tmp/neuronbuild-absolute-escape.txt").exists()
    if kind == "dotdot":  # the CLI says it in one line and exits 2
        proc = run_cli(["deploy", str(bad), "--cache-dir", str(dest)], ws)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
        assert _snapshot(tmp_path) == before


def test_failed_deploy_into_a_new_directory_leaves_nothing(built_example, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ws, _ = built_example
    bad = _write(tmp_path / "bad.tar.zst", _hostile("tampered", _members(ws / BUNDLE)))
    with pytest.raises(BundleError):
        deploy(bad, tmp_path / "new")
    assert not (tmp_path / "new").exists()


def test_bundle_srcs_must_be_compile_targets(tmp_path: Path) -> None:
    ws = write_ws(tmp_path / "ws", {"m/BUILD": 'neuron_target(name = "t", platform = "trn2")\n'
                                                'neuron_bundle(name = "b", srcs = [":t"])\n'})
    proc = run_cli(["build", "//m:b"], ws, env={"NEURONBUILD_CACHE_DIR": str(tmp_path / "c")})
    assert proc.returncode == 2, proc.stderr
    assert "m/BUILD:2:" in proc.stderr and "must be a neuron_compile target" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_verify_checks_digests_and_host(built_example, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ws, _ = built_example
    env_trn2 = {"NEURON_PLATFORM_TARGET_OVERRIDE": "trn2"}
    ok = run_cli(["verify", str(ws / BUNDLE), "--host"], ws, env=env_trn2)
    assert ok.returncode == 0, ok.stderr
    assert "every digest matches" in ok.stdout and "can use every graph" in ok.stdout
    # A host without the Neuron platform and with an older CPU: every mismatch is listed.
    bad = run_cli(["verify", str(ws / BUNDLE), "--host"], ws,
                  env={"NEURON_PLATFORM_TARGET_OVERRIDE": "", "NEURONBUILD_HOST_ISA": "x86-64-v2"})
    assert bad.returncode == 1
    lines = [ln for ln in bad.stderr.splitlines() if ln.startswith("  //")]
    assert sum("target.platform differs (built for trn2" in ln for ln in lines) == 4
    assert sum("target.isa differs" in ln and "x86-64-v2" in ln for ln in lines) == 4
    tampered = _write(tmp_path / "t.tar.zst", _hostile("tampered", _members(ws / BUNDLE)))
    proc = run_cli(["verify", str(tampered)], ws)
    assert proc.returncode == 2 and "sha256 differs" in proc.stderr
    assert os.listdir(tmp_path) == ["t.tar.zst"]
