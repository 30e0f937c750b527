"""A corrupt action record in a (shared) cache is a miss for builds and is reported and repaired by `cache verify`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from helpers import _ENV_AT_START, run_cli, write_ws

MODEL = '''import torch


def build(config):
    return torch.nn.Linear(4, 2)
'''
BUILD = '''neuron_model(name = "m", srcs = ["m.py"], entry = "m:build", inputs = {"x": "float32[b, n]"})
neuron_buckets(name = "bk", shapes = [{"b": 1, "n": 4}])
neuron_target(name = "t", platform = "trn2")
neuron_compile(name = "c", model = ":m", buckets = [":bk"], target = ":t")
'''
CORRUPT = {
    "outputs-a-string": b'{"version": 1, "fingerprint": "FP", "identity": "i", "outputs": "x", "record": {}, '
                        b'"duration_s": 0}',
    "deeply-nested": b'{"version": 1, "record": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
}


def test_corrupt_action_records_are_misses_and_verify_repairs_them(tmp_path: Path) -> None:
    ws = write_ws(tmp_path / "ws", {"pkg/BUILD": BUILD, "pkg/m.py": MODEL})
    cache = tmp_path / "cache"
    args = ["build", "//pkg:all", "--jobs", "1", "--cache-dir", str(cache)]
    first = run_cli(args, ws)
    assert first.returncode == 0, first.stderr
    records = sorted((cache / "v1" / "ac").glob("*/*.json"))
    assert len(records) >= 2
    n = len(records)

    def corrupt(data: bytes) -> None:
        for r in records:
            r.parent.mkdir(exist_ok=True)
            r.write_bytes(data.replace(b"FP", r.stem.encode()))

    for name, data in CORRUPT.items():
        corrupt(data)
        again = run_cli([*args[:-2], "--cache-dir", str(cache)], ws)
        assert again.returncode == 0, f"{name}: {again.stderr}"
        assert f"{n} executed" in again.stdout, again.stdout
        corrupt(data)
        v = run_cli(["cache", "verify", "--cache-dir", str(cache)], ws)
        assert v.returncode != 0 and "bad-record" in v.stdout + v.stderr, v.stdout + v.stderr
        assert "Traceback" not in v.stderr
        fixed = run_cli(["cache", "verify", "--repair", "--cache-dir", str(cache)], ws)
        assert "Traceback" not in fixed.stderr
        assert not any(r.exists() for r in records)
    rebuilt = run_cli(args, ws)  # after the repairs: every action again
    assert rebuilt.returncode == 0 and f"{n} executed" in rebuilt.stdout, rebuilt.stdout + rebuilt.stderr


def _build_in_umask(ws: Path, cache: Path, umask: str, *patterns: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k in _ENV_AT_START or not k.startswith("TORCHINDUCTOR_")}
    return subprocess.run(["sh", "-c", f'umask {umask}; exec "$0" -m neuronbuild "$@"', sys.executable, "build",
                           *patterns, "--jobs", "1", "--cache-dir", str(cache)], cwd=ws, env=env,
                          capture_output=True, text=True, timeout=1800)


def test_a_directory_where_a_blob_belongs_is_reported_and_repaired(tmp_path: Path) -> None:
    ws = write_ws(tmp_path / "ws", {"pkg/BUILD": BUILD, "pkg/m.py": MODEL})
    cache = tmp_path / "cache"
    assert run_cli(["build", "//pkg:all", "--jobs", "1", "--cache-dir", str(cache)], ws).returncode == 0
    blob = next(p for p in sorted((cache / "v1" / "cas").glob("*/*")) if len(p.name) == 64)
    blob.unlink()
    blob.mkdir()
    (blob / "junk").write_text("x")
    v = run_cli(["cache", "verify", "--cache-dir", str(cache)], ws)
    assert v.returncode != 0 and blob.name[:16] in v.stdout + v.stderr and "Traceback" not in v.stderr, v.stderr
    r = run_cli(["cache", "verify", "--repair", "--cache-dir", str(cache)], ws)
    assert "Traceback" not in r.stderr and not blob.exists(), r.stdout + r.stderr
    again = run_cli(["build", "//pkg:all", "--jobs", "1", "--cache-dir", str(cache)], ws)
    assert again.returncode == 0 and blob.is_file(), again.stdout + again.stderr
    assert run_cli(["cache", "verify", "--cache-dir", str(cache)], ws).returncode == 0


def test_outputs_bundle_manifests_and_sha256_files_follow_the_umask(tmp_path: Path) -> None:
    build = BUILD + 'neuron_bundle(name = "rel", srcs = [":c"])\n'
    ws = write_ws(tmp_path / "ws", {"pkg/BUILD": build, "pkg/m.py": MODEL})
    proc = _build_in_umask(ws, tmp_path / "cache", "027", "//pkg:all")
    assert proc.returncode == 0, proc.stderr
    out = ws / "neuronbuild-out" / "pkg"
    files = [*sorted((out / "c").rglob("*.*")), out / "rel.tar.zst", out / "rel.manifest.json",
             out / "rel.tar.zst.sha256"]
    assert len(files) >= 5
    modes = {str(p.relative_to(out)): oct(p.stat().st_mode & 0o777) for p in files if p.is_file()}
    assert set(modes.values()) == {"0o640"}, modes


def test_a_read_only_cache_serves_a_fully_cached_build(tmp_path: Path) -> None:
    """A release cache mounted read-only (here: a read-only bind mount in a private mount namespace)."""
    import shutil

    import pytest

    ws = write_ws(tmp_path / "ws", {"pkg/BUILD": BUILD, "pkg/m.py": MODEL})
    cache = tmp_path / "cache"
    assert run_cli(["build", "//pkg:all", "--jobs", "1", "--cache-dir", str(cache)], ws).returncode == 0
    shutil.rmtree(ws / "neuronbuild-out")
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount --bind {cache} {cache} && "
                            f"mount -o remount,bind,ro {cache} && ! touch {cache}/probe"],
                           capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a read-only bind mount here (needs unshare -m as root): {probe.stderr.strip()}")
    env = {k: v for k, v in os.environ.items() if k in _ENV_AT_START or not k.startswith("TORCHINDUCTOR_")}
    script = (f"mount --bind {cache} {cache} && mount -o remount,bind,ro {cache} && "
              f'"$0" -m neuronbuild build //pkg:all --cache-dir {cache}')
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script, sys.executable], cwd=ws, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"0 executed, [1-9]\d* cached", proc.stdout), proc.stdout
    assert (ws / "neuronbuild-out" / "pkg" / "c" / "manifest.json").is_file()
    assert len(list((ws / "neuronbuild-out" / "pkg" / "c" / "b1_n4").iterdir())) >= 2


def test_unreadable_records_are_reported_not_counted_as_ok(tmp_path: Path) -> None:
    ws = write_ws(tmp_path / "ws", {"pkg/BUILD": BUILD, "pkg/m.py": MODEL})
    cache = tmp_path / "cache"
    assert run_cli(["build", "//pkg:all", "--jobs", "1", "--cache-dir", str(cache)], ws).returncode == 0
    for r in sorted((cache / "v1" / "ac").glob("*/*.json")):
        r.unlink()
        r.mkdir()  # unreadable as a file, whoever runs verify (root included)
    v = run_cli(["cache", "verify", "--cache-dir", str(cache)], ws)
    assert v.returncode != 0 and v.stdout.count("bad-record") >= 2, v.stdout + v.stderr
    assert "0 entries verified: ok" not in v.stdout
    r = run_cli(["cache", "verify", "--repair", "--cache-dir", str(cache)], ws)
    assert not list((cache / "v1" / "ac").glob("*/*.json")), r.stdout + r.stderr


def test_one_process_sees_records_replaced_and_blobs_damaged_after_it_checked_them(tmp_path: Path) -> None:
    """A build server keeps the records it parsed and the blobs it verified (by their stat keys) from one command to
    the next: a record another build replaced, and a blob damaged in place (same size), are seen as a batch build
    sees them."""
    import time

    from neuronbuild.cache.local import LocalCache

    fp = "ab" * 32
    out = tmp_path / "out"
    out.mkdir()

    def store(data: bytes) -> str:
        (out / "o.bin").write_bytes(data)
        res = LocalCache(tmp_path / "c").store_outputs(fp, "id", {"action": "test"}, out, ["o.bin"], 1.0, {})
        time.sleep(0.05)  # out of the racy window: the next lookups may keep what they read
        return res.outputs["o.bin"].digest

    first = store(b"first result")
    for _ in range(2):  # the second command of this process answers from what the first one kept
        res = LocalCache(tmp_path / "c").lookup(fp)
        assert res is not None and res.outputs["o.bin"].digest == first
    second = store(b"another result")  # another build ran the action again (a nondeterministic output)
    res = LocalCache(tmp_path / "c").lookup(fp)
    assert res is not None and res.outputs["o.bin"].digest == second
    blob = tmp_path / "c" / "v1" / "cas" / second[:2] / second
    blob.chmod(0o644)
    blob.write_bytes(b"anothe! result")  # same size, other bytes
    cache = LocalCache(tmp_path / "c", report=lambda msg: None)
    assert cache.lookup(fp) is None and not blob.exists()  # evicted: the action runs again


def test_a_record_this_process_touched_for_gc_is_not_parsed_again(tmp_path: Path, monkeypatch) -> None:
    """A hit on a record older than a minute touches it (its mtime: last use, for gc). The process that touched it
    keeps its parsed copy: the next build of a build server stats the record rather than parsing it again (a user
    building once a minute or less often would otherwise pay a re-parse of every record each time). A touch made by
    anyone else still makes it read again."""
    import time

    from neuronbuild.cache import local
    from neuronbuild.cache.action_cache import ActionResult
    from neuronbuild.cache.local import LocalCache

    parses = []
    real_from_json = ActionResult.from_json

    def counting(data: bytes) -> ActionResult:
        parses.append(1)
        return real_from_json(data)

    monkeypatch.setattr(ActionResult, "from_json", staticmethod(counting))
    fp = "cd" * 32
    out = tmp_path / "out"
    out.mkdir()
    (out / "o.bin").write_bytes(b"a result")
    stored = LocalCache(tmp_path / "c").store_outputs(fp, "id", {"action": "test"}, out, ["o.bin"], 1.0, {})
    record = tmp_path / "c" / "v1" / "ac" / fp[:2] / f"{fp}.json"
    old = time.time() - 3 * local.TOUCH_NS / 1e9
    os.utime(record, (old, old))  # last used three minutes ago
    time.sleep(0.05)  # out of the racy window of that change
    res = LocalCache(tmp_path / "c").lookup(fp)  # a build: parses the record, and touches it
    assert res is not None and res.outputs == stored.outputs and len(parses) == 1
    assert record.stat().st_mtime > old + 60  # touched: gc sees it used now
    for _ in range(2):  # the next builds of this process
        res = LocalCache(tmp_path / "c").lookup(fp)
        assert res is not None and res.outputs == stored.outputs
    assert len(parses) == 1
    os.utime(record, (old + 1, old + 1))  # another process's change of the file
    time.sleep(0.05)
    res = LocalCache(tmp_path / "c").lookup(fp)
    assert res is not None and res.outputs == stored.outputs and len(parses) == 2


def _two_records_one_copied_over_the_other(tmp_path: Path, cache: Path) -> tuple[list[str], Path, Path]:
    """Two genuine records in `cache`; then the second's copied to the first's place, its `fingerprint` field rewritten
    to match (well-formed, its blobs intact: checking fields and blobs finds nothing). (fingerprints, real, hostile)"""
    from neuronbuild.cache.action_cache import OutputRef
    from neuronbuild.cache.local import LocalCache
    from neuronbuild.digests import fingerprint

    local = LocalCache(cache)
    fps = []
    for i, text in enumerate(("the real program", "a hostile program")):
        out = tmp_path / f"out{i}"
        out.write_text(text)
        digest, size = local.put_file(out)
        record = {"kind": "compile", "model": f"//pkg:m{i}"}
        fps.append(fingerprint(record))
        local.record_outputs(fps[-1], f"//pkg:m{i}", record, {"model.neff": OutputRef(digest, size)}, 1.0, {})
    real, hostile = (cache / "v1" / "ac" / fp[:2] / f"{fp}.json" for fp in fps)
    real.write_bytes(hostile.read_bytes().replace(fps[1].encode(), fps[0].encode()))
    return fps, real, hostile


def test_verify_reports_a_record_whose_input_record_is_another_actions(tmp_path: Path) -> None:
    """`cache verify` re-derives each record's fingerprint from the input record it holds: a record copied to another
    action's place is reported and removed with --repair; the genuine one is kept."""
    cache = tmp_path / "cache"
    fps, real, hostile = _two_records_one_copied_over_the_other(tmp_path, cache)
    v = run_cli(["cache", "verify", "--cache-dir", str(cache)], tmp_path)
    assert v.returncode != 0, v.stdout + v.stderr
    assert f"bad-record {fps[0]}: its input record hashes to {fps[1][:16]}" in v.stdout, v.stdout
    assert v.stdout.count("bad-record") == 1, v.stdout
    r = run_cli(["cache", "verify", "--repair", "--cache-dir", str(cache)], tmp_path)
    assert not real.exists() and hostile.exists(), r.stdout + r.stderr


def test_a_shared_tier_record_holding_another_actions_input_record_is_not_served(tmp_path: Path) -> None:
    """A build reading a shared tier does not take a record copied to another action's place as that action's
    result (a miss, one warning); the genuine record is served."""
    from neuronbuild.cache.shared_fs import SharedDirTier
    from neuronbuild.cache.tiered import TieredCache

    shared = tmp_path / "shared"
    fps, _real, _hostile = _two_records_one_copied_over_the_other(tmp_path, shared)
    warnings: list[str] = []
    tiered = TieredCache(tmp_path / "local", SharedDirTier(shared), report=warnings.append)
    assert not tiered.peek(fps[0])
    assert tiered.lookup(fps[0]) is None
    assert any("holds another action's input record" in w for w in warnings), warnings
    genuine = tiered.lookup(fps[1])
    assert genuine is not None and genuine.identity == "//pkg:m1"
