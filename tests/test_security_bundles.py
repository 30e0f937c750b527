"""Release authenticity and verified loads: signed manifests, pinned digests, tampering after deploy, hostile paths."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import tarfile
from pathlib import Path

import blake3
import pytest
import zstandard
from helpers import run_cli, write_ws

from neuronbuild.packaging.deploy import BundleError, deploy
from neuronbuild.runtime.layout import INDEX
from neuronbuild.runtime.signing import load_trusted_keys, sign_manifest

MODEL = '''import torch


class M(torch.nn.Module):
    def __init__(self, n, act):
        super().__init__()
        self.lin = torch.nn.Linear(n, 4)
        self.act = getattr(torch, act)

    def forward(self, x):
        return self.act(self.lin(x))


def build(config):
    return M(int(config["n"]), config.get("act", "relu"))
'''
BUILD = '''neuron_model(name = "m", srcs = ["m.py"], entry = "m:build", config = {"n": 8}, inputs = {"x": "float32[batch, n]"})
neuron_model(name = "m2", srcs = ["m.py"], entry = "m:build", config = {"n": 8, "act": "tanh"},
             inputs = {"x": "float32[batch, n]"}, seed = 7)
neuron_buckets(name = "b", shapes = [{"batch": 2, "n": 8}])
neuron_target(name = "cpu", platform = "cpu", isa = "x86-64")
neuron_target(name = "trn2", platform = "trn2")
neuron_compile(name = "m_cpu", model = ":m", buckets = [":b"], target = ":cpu")
neuron_compile(name = "m_trn2", model = ":m", buckets = [":b"], target = ":trn2")
neuron_compile(name = "m2_cpu", model = ":m2", buckets = [":b"], target = ":cpu")
neuron_bundle(name = "release", srcs = [":m_cpu", ":m_trn2"])
neuron_bundle(name = "other", srcs = [":m2_cpu"])
neuron_buckets(name = "b23", shapes = [{"batch": 2, "n": 8}, {"batch": 3, "n": 8}])
neuron_compile(name = "m_two_cpu", model = ":m", buckets = [":b23"], target = ":cpu")
neuron_bundle(name = "two", srcs = [":m_two_cpu"])
'''
ARCHIVE = "neuronbuild-out/pkg/release.tar.zst"
OTHER = "neuronbuild-out/pkg/other.tar.zst"


def _keygen(path: Path) -> Path:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "release@test", "-f", str(path)], check=True)
    return path


@pytest.fixture(scope="module")
def signed(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> dict[str, Path]:
    """A tiny workspace built once with real compiles, its bundles signed with an OpenSSH Ed25519 key."""
    base = tmp_path_factory.mktemp("signed")
    ws = write_ws(base / "ws", {"pkg/BUILD": BUILD, "pkg/m.py": MODEL})
    key = _keygen(base / "release_key")
    _keygen(base / "other_key")
    proc = run_cli(["build", "//pkg:release", "//pkg:other", "--jobs", "2", "--cache-dir", str(cache_dir),
                    "--signing-key", str(key)], ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {"ws": ws, "key": key, "pub": base / "release_key.pub", "other_pub": base / "other_key.pub",
            "base": base}


def _members(archive: Path) -> list[tuple[tarfile.TarInfo, bytes]]:
    raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(archive.read_bytes()), read_across_frames=True).read()
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tar:
        return [(m, tar.extractfile(m).read()) for m in tar.getmembers()]  # type: ignore[union-attr]


def _write(dest: Path, members: list[tuple[str, bytes]], fmt: int = tarfile.USTAR_FORMAT) -> Path:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    dest.write_bytes(zstandard.ZstdCompressor().compress(buf.getvalue()))
    return dest


def _forge(archive: Path, replace: dict[str, bytes], keep_signature: bool = True,
           edit=None) -> list[tuple[str, bytes]]:  # type: ignore[no-untyped-def]
    """A self-consistent forgery: members replaced and the manifest's digests updated to match."""
    members = [(m.name, d) for m, d in _members(archive)]
    manifest = json.loads(members[0][1])
    out = []
    for name, data in members[1:]:
        if name == "manifest.json.sig":
            continue
        data = replace.get(name, data)
        manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
        for g in manifest["graphs"]:
            for ref in [*g["artifacts"].values(), *([g["weights"]] if g["weights"] else [])]:
                if ref["path"] == name:
                    ref["sha256"], ref["size"] = manifest["files"][name]["sha256"], len(data)
                    if "blake3" in ref:
                        ref["blake3"] = blake3.blake3(data).hexdigest()
        out.append((name, data))
    if edit is not None:
        edit(manifest)
    mbytes = (json.dumps(manifest, sort_keys=True, indent=1) + "\n").encode()
    sig = [(n, d) for n, d in members if n == "manifest.json.sig"]
    return [("manifest.json", mbytes), *(sig if keep_signature else []), *out]


