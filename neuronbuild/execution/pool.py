"""A pool of long-lived worker processes that survives the death of any one of them.

Each worker is a fresh interpreter (like multiprocessing's spawn, but started with subprocess so it also works inside
daemonic processes such as Dask workers) in its own session: a terminal's Ctrl-C reaches only the build, which then
ends the workers and their compilers as a group. Torch is imported in the workers, never in the pool's process."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import neuronbuild

# The package's parent directory, so the worker imports this very neuronbuild (as spawn would, via sys.path).
_PKG_PARENT = str(Path(neuronbuild.__file__).resolve().parent.parent)
_BOOT = ("import sys; sys.path.insert(0, sys.argv[1]); "
         "from neuronbuild.execution.worker import main; main(int(sys.argv[2]), int(sys.argv[3]))")
# A task sent to a worker still starting (importing torch) gets this much time for the start on top of its timeout:
# the timeout is the action's own, but a start that hangs must still end.
_START_GRACE = 300.0


@dataclass(frozen=True)
class TaskResult:
    """What a worker sent back for one task, or a stand-in when the worker died running it."""

    task_id: str
    slot: int
    pid: int
    result: dict[str, Any]

    @property
    def worker_died(self) -> bool:
        return bool(self.result.get("worker_died"))


class WorkerProcess:
    """One worker: a subprocess plus the two pipes its tasks and results travel on."""

    def __init__(self, slot: int, env: dict[str, str], cwd: Path, stderr_path: Path | None = None) -> None:
        self.slot = slot
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        cwd.mkdir(parents=True, exist_ok=True)
        err: Any = subprocess.DEVNULL
        if stderr_path is not None:
            stderr_path.parent.mkdir(parents=True, exist_ok=True)
            err = open(stderr_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT, _PKG_PARENT, str(to_child_r), str(from_child_w), "neuronbuild-worker"],
                pass_fds=(to_child_r, from_child_w), env=env, cwd=cwd, start_new_session=True,
                stdin=subprocess.DEVNULL, stdout=err, stderr=err,
            )
        finally:
            os.close(to_child_r)
            os.close(from_child_w)
            if err is not subprocess.DEVNULL:
                err.close()
        self.to_child = Connection(to_child_w, readable=False)
        self.from_child = Connection(from_child_r, writable=False)
        # Readable when the worker exits, even if a process it forked still holds the result pipe open.
        self.pidfd: int | None = None
        with contextlib.suppress(AttributeError, OSError):
            self.pidfd = os.pidfd_open(self.proc.pid)
        self.task: str | None = None
        self.started = 0.0
        self.timeout = 0.0  # the running task's limit in seconds (0: none)
        self.timeout_source = ""
        self.ready = False  # warm (imports done): a task's timeout clock runs from then (see deadline)

    def deadline(self) -> float:
        """When the running task times out: `timeout` after it was sent, or after the worker became ready when it
        was sent to a worker still importing torch (plus _START_GRACE while that lasts, so a hung start ends too)."""
        return self.started + self.timeout + (0.0 if self.ready else _START_GRACE)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, task_id: str, msg: dict[str, Any], timeout: float = 0.0, source: str = "") -> None:
        self.task = task_id
        self.started = time.time()
        self.timeout, self.timeout_source = timeout, source
        self.to_child.send(msg)

    def kill(self) -> None:
        """End the worker and everything it started (its session's process group)."""
        if self.proc.poll() is not None:  # exited (and reaped) already: its group id may no longer be ours
            self.close()
            return
        with contextlib.suppress(OSError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self.close()

    def close(self) -> None:
        for c in (self.to_child, self.from_child):
            with contextlib.suppress(OSError):
                c.close()
        if self.pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self.pidfd)
            self.pidfd = None


class WorkerPool:
    """Up to `size` workers, each running one task at a time; a dead worker fails only its task and is replaced."""

    def __init__(self, size: int, env: dict[str, str], cwd: Path, stderr_path: Path | None = None,
                 action_timeout: float = 0.0) -> None:
        self.size = max(1, size)
        self.action_timeout = action_timeout  # seconds; 0: none
        self._env = env
        self._cwd = cwd
        self._stderr = stderr_path
        self._workers: dict[int, WorkerProcess] = {}

    def warm(self, n: int) -> None:
        """Start up to n workers now, so their torch import overlaps with the build's other work."""
        for slot in range(min(n, self.size)):
            if slot not in self._workers:
                self._workers[slot] = WorkerProcess(slot, self._env, self._cwd, self._stderr)

    def idle_slot(self) -> int | None:
        for slot in range(self.size):
            w = self._workers.get(slot)
            if w is None or w.task is None:
                return slot
        return None

    @property
    def busy(self) -> int:
        return sum(1 for w in self._workers.values() if w.task is not None)

    def submit(self, task_id: str, msg: dict[str, Any], timeout: float | None = None,
               timeout_source: str = "") -> tuple[int, int]:
        """Hand a task to an idle worker (starting one if needed); returns (slot, pid). `timeout` (seconds, from a
        target's `timeout` attribute, named by `timeout_source`) replaces the pool's action timeout for this task."""
        slot = self.idle_slot()
        if slot is None:
            raise RuntimeError("no idle worker")
        w = self._workers.get(slot)
        if w is None or w.proc.poll() is not None:
            if w is not None:
                w.close()
            w = self._workers[slot] = WorkerProcess(slot, self._env, self._cwd, self._stderr)
        limit, source = (timeout, timeout_source) if timeout else (self.action_timeout, "--action-timeout")
        try:
            w.send(task_id, msg, limit, source)
        except OSError:  # it died since: the next wait() reports the task as failed
            w.task, w.started, w.timeout, w.timeout_source = task_id, time.time(), limit, source
        return slot, w.pid

    def wait(self, timeout: float | None) -> list[TaskResult]:
        """Results of tasks that finished, whose worker died, or that ran past the action timeout, within
        `timeout` seconds."""
        now = time.time()
        for w in self._workers.values():
            if w.task is not None and w.timeout > 0:
                left = max(0.0, w.deadline() - now)
                timeout = left if timeout is None else min(timeout, left)
        handles: dict[Any, WorkerProcess] = {}
        for w in self._workers.values():
            handles[w.from_child] = w
            if w.pidfd is not None:
                handles[w.pidfd] = w
        if not handles:
            if timeout:
                time.sleep(timeout)
            return []
        out: list[TaskResult] = []
        done: set[int] = set()
        for h in wait(list(handles), timeout):
            w = handles[h]
            if w.slot in done or self._workers.get(w.slot) is not w:
                continue
            if h is not w.from_child and not self._has_message(w):
                done.add(w.slot)
                self._dead(w, out)  # exited; whatever holds its pipe (a forked child) is ended with its group
                continue
            try:
                msg = w.from_child.recv()
            except (EOFError, OSError):
                done.add(w.slot)
                self._dead(w, out)
                continue
            if "ready" in msg:
                w.ready = True
                if w.task is not None:  # sent before the worker was warm: its clock starts now
                    w.started = time.time()
                continue
            task, w.task = w.task, None
            if task is not None:
                out.append(TaskResult(task, w.slot, w.pid, msg))
        now = time.time()
        for w in list(self._workers.values()):
            if w.task is not None and w.timeout > 0 and now >= w.deadline():
                task, started = w.task, w.started
                w.kill()
                del self._workers[w.slot]
                out.append(TaskResult(task, w.slot, w.pid, {
                    "ok": False, "timed_out": True, "duration_s": now - started, "pid": w.pid,
                    "error": f"timed out after {w.timeout:g} s ({w.timeout_source}); the action and every "
                             "process it started were killed"}))
        return out

    @staticmethod
    def _has_message(w: WorkerProcess) -> bool:
        try:
            return bool(w.from_child.poll(0))
        except (EOFError, OSError):
            return True  # recv() will report EOF

    def _dead(self, w: WorkerProcess, out: list[TaskResult]) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            w.proc.wait(timeout=5)
        with contextlib.suppress(OSError):
            os.killpg(w.proc.pid, signal.SIGKILL)  # compilers or forked children it left behind
        w.close()
        del self._workers[w.slot]
        if w.task is not None:
            from neuronbuild.execution.worker import death_message  # (worker.py's own, for the action's child)

            out.append(TaskResult(w.task, w.slot, w.pid, {
                "ok": False, "worker_died": True, "error": death_message(w.proc.returncode),
                "duration_s": time.time() - w.started, "pid": w.pid}))

    def kill_all(self) -> None:
        for w in list(self._workers.values()):
            w.kill()
        self._workers.clear()

    def shutdown(self) -> None:
        """Stop idle workers politely (all at once) and kill busy ones."""
        idle = [w for w in self._workers.values() if w.task is None]
        for w in idle:
            with contextlib.suppress(OSError, ValueError):
                w.to_child.send(None)
        deadline = time.monotonic() + 5.0
        for w in idle:
            with contextlib.suppress(subprocess.TimeoutExpired):
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        for w in self._workers.values():
            w.kill()  # a no-op for workers that exited
        self._workers.clear()

    def pids(self) -> list[int]:
        return [w.pid for w in self._workers.values()]
