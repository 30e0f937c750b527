"""Dask executor: runs actions on a Dask cluster (a compile farm) through a shared store (a directory or S3).

The client puts each action's source inputs into the shared CAS and sends digests; a Dask worker builds the sandbox
from the shared CAS, runs the action in a warm worker process (FarmPool: one per Dask thread, forked from one zygote
per Dask worker that starts when a build starts, runs the toolchain warm-ups and is kept between tasks and builds),
puts the outputs into the shared CAS and returns their digests. The client's local cache then verifies and adopts
those blobs (store_outputs' `expect`) and writes the records (local cache and shared tier). The shared directory
has a local cache's layout and the same path on every machine. A worker lost mid-action is handled by Dask, which
runs the task again on another worker."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from neuronbuild.digests import digest_file
from neuronbuild.errors import NeuronBuildError
from neuronbuild.execution.cache_api import SpawnCache
from neuronbuild.execution.env import action_environment, with_threads, worker_threads
from neuronbuild.execution.jobs import Completion, Job, Started
from neuronbuild.execution.limits import LimitSettings, for_action
from neuronbuild.execution.pool import WorkerPool
from neuronbuild.execution.sandbox import InputChanged, place_input
from neuronbuild.execution.worker import first_lines
from neuronbuild.plugin_api.toolchain import WARM_UP, is_warm_up

_LOG_TAIL = 200_000
SLOTS_REFRESH_S = 2.0
AHEAD_PER_THREAD = 1  # tasks queued on each Dask thread beyond the one it runs (started the moment it frees)


class DaskExecutor:
    """Dispatches jobs to an existing scheduler (`address`) or to a LocalCluster of `jobs` workers (address None)."""

    local = False

    def __init__(self, root: Path, cache: SpawnCache, shared_url: str, address: str | None, jobs: int,
                 open_store: Callable[[str], Any], same: bool = False, toolchain_tmp: Path | None = None,
                 action_timeout: float = 0.0, timeouts: Mapping[str, tuple[float, str]] | None = None,
                 limits: LimitSettings | None = None) -> None:
        """`shared_url`: the farm store every worker reaches (a directory mounted at the same path everywhere, or
        s3://bucket/prefix); `open_store(url)` opens it (picklable: workers call it too); `same`: it is `cache`.
        `action_timeout` / `timeouts` ({fingerprint: (seconds, what set it)}): as the local executor's; the Dask
        worker running an action kills it (and every process it started) when its limit passes."""
        try:
            from distributed import Client, LocalCluster
        except ImportError:
            raise NeuronBuildError("the Dask executor needs dask[distributed]: pip install 'neuronbuild[farm]'") \
                from None
        self.root = root
        self.cache = cache
        self._timeouts = dict(timeouts or {})
        # each action's limits (execution/limits.py), enforced by the farm worker's pool as locally
        self.limits = limits if limits is not None else LimitSettings(timeout_s=action_timeout or None)
        self._open_store = open_store  # also sent to farm workers (pickled by reference)
        self.shared = open_store(shared_url)
        self._shared_url = shared_url
        self._same = same
        self._toolchain_tmp = str(toolchain_tmp) if toolchain_tmp else None
        self._cluster: Any = None
        try:
            if address is None:
                self.name = "dask-local"
                # Its worker processes are spawned (`python -c ...`) in this process's working directory, the
                # workspace in batch mode: without -P (PYTHONSAFEPATH) a cloned repo's multiprocessing.py, pickle.py
                # or socket.py there ran in them, unconfined, before they took this process's sys.path.
                os.environ["PYTHONSAFEPATH"] = "1"
                self._cluster = LocalCluster(n_workers=max(1, jobs), threads_per_worker=1, processes=True,
                                             host="127.0.0.1", dashboard_address=None)
                self.client: Any = Client(self._cluster)
            else:
                self.name = "dask"
                self.client = Client(address, timeout="30s")
                self.client.wait_for_workers(1, timeout=120)
        except (OSError, TimeoutError, RuntimeError) as e:  # (a Nanny that failed to start: RuntimeError)
            self.shutdown()
            raise NeuronBuildError(f"cannot use the Dask cluster at {address or 'a LocalCluster'}: {e}") from None
        self.slots = max(1, sum(self.client.nthreads().values()))
        self._host_threads: dict[str, int] = {}  # host -> Dask worker threads on it (each gets cores / that)
        self._workers_now: set[str] = set()  # the Dask workers' addresses when last asked
        self._slots_checked = time.monotonic()
        self._futures: dict[Any, Job] = {}
        self._sent: dict[str, float] = {}  # task key -> when it was sent to the cluster
        cache.scratch.mkdir(parents=True, exist_ok=True)
        self._tmp = Path(tempfile.mkdtemp(dir=cache.scratch, prefix="farm-"))

    def warm(self, n: int) -> None:
        """Start every Dask worker's warm worker processes now (torch imported while the client uploads inputs and
        the first tasks travel), instead of with each worker's first task."""
        self._refresh_slots(force=True)
        with contextlib.suppress(Exception):
            # It only starts processes (no waiting for their imports): one quick round trip.
            self.client.run(farm_prestart, self._toolchain_tmp, dict(self._host_threads), on_error="ignore")

    @property
    def ahead(self) -> int:
        """Tasks the scheduler sends beyond the farm's threads: each Dask worker holds the next one in its own queue
        and starts it the moment its thread frees, instead of idling while the result travels to the client, the
        client stores it and sends the next (a task also frees its thread before storing its outputs)."""
        return self.slots * AHEAD_PER_THREAD

    @property
    def warms_apart(self) -> bool:
        """Toolchain warm-ups run in each Dask worker's zygote, beside its workers: a warm-up task leaves Dask's
        thread pool (secede) and takes no slot, and the steps needing it are held back until it is done."""
        return True

    def hosts(self) -> list[str]:
        """Where a toolchain warm-up runs: every Dask worker (each has its own zygote; what a warm-up leaves on disk,
        inductor's precompiled headers, is built once per host under inductor's file lock, and the other workers of
        that host only load it)."""
        try:
            workers = self.client.scheduler_info().get("workers", {})
        except Exception:  # noqa: BLE001 - no warm-up rather than no build
            return []
        return sorted(str(a) for a in workers)

    def _to_shared(self, a_path: str, digest: str) -> None:
        """A workspace file into the shared CAS (verified against the digest analysis saw)."""
        src = self.root / a_path
        if self.shared.has_blob(digest):
            if digest_file(src) != digest:
                raise InputChanged(f"input '{a_path}' changed during the build; run the build again")
            return
        got, _size = self.shared.put_file(src)
        if got != digest:
            raise InputChanged(f"input '{a_path}' changed during the build; run the build again")

    def start(self, job: Job) -> Started:
        a = job.action
        inputs: list[tuple[str, str]] = []
        for f in a.files:
            self._to_shared(f.path, f.digest)
            inputs.append((f.path, f.digest))
        for d in a.dep_inputs:
            res = self.cache.lookup(d.action)
            if res is None or d.output not in res.outputs:
                raise InputChanged(f"output '{d.output}' of action {d.action[:12]} is missing from the cache")
            digest = res.outputs[d.output].digest
            if not self.shared.has_blob(digest):
                tmp = self._tmp / f"up-{uuid.uuid4().hex}"
                try:
                    self.cache.copy_blob(digest, tmp)
                    self.shared.put_file(tmp)
                finally:
                    tmp.unlink(missing_ok=True)
            inputs.append((d.path, digest))
        payload = {"kind": a.kind, "spec": json.loads(json.dumps(a.spec)), "inputs": inputs, "expect": dict(a.versions),
                   "outputs": list(a.outputs), "shared": self._shared_url, "open_store": self._open_store, "toolchain_tmp": self._toolchain_tmp,
                   "description": a.describe(), "host_threads": dict(self._host_threads)}
        if a.kind != WARM_UP:
            lim = for_action(self.limits, a.kind, a.toolchain, job.estimate_s, job.estimate_mb,
                             self._timeouts.get(a.fingerprint), job.estimate_mb_recorded)
            payload["limits"] = lim.message()
            if lim.timeout_s > 0:
                payload["timeout"] = [lim.timeout_s, lim.timeout_source]
        prefix = "neuronbuild-warmup" if a.kind == WARM_UP else "neuronbuild"  # a warm-up is not an action
        key = f"{prefix}-{a.fingerprint[:16]}-{job.attempt}-{uuid.uuid4().hex[:8]}"
        payload["key"] = key
        # A warm-up runs on its Dask worker only (it warms that worker's zygote; see wait() for one whose worker left).
        where: dict[str, Any] = {"workers": [job.host], "allow_other_workers": False} if job.host else {}
        self._sent[key] = time.time()
        fut = self.client.submit(farm_run, payload, key=key, pure=False, **where)
        self._futures[fut] = job
        return Started("zygote" if a.kind == WARM_UP else "dask", 0)

    def _refresh_slots(self, force: bool = False) -> None:
        """Workers that joined (or left) since the build started change how many actions run at once (and how many
        share each host's cores)."""
        now = time.monotonic()
        if not force and now - self._slots_checked < SLOTS_REFRESH_S:
            return
        self._slots_checked = now
        with contextlib.suppress(Exception):
            self.slots = max(1, sum(self.client.nthreads().values()))
        with contextlib.suppress(Exception):
            per_host: dict[str, int] = {}
            workers = self.client.scheduler_info().get("workers", {})
            self._workers_now = set(workers)
            for w in workers.values():
                host = str(w.get("host") or "")
                per_host[host] = per_host.get(host, 0) + int(w.get("nthreads") or 1)
            self._host_threads = per_host

    def wait(self, timeout: float | None) -> list[Completion]:
        from distributed import wait as dask_wait

        self._refresh_slots()
        if not self._futures:
            time.sleep(timeout or 0.1)
            return []
        # A warm-up is bound to its Dask worker (its zygote is what it warms): one whose worker left would wait for
        # it forever, so it ends here as failed (not the build's failure), and the steps held back for it go.
        lost = [f for f, j in self._futures.items() if j.action.kind == WARM_UP and j.host
                and self._workers_now and j.host not in self._workers_now]
        if lost:
            return [self._lost_warm_up(f) for f in lost]
        if any(j.action.kind == WARM_UP for j in self._futures.values()):
            timeout = SLOTS_REFRESH_S if timeout is None else min(timeout, SLOTS_REFRESH_S)
        try:
            done, _ = dask_wait(list(self._futures), timeout=timeout, return_when="FIRST_COMPLETED")
        except TimeoutError:
            return []
        return [self._completion(fut) for fut in done]

    def _lost_warm_up(self, fut: Any) -> Completion:
        job = self._futures.pop(fut)
        with contextlib.suppress(Exception):
            self.client.cancel([fut], force=True)
        return Completion(job, False, "dask", error=f"its Dask worker {job.host} left the cluster")

    def _completion(self, fut: Any) -> Completion:
        job = self._futures.pop(fut)
        sent = self._sent.pop(str(fut.key), 0.0)
        a = job.action
        try:
            res = fut.result()
        except Exception as e:  # noqa: BLE001 - KilledWorker (lost too often), cancellation, a broken worker
            return Completion(job, False, "dask", error=first_lines(f"the Dask task failed: {type(e).__name__}: {e}"),
                              worker_died=True)
        started, ended = _on_worker(res, sent, time.time())
        with contextlib.suppress(OSError), open(job.log, "a", encoding="utf-8") as log:
            log.write(f"# ran on {res.get('worker')} (seconds on the worker: {res.get('farm_s')})\n{res.get('log', '')}")
        worker = str(res.get("worker") or "dask")
        cpu_s = float(res.get("cpu_s") or 0.0)  # the action's process and its compilers, on the worker
        if a.kind == WARM_UP:  # a toolchain warm-up: no outputs, no record
            return Completion(job, bool(res.get("ok")), worker, int(res.get("pid") or 0), str(res.get("error") or ""),
                              float(res.get("duration_s") or 0.0), metadata=res.get("metadata") or {}, cpu_s=cpu_s)
        if not res.get("ok"):
            return Completion(job, False, worker, int(res.get("pid") or 0), str(res.get("error") or ""),
                              float(res.get("duration_s") or 0.0), worker_died=bool(res.get("worker_died")),
                              cpu_s=cpu_s, started=started, ended=ended)
        out = self._tmp / job.id.replace("#", "-")
        digests = {str(name): str(digest) for name, (digest, _size) in res["outputs"].items()}
        adopt = self._records_here()
        try:
            for name, digest in digests.items():
                if adopt:
                    # Named, not read: a hard link where the store is a directory on this filesystem (else a copy or
                    # a verified download). The scheduler's store verifies each against its digest while adopting it
                    # into the local cache (after handing the freed worker its next task), and the local cache's
                    # upload records it in the store.
                    self.shared.link_blob(digest, out / name)
                else:
                    self.shared.place_blob(digest, out / name)  # verified
            if not adopt:  # the shared tier's record, for other clients (blobs are there already)
                self._record_shared(a, res, out)
        except Exception as e:  # noqa: BLE001 - CorruptBlob, OSError: the action's failure, not the build's
            return Completion(job, False, worker, error=f"fetching outputs from the shared cache failed: {e}",
                              cpu_s=cpu_s, started=started, ended=ended)
        return Completion(job, True, worker, int(res.get("pid") or 0), "", float(res["duration_s"]),
                          float(res.get("peak_rss_mb") or 0.0), res.get("metadata") or {}, out, cpu_s=cpu_s,
                          digests=digests if adopt else None, started=started, ended=ended)

    def _records_here(self) -> bool:
        """Whether the local cache records outputs in the farm's store itself: it is that store, or its shared tier
        (the build's --remote-cache) is. Then a worker's outputs are verified once, by the local cache's store."""
        if self._same:
            return True
        shared_url = getattr(self.cache, "shared_url", None)
        tier = str(shared_url() if callable(shared_url) else "")
        return bool(tier) and tier.rstrip("/") == self._shared_url.rstrip("/")

    def _record_shared(self, a: Any, res: Mapping[str, Any], out: Path) -> None:
        """The farm store's record of an action's outputs, for other clients (whose shared tier it is): written as
        the build writes every shared record (SpawnCache.shared_record: signed with its --remote-cache-signing-key,
        none at all when it trusts only signed records and holds no key). In a shared directory the worker's blobs
        (just verified while placing them) are recorded as they are, not copied into it a second time; an S3 tier
        checks (HEAD)."""
        metadata = res.get("metadata") or {}
        sizes = {name: (str(d), (out / name).stat().st_size) for name, (d, _size) in res["outputs"].items()}
        sign = self.cache.shared_record
        # A directory tier (cache/local.py) records blobs it holds already; execution reaches it only through the
        # SpawnCache protocol (tests/test_layering.py), so the method is looked up, not the class.
        record_stored = getattr(self.shared, "record_stored", None)
        if callable(record_stored) and set(sizes) == set(a.outputs) and \
                all(self.shared.has_blob(d) for d, _n in sizes.values()):
            record_stored(a.fingerprint, a.identity, a.record, sizes, float(res["duration_s"]), metadata, sign)
            return
        self.shared.store_outputs(a.fingerprint, a.identity, a.record, out, a.outputs, float(res["duration_s"]),
                                  metadata, sign=sign)

    def finish(self, job: Job) -> None:
        shutil.rmtree(self._tmp / job.id.replace("#", "-"), ignore_errors=True)

    def cancel(self) -> None:
        """Stop running tasks: each worker kills the process running one of ours (and everything it started), then
        the futures are cancelled; nothing they would have produced is recorded."""
        if self._futures:
            keys = [str(f.key) for f in self._futures]
            with contextlib.suppress(Exception):
                self.client.run(cancel_farm_tasks, keys, wait=True, on_error="ignore")
            with contextlib.suppress(Exception):
                self.client.cancel(list(self._futures), force=True)
        self._futures.clear()
        self._sent.clear()

    def shutdown(self) -> None:
        self.cancel()
        client = getattr(self, "client", None)
        if client is not None and self._cluster is not None:
            # Our own LocalCluster: its processes write to the user's terminal, and closing it races Dask's own
            # heartbeats (a worker logs a CommClosedError traceback when its in-flight heartbeat meets the closing
            # scheduler). Its logs are quieted first (the build's own outcome is already reported by then).
            with contextlib.suppress(Exception):
                client.run(quiet_dask_logs, nanny=True, on_error="ignore")
            with contextlib.suppress(Exception):
                client.run(quiet_dask_logs, on_error="ignore")
        levels = quiet_dask_logs() if self._cluster is not None else {}  # this process's (the scheduler's) too
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()
        if self._cluster is not None:
            with contextlib.suppress(Exception):
                self._cluster.close()
        for name, level in levels.items():  # a build server's next build logs as before
            logging.getLogger(name).setLevel(level)
        if getattr(self, "_tmp", None) is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ on the Dask worker

