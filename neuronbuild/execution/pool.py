"""A pool of long-lived worker processes that survives the death of any one of them.

Each worker runs in its own session: a terminal's Ctrl-C reaches only the build, which then ends the workers and their
compilers as a group. A pool of two or more workers forks them from one warm process, the zygote (zygote.py), so they
pay one torch import between them instead of one each; a one-worker pool (and any pool where the zygote cannot fork)
starts each worker as a fresh interpreter (like multiprocessing's spawn, but started with subprocess so it also works
inside daemonic processes such as Dask workers). Torch is imported in the workers and the zygote, never in the
pool's process."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import neuronbuild
from neuronbuild import envvars
from neuronbuild.execution import channel
from neuronbuild.execution import zygote as zy
from neuronbuild.execution.env import hide_process_environ
from neuronbuild.plugin_api.toolchain import is_warm_up

# The package's parent directory, so the worker imports this very neuronbuild (as spawn would, via sys.path).
_PKG_PARENT = str(Path(neuronbuild.__file__).resolve().parent.parent)
_BOOT = ("import os, sys; sys.path[:] = [p for p in sys.path if os.path.isabs(p)]; "
         "sys.path.insert(0, sys.argv[1]); "
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

    def __init__(self, slot: int, env: dict[str, str], cwd: Path, stderr_path: Path | None = None,
                 zygote: zy.Zygote | None = None) -> None:
        self.slot = slot
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        self.proc: Any = None  # subprocess.Popen, or zygote.ForkedProc for a worker forked from the zygote
        self.forked = False
        try:
            if zygote is not None:
                pid = zygote.fork(to_child_r, from_child_w, _START_GRACE)
                if pid is not None:
                    self.proc, self.forked = zy.ForkedProc(pid, zygote), True
            if self.proc is None:
                self.proc = zy.spawn(_BOOT, [_PKG_PARENT, str(to_child_r), str(from_child_w), "neuronbuild-worker"],
                                     (to_child_r, from_child_w), env, cwd, stderr_path)
        except BaseException:  # e.g. Ctrl-C while the zygote imports: a worker forked later reads EOF and exits
            os.close(to_child_w)
            os.close(from_child_r)
            raise
        finally:
            os.close(to_child_r)
            os.close(from_child_w)
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
        self.keys: set[str] = set(zygote.keys) if self.forked and zygote is not None else set()  # its warm-ups

    def returncode(self) -> int | None:
        """How it exited (None when a forked worker's status was not reported)."""
        if self.forked and not self.proc.status_known:
            return None
        return int(self.proc.returncode) if self.proc.returncode is not None else None

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
        channel.send(self.to_child, msg)

    def kill(self) -> None:
        """End the worker and everything it started (its session's process group)."""
        if self.proc.poll() is not None:  # exited (and reaped) already: its group id may no longer be ours
            self.close()
            return
        self.signal_kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self.close()

    def signal_kill(self) -> None:
        """SIGKILL the worker and everything it started (its session's process group), without waiting."""
        with contextlib.suppress(OSError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            self.proc.kill()

    def close(self) -> None:
        for c in (self.to_child, self.from_child):
            with contextlib.suppress(OSError):
                c.close()
        if self.pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self.pidfd)
            self.pidfd = None
        if self.forked:
            self.proc.close()


class WorkerPool:
    """Up to `size` workers, each running one task at a time; a dead worker fails only its task and is replaced."""

    def __init__(self, size: int, env: dict[str, str], cwd: Path, stderr_path: Path | None = None,
                 action_timeout: float = 0.0, use_zygote: bool | None = None) -> None:
        self.size = max(1, size)
        self.action_timeout = action_timeout  # seconds; 0: none
        self._env = env
        self._cwd = cwd
        self._stderr = stderr_path
        self._workers: dict[int, WorkerProcess] = {}
        # Forked workers from one zygote: for two or more workers (one worker would only add a process); off with
        # NEURONBUILD_ZYGOTE=0, and where pidfds are missing.
        if use_zygote is None:
            use_zygote = self.size >= 2
        self._use_zygote = use_zygote and envvars.current().flag("NEURONBUILD_ZYGOTE") and zy.supported()
        self._zygote: zy.Zygote | None = None
        # Toolchain warm-ups sent to the zygote between builds (warm_up_between): their results are no build's
        self._between: set[str] = set()
        hide_process_environ()  # before any action runs: /proc/<this pid>/environ shows nothing of ours

    def _zygote_now(self) -> zy.Zygote | None:
        """The zygote (started on first use, and again after it ended), or None when this pool spawns workers."""
        if not self._use_zygote:
            return None
        if self._zygote is not None and not self._zygote.alive():
            self._zygote.close()
            self._zygote = None
        if self._zygote is None:
            self._zygote = zy.Zygote(_PKG_PARENT, self._env, self._cwd, self._stderr)
        return self._zygote

    def _start(self, slot: int) -> WorkerProcess:
        z = self._zygote_now()
        if z is not None and z.warming:  # busy with a warm-up for seconds: a fresh interpreter starts sooner
            z = None
        return WorkerProcess(slot, self._env, self._cwd, self._stderr, z)

    @property
    def warms_apart(self) -> bool:
        """Toolchain warm-ups run in the zygote, beside the workers (not in a worker slot): every worker forked
        afterwards inherits them (submit; the scheduler holds back the steps needing one until it is done)."""
        return self._use_zygote

    def _submit_apart(self, task_id: str, msg: dict[str, Any]) -> tuple[int, int] | None:
        """A warm-up task in the zygote: every slot's worker is forked first (the zygote does one thing at a time, and
        the workers are wanted now, for the work that does not need the warm-up). Returns (-1, zygote pid)."""
        z = self._zygote_now()
        if z is None:
            return None
        for slot in range(self.size):
            if slot not in self._workers:
                self._workers[slot] = self._start(slot)
        if not z.warm_up(task_id, msg):
            return None
        return -1, z.pid

    def _refresh(self, w: WorkerProcess) -> None:
        """An idle worker that lacks a warm-up the zygote now holds (and holds none the zygote lacks, such as one it
        ran itself) is replaced by a fresh fork, which inherits it: cheaper than the worker warming up itself."""
        z = self._zygote
        if z is None or z.warming or not z.alive() or w.task is not None or not w.ready:
            return
        if not (z.keys - w.keys) or not (w.keys <= z.keys):
            return
        with contextlib.suppress(OSError, ValueError):
            channel.send(w.to_child, None)  # it exits at once (between tasks: nothing to clean up)
        w.close()
        del self._workers[w.slot]
        self._workers[w.slot] = self._start(w.slot)

    def warm(self, n: int) -> None:
        try:
            self._warm(n)
        except BaseException:  # interrupted while starting (Ctrl-C): nothing half-started is kept
            self.kill_all()
            raise

    def _warm(self, n: int) -> None:
        """Start up to n workers now, so their torch import overlaps with the build's other work. With a zygote, start
        it: it imports torch now, and the workers are forked from it when the first tasks come (a fork waits for the
        import to end, so starting them here would hold up the caller)."""
        z = self._zygote_now()
        if z is not None:
            z.drain()
            if not z.ready:
                return
        for slot in range(min(n, self.size)):
            if slot not in self._workers:
                self._workers[slot] = self._start(slot)

    def warm_up_between(self, task_id: str, msg: dict[str, Any]) -> bool:
        """Between builds (the build server, once a command has answered): a toolchain warm-up (a WARM_UP task
        message) in the ready zygote, so the workers forked afterwards, and the idle ones settle() replaces, inherit it.
        Its result is no build's (wait never returns it). False when there is no ready zygote, or a task runs."""
        z = self._zygote
        if z is None or not z.alive() or not z.ready or self.busy:
            return False
        if z.warm_up(task_id, msg):
            self._between.add(task_id)
            return True
        return False

    def zygote_ready(self) -> bool | None:
        """Whether the zygote has finished its imports (None: this pool has no live zygote)."""
        z = self._zygote
        if z is None or not z.alive():
            return None
        z.drain()
        return z.ready

    def zygote_keys(self) -> set[str]:
        """The toolchain warm-ups the zygote holds (worker.warm_key)."""
        return set(self._zygote.keys) if self._zygote is not None else set()

    def settle(self) -> bool:
        """Between builds: read the workers' ready messages and the zygote's results, and replace each idle worker that
        lacks a warm-up the zygote now holds by a fresh fork. True once nothing is left to do: no warm-up of
        warm_up_between still runs, and every worker is ready and holds what the zygote holds."""
        if self.busy:
            return True
        self.wait(0)
        z = self._zygote
        if z is None or not z.alive():
            return True
        if self._between & set(z.warming):
            return False
        for w in list(self._workers.values()):
            self._refresh(w)
        return all(w.ready and z.keys <= w.keys for w in self._workers.values())

    def zygote_pid(self) -> int | None:
        return self._zygote.pid if self._zygote is not None and self._zygote.alive() else None

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
        try:
            return self._submit(task_id, msg, timeout, timeout_source)
        except BaseException:  # interrupted while a worker started (Ctrl-C): nothing half-started is kept
            self.kill_all()
            raise

    def _submit(self, task_id: str, msg: dict[str, Any], timeout: float | None = None,
                timeout_source: str = "") -> tuple[int, int]:
        """Hand a task to an idle worker (starting one if needed); returns (slot, pid). `timeout` (seconds, from a
        target's `timeout` attribute, named by `timeout_source`) replaces the pool's action timeout for this task."""
        if self._use_zygote and is_warm_up(msg):
            apart = self._submit_apart(task_id, msg)
            if apart is not None:
                return apart
        slot = self.idle_slot()
        if slot is None:
            raise RuntimeError("no idle worker")
        w = self._workers.get(slot)
        if w is not None and self._zygote is not None and w.proc.poll() is None and w.ready:
            self._zygote.drain()  # the warm-ups it finished since the last wait()
            self._refresh(w)  # it was busy when the zygote's warm-up ended: a fresh fork has that warm-up
            w = self._workers[slot]
        if w is None or w.proc.poll() is not None:
            if w is not None:
                w.close()
            w = self._workers[slot] = self._start(slot)
        limit, source = (timeout, timeout_source) if timeout else (self.action_timeout, "--action-timeout")
        try:
            w.send(task_id, msg, limit, source)
        except OSError:  # it died since: the next wait() reports the task as failed
            w.task, w.started, w.timeout, w.timeout_source = task_id, time.time(), limit, source
        return slot, w.pid

    def wait(self, timeout: float | None, wake: int | None = None) -> list[TaskResult]:
        """Results of tasks that finished, whose worker died, or that ran past the action timeout, within
        `timeout` seconds; sooner (maybe with none) when file descriptor `wake` becomes readable (the caller drains
        it)."""
        now = time.time()
        for w in self._workers.values():
            if w.task is not None and w.timeout > 0:
                left = max(0.0, w.deadline() - now)
                timeout = left if timeout is None else min(timeout, left)
        handles: dict[Any, WorkerProcess | None] = {}
        for w in self._workers.values():
            handles[w.from_child] = w
            if w.pidfd is not None:
                handles[w.pidfd] = w
        z = self._zygote
        if z is not None and not z.closed:
            handles[z.sock] = None  # warm-up results and exit reports
        if wake is not None:
            handles[wake] = None
        if not handles:
            if timeout:
                time.sleep(timeout)
            return []
        out: list[TaskResult] = []
        done: set[int] = set()
        for h in wait(list(handles), timeout):
            found = handles[h]
            if found is None:
                continue
            w = found
            if w.slot in done or self._workers.get(w.slot) is not w:
                continue
            if h is not w.from_child and not self._has_message(w):
                done.add(w.slot)
                self._dead(w, out)  # exited; whatever holds its pipe (a forked child) is ended with its group
                continue
            try:
                msg = channel.recv(w.from_child)
                if msg is None:
                    raise channel.BadMessage("an empty message")
            except (EOFError, OSError):
                done.add(w.slot)
                self._dead(w, out)
                continue
            except channel.BadMessage as e:  # not a worker's message: its task fails, the worker is replaced
                done.add(w.slot)
                w.signal_kill()
                self._dead(w, out, f"its worker sent {e}")
                continue
            if "ready" in msg:
                w.ready = True
                if w.task is not None:  # sent before the worker was warm: its clock starts now
                    w.started = time.time()
                continue
            task, w.task = w.task, None
            w.keys = set(msg.get("warmed") or ()) | w.keys
            if task is not None:
                out.append(TaskResult(task, w.slot, w.pid, msg))
        out += self._zygote_results()
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

    def _zygote_results(self) -> list[TaskResult]:
        """Warm-ups the zygote finished (then idle workers lacking them are refreshed), or a warm-up lost with it."""
        z = self._zygote
        if z is None:
            return []
        z.drain()
        got = bool(z.results)
        out = [TaskResult(task, -1, z.pid, res) for task, res in z.results if task not in self._between]
        self._between.difference_update(task for task, _res in z.results)
        z.results.clear()
        now = time.time()
        limit = self.action_timeout
        if z.warming and (z.closed or (limit > 0 and any(now - t > limit + _START_GRACE for t in z.warming.values()))):
            error = ("the zygote process died" if z.closed else
                     f"timed out after {limit:g} s (--action-timeout); the zygote was killed")
            out += [TaskResult(task, -1, z.pid, {"ok": False, "error": error, "duration_s": now - t})
                    for task, t in z.warming.items()]
            z.warming.clear()
            self._close_zygote()
        lost = {r.task_id for r in out} & self._between  # (a warm-up between builds lost with the zygote)
        out = [r for r in out if r.task_id not in lost]
        self._between -= lost
        if out or got:
            for w in list(self._workers.values()):
                self._refresh(w)
        return out

    @staticmethod
    def _has_message(w: WorkerProcess) -> bool:
        try:
            return bool(w.from_child.poll(0))
        except (EOFError, OSError):
            return True  # recv() will report EOF

    def _dead(self, w: WorkerProcess, out: list[TaskResult], error: str | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            w.proc.wait(timeout=5)
        with contextlib.suppress(OSError):
            os.killpg(w.proc.pid, signal.SIGKILL)  # compilers or forked children it left behind
        w.close()
        del self._workers[w.slot]
        if w.task is not None:
            from neuronbuild.execution.worker import death_message  # (worker.py's own, for the action's child)

            out.append(TaskResult(w.task, w.slot, w.pid, {
                "ok": False, "worker_died": error is None, "error": error or death_message(w.returncode()),
                "duration_s": time.time() - w.started, "pid": w.pid}))

    def kill_task(self, task_id: str) -> bool:
        """End the worker running `task_id` (and everything it started); the next wait() reports the task as failed
        (its worker died) and a later task gets a fresh worker. A warm-up running in the zygote is left to finish
        (toolchain code only). False when no worker runs it."""
        for w in self._workers.values():
            if w.task == task_id:
                if w.proc.poll() is None:
                    w.signal_kill()
                return True
        return False

    def kill_all(self) -> None:
        for w in list(self._workers.values()):
            w.kill()
        self._workers.clear()
        self._close_zygote()

    def _close_zygote(self) -> None:
        if self._zygote is not None:
            self._zygote.close()
            self._zygote = None

    def shutdown(self) -> None:
        """Stop idle workers politely (all at once) and kill busy ones."""
        idle = [w for w in self._workers.values() if w.task is None]
        for w in idle:
            with contextlib.suppress(OSError, ValueError):
                channel.send(w.to_child, None)
        deadline = time.monotonic() + 5.0
        for w in idle:
            with contextlib.suppress(subprocess.TimeoutExpired):
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        for w in self._workers.values():
            w.kill()  # a no-op for workers that exited
        self._workers.clear()
        self._close_zygote()

    def pids(self) -> list[int]:
        """The pool's processes: its workers and its zygote (a warm process too, still importing at a build's start)."""
        z = self.zygote_pid()
        return [w.pid for w in self._workers.values()] + ([z] if z is not None else [])
