"""Local executor: a pool of long-lived worker processes (spawned, so torch is imported once per worker, never here)."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

from neuronbuild.execution.worker import init_worker, run_action


class LocalExecutor:
    """Runs actions in up to `jobs` worker processes that stay alive for the whole build."""

    def __init__(self, jobs: int, env: dict[str, str]) -> None:
        self.jobs = max(1, jobs)
        self._env = env
        self._pool: ProcessPoolExecutor | None = None

    def submit(self, kind: str, spec: dict[str, Any], inputs: str, outputs: str, log: str) -> Future[dict[str, Any]]:
        if self._pool is None:
            ctx = multiprocessing.get_context("spawn")
            self._pool = ProcessPoolExecutor(self.jobs, mp_context=ctx, initializer=init_worker,
                                             initargs=(self._env,))
        return self._pool.submit(run_action, kind, spec, inputs, outputs, log)

    def shutdown(self, cancel: bool = False) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=cancel)
            self._pool = None
