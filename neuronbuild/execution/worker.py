"""Code that runs inside worker processes: environment set-up and running one action's toolchain step."""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def init_worker(env: dict[str, str]) -> None:
    """Pool initializer: replace the inherited environment with the action allow-list."""
    os.environ.clear()
    os.environ.update(env)
    Path(env["TMPDIR"]).mkdir(parents=True, exist_ok=True)
    Path(env["HOME"]).mkdir(parents=True, exist_ok=True)


@contextlib.contextmanager
def _redirect_fds(log_path: str) -> Iterator[None]:
    """Send fd 1 and 2 (Python and C++ compiler output alike) to the action's log."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
        os.close(fd)


def run_action(kind: str, spec: dict[str, Any], inputs: str, outputs: str, log_path: str) -> dict[str, Any]:
    """Run a trace or compile in this process. Returns {"ok", "metadata"|"error", "duration_s", "pid"}."""
    start = time.perf_counter()
    cwd = os.getcwd()
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    try:
        with _redirect_fds(log_path):
            os.chdir(inputs)
            try:
                if kind == "trace":
                    from neuronbuild.toolchains.trace import run_trace

                    meta = run_trace(spec, Path(inputs), Path(outputs))
                else:
                    from neuronbuild.toolchains.compile import run_compile

                    meta = run_compile(spec, Path(inputs), Path(outputs))
            finally:
                os.chdir(cwd)
        return {"ok": True, "metadata": meta, "duration_s": time.perf_counter() - start, "pid": os.getpid()}
    except Exception as e:  # noqa: BLE001 - every failure is reported as the action's failure
        from neuronbuild.toolchains.errors import ToolchainError

        with open(log_path, "a", encoding="utf-8") as log:
            traceback.print_exc(file=log)
        msg = str(e) if isinstance(e, ToolchainError) else f"{type(e).__name__}: {e}"
        return {"ok": False, "error": msg.strip().splitlines()[0] if msg.strip() else type(e).__name__,
                "duration_s": time.perf_counter() - start, "pid": os.getpid()}