def test_bundles_are_signed_and_deploy_refuses_unsigned_or_wrongly_signed(signed: dict[str, Path],
                                                                            tmp_path: Path) -> None:
    ws = signed["ws"]
    archive = ws / ARCHIVE
    names = [m.name for m, _ in _members(archive)]
    assert names[:2] == ["manifest.json", "manifest.json.sig"]
    assert (ws / "neuronbuild-out/pkg/release.manifest.json.sig").is_file()
    # The real OpenSSH public key is what operators trust.
    assert load_trusted_keys(signed["pub"])[0].key_id in (ws / "neuronbuild-out/pkg/release.manifest.json.sig").read_text()

    ok = run_cli(["verify", str(archive), "--trusted-keys", str(signed["pub"])], ws)
    assert ok.returncode == 0 and "signed by a trusted key" in ok.stdout, ok.stderr
    wrong = run_cli(["deploy", str(archive), "--cache-dir", str(tmp_path / "a"), "--trusted-keys",
                     str(signed["other_pub"])], ws)
    assert wrong.returncode == 2 and "bad signature" in wrong.stderr and wrong.stderr.count("\n") == 1
    assert not (tmp_path / "a").exists()

    # One artifact replaced by another model's, digests updated: self-consistent, but the signature no longer fits.
    other_pt2 = next(d for m, d in _members(ws / OTHER) if m.name.endswith("model.pt2"))
    target, mine = next((m.name, d) for m, d in _members(archive) if m.name.endswith("model.pt2"))
    assert other_pt2 != mine  # another program (packages hold no weights: a seed alone would not differ)
    forged = _write(tmp_path / "forged.tar.zst", _forge(archive, {target: other_pt2}))
    unsigned = _write(tmp_path / "unsigned.tar.zst", _forge(archive, {target: other_pt2}, keep_signature=False))
    for bad, msg in ((forged, "bad signature"), (unsigned, "not signed")):
        proc = run_cli(["deploy", str(bad), "--cache-dir", str(tmp_path / "b"), "--trusted-keys",
                        str(signed["pub"])], ws)
        assert proc.returncode == 2 and msg in proc.stderr, proc.stderr
        assert not (tmp_path / "b").exists()
        proc = run_cli(["verify", str(bad), "--trusted-keys", str(signed["pub"])], ws)
        assert proc.returncode == 2 and msg in proc.stderr
    good = run_cli(["deploy", str(archive), "--cache-dir", str(tmp_path / "c"), "--trusted-keys",
                    str(signed["pub"])], ws)
    assert good.returncode == 0 and "installed" in good.stdout, good.stderr


def _open(dest: Path, **kw):  # type: ignore[no-untyped-def]
    from neuronbuild.runtime import open_cache

    return open_cache(dest, strict=True, require=["//pkg:m_cpu", "//pkg:m_trn2"], emulate="xla-cpu", **kw)


def _loaded(cache) -> int:  # type: ignore[no-untyped-def]
    return int(cache.counters.hit + cache.counters.emulated)


@pytest.fixture()
def trn2_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")


