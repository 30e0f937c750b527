"""The neuronx-cc hand-off against a stand-in that keeps neuronx-cc's command-line contract (tests/standins/neuronx-cc):
success (NEFF cached and materialised), failure (log shown, nothing cached) and a hang (killed at the timeout)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from helpers import run_cli
from introspect_ws import (
    STANDIN,
    cli_json,
    copy_ws,
    edit,
    tiny_built_fixture,  # noqa: F401  (registers the session fixture `tiny_built`)
)

from neuronbuild.toolchains.neuronx_cc import neuronx_cc_command

NO_CC = {"NEURONX_CC": ""}


def _setup(tiny_built: tuple[Path, Path], tmp_path: Path, mode: str | None = None) -> tuple[Path, Path]:
    """A copy of the tiny workspace cut to one bucket (optionally with a stand-in mode flag) and of its cache (the
    trace is cached, so a build runs one trn2 compile)."""
    ws0, cache0 = tiny_built
    ws, cache = copy_ws(ws0, tmp_path / "ws"), tmp_path / "cache"
    shutil.copytree(cache0, cache)
    edit(ws / "m/BUILD", '"seq": [8, 16]', '"seq": [8]')
    if mode:
        edit(ws / "m/BUILD", 'model_type = "transformer"', f'model_type = "transformer", flags = ["--standin-mode={mode}"]')
    return ws, cache


def _fps(ws: Path, cache: Path, *extra: str, env: dict[str, str] | None = None) -> dict[str, str]:
    out = cli_json(["plan", "--cache-dir", str(cache), *extra], ws, env)
    return {a["description"]: a["fingerprint"] for a in out["execute"]}


def test_command_line_contract() -> None:
    assert neuronx_cc_command("/opt/neuronx-cc", "trn2", {"opt_level": 3, "auto_cast": "matmult",
                                                         "model_type": "transformer", "flags": ["--foo=1"]}) == [
        "/opt/neuronx-cc", "compile", "--framework", "XLA", "lowered.pt2", "--target", "trn2", "--output",
        "model.neff", "--optlevel", "3", "--auto-cast", "matmult", "--model-type", "transformer", "--foo=1"]
    # The stand-in checks what the real CLI would reject.
    bad = subprocess.run([str(STANDIN), "compile", "--framework", "PT", "x.pt2", "--target", "trn2", "--output",
                          "m.neff"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--framework" in bad.stderr


def test_version_enters_compile_fingerprints_only(tiny_built, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ws, cache = tiny_built
    without = _fps(ws, tmp_path / "empty", env=NO_CC)
    with_cc = _fps(ws, tmp_path / "empty", "--neuronx-cc", str(STANDIN))
    via_env = _fps(ws, tmp_path / "empty", env={"NEURONX_CC": str(STANDIN)})
    newer = _fps(ws, tmp_path / "empty", env={"NEURONX_CC": str(STANDIN), "NEURONX_CC_STANDIN_VERSION": "3.0.1"})
    assert via_env == with_cc
    for other in (with_cc, newer):
        assert {k for k in without if without[k] != other[k]} == {k for k in without if k.startswith("Compile")}
    assert {k for k in with_cc if with_cc[k] != newer[k]} == {k for k in with_cc if k.startswith("Compile")}
    out = cli_json(["explain", "--cache-dir", str(cache)], ws, {"NEURONX_CC": str(STANDIN)})
    assert {tuple(c["text"] for c in a["changes"]) for a in out["execute"]} == {
        ("toolchain neuronx-cc: (unset) -> 2.99.0.0+standin",)}
    bad = run_cli(["plan", "--neuronx-cc", str(tmp_path / "missing")], ws)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--neuronx-cc" in bad.stderr


def test_without_neuronx_cc_the_build_says_once_that_no_neffs_were_produced(tiny_built, tmp_path) -> None:  # type: ignore[no-untyped-def]
    ws = copy_ws(tiny_built[0], tmp_path / "ws")
    proc = run_cli(["build", "--cache-dir", str(tmp_path / "cache")], ws, NO_CC)
    assert proc.returncode == 0 and " 4 executed" in proc.stdout
    assert proc.stderr.count("NEFFs were not produced") == 1
    assert not list((ws / "neuronbuild-out").rglob("*.neff"))


def test_success_stores_the_neff_and_logs_the_compiler(tiny_built, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ws, cache = _setup(tiny_built, tmp_path)
    proc = run_cli(["build", "--jobs", "2", "--cache-dir", str(cache), "--neuronx-cc", str(STANDIN)], ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 actions: 1 executed, 1 cached" in proc.stdout  # the trace is reused; only the compile ran
    assert "NEFFs were not produced" not in proc.stderr
    out = ws / "neuronbuild-out/m/tiny_trn2"
    manifest = json.loads((out / "manifest.json").read_text())
    assert [b["name"] for b in manifest["buckets"]] == ["batch1_seq8"]
    for b in manifest["buckets"]:
        assert set(b["outputs"]) == {"lowered.pt2", "compile_flags.json", "model.neff"}
        neff = (out / b["name"] / "model.neff").read_bytes()
        assert neff.startswith(b"NEFF\x00standin\n")
        body = json.loads(neff.split(b"\n", 1)[1])
        assert body["target"] == "trn2" and body["options"]["--optlevel"] == "2"
        assert body["options"]["--model-type"] == "transformer"
        log = (cache / "v1/logs" / b["fingerprint"][:2] / f"{b['fingerprint']}.log").read_text()
        assert "compile --framework XLA lowered.pt2 --target trn2 --output model.neff" in log
        assert "Compiler status PASS" in log and "# neuronx-cc: exit status 0" in log
    again = run_cli(["build", "--cache-dir", str(cache), "--neuronx-cc", str(STANDIN)], ws)
    assert " 0 executed" in again.stdout  # the NEFF came from the cache


def test_failure_shows_the_log_and_caches_nothing(tiny_built, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ws, cache = _setup(tiny_built, tmp_path, mode="fail")
    proc = run_cli(["build", "--jobs", "2", "--cache-dir", str(cache), "--neuronx-cc", str(STANDIN)], ws)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "neuronx-cc exited with status 1: ERROR 70: internal compiler error" in proc.stderr
    logs = re.findall(r"log: (\S+\.log)", proc.stderr)
    assert logs and "ERROR 70: internal compiler error" in Path(logs[0]).read_text()
    planned = cli_json(["plan", "--cache-dir", str(cache), "--neuronx-cc", str(STANDIN)], ws)
    statuses = {r["compile"]["status"] for t in planned["targets"] for r in t["buckets"]}
    assert statuses == {"build"}  # not cached as a success
    assert list((cache / "v1/failures").rglob("*.json"))  # kept for reports


def test_hang_is_killed_at_the_timeout(tiny_built, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ws, cache = _setup(tiny_built, tmp_path, mode="hang")
    start = time.monotonic()
    proc = run_cli(["build", "--jobs", "2", "--cache-dir", str(cache), "--neuronx-cc", str(STANDIN),
                    "--neuronx-cc-timeout", "2"], ws)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "neuronx-cc timed out after 2 s and was killed" in proc.stderr
    assert time.monotonic() - start < 600
    log = Path(re.findall(r"log: (\S+\.log)", proc.stderr)[0]).read_text()
    pid = int(re.search(r"\(pid (\d+)\)", log).group(1))  # type: ignore[union-attr]
    assert "killed after timeout" in log
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
