"""The per-action timeout counts the action's own run: a task handed to a worker still importing torch is not killed
for the worker's start-up."""

from __future__ import annotations

import os
import time
from pathlib import Path

from neuronbuild.execution.pool import WorkerPool


def test_a_short_action_timeout_does_not_count_a_cold_workers_start(tmp_path: Path) -> None:
    pool = WorkerPool(1, dict(os.environ), tmp_path, action_timeout=0.5)
    try:
        sent = time.monotonic()
        # A warm-up of a toolchain that does not exist: run by the worker once it is ready, failing at once.
        pool.submit("t", {"kind": "warm_up", "spec": {"toolchain": "no-such-toolchain", "step": "warm_up", "key": "k"},
                          "inputs": str(tmp_path), "outputs": str(tmp_path), "log": str(tmp_path / "log")})
        results = []
        while not results and time.monotonic() - sent < 300:
            results = pool.wait(1.0)
        took = time.monotonic() - sent
    finally:
        pool.kill_all()
    assert took > 0.5  # the worker's start (torch and the toolchains imported) alone outlasts the timeout
    (res,) = results
    assert not res.result.get("timed_out"), res.result
    assert res.result.get("ok") is False and "worker_died" not in res.result, res.result
