"""Local executor: actions run in sandboxes on this machine, in a pool of long-lived worker processes."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from neuronbuild import envvars
from neuronbuild.execution import sandbox as sandboxes
from neuronbuild.execution.cache_api import SpawnCache
from neuronbuild.execution.env import action_environment, with_threads, worker_threads
from neuronbuild.execution.jobs import Completion, Job, Started
from neuronbuild.execution.limits import LimitSettings, for_action
from neuronbuild.execution.pool import WorkerPool
from neuronbuild.plugin_api.actions import is_light


class Pools:
    """Where a command's builds get their worker pool (its session's, passed explicitly: command.Command.pools): a
    batch command makes a fresh pool per build and names none for later (this class); the build server's
    (server/warm.py WarmState) keeps one pool across commands and, while it keeps none, is told (`want`) the pool a
    local build would make after a command that made none (a build answered from its no-op stamp, a plan, a query),
    so it can start that pool's processes once the answer is sent."""

    wanting = False  # whether `want` is listened to (the server's, while it keeps no pool)

    def make(self, *args: Any, **kwargs: Any) -> WorkerPool:
        return WorkerPool(*args, **kwargs)

    def want(self, *args: Any, **kwargs: Any) -> None:
        return None


FRESH_POOLS = Pools()


def pool_args(cache: SpawnCache, jobs: int, env: dict[str, str],
              action_timeout: float = 0.0) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments of the worker pool a local build running `jobs` actions at once makes (LocalExecutor)."""
    slots = max(1, jobs)
    return ((slots, with_threads(env, worker_threads(slots)), cache.scratch, cache.logs / "workers.log",
             action_timeout), {"use_zygote": True})


def want_workers(pools: Pools, cache: Any, jobs: int, declared: Sequence[tuple[str, str | None]] = ()) -> None:
    """In the build server, after a command that made no worker pool (a build answered from its no-op stamp, a plan, a
    query): name the pool a local build running `jobs` actions with this cache (a LocalCache: its local paths only)
    and these declared --action-env values would make, so the server can start its processes once the answer is sent
    (server/warm.py). Nothing outside the server, or while it keeps a pool."""
    if not pools.wanting or not (os.path.isdir(cache.scratch) and os.path.isdir(cache.logs)):
        return  # (a cache that never ran an action: its first build makes the directories and starts the workers)
    env = action_environment(cache.toolchain_tmp, cache.root / "home", declared)
    args, kwargs = pool_args(cache, jobs, env)
    pools.want(*args, **kwargs)


class LocalExecutor:
    """Runs up to `jobs` actions at once; workers stay alive for the whole build (torch imported once per worker)."""

    local = True
    name = "local"
    runs_light = True  # light steps (actions.LIGHT) run in this process, in wait(): the scheduler warms no worker

    def __init__(self, root: Path, cache: SpawnCache, jobs: int, env: dict[str, str],
                 action_timeout: float = 0.0, timeouts: Mapping[str, tuple[float, str]] | None = None,
                 limits: LimitSettings | None = None, pools: Pools = FRESH_POOLS) -> None:
        self.root = root
        # each action's limits (execution/limits.py): automatic unless the build's flags say otherwise
        self.limits = limits if limits is not None else LimitSettings(timeout_s=action_timeout or None)
        self._timeouts = dict(timeouts or {})  # fingerprint -> (seconds, the attribute that set it)
        self.cache = cache
        self.runs_light = envvars.current().flag("NEURONBUILD_LIGHT_STEPS")  # (0: in workers, for A/B measurements)
        self.slots = max(1, jobs)
        self.threads = worker_threads(self.slots)  # each worker's share of the machine's cores
        args, kwargs = pool_args(cache, jobs, env, action_timeout)
        self._pool = pools.make(*args, **kwargs)
        self._running: dict[str, tuple[Job, sandboxes.Sandbox]] = {}
        # light steps queued by start(), run in this process by wait() one at a time: each is handed back (and so
        # stored) as soon as it ran, not after every other light step the scheduler started meanwhile
        self._light: list[Job] = []
        # This build's sandboxes live under one directory, removed whole at the end (even after a Ctrl-C that
        # struck while a sandbox was being made). Made on the first action: a fully cached build writes nothing to
        # the cache, so a read-only (mounted release) cache serves it.
        self._scratch_dir: Path | None = None
        # finished actions' sandboxes, removed by a thread (off the scheduler's path to the next action); shutdown
        # waits for it before removing the build's directory
        self._remover: ThreadPoolExecutor | None = None

    @property
    def _scratch(self) -> Path:
        if self._scratch_dir is None:
            self.cache.scratch.mkdir(parents=True, exist_ok=True)
            self._scratch_dir = Path(tempfile.mkdtemp(dir=self.cache.scratch, prefix="build-"))
        return self._scratch_dir

    def warm(self, n: int) -> None:
        self._pool.warm(n)

    @property
    def warms_apart(self) -> bool:
        """Toolchain warm-ups run beside the workers (in the pool's zygote), taking no worker slot."""
        return bool(getattr(self._pool, "warms_apart", False))

    def hosts(self) -> list[str]:
        return [""]  # one machine: its workers share the toolchain scratch dir (the cache's toolchain-tmp)

    def start(self, job: Job) -> Started:
        a = job.action
        sb = sandboxes.prepare(a, self.root, self.cache, self._scratch)
        if self.runs_light and is_light(a):  # its toolchain's code on data, no model code: no worker, no fork
            self._running[job.id] = (job, sb)
            self._light.append(job)
            return Started("build", os.getpid())
        msg = {"kind": a.kind, "spec": json.loads(json.dumps(a.spec)), "inputs": str(sb.inputs),
               "outputs": str(sb.outputs), "log": str(job.log), "expect": dict(a.versions)}
        try:
            lim = for_action(self.limits, a.kind, a.toolchain, job.estimate_s, job.estimate_mb,
                             self._timeouts.get(a.fingerprint), job.estimate_mb_recorded)
            msg["limits"] = lim.message()
            slot, pid = self._pool.submit(job.id, msg, lim.timeout_s or None, lim.timeout_source)
        except BaseException:
            sb.remove()
            raise
        self._running[job.id] = (job, sb)
        return Started(_worker_name(slot), pid)

    def wait(self, timeout: float | None) -> list[Completion]:
        out = []
        if self._light:  # one light step, then what the workers finished meanwhile (no waiting for them)
            job = self._light.pop(0)
            out.append(run_light(job, self._running[job.id][1]))
        for r in self._pool.wait(0 if out else timeout):
            job, sb = self._running[r.task_id]
            res = r.result
            if sb.linked:
                sb.restore_linked()  # the user's files' mode and times, where the action could change them
            changed = sb.changed_input() if res.get("ok") and sb.linked else None
            if changed is not None:  # a linked input edited while the action ran: its result names other bytes
                res = {**res, "ok": False, "error": f"input '{changed}' changed during the build; run the build again"}
            out.append(Completion(
                job, bool(res.get("ok")), _worker_name(r.slot), r.pid, str(res.get("error") or ""),
                float(res.get("duration_s") or 0.0), float(res.get("peak_rss_mb") or 0.0),
                res.get("metadata") or {}, sb.outputs if res.get("ok") else None, r.worker_died,
                cpu_s=float(res.get("cpu_s") or 0.0)))
        return out

    def finish(self, job: Job) -> None:
        entry = self._running.pop(job.id, None)
        if entry is None:
            return
        if self._remover is None:
            self._remover = ThreadPoolExecutor(1, thread_name_prefix="neuronbuild-sandbox-remover")
        self._remover.submit(entry[1].remove)

    def cancel(self) -> None:
        self._light.clear()
        self._pool.kill_all()
        for _job, sb in self._running.values():
            sb.remove()
        self._running.clear()

    def shutdown(self) -> None:
        self._pool.shutdown()
        self._running.clear()
        if self._remover is not None:
            self._remover.shutdown(wait=True)
            self._remover = None
        if self._scratch_dir is not None:
            shutil.rmtree(self._scratch_dir, ignore_errors=True)

    def worker_pids(self) -> list[int]:
        return self._pool.pids()


def run_light(job: Job, sb: sandboxes.Sandbox) -> Completion:
    """Run a light toolchain step (actions.LIGHT: its toolchain's own code on its inputs as data, no model code) here,
    in the build process, reading the sandbox `sb` made for it and writing its outputs there, as a worker's action
    process would; a failure is the action's, reported the same way. No worker, fork, namespace or confinement: what
    those protect the build from is model code, which such a step never runs (#53)."""
    from neuronbuild import plugins
    from neuronbuild.toolchains.errors import ToolchainError

    a = job.action
    start, cpu, began = time.perf_counter(), time.thread_time(), time.time()
    error, meta = "", {}
    try:
        meta = plugins.run_step(a.spec, sb.inputs, sb.outputs)
    except ToolchainError as e:
        error = str(e)
    except Exception as e:  # noqa: BLE001 - the step's failure is its action's, as in a worker
        error = f"{type(e).__name__}: {e}"
    duration = time.perf_counter() - start
    with open(job.log, "a", encoding="utf-8") as log:
        log.write(f"neuronbuild: a light step, run in the build process (pid {os.getpid()}) in {duration:.3f} s\n")
        if error:
            log.write(f"{error}\n")
    return Completion(job, not error, "build", os.getpid(), error.splitlines()[0] if error else "", duration, 0.0,
                      meta if isinstance(meta, dict) else {}, None if error else sb.outputs,
                      cpu_s=time.thread_time() - cpu, started=began, ended=time.time())


def _worker_name(slot: int) -> str:
    return "zygote" if slot < 0 else f"worker-{slot + 1}"  # slot -1: a warm-up run in the pool's zygote
