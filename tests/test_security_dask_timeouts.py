"""Per-action timeouts on the Dask executor: `--action-timeout` and a target's `timeout =` fail an action running on a
real Dask worker (127.0.0.1) as they do locally, killing it and every process it started; the worker serves on."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_farm import Farm, _dask_build
from test_security_hangs import build_watching, child_name, model_ws, none_left


@pytest.fixture()
def farm(tmp_path: Path) -> Iterator[Farm]:
    f = Farm(tmp_path)
    try:
        f.add_worker()
        yield f
    finally:
        f.close()


def _build(ws: Path, farm: Farm, tmp: Path, name: str, *extra: str
           ) -> tuple[subprocess.CompletedProcess[str], float, bool]:
    return build_watching([*_dask_build(ws, farm, tmp), "//pkg:all", *extra], ws, name, {"NEURONX_CC": ""})


def test_timeouts_end_actions_on_dask_workers_and_kill_their_processes(farm: Farm, tmp_path: Path) -> None:
    name = child_name(tmp_path, "hang")  # a model that forks a child (which sleeps 600 s) and then hangs
    ws = model_ws(tmp_path / "ws", name, "hang")
    # The clock starts when the worker process is ready (its torch import is not counted): a few seconds are enough
    # for the model to reach its fork and hang.
    proc, took, seen = _build(ws, farm, tmp_path, name, "--action-timeout", "8")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "timed out after 8 s (--action-timeout)" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and took < 120 and seen
    assert none_left(name), "the action's forked child outlived its timeout"
    assert farm.workers[0].poll() is None  # the Dask worker itself lives on
    assert not list((tmp_path / "shared" / "v1" / "ac").rglob("*.json"))  # nothing cached for a timed-out action

    # A target's `timeout =` overrides the flag for its actions, on the farm as locally; the same worker runs it.
    ws2 = model_ws(tmp_path / "ws2", name, "hang", ", timeout = 6")
    proc, took, seen = _build(ws2, farm, tmp_path, name, "--action-timeout", "600")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "timed out after 6 s (timeout = 6 on //pkg:c)" in proc.stderr, proc.stderr
    assert took < 120 and seen
    assert none_left(name)
