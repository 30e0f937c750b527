"""Per-action timeouts on the Dask executor: `--action-timeout` and a target's `timeout =` fail an action running on a
real Dask worker (127.0.0.1) as they do locally, killing it and every process it started; the worker serves on."""

from __future__ import annotations

import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import run_cli, write_ws
from test_farm import Farm, _dask_build
from test_security_hangs import MODEL, _gone

from neuronbuild.execution.dask_executor import _farm_base


@pytest.fixture()
def farm(tmp_path: Path) -> Iterator[Farm]:
    f = Farm(tmp_path)
    try:
        f.add_worker()
        yield f
    finally:
        f.close()


def _ws(root: Path, pidfile: str, compile_attrs: str = "") -> Path:
    """A model that forks a child (which sleeps 600 s) and then hangs: only a timeout ends its action."""
    build = (f'neuron_model(name = "m", srcs = ["m.py"], entry = "m:build", inputs = {{"x": "float32[b, n]"}},\n'
             f'             config = {{"pidfile": "{pidfile}", "mode": "hang"}})\n'
             'neuron_buckets(name = "bk", shapes = [{"b": 1, "n": 4}])\n'
             'neuron_target(name = "t", platform = "trn2")\n'
             f'neuron_compile(name = "c", model = ":m", buckets = [":bk"], target = ":t"{compile_attrs})\n')
    return write_ws(root, {"pkg/BUILD": build, "pkg/m.py": MODEL})


def _child_pid(pidfile: str) -> int:
    # The farm's actions get $TMPDIR = <farm base>/toolchain-tmp (the model writes its child's pid there).
    p = _farm_base() / "toolchain-tmp" / pidfile
    pid = int(p.read_text())
    p.unlink()
    return pid


def _build(ws: Path, farm: Farm, tmp: Path, *extra: str) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    proc = run_cli([*_dask_build(ws, farm, tmp), "//pkg:all", *extra], ws, {"NEURONX_CC": ""})
    return proc, time.monotonic() - start


def test_timeouts_end_actions_on_dask_workers_and_kill_their_processes(farm: Farm, tmp_path: Path) -> None:
    pidfile = f"dask-timeout-{uuid.uuid4().hex[:8]}.pid"
    ws = _ws(tmp_path / "ws", pidfile)
    # The clock starts when the worker process is ready (its torch import is not counted): a few seconds are enough
    # for the model to reach its fork and hang.
    proc, took = _build(ws, farm, tmp_path, "--action-timeout", "8")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "timed out after 8 s (--action-timeout)" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and took < 120
    assert _gone(_child_pid(pidfile)), "the action's forked child outlived its timeout"
    assert farm.workers[0].poll() is None  # the Dask worker itself lives on
    assert not list((tmp_path / "shared" / "v1" / "ac").rglob("*.json"))  # nothing cached for a timed-out action

    # A target's `timeout =` overrides the flag for its actions, on the farm as locally; the same worker runs it.
    ws2 = _ws(tmp_path / "ws2", pidfile, ", timeout = 6")
    proc, took = _build(ws2, farm, tmp_path, "--action-timeout", "600")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "timed out after 6 s (timeout = 6 on //pkg:c)" in proc.stderr, proc.stderr
    assert took < 120
    assert _gone(_child_pid(pidfile))