_POOLS: dict[tuple[str, int], FarmPool] = {}  # this Dask worker's warm processes, by toolchain tmp and thread share
_POOLS_LOCK = threading.Lock()
_RUNNING: dict[str, FarmPool] = {}  # task key (also its task id in the pool) -> the pool running it
_CANCELLED: dict[str, None] = {}  # keys of cancelled tasks (oldest first), also of tasks not started here yet
_CANCELLED_KEEP = 10_000
_POLL_S = 1.0  # the farm pool's driver waits this long for results at most (a new task wakes it at once)


class FarmPool:
    """One Dask worker's warm processes for one toolchain tmp and thread share: a WorkerPool with one worker per Dask
    thread, forked from one zygote (torch imported once per Dask worker process: once per host when a host runs one
    Dask worker with several threads), whose toolchain warm-ups run in that zygote beside the workers. Shared by the
    Dask worker's threads through one driver thread, the only one that touches the WorkerPool: tasks are handed to it
    (an action waits in line for an idle worker; a warm-up goes to the zygote at once), and it hands each result to
    the thread waiting for it. The driver ends when nothing is left to do and starts again with the next task."""

    def __init__(self, toolchain_tmp: str | None, threads: int, size: int) -> None:
        base = _farm_base()
        base.mkdir(parents=True, exist_ok=True)
        tmp = Path(toolchain_tmp) if toolchain_tmp else base / "toolchain-tmp"
        self.pool = WorkerPool(size, with_threads(action_environment(tmp, base / "home"), threads), base / "scratch",
                               use_zygote=True)
        self._cond = threading.Condition()
        self._inbox: list[tuple[str, dict[str, Any], float | None, str]] = []  # tasks not yet handed to the pool
        self._kills: list[str] = []  # tasks whose worker the driver is to kill (cancelled)
        self._warm = False  # the driver is to start the pool's zygote (farm_prestart)
        self._results: dict[str, dict[str, Any]] = {}  # task id -> its result, until its thread takes it
        self._pending: set[str] = set()  # tasks submitted and not yet taken or abandoned
        self._driver: threading.Thread | None = None
        self._retired = False  # replaced (the Dask worker's thread share changed): its processes end once idle
        self._wake_r, self._wake_w = os.pipe()  # a byte written here ends the driver's wait for results at once
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    @property
    def warms_apart(self) -> bool:
        return self.pool.warms_apart

    def _wake(self) -> None:
        """(Lock held.) Start the driver if it is not running."""
        if self._driver is None or not self._driver.is_alive():
            self._driver = threading.Thread(target=self._drive, name="neuronbuild-farm-pool", daemon=True)
            self._driver.start()
        else:
            with contextlib.suppress(BlockingIOError):
                os.write(self._wake_w, b"x")
        self._cond.notify_all()

    def warm(self) -> None:
        with self._cond:
            self._warm = True
            self._wake()

    def submit(self, task_id: str, msg: dict[str, Any], timeout: float | None, source: str) -> None:
        with self._cond:
            self._pending.add(task_id)
            self._inbox.append((task_id, msg, timeout, source))
            self._wake()

    def result(self, task_id: str, cancelled: Callable[[], bool]) -> dict[str, Any] | None:
        """The result of `task_id`, or None once `cancelled()` says so (the task is abandoned)."""
        with self._cond:
            try:
                while task_id not in self._results:
                    if cancelled():
                        return None
                    self._cond.wait(0.5)
                return self._results.pop(task_id)
            finally:
                self._pending.discard(task_id)
                self._results.pop(task_id, None)

    def kill_task(self, task_id: str) -> None:
        with self._cond:
            self._kills.append(task_id)
            self._wake()

    def retire(self) -> None:
        """No new tasks come (another pool replaced this one): its zygote and workers end as soon as it is idle
        (at once when it is idle now), instead of staying with torch (and jax) loaded for nothing."""
        with self._cond:
            self._retired = True
            self._wake()

    def _drive(self) -> None:
        try:
            self._drive_loop()
        except BaseException as e:  # noqa: BLE001 - a broken pool fails its tasks, never leaves them waiting
            with self._cond:
                self._driver = None
                failed = {t: {"ok": False, "worker_died": True, "duration_s": 0.0,
                              "error": f"the Dask worker's pool of warm processes failed: {type(e).__name__}: {e}"}
                          for t in self._pending}
                self._inbox.clear()
            for task_id, res in failed.items():
                self._deliver(task_id, res)
            with contextlib.suppress(Exception):
                self.pool.kill_all()

    def _drive_loop(self) -> None:
        while True:
            with self._cond:
                kills, self._kills = self._kills, []
                warm, self._warm = self._warm, False
                idle = self.pool.idle_slot() is not None
                take = [t for t in self._inbox if (self.pool.warms_apart and is_warm_up(t[1])) or idle][:1]
                for t in take:
                    self._inbox.remove(t)
                if not (kills or warm or take or self._pending or self.pool.busy):
                    self._driver = None  # nothing to do: a later submit starts a new driver
                    if self._retired:
                        with contextlib.suppress(Exception):
                            self.pool.kill_all()
                    return
            for task_id in kills:
                self.pool.kill_task(task_id)
            if warm:
                with contextlib.suppress(Exception):
                    self.pool.warm(self.pool.size)
            for task_id, msg, timeout, source in take:
                try:
                    self.pool.submit(task_id, msg, timeout, source)
                except Exception as e:  # noqa: BLE001 - the task's failure, not the Dask worker's
                    self._deliver(task_id, {"ok": False, "error": f"starting a worker failed: {e}",
                                            "worker_died": True, "duration_s": 0.0})
            if take:
                continue  # the next waiting task first (a warm-up right after an action, say)
            for r in self.pool.wait(_POLL_S, self._wake_r):
                self._deliver(r.task_id, r.result)
            with contextlib.suppress(BlockingIOError):
                os.read(self._wake_r, 4096)

    def _deliver(self, task_id: str, result: dict[str, Any]) -> None:
        with self._cond:
            if task_id in self._pending:  # else abandoned (cancelled): dropped
                self._results[task_id] = result
                self._cond.notify_all()