def test_strict_open_refuses_unsigned_releases_and_pins_artifact_digests(signed: dict[str, Path], tmp_path: Path,
                                                                         trn2_host: None) -> None:
    ws = signed["ws"]
    archive = ws / ARCHIVE
    other_pt2 = next(d for m, d in _members(ws / OTHER) if m.name.endswith("model.pt2"))
    target = next(m.name for m, _ in _members(archive) if m.name.endswith("model.pt2"))
    forged = _write(tmp_path / "forged.tar.zst", _forge(archive, {target: other_pt2}, keep_signature=False))
    dest = tmp_path / "serve"
    deploy(forged, dest)  # without trusted keys deploy only checks consistency
    genuine = ws / "neuronbuild-out/pkg/release.manifest.json"
    with pytest.raises(RuntimeError, match="model.pt2 differs from the expected manifest"):
        _open(dest, expect=genuine)
    with pytest.raises(RuntimeError, match="not signed"):
        _open(dest, trusted_keys=signed["pub"])
    good = tmp_path / "good"
    deploy(archive, good)
    cache = _open(good, expect=genuine, trusted_keys=signed["pub"])
    assert _loaded(cache) == 2 and cache.counters.error == 0


def test_a_pin_covers_the_digest_the_runtime_checks(signed: dict[str, Path], tmp_path: Path, trn2_host: None) -> None:
    # After deploy, an artifact is replaced (same size, one byte changed) and the deployed manifest's BLAKE3 for it
    # (the digest strict open checks) rewritten to fit, its sha256 left as pinned. The pin must still refuse it: by its BLAKE3 when the expected
    # manifest gives one, else by checking the sha256 it pins.
    ws = signed["ws"]
    archive = ws / ARCHIVE
    genuine = ws / "neuronbuild-out/pkg/release.manifest.json"
    dest = tmp_path / "serve"
    res = deploy(archive, dest)
    manifest = json.loads((res.dir / "manifest.json").read_text())
    ref = next(g["artifacts"]["model.pt2"] for g in manifest["graphs"] if "model.pt2" in g["artifacts"])
    evil = bytearray((res.dir / ref["path"]).read_bytes())
    evil[len(evil) // 2] ^= 0xFF
    other_pt2 = bytes(evil)
    assert ref["blake3"]  # graph artifacts carry their BLAKE3
    (res.dir / ref["path"]).write_bytes(other_pt2)
    ref["blake3"] = blake3.blake3(other_pt2).hexdigest()
    (res.dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(RuntimeError, match="model.pt2 differs from the expected manifest \\(expected blake3"):
        _open(dest, expect=genuine)
    old_lock = json.loads(genuine.read_text())  # a lock written before manifests had BLAKE3 digests
    for g in old_lock["graphs"]:
        for r in [*g["artifacts"].values(), *([g["weights"]] if g["weights"] else [])]:
            r.pop("blake3", None)
    (tmp_path / "old.manifest.json").write_text(json.dumps(old_lock))
    with pytest.raises(RuntimeError, match="differ from the manifest \\(sha256 "):
        _open(dest, expect=tmp_path / "old.manifest.json")
    good = tmp_path / "good"
    deploy(archive, good)
    assert _loaded(_open(good, expect=tmp_path / "old.manifest.json")) == 2


def _evil_pt2(genuine: bytes, tmp: Path, marker: Path) -> bytes:
    """The genuine AOTInductor package with its shared library replaced by one whose constructor creates `marker`."""
    import zipfile

    src = tmp / "evil.c"
    src.write_text('#include <stdio.h>\n__attribute__((constructor)) static void evil(void) {\n'
                   f'  FILE *f = fopen("{marker}", "w"); if (f) {{ fputs("ran", f); fclose(f); }}\n}}\n')
    so = tmp / "evil.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(so), str(src)], check=True)

    def package(pad: int) -> bytes:
        out = io.BytesIO()
        with zipfile.ZipFile(io.BytesIO(genuine)) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zout:
            for info in zin.infolist():
                zout.writestr(info, so.read_bytes() if info.filename.endswith(".so") else zin.read(info))
            zout.writestr("model/pad", b"\0" * pad)
        return out.getvalue()

    evil = package(len(genuine) - len(package(0)))  # the genuine file's size exactly: only the digest tells
    assert len(evil) == len(genuine)
    return evil


def test_a_forged_shared_library_never_runs_in_a_pinned_signed_or_checked_open(signed: dict[str, Path], tmp_path: Path,
                                                                              trn2_host: None) -> None:
    # The worst finding: a forged .so ran its constructor inside open_cache. Forged into a self-consistent bundle,
    # or swapped into a deployed release, it must be refused before anything dlopens it.
    ws = signed["ws"]
    archive = ws / ARCHIVE
    genuine = ws / "neuronbuild-out/pkg/release.manifest.json"
    target, pt2 = next((m.name, d) for m, d in _members(archive) if m.name.endswith("model.pt2"))
    marker = tmp_path / "constructor-ran"
    evil = _evil_pt2(pt2, tmp_path, marker)
    dest = tmp_path / "serve"
    deploy(_write(tmp_path / "forged.tar.zst", _forge(archive, {target: evil}, keep_signature=False)), dest)
    with pytest.raises(RuntimeError, match="model.pt2 differs from the expected manifest"):
        _open(dest, expect=genuine)
    with pytest.raises(RuntimeError, match="not signed"):
        _open(dest, trusted_keys=signed["pub"])
    assert not marker.exists()
    good = tmp_path / "good"
    res = deploy(archive, good)
    (res.dir / target).write_bytes(evil)  # swapped after deploy: the strict open checks every byte first
    with pytest.raises(RuntimeError, match="differ from the manifest"):
        _open(good)
    assert not marker.exists()
    # The control: with no trust root, the forged release's manifest is all there is, and its library does load,
    # so the marker is what a constructor run leaves behind.
    with pytest.raises(RuntimeError):
        _open(dest)
    assert marker.read_text() == "ran"


def test_tampering_after_deploy_is_caught_at_load_and_redeploy_repairs(signed: dict[str, Path], tmp_path: Path,
                                                                       trn2_host: None) -> None:
    ws = signed["ws"]
    archive = ws / ARCHIVE
    dest = tmp_path / "serve"
    res = deploy(archive, dest)
    manifest = json.loads((res.dir / "manifest.json").read_text())
    for g in manifest["graphs"]:
        for name, ref in [*g["artifacts"].items(), *([("weights", g["weights"])] if g["weights"] else [])]:
            if name == "compile_flags.json":  # not loaded by the runtime (a record of the neuronx-cc command)
                continue
            p = res.dir / ref["path"]
            data = bytearray(p.read_bytes())
            data[len(data) // 2] ^= 0xFF  # same size, different bytes
            p.write_bytes(bytes(data))
            with pytest.raises(RuntimeError, match="differ from the manifest"):
                _open(dest)
            proc = run_cli(["deploy", str(archive), "--cache-dir", str(dest)], ws)
            assert proc.returncode == 0 and "repaired" in proc.stdout, proc.stdout + proc.stderr
            assert _loaded(_open(dest)) == 2
    proc = run_cli(["deploy", str(archive), "--cache-dir", str(dest)], ws)
    assert "already installed" in proc.stdout


def test_hostile_paths_and_names_in_manifests_and_destinations(signed: dict[str, Path], tmp_path: Path,
                                                               trn2_host: None) -> None:
    ws = signed["ws"]
    archive = ws / ARCHIVE
    dest = tmp_path / "serve"
    res = deploy(archive, dest)
    # A deployed manifest pointing outside its release is refused, not followed.
    (tmp_path / "elsewhere.pt2").write_bytes(b"x")
    mpath = res.dir / "manifest.json"
    manifest = json.loads(mpath.read_text())
    g = next(g for g in manifest["graphs"] if g["target"]["platform"] != "cpu")
    art = next(iter(g["artifacts"]))
    old = g["artifacts"][art]["path"]
    new = "../../../elsewhere.pt2"
    g["artifacts"][art]["path"] = new
    manifest["files"][new] = manifest["files"].pop(old)
    mpath.write_text(json.dumps(manifest))
    with pytest.raises(RuntimeError, match="refusing member '../../../elsewhere.pt2'"):
        _open(dest)

    # A pre-existing releases symlink is not followed out of the destination.
    outside = tmp_path / "outside"
    outside.mkdir()
    d2 = tmp_path / "d2"
    d2.mkdir()
    (d2 / "releases").symlink_to(outside)
    with pytest.raises(BundleError, match="not a plain directory"):
        deploy(archive, d2)
    assert list(outside.iterdir()) == []

    # Member names and labels with newlines are refused.
    def newline_label(m: dict) -> None:  # type: ignore[type-arg]
        m["label"] = "//pkg:release\nINJECTED"

    for bad in (_forge(archive, {}, False) + [("evil\nname", b"")],
                _forge(archive, {}, False, edit=newline_label)):
        with pytest.raises(BundleError, match="refusing member|control characters"):
            deploy(_write(tmp_path / "bad.tar.zst", bad, tarfile.PAX_FORMAT), tmp_path / "d3")
        assert not (tmp_path / "d3").exists()


def test_env_file_is_quoted_data_and_a_hostile_one_is_refused(signed: dict[str, Path], tmp_path: Path) -> None:
    ws = signed["ws"]
    archive = ws / ARCHIVE
    env = dict((m.name, d) for m, d in _members(archive))["neuronbuild.env"].decode()
    for line in env.splitlines():
        if line and not line.startswith("#"):
            name, value = line.split("=", 1)
            assert name.startswith("NEURONBUILD_") and value.startswith("'") and value.endswith("'"), line
    out = subprocess.run(["sh", "-c", f"set -a; . {tmp_path / 'e'}; env"], capture_output=True, text=True,
                         input=None, env={"PATH": os.environ["PATH"]}, check=False) \
        if (tmp_path / "e").write_text(env) else None
    assert out is not None and "NEURONBUILD_REQUIRE=//pkg:m_cpu,//pkg:m_trn2" in out.stdout
    marker = tmp_path / "ran"
    evil = env + f"touch {marker}\n"
    bad = _write(tmp_path / "bad.tar.zst", _forge(archive, {"neuronbuild.env": evil.encode()}, False))
    proc = run_cli(["deploy", str(bad), "--cache-dir", str(tmp_path / "d")], ws)
    assert proc.returncode == 2 and "neuronbuild.env" in proc.stderr, proc.stderr
    assert not (tmp_path / "d").exists() and not marker.exists()


def test_packages_loaded_through_one_reused_memory_file_are_each_their_own_checked_package(
        signed: dict[str, Path], tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A strict open reads every model.pt2 into one reused memory file (verified.Scratch) in turn. Each graph must
    # still run its own package (the loader is done with a copy before the next overwrites it; a package loader that
    # kept reading the file, or cached it by its /proc/self/fd path, would run the wrong graph and fail the shape
    # check), and a package tampered after deploy is refused even after others were loaded through the same file.
    import torch
    from safetensors.torch import load_file

    from neuronbuild.runtime import verified
    from neuronbuild.runtime.deployed import open_cache

    ws = signed["ws"]
    proc = run_cli(["build", "//pkg:two", "--cache-dir", str(cache_dir)], ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    filled: list[str] = []
    real_fill = verified.Scratch._fill

    def counting_fill(self, path, ref):  # type: ignore[no-untyped-def]
        filled.append(ref.path)
        return real_fill(self, path, ref)

    monkeypatch.setattr(verified.Scratch, "_fill", counting_fill)
    res = deploy(ws / "neuronbuild-out/pkg/two.tar.zst", tmp_path / "serve")
    cache = open_cache(tmp_path / "serve", strict=True, require=["//pkg:m_two_cpu"])
    assert cache.counters.hit == 2 and len(filled) == 2 and len(set(filled)) == 2  # both through the one scratch
    model = cache.model("//pkg:m_two_cpu")
    weights = load_file(str(next((res.dir / "weights").iterdir())))
    for name, bucket in model.buckets.items():
        x = torch.randn(bucket["batch"], 8)
        want = torch.relu(x @ weights["lin.weight"].T + weights["lin.bias"])
        fn = model.bucket_fn(name)
        assert fn is not None
        assert torch.allclose(fn(x), want, atol=1e-5)
        with pytest.raises(RuntimeError):  # its own package: the other bucket's shape is refused
            fn(torch.randn(5 - bucket["batch"], 8))
    manifest = json.loads((res.dir / "manifest.json").read_text())
    last = res.dir / manifest["graphs"][-1]["artifacts"]["model.pt2"]["path"]
    data = bytearray(last.read_bytes())
    data[len(data) // 3] ^= 0x40
    last.write_bytes(bytes(data))
    filled.clear()
    with pytest.raises(RuntimeError, match="differ from the manifest"):
        open_cache(tmp_path / "serve", strict=True, require=["//pkg:m_two_cpu"])
    assert len(filled) == 2  # the first loaded through the scratch, then the second refused there


def _variant(archive: Path, dest: Path, key: Path | None, note: str) -> Path:
    """Another release of the same label (its manifest differs by one field), signed with `key` or unsigned."""
    members = _forge(archive, {}, keep_signature=False, edit=lambda m: m.update({"note": note}))
    if key is not None:
        members.insert(1, ("manifest.json.sig", sign_manifest(members[0][1], key)))
    return _write(dest, members)


def test_redeploy_keeps_a_valid_signature_and_a_downgrade_is_refused_strictly(signed: dict[str, Path],
                                                                             tmp_path: Path) -> None:
    ws, pub, serve = signed["ws"], str(signed["pub"]), tmp_path / "serve"
    older = _variant(ws / ARCHIVE, tmp_path / "older.tar.zst", signed["key"], "older")
    newer = _variant(ws / ARCHIVE, tmp_path / "newer.tar.zst", signed["key"], "newer")
    for archive in (older, newer):
        proc = run_cli(["deploy", str(archive), "--dest", str(serve), "--trusted-keys", pub], ws)
        assert proc.returncode == 0 and "installed" in proc.stdout, proc.stderr
    index = json.loads((serve / INDEX).read_text())["releases"]
    old_id, new_id = index[1]["id"], index[0]["id"]
    # The older release, validly signed, replayed: refused strictly, nothing changes; allowed by the flag.
    refused = run_cli(["deploy", str(older), "--dest", str(serve), "--trusted-keys", pub], ws)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert f"deployed before the current {new_id}" in refused.stderr and "--allow-downgrade" in refused.stderr
    assert json.loads((serve / INDEX).read_text())["releases"][0]["id"] == new_id
    allowed = run_cli(["deploy", str(older), "--dest", str(serve), "--trusted-keys", pub, "--allow-downgrade"], ws)
    assert allowed.returncode == 0 and "downgrade" not in allowed.stderr, allowed.stderr
    assert json.loads((serve / INDEX).read_text())["releases"][0]["id"] == old_id
    # Without trusted keys a downgrade is made current with a warning; re-deploying the same release with junk in
    # its signature member keeps the installed, valid signature.
    sig = serve / "releases" / new_id / "manifest.json.sig"
    valid = sig.read_bytes()
    members = _forge(ws / ARCHIVE, {}, keep_signature=False, edit=lambda m: m.update({"note": "newer"}))
    members.insert(1, ("manifest.json.sig", b"junk"))
    junk = _write(tmp_path / "junk.tar.zst", members)
    forward = run_cli(["deploy", str(junk), "--dest", str(serve)], ws)  # (back to the newer one: no downgrade)
    assert forward.returncode == 0 and "downgrade" not in forward.stderr, forward.stderr
    assert sig.read_bytes() == valid
    back = run_cli(["deploy", str(older), "--dest", str(serve)], ws)
    assert back.returncode == 0 and "warning: a downgrade" in back.stderr, back.stderr


def test_a_passphrase_protected_openssh_key_signs_with_its_passphrase(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from neuronbuild.runtime.signing import SignatureError, verify_manifest

    key = tmp_path / "protected"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "s3cret phrase", "-f", str(key)], check=True)
    manifest = b'{"label": "//pkg:release"}\n'
    monkeypatch.delenv("NEURONBUILD_SIGNING_KEY_PASSPHRASE", raising=False)
    with pytest.raises(SignatureError, match="passphrase-protected: give the passphrase in"):
        sign_manifest(manifest, key)
    monkeypatch.setenv("NEURONBUILD_SIGNING_KEY_PASSPHRASE", "s3cret phrase")
    sig = sign_manifest(manifest, key)
    assert verify_manifest(manifest, sig, load_trusted_keys(key.with_suffix(".pub")), "release")
