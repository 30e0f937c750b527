"""Every command sees the build as `build` sees it: the same fingerprints (--action-env, neuronx-cc) and cache tiers.

Regression tests for commands that used to compute their own settings or open only the local tier."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import run_cli
from introspect_ws import STANDIN, cli_json, tiny_ws

LABEL = "//m:tiny_trn2"


def _record_exists(cache: Path, fp: str) -> bool:
    return (cache / "v1" / "ac" / fp[:2] / f"{fp}.json").is_file()


def _entries(cache: Path) -> set[str]:
    return {p.stem for p in (cache / "v1" / "ac").glob("*/*.json")}


def _ok(proc) -> str:  # type: ignore[no-untyped-def]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return str(proc.stdout)


def test_pin_gc_and_validate_see_what_a_build_with_action_env_built(tmp_path: Path) -> None:
    ws, cache = tiny_ws(tmp_path / "ws"), tmp_path / "cache"
    env = {"NEURONX_CC": ""}
    _ok(run_cli(["build", "--cache-dir", str(cache), "--action-env", "FOO=1"], ws, env))
    built = _entries(cache)
    assert len(built) == 7  # the weights action + 2 buckets x (trace, lower, compile)

    # pin: exactly the 7 fingerprints the build stored (it used to pin fingerprints computed without FOO=1)
    out = _ok(run_cli(["cache", "pin", "rel", LABEL, "--cache-dir", str(cache)], ws, env))
    assert "pinned 7 actions" in out
    pin = json.loads((cache / "v1" / "pins" / "rel.json").read_text())
    assert set(pin["fingerprints"]) == built

    # gc under a 1-byte cap: the last successful build's actions are protected (pin removed to test roots alone)
    _ok(run_cli(["cache", "unpin", "rel", "--cache-dir", str(cache)], ws, env))
    out = _ok(run_cli(["cache", "gc", "--max-size", "1", "--cache-dir", str(cache)], ws, env))
    assert "protecting 7 actions" in out and "removed 0 of 7 entries" in out, out
    assert _entries(cache) == built

    # validate with the build's flags finds every graph (it used to say NOT BUILT)
    proc = run_cli(["validate", LABEL, "--cache-dir", str(cache), "--action-env", "FOO=1"], ws, env)
    assert "NOT BUILT" not in proc.stdout, proc.stdout
    assert proc.stdout.count(" ok") + proc.stdout.count("FAIL") == 2, proc.stdout

    # a workspace that no longer exists protects nothing: gc then frees the cache
    shutil.rmtree(ws)
    proc = run_cli(["cache", "gc", "--max-size", "1", "--cache-dir", str(cache)], tmp_path,
                   {**env, "NEURONBUILD_CACHE_GC_GRACE_S": "0"})
    assert "removed 7 of 7 entries" in _ok(proc)


@pytest.fixture(scope="module")
def shared_tier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A shared tier holding one build of the tiny workspace (NEURONX_CC unset: HLO modules, no NEFFs), as a team's
    shared cache would: the tests below start fresh machines from a copy of it instead of building cold."""
    root = tmp_path_factory.mktemp("context-shared")
    shared = root / "shared"
    shared.mkdir()
    _ok(run_cli(["build", "--cache-dir", str(root / "cache"), "--remote-cache", str(shared)], tiny_ws(root / "ws"),
                {"NEURONX_CC": ""}))
    return shared


def _tier(shared_tier: Path, tmp_path: Path) -> list[str]:
    copy = shutil.copytree(shared_tier, tmp_path / "shared")
    return ["--remote-cache", str(copy)]


def test_neuronx_cc_from_the_environment_is_seen_by_gc_and_validate(shared_tier: Path, tmp_path: Path) -> None:
    ws, cache = tiny_ws(tmp_path / "ws"), tmp_path / "cache"
    env = {"NEURONX_CC": str(STANDIN)}  # as on a host where neuronx-cc is installed: its compiles are new
    out = _ok(run_cli(["build", "--cache-dir", str(cache), *_tier(shared_tier, tmp_path)], ws, env))
    assert "2 executed, 5 cached" in out, out  # the weights, traces and lowerings came from the shared tier
    built = _entries(cache)
    assert len(built) == 7  # the weights action + 2 buckets x (trace, lower, compile)
    out = _ok(run_cli(["cache", "gc", "--max-size", "1", "--cache-dir", str(cache)], ws, env))
    assert "removed 0 of 7 entries" in out and _entries(cache) == built
    plan = cli_json(["plan", "--cache-dir", str(cache)], ws, env)
    assert plan["execute"] == [] and len(plan["cached"]) == 7
    proc = run_cli(["validate", LABEL, "--cache-dir", str(cache)], ws, env)
    assert "NOT BUILT" not in proc.stdout, proc.stdout


def test_plan_dry_run_and_explain_read_the_shared_tier(shared_tier: Path, tmp_path: Path) -> None:
    ws = tiny_ws(tmp_path / "ws")
    env = {"NEURONX_CC": ""}
    empty = tmp_path / "b"  # a fresh machine: empty local cache, the shared tier holds everything
    tier = ["--cache-dir", str(empty), *_tier(shared_tier, tmp_path)]
    plan = cli_json(["plan", *tier], ws, env)
    assert plan["execute"] == [], plan["execute"]
    assert "7 actions: 0 to execute, 7 cached" in _ok(run_cli(["build", "--dry-run", *tier], ws, env))
    assert "nothing would execute" in _ok(run_cli(["explain", *tier], ws, env))
    assert not _entries(empty)  # checking is not fetching
    out = _ok(run_cli(["build", *tier], ws, env))
    assert "0 executed, 7 cached" in out, out
    # without the tier, the same fresh cache would execute everything
    assert len(cli_json(["plan", "--cache-dir", str(tmp_path / "c")], ws, env)["execute"]) == 7


def test_a_deleted_target_stops_being_protected(shared_tier: Path, tmp_path: Path) -> None:
    ws, cache = tiny_ws(tmp_path / "ws"), tmp_path / "cache"
    env = {"NEURONX_CC": "", "NEURONBUILD_CACHE_GC_GRACE_S": "0"}
    tier = _tier(shared_tier, tmp_path)
    _ok(run_cli(["build", "--cache-dir", str(cache), *tier], ws, env))  # filled from the shared tier
    first = _entries(cache)
    assert len(first) == 7
    build_file = ws / "m" / "BUILD"  # rename the compile target and change its options: 2 new compiles, same traces and lowerings
    build_file.write_text(build_file.read_text().replace('name = "tiny_trn2"', 'name = "tiny_o3"')
                          .replace("opt_level = 2", "opt_level = 3"))
    _ok(run_cli(["build", "--cache-dir", str(cache), *tier], ws, env))
    assert len(_entries(cache)) == 9
    out = _ok(run_cli(["cache", "gc", "--max-size", "1", "--cache-dir", str(cache)], ws, env))
    assert "removed 2 of 9 entries" in out, out
    kept = _entries(cache)
    assert len(kept) == 7 and len(kept & first) == 5  # the shared weights, traces and lowerings stay; the old compiles go