def quiet_dask_logs() -> dict[str, int]:
    """Runs in a closing LocalCluster's processes (and the client's): Dask's loggers say nothing more. Returns the
    levels they had."""
    levels = {}
    for name in ("distributed", "distributed.worker", "distributed.nanny", "distributed.core", "distributed.comm",
                 "distributed.scheduler", "tornado"):
        logger = logging.getLogger(name)
        levels[name] = logger.level
        logger.setLevel(logging.CRITICAL + 1)
    return levels


def cancel_farm_tasks(keys: list[str]) -> int:
    """Runs on every Dask worker (Client.run): kill the worker processes (process groups) running these tasks. A task
    still queued on this Dask worker (the client sends some ahead) is marked too: if it starts before Dask's own
    cancellation reaches the worker, it returns at once instead of running its action."""
    killed = 0
    for key in keys:
        _CANCELLED[key] = None
        pool = _RUNNING.get(key)
        if pool is None:
            continue
        pool.kill_task(key)
        killed += 1
    for old in list(_CANCELLED)[:max(0, len(_CANCELLED) - _CANCELLED_KEEP)]:
        _CANCELLED.pop(old, None)
    return killed


def _farm_base() -> Path:
    return Path(tempfile.gettempdir()) / "neuronbuild-farm"


def _threads_here(host_threads: dict[str, int] | None, dask_worker: Any = None) -> int:
    """This Dask worker thread's share of its host's cores: the host's cores / the Dask threads on that host (as the
    client saw the cluster; this worker's own thread count when the host is not listed)."""
    try:
        if dask_worker is None:
            from distributed import get_worker

            dask_worker = get_worker()
        host = urlparse(str(dask_worker.address)).hostname or ""
        mine = _dask_threads(dask_worker)
    except Exception:  # noqa: BLE001 - outside a worker (tests): one worker thread
        host, mine = "", 1
    return worker_threads(max(mine, int((host_threads or {}).get(host, 0) or 0)))


