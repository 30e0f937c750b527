"""Shared tiers (directory and S3 on a local moto server), integrity of every tier, gc with pins, recorded failures.

One tiny trn2-path workspace is built once per module (10 actions, seconds each); tests work on copies of its cache."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
from pathlib import Path
from typing import Any

import pytest
from helpers import run_cli, write_ws

MODEL = '''
import os
import torch

def build(config):
    if os.path.exists(config.get("fail_if", "/nonexistent")):
        raise RuntimeError("transient failure requested by the test")
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 4))
'''
BUILD = '''
neuron_model(name = "m", srcs = ["m.py"], entry = "m:build", inputs = {"x": "int64[batch, seq]"})
neuron_buckets(name = "b", shapes = [{"batch": 1, "seq": 4}, {"batch": 2, "seq": 4}])
neuron_buckets(name = "b3", shapes = [{"batch": 3, "seq": 4}])
neuron_target(name = "t", platform = "trn2")
neuron_compile(name = "c", model = ":m", buckets = [":b"], target = ":t")
neuron_compile(name = "c2", model = ":m", buckets = [":b3"], target = ":t")
'''
C1 = "compile //pkg:c [batch=1, seq=4] for trn2"
C2 = "compile //pkg:c [batch=2, seq=4] for trn2"
AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_CONFIG_FILE": "/dev/null", "AWS_SHARED_CREDENTIALS_FILE": "/dev/null"}


def executed(stderr: str) -> list[str]:
    return re.findall(r"^\[\d+/\d+\] (.+?)(?: \(\d|: skipped \()", stderr, re.M)  # (no neuronx-cc: skipped)


def warnings(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("warning:")]


def build(ws: Path, cache: Path, *extra: str, ok: bool = True) -> Any:
    proc = run_cli(["build", "//pkg:c", "--jobs", "2", "--cache-dir", str(cache), *extra], ws, env=AWS_ENV)
    if ok:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def entries(cache_base: Path) -> dict[str, dict[str, Any]]:
    """identity -> record JSON of every action entry in a cache (local or shared directory)."""
    out = {}
    for p in (cache_base / "v1" / "ac").glob("*/*.json"):
        d = json.loads(p.read_text())
        out[d["identity"]] = d
    return out


def blob(cache_base: Path, identity: str, output: str = "compile_flags.json") -> Path:
    """A compile-only output's blob (compile_flags.json names the module's digest: one per graph)."""
    digest = entries(cache_base)[identity]["outputs"][output]["digest"]
    return cache_base / "v1" / "cas" / digest[:2] / digest


def flip_byte(p: Path) -> None:
    os.chmod(p, 0o644)
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))


def truncate(p: Path) -> None:
    os.chmod(p, 0o644)
    with open(p, "r+b") as f:
        f.truncate(p.stat().st_size // 2)


def verify(cache: Path, *extra: str) -> Any:
    return run_cli(["cache", "verify", "--cache-dir", str(cache), *extra], cache.parent, env=AWS_ENV)


def outputs_match_cache(ws: Path, cache: Path) -> None:
    """Every materialised output file equals the digest its manifest (and the cache) names."""
    import blake3

    manifest = json.loads((ws / "neuronbuild-out/pkg/c/manifest.json").read_text())
    for b in manifest["buckets"]:
        for out in b["outputs"].values():
            data = (ws / "neuronbuild-out/pkg/c" / out["path"]).read_bytes()
            assert blake3.blake3(data).hexdigest() == out["digest"]


@pytest.fixture(scope="module")
def ws(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_ws(tmp_path_factory.mktemp("tiers") / "ws", {"pkg/BUILD": BUILD, "pkg/m.py": MODEL})


@pytest.fixture(scope="module")
def populated(ws: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(local cache, shared directory) after one build of //pkg:c and //pkg:c2 uploading to the shared directory."""
    base = tmp_path_factory.mktemp("populated")
    local, shared = base / "local", base / "shared"
    shared.mkdir()
    proc = run_cli(["build", "//pkg:c", "//pkg:c2", "--jobs", "2", "--cache-dir", str(local),
                    "--remote-cache", str(shared)], ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "10 actions: 10 executed" in proc.stdout
    assert len(entries(shared)) == 10
    return local, shared


def copy_cache(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def test_empty_local_cache_is_filled_from_the_shared_directory(populated: tuple[Path, Path], ws: Path,
                                                               tmp_path: Path) -> None:
    _local, shared = populated
    proc = build(ws, tmp_path / "fresh", "--remote-cache", str(shared))
    assert "7 actions: 0 executed, 7 cached" in proc.stdout
    # Uploaded signed with this user's own record key (#49: the default) and served by it, without a warning.
    assert executed(proc.stderr) == [] and warnings(proc.stderr) == [], proc.stderr
    assert all(json.loads(p.read_bytes()).get("signature") for p in (shared / "v1" / "ac").glob("*/*.json"))
    assert set(entries(tmp_path / "fresh")) == {C1, C2, "weights //pkg:m", "trace //pkg:m [batch=1, seq=4]",
                                                 "trace //pkg:m [batch=2, seq=4]", "lower //pkg:m [batch=1, seq=4]",
                                                 "lower //pkg:m [batch=2, seq=4]"}  # copied down
    outputs_match_cache(ws, tmp_path / "fresh")
    stats = run_cli(["cache", "stats", "--cache-dir", str(tmp_path / "fresh")], ws)
    assert re.search(r"^\s+\S+ \S+\s+0\s+7\s+\|\s+7 \(0\+7\)\s+0\s+0\s+0\s+0", stats.stdout, re.M), stats.stdout
    # A second build is served locally.
    proc = build(ws, tmp_path / "fresh", "--remote-cache", str(shared))
    stats = run_cli(["cache", "stats", "--cache-dir", str(tmp_path / "fresh")], ws)
    assert re.search(r"^\s+\S+ \S+\s+0\s+7\s+\|\s+7 \(7\+0\)", stats.stdout, re.M), stats.stdout


def test_corrupt_local_blobs_are_not_served_and_are_rebuilt(populated: tuple[Path, Path], ws: Path,
                                                            tmp_path: Path) -> None:
    local = copy_cache(populated[0], tmp_path / "local")
    flip_byte(blob(local, C1))
    truncate(blob(local, C2))
    proc = build(ws, local)
    assert sorted(executed(proc.stderr)) == ["Compile //pkg:c [batch=1, seq=4] for trn2",
                                             "Compile //pkg:c [batch=2, seq=4] for trn2"]
    assert len([w for w in warnings(proc.stderr) if "corrupt" in w and "local" in w]) == 2
    outputs_match_cache(ws, local)
    v = verify(local)
    assert v.returncode == 0 and "verified: ok" in v.stdout, v.stdout + v.stderr


def test_corrupt_local_blob_is_refetched_from_the_shared_tier(populated: tuple[Path, Path], ws: Path,
                                                              tmp_path: Path) -> None:
    local = copy_cache(populated[0], tmp_path / "local")
    flip_byte(blob(local, C1))
    proc = build(ws, local, "--remote-cache", str(populated[1]), "--remote-cache-readonly")
    assert executed(proc.stderr) == []
    assert len(warnings(proc.stderr)) == 1 and "corrupt" in warnings(proc.stderr)[0]
    outputs_match_cache(ws, local)


def test_corrupt_shared_blobs_are_not_served_and_are_rebuilt_and_reuploaded(populated: tuple[Path, Path], ws: Path,
                                                                            tmp_path: Path) -> None:
    shared = copy_cache(populated[1], tmp_path / "shared")
    flip_byte(blob(shared, C1))
    truncate(blob(shared, C2))
    bad = verify(tmp_path / "empty", "--remote-cache", str(shared))
    assert bad.returncode == 1 and bad.stdout.count("corrupt-blob") == 2, bad.stdout
    proc = build(ws, tmp_path / "local", "--remote-cache", str(shared))
    assert sorted(executed(proc.stderr)) == ["Compile //pkg:c [batch=1, seq=4] for trn2",
                                             "Compile //pkg:c [batch=2, seq=4] for trn2"]
    assert len([w for w in warnings(proc.stderr) if "is corrupt" in w and "shared cache" in w]) == 2
    outputs_match_cache(ws, tmp_path / "local")
    v = verify(tmp_path / "local", "--remote-cache", str(shared))
    assert v.returncode == 0 and v.stdout.count("verified: ok") == 2, v.stdout + v.stderr


def test_missing_shared_directory_costs_one_warning(populated: tuple[Path, Path], ws: Path, tmp_path: Path) -> None:
    local = copy_cache(populated[0], tmp_path / "local")
    os.unlink(local / "v1" / "ac" / entries(local)[C1]["fingerprint"][:2] / f"{entries(local)[C1]['fingerprint']}.json")
    proc = build(ws, local, "--remote-cache", str(tmp_path / "no" / "such" / "dir"))
    assert executed(proc.stderr) == ["Compile //pkg:c [batch=1, seq=4] for trn2"]
    assert len(warnings(proc.stderr)) == 1 and "unavailable" in warnings(proc.stderr)[0], proc.stderr
    assert not (tmp_path / "no").exists()


# -- S3 -----------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def s3_url(s3_endpoint: str) -> str:  # (conftest's moto server, one per module)
    return s3_endpoint


def s3_client(endpoint: str) -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                        region_name="us-east-1")


def upload_dir(client: Any, bucket: str, prefix: str, shared: Path) -> None:
    for p in (shared / "v1").rglob("*"):
        rel = p.relative_to(shared).as_posix()
        if p.is_file() and rel.split("/")[1] in ("ac", "cas"):
            client.upload_file(str(p), bucket, f"{prefix}/{rel}")


def test_s3_tier_serves_hits_and_corrupt_objects_are_rebuilt(populated: tuple[Path, Path], ws: Path, tmp_path: Path,
                                                           s3_url: str) -> None:
    client = s3_client(s3_url)
    client.create_bucket(Bucket="team")
    upload_dir(client, "team", "nb/cache", populated[1])
    remote = ("--remote-cache", "s3://team/nb/cache", "--s3-endpoint-url", s3_url, "--remote-cache-trust-writers")
    proc = build(ws, tmp_path / "l1", *remote)
    assert "7 actions: 0 executed, 7 cached" in proc.stdout and warnings(proc.stderr) == []
    outputs_match_cache(ws, tmp_path / "l1")

    def key(identity: str) -> str:
        digest = entries(populated[1])[identity]["outputs"]["compile_flags.json"]["digest"]
        return f"nb/cache/v1/cas/{digest[:2]}/{digest}"

    data = bytearray(client.get_object(Bucket="team", Key=key(C1))["Body"].read())
    data[100] ^= 0x01
    client.put_object(Bucket="team", Key=key(C1), Body=bytes(data))
    data = client.get_object(Bucket="team", Key=key(C2))["Body"].read()
    client.put_object(Bucket="team", Key=key(C2), Body=data[:-10])
    bad = verify(tmp_path / "none", *remote)
    assert bad.returncode == 1 and bad.stdout.count("corrupt-blob") == 2, bad.stdout + bad.stderr
    proc = build(ws, tmp_path / "l2", *remote)
    assert sorted(executed(proc.stderr)) == ["Compile //pkg:c [batch=1, seq=4] for trn2",
                                             "Compile //pkg:c [batch=2, seq=4] for trn2"]
    assert len([w for w in warnings(proc.stderr) if "corrupt" in w and "shared" in w]) == 2, proc.stderr
    outputs_match_cache(ws, tmp_path / "l2")
    v = verify(tmp_path / "l2", *remote)  # the rebuilt results were uploaded over the evicted objects
    assert v.returncode == 0 and v.stdout.count("verified: ok") == 2, v.stdout + v.stderr
    proc = build(ws, tmp_path / "l3", *remote)
    assert "0 executed" in proc.stdout


def test_dead_s3_endpoint_costs_one_warning(populated: tuple[Path, Path], ws: Path, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    local = copy_cache(populated[0], tmp_path / "local")
    fp = entries(local)[C2]["fingerprint"]
    os.unlink(local / "v1" / "ac" / fp[:2] / f"{fp}.json")
    proc = build(ws, local, "--remote-cache", "s3://team/x", "--s3-endpoint-url", f"http://127.0.0.1:{port}")
    assert executed(proc.stderr) == ["Compile //pkg:c [batch=2, seq=4] for trn2"]
    assert len(warnings(proc.stderr)) == 1 and "unavailable" in warnings(proc.stderr)[0], proc.stderr


@pytest.mark.parametrize("listing_after", [0, 512])  # (0: every pass through the shard listings)
@pytest.mark.parametrize("tier", ["dir", "s3"])
def test_a_plans_probe_of_a_tiered_cache_finds_exactly_the_entries_a_lookup_takes(
        tier: str, listing_after: int, tmp_path: Path, request: pytest.FixtureRequest,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import uuid

    from neuronbuild.cache.action_cache import ActionCache
    from neuronbuild.cache.local import LocalCache
    from neuronbuild.cache.tiered import TieredCache, open_shared
    from neuronbuild.digests import fingerprint

    monkeypatch.setattr(ActionCache, "LISTING_AFTER", listing_after)
    local, shared = LocalCache(tmp_path / "local"), LocalCache(tmp_path / "shared")
    out = tmp_path / "out"
    out.mkdir()
    records = {fingerprint(r): r for r in ({"action": i} for i in range(40))}  # (records that re-derive)
    fps = list(records)

    def store(cache: LocalCache, fp: str) -> str:
        (out / "o").write_text(fp)  # (one blob per entry)
        return cache.store_outputs(fp, f"compile {fp[-4:]}", records[fp], out, ["o"], 1.0, {}).outputs["o"].digest

    for fp in fps[0::5]:
        store(local, fp)  # local only
    for fp in fps[1::5]:
        store(shared, fp)  # shared only
    for fp in fps[2::5]:
        store(shared, fp)
        local.blobs.evict(store(local, fp))  # both, the local blob lost: the shared one serves
    for fp in fps[3::5]:
        shared.blobs.evict(store(shared, fp))  # shared record without its blob
    mislabelled = fps[4]  # a shared record of another action filed under this one's name
    (shared.root / "ac" / mislabelled[:2]).mkdir(exist_ok=True)
    shutil.copyfile(shared.actions.path(fps[1]), shared.actions.path(mislabelled))
    url = str(tmp_path / "shared")
    if tier == "s3":
        endpoint = request.getfixturevalue("s3_url")
        for k, v in AWS_ENV.items():
            monkeypatch.setenv(k, v)
        bucket = f"probe-{uuid.uuid4().hex[:12]}"
        s3_client(endpoint).create_bucket(Bucket=bucket)
        upload_dir(s3_client(endpoint), bucket, "nb", tmp_path / "shared")
        url = f"s3://{bucket}/nb"

    def tiered() -> TieredCache:
        return TieredCache(tmp_path / "local", open_shared(url, endpoint if tier == "s3" else None))

    want = {*fps[0::5], *fps[1::5], *fps[2::5]}
    assert tiered().peek_many(fps) == want
    assert {fp for fp in fps if tiered().peek(fp)} == want
    cache = tiered()
    assert {fp for fp in fps if cache.lookup(fp) is not None} == want  # (copies the shared entries down)
    assert cache.peek_many(fps) == want and cache.stats.errors == 0


# -- gc, pins, failures ----------------------------------------------------------------------------------------------
def test_gc_under_a_size_cap_keeps_referenced_and_pinned_entries(populated: tuple[Path, Path], ws: Path,
                                                                 tmp_path: Path) -> None:
    local = copy_cache(populated[0], tmp_path / "local")
    env = {"NEURONBUILD_CACHE_GC_GRACE_S": "0"}
    # Only a workspace whose targets are //pkg:c has built into this cache (the populating workspace's build roots are
    # dropped): c2's three actions are referenced by no workspace's last successful build (the weights action is c's
    # too).
    shutil.rmtree(local / "v1" / "roots")
    small = write_ws(tmp_path / "small", {"pkg/m.py": MODEL, "pkg/BUILD": BUILD.split("neuron_compile(name = \"c2\"")[0]})
    assert "0 executed, 7 cached" in build(small, local).stdout
    before = entries(local)
    gc = run_cli(["cache", "gc", "--max-size", "1", "--cache-dir", str(local)], small, env=env)
    assert gc.returncode == 0, gc.stdout + gc.stderr
    assert "removed 3 of 10 entries" in gc.stdout and "kept 7 referenced" in gc.stdout, gc.stdout
    after = entries(local)
    assert set(after) == {k for k in before if "batch=3" not in k}
    assert verify(local).returncode == 0
    proc = build(small, local)
    assert "0 executed" in proc.stdout

    # Pins protect entries that no current target references; unpinning lets gc take them.
    local2 = copy_cache(populated[0], tmp_path / "local2")
    pin = run_cli(["cache", "pin", "release-1", "//pkg:c2", "--cache-dir", str(local2)], ws)
    assert pin.returncode == 0, pin.stderr
    pin_file = local2 / "v1" / "pins" / "release-1.json"
    assert len(json.loads(pin_file.read_text())["fingerprints"]) == 4  # + the weights action
    gc = run_cli(["cache", "gc", "--max-size", "1", "--cache-dir", str(local2)], small, env=env)
    assert "removed 0 of 10 entries" in gc.stdout, gc.stdout
    assert run_cli(["cache", "unpin", "release-1", "--cache-dir", str(local2)], ws).returncode == 0
    gc = run_cli(["cache", "gc", "--max-size", "1", "--no-workspace", "--cache-dir", str(local2)], small, env=env)
    assert "removed 10 of 10 entries" in gc.stdout, gc.stdout
    assert not list((local2 / "v1" / "cas").glob("*/*"))


def test_failed_action_is_recorded_but_retried(ws: Path, tmp_path: Path) -> None:
    flag = tmp_path / "fail-now"
    flag.write_text("")
    fws = write_ws(tmp_path / "fws", {"pkg/m.py": MODEL, "pkg/BUILD": BUILD.replace(
        'entry = "m:build",', f'entry = "m:build", config = {{"fail_if": "{flag}"}},')})
    cache = tmp_path / "cache"
    proc = run_cli(["build", "//pkg:c2", "--cache-dir", str(cache)], fws)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    failures = list((cache / "v1" / "failures").glob("*/*.json"))
    assert 1 <= len(failures) <= 2  # the trace, and the weights action when it started before the build stopped
    for f in failures:
        rec = json.loads(f.read_text())
        assert "transient failure" in rec["error"] + rec["log"] and rec["toolchain"]["torch"]
    flag.unlink()
    proc = run_cli(["build", "//pkg:c2", "--cache-dir", str(cache)], fws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4 executed" in proc.stdout  # retried, not replayed (the weights action, trace, lower, compile)
    assert not list((cache / "v1" / "failures").glob("*/*.json"))