def _dask_threads(dask_worker: Any) -> int:
    """How many threads (tasks at once) this Dask worker runs."""
    return int(getattr(getattr(dask_worker, "state", None), "nthreads", 0) or getattr(dask_worker, "nthreads", 1) or 1)


def _pool_key(toolchain_tmp: str | None, threads: int) -> tuple[str, int]:
    return (toolchain_tmp or "", threads)


def _farm_pool(toolchain_tmp: str | None, threads: int, size: int) -> FarmPool:
    """This Dask worker's warm processes for this toolchain tmp and thread share (kept between tasks and builds)."""
    with _POOLS_LOCK:
        key = _pool_key(toolchain_tmp, threads)
        pool = _POOLS.get(key)
        if pool is None:
            pool = _POOLS[key] = FarmPool(toolchain_tmp, threads, size)
            # The thread share changed (Dask workers joined or left the host): the pool of the old share is not
            # used again by this toolchain tmp's builds. Pools of other toolchain tmps (other clients) stay.
            for old in [k for k in _POOLS if k[0] == key[0] and k != key]:
                _POOLS.pop(old).retire()
        return pool


def farm_prestart(toolchain_tmp: str | None, host_threads: dict[str, int], dask_worker: Any = None) -> int:
    """Runs on every Dask worker (Client.run, at the start of a build): its zygote (and so its torch import) starts
    now, overlapping the client's uploads; its workers are forked when the first tasks come. Returns the pool's
    size (the Dask worker's threads)."""
    threads = _threads_here(host_threads, dask_worker)
    want = _dask_threads(dask_worker)
    pool = _farm_pool(toolchain_tmp, threads, want)
    pool.warm()
    return want


def farm_run(payload: dict[str, Any]) -> dict[str, Any]:
    """Runs on a Dask worker: sandbox from the shared CAS, the action in a warm worker process, outputs to the CAS. A
    toolchain warm-up runs in the Dask worker's zygote and leaves Dask's thread pool first (distributed.secede), so
    the worker's thread runs the build's traces meanwhile; an action leaves it once its run has ended, so the task
    queued behind it on this Dask worker starts while it stores the outputs. Returns, beside the result, when it
    started here and when its run ended (`on_worker`: this host's clock)."""
    t_start = time.perf_counter()
    started_at = time.time()
    dask_worker: Any = None
    try:
        from distributed import get_worker

        dask_worker = get_worker()
        where = f"{dask_worker.address} ({socket.gethostname()})"
    except (ImportError, ValueError):
        where = f"dask ({socket.gethostname()})"
    key = str(payload.get("key") or uuid.uuid4().hex)
    if key in _CANCELLED:  # its build was cancelled while it waited in this Dask worker's queue
        return {"ok": False, "error": "cancelled", "duration_s": 0.0, "worker": where}
    shared = payload["open_store"](payload["shared"])
    base = _farm_base()
    base.mkdir(parents=True, exist_ok=True)
    sb = Path(tempfile.mkdtemp(dir=base, prefix="job-"))
    t0 = time.perf_counter()
    try:
        inputs, outputs, log = sb / "in", sb / "out", sb / "action.log"
        inputs.mkdir()
        outputs.mkdir()
        for rel, digest in payload["inputs"]:
            _place_input(shared, digest, inputs / rel)
        t_in = time.perf_counter()
        log.write_text(f"# {payload['description']}\n", encoding="utf-8")
        threads = _threads_here(payload.get("host_threads"), dask_worker)
        pool = _farm_pool(payload.get("toolchain_tmp"), threads, _dask_threads(dask_worker) if dask_worker else 1)
        limit, source = payload.get("timeout") or (0.0, "")  # the pool kills the action's process tree after it
        msg = {"kind": payload["kind"], "spec": payload["spec"], "inputs": str(inputs), "outputs": str(outputs),
               "log": str(log), "expect": payload.get("expect"), "limits": payload.get("limits")}
        apart = pool.warms_apart and is_warm_up(msg)
        if apart and dask_worker is not None:
            _secede()  # its slot runs other tasks (traces) now
            where = f"zygote@{where}"
        _RUNNING[key] = pool
        try:
            pool.submit(key, msg, float(limit) or None, str(source))
            result = pool.result(key, lambda: key in _CANCELLED)
        finally:
            _RUNNING.pop(key, None)
            cancelled = key in _CANCELLED
            _CANCELLED.pop(key, None)
        ended_at = time.time()
        if cancelled or result is None:
            return {"ok": False, "error": "cancelled", "duration_s": 0.0, "worker": where}
        if not apart and dask_worker is not None:
            _secede()  # the next task queued here starts now, in the pool worker this action has just freed
        res = dict(result)
        res["on_worker"] = [started_at, ended_at]
        t_run = time.perf_counter()
        if res.get("ok"):
            outs: dict[str, list[Any]] = {}
            for name in payload["outputs"]:
                p = outputs / name
                if not p.is_file():
                    res = {"ok": False, "error": f"the action did not produce its declared output '{name}'",
                           "duration_s": res.get("duration_s", 0.0)}
                    break
                outs[name] = _store_output(shared, p)
            else:
                res["outputs"] = outs
        res["worker"] = where
        # Where the task's time went on the worker (the action's own run time is duration_s): in its log.
        res["farm_s"] = {"start": round(t0 - t_start, 3), "inputs": round(t_in - t0, 3), "run": round(t_run - t_in, 3),
                         "outputs": round(time.perf_counter() - t_run, 3)}
        try:
            res["log"] = log.read_text(encoding="utf-8", errors="replace")[-_LOG_TAIL:]
        except OSError:
            res["log"] = ""
        return res
    finally:
        shutil.rmtree(sb, ignore_errors=True)


def _place_input(shared: Any, digest: str, dest: Path) -> None:
    """An input from the farm's store into a sandbox: a verified read-only copy, as the local executor places its
    own (sandbox.place_input); never a link to the store, which the action could chmod and write through."""
    place_input(shared, digest, dest)


def _store_output(shared: Any, p: Path) -> list[Any]:
    """An action's output into the farm's store: [digest, size] (hashed; not sent again if the store has it;
    linked, not copied, into a store directory on the sandbox's filesystem)."""
    digest, size = shared.put_file(p, scratch=True)
    return [digest, size]


def _secede() -> None:
    """This thread leaves its Dask worker's thread pool: its slot runs the next task (the scheduler no longer counts
    this one as taking it)."""
    with contextlib.suppress(Exception):
        from distributed import secede

        secede()


def _on_worker(res: Mapping[str, Any], sent: float, received: float) -> tuple[float, float]:
    """When a farm task started on its Dask worker and when its run ended there (it freed its thread), from the
    worker's clock, kept between when the client sent it and when the result came back (clocks of other hosts may
    differ); (0.0, 0.0) when the worker did not say."""
    try:
        w_start, w_end = (float(t) for t in res["on_worker"])
    except (KeyError, TypeError, ValueError):
        return 0.0, 0.0
    ended = min(max(w_end, sent), received)
    return min(max(w_start, sent), ended), ended


def worker_toolchain() -> dict[str, Any]:
    """Runs on a Dask worker (Client.run): what this host would build with, as fingerprints record it: the trace's
    versions, then what each registered toolchain reports (Toolchain.host_status), under "status" in registry order
    (a key two toolchains report is shown once)."""
    from neuronbuild import plugins
    from neuronbuild.plugin_api.toolchain import trace_toolchain

    status: dict[str, str | None] = {}
    for tc in plugins.toolchains().values():
        try:
            for k, v in tc.host_status().items():
                status.setdefault(k, v)
        except Exception as e:  # noqa: BLE001 - a broken toolchain is reported, not raised
            status.setdefault(tc.name, f"broken ({e})")
    return {"host": socket.gethostname(), "pid": os.getpid(), **trace_toolchain(), "status": status}
