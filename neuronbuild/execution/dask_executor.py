"""Dask executor: runs actions on a Dask cluster (a compile farm) through a shared store (a directory or S3).

The client puts each action's source inputs into the shared CAS and sends digests; a Dask worker builds the sandbox
from the shared CAS, runs the action in a warm worker process (pool.WorkerPool; one per Dask thread at a time, started
when a build starts and kept between tasks and builds), puts the outputs into the shared CAS and returns their digests. The client then writes the records (shared tier and
local cache). The shared directory has a local cache's layout and the same path on every machine. A worker lost
mid-action is handled by Dask, which runs the task again on another worker."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from neuronbuild.analysis.toolchain_api import WARM_UP
from neuronbuild.digests import digest_file
from neuronbuild.errors import NeuronBuildError
from neuronbuild.execution.cache_api import SpawnCache
from neuronbuild.execution.env import action_environment, with_threads, worker_threads
from neuronbuild.execution.jobs import Completion, Job, Started
from neuronbuild.execution.pool import WorkerPool
from neuronbuild.execution.sandbox import InputChanged
from neuronbuild.execution.worker import first_lines

_LOG_TAIL = 200_000
SLOTS_REFRESH_S = 2.0


class DaskExecutor:
    """Dispatches jobs to an existing scheduler (`address`) or to a LocalCluster of `jobs` workers (address None)."""

    local = False

    def __init__(self, root: Path, cache: SpawnCache, shared_url: str, address: str | None, jobs: int,
                 open_store: Callable[[str], Any], same: bool = False, toolchain_tmp: Path | None = None,
                 action_timeout: float = 0.0, timeouts: Mapping[str, tuple[float, str]] | None = None) -> None:
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
        self._action_timeout = action_timeout
        self._timeouts = dict(timeouts or {})
        self._open_store = open_store  # also sent to farm workers (pickled by reference)
        self.shared = open_store(shared_url)
        self._shared_url = shared_url
        self._same = same
        self._toolchain_tmp = str(toolchain_tmp) if toolchain_tmp else None
        self._cluster: Any = None
        try:
            if address is None:
                self.name = "dask-local"
                self._cluster = LocalCluster(n_workers=max(1, jobs), threads_per_worker=1, processes=True,
                                             host="127.0.0.1", dashboard_address=None)
                self.client: Any = Client(self._cluster)
            else:
                self.name = "dask"
                self.client = Client(address, timeout="30s")
                self.client.wait_for_workers(1, timeout=120)
        except (OSError, TimeoutError) as e:
            self.shutdown()
            raise NeuronBuildError(f"cannot use the Dask cluster at {address or 'a LocalCluster'}: {e}") from None
        self.slots = max(1, sum(self.client.nthreads().values()))
        self._host_threads: dict[str, int] = {}  # host -> Dask worker threads on it (each gets cores / that)
        self._slots_checked = time.monotonic()
        self._futures: dict[Any, Job] = {}
        cache.scratch.mkdir(parents=True, exist_ok=True)
        self._tmp = Path(tempfile.mkdtemp(dir=cache.scratch, prefix="farm-"))

    def warm(self, n: int) -> None:
        """Start every Dask worker's warm worker processes now (torch imported while the client uploads inputs and
        the first tasks travel), instead of with each worker's first task."""
        self._refresh_slots(force=True)
        with contextlib.suppress(Exception):
            # It only starts processes (no waiting for their imports): one quick round trip.
            self.client.run(farm_prestart, self._toolchain_tmp, dict(self._host_threads), on_error="ignore")

    def hosts(self) -> list[str]:
        """The farm's hosts (as the scheduler knows their workers' addresses): a toolchain warm-up runs once on each,
        since every Dask worker process of a host shares that host's toolchain scratch dir."""
        try:
            workers = self.client.scheduler_info().get("workers", {})
        except Exception:  # noqa: BLE001 - no warm-up rather than no build
            return []
        return sorted({str(w.get("host") or "") for w in workers.values()} - {""})

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
        limit, source = self._timeouts.get(a.fingerprint) or (self._action_timeout, "--action-timeout")
        if a.kind != WARM_UP and limit > 0:
            payload["timeout"] = [limit, source]
        prefix = "neuronbuild-warmup" if a.kind == WARM_UP else "neuronbuild"  # a warm-up is not an action
        key = f"{prefix}-{a.fingerprint[:16]}-{job.attempt}-{uuid.uuid4().hex[:8]}"
        payload["key"] = key
        where: dict[str, Any] = {"workers": [job.host], "allow_other_workers": False} if job.host else {}
        fut = self.client.submit(farm_run, payload, key=key, pure=False, **where)
        self._futures[fut] = job
        return Started("dask", 0)

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
            for w in self.client.scheduler_info().get("workers", {}).values():
                host = str(w.get("host") or "")
                per_host[host] = per_host.get(host, 0) + int(w.get("nthreads") or 1)
            self._host_threads = per_host

    def wait(self, timeout: float | None) -> list[Completion]:
        from distributed import wait as dask_wait

        self._refresh_slots()
        if not self._futures:
            time.sleep(timeout or 0.1)
            return []
        try:
            done, _ = dask_wait(list(self._futures), timeout=timeout, return_when="FIRST_COMPLETED")
        except TimeoutError:
            return []
        return [self._completion(fut) for fut in done]

    def _completion(self, fut: Any) -> Completion:
        job = self._futures.pop(fut)
        a = job.action
        try:
            res = fut.result()
        except Exception as e:  # noqa: BLE001 - KilledWorker (lost too often), cancellation, a broken worker
            return Completion(job, False, "dask", error=first_lines(f"the Dask task failed: {type(e).__name__}: {e}"),
                              worker_died=True)
        with contextlib.suppress(OSError), open(job.log, "a", encoding="utf-8") as log:
            log.write(f"# ran on {res.get('worker')}\n{res.get('log', '')}")
        worker = str(res.get("worker") or "dask")
        if a.kind == WARM_UP:  # a toolchain warm-up: no outputs, no record
            return Completion(job, bool(res.get("ok")), worker, int(res.get("pid") or 0), str(res.get("error") or ""),
                              float(res.get("duration_s") or 0.0), metadata=res.get("metadata") or {})
        if not res.get("ok"):
            return Completion(job, False, worker, int(res.get("pid") or 0), str(res.get("error") or ""),
                              float(res.get("duration_s") or 0.0), worker_died=bool(res.get("worker_died")))
        out = self._tmp / job.id.replace("#", "-")
        try:
            for name, (digest, _size) in res["outputs"].items():
                # Verified, then a hard link where the store is a directory on this filesystem (the scheduler only
                # reads these files into the local cache and removes them): no second copy of every output.
                self.shared.place_blob(digest, out / name)
            if not self._same:  # the shared tier's record, for other clients (blobs are there already)
                self._record_shared(a, res, out)
        except Exception as e:  # noqa: BLE001 - CorruptBlob, OSError: the action's failure, not the build's
            return Completion(job, False, worker, error=f"fetching outputs from the shared cache failed: {e}")
        return Completion(job, True, worker, int(res.get("pid") or 0), "", float(res["duration_s"]),
                          float(res.get("peak_rss_mb") or 0.0), res.get("metadata") or {}, out)

    def _record_shared(self, a: Any, res: Mapping[str, Any], out: Path) -> None:
        """The shared tier's record of an action's outputs. In a shared directory the worker's blobs (just verified
        while placing them) are recorded as they are, not copied into it a second time; an S3 tier checks (HEAD)."""
        metadata = res.get("metadata") or {}
        sizes = {name: (str(d), (out / name).stat().st_size) for name, (d, _size) in res["outputs"].items()}
        # A directory tier (cache/local.py) records blobs it holds already; execution reaches it only through the
        # SpawnCache protocol (tests/test_layering.py), so the method is looked up, not the class.
        record_stored = getattr(self.shared, "record_stored", None)
        if callable(record_stored) and set(sizes) == set(a.outputs) and \
                all(self.shared.has_blob(d) for d, _n in sizes.values()):
            record_stored(a.fingerprint, a.identity, a.record, sizes, float(res["duration_s"]), metadata)
            return
        self.shared.store_outputs(a.fingerprint, a.identity, a.record, out, a.outputs, float(res["duration_s"]),
                                  metadata)

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

_POOLS: dict[tuple[str, int], list[WorkerPool]] = {}  # idle warm worker processes, by toolchain tmp and thread share
_POOLS_LOCK = threading.Lock()
_RUNNING: dict[str, WorkerPool] = {}  # task key -> the pool running it (on this Dask worker)
_CANCELLED: set[str] = set()


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
    """Runs on every Dask worker (Client.run): kill the worker processes (process groups) running these tasks."""
    killed = 0
    for key in keys:
        pool = _RUNNING.get(key)
        if pool is None:
            continue
        _CANCELLED.add(key)
        for pid in pool.pids():
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
                killed += 1
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


def _take_pool(toolchain_tmp: str | None, threads: int) -> WorkerPool:
    """An idle warm worker process (one per Dask worker thread at a time) for this toolchain tmp and thread share,
    started by farm_prestart or an earlier task; a new one when none is idle. Give it back with _give_back."""
    with _POOLS_LOCK:
        idle = _POOLS.get(_pool_key(toolchain_tmp, threads))
        if idle:
            return idle.pop()
    return _new_pool(toolchain_tmp, threads)


def _new_pool(toolchain_tmp: str | None, threads: int) -> WorkerPool:
    base = _farm_base()
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(toolchain_tmp) if toolchain_tmp else base / "toolchain-tmp"
    return WorkerPool(1, with_threads(action_environment(tmp, base / "home"), threads), base / "scratch")


def _give_back(pool: WorkerPool, toolchain_tmp: str | None, threads: int) -> None:
    with _POOLS_LOCK:
        _POOLS.setdefault(_pool_key(toolchain_tmp, threads), []).append(pool)


def farm_prestart(toolchain_tmp: str | None, host_threads: dict[str, int], dask_worker: Any = None) -> int:
    """Runs on every Dask worker (Client.run, at the start of a build): one warm worker process per Dask worker
    thread, started now so their torch import overlaps the client's uploads. Returns how many it started."""
    threads = _threads_here(host_threads, dask_worker)
    want = _dask_threads(dask_worker)
    with _POOLS_LOCK:
        have = len(_POOLS.get(_pool_key(toolchain_tmp, threads), []))
    started = 0
    for _ in range(max(0, want - have)):
        pool = _new_pool(toolchain_tmp, threads)
        pool.warm(1)
        _give_back(pool, toolchain_tmp, threads)
        started += 1
    return started


def farm_run(payload: dict[str, Any]) -> dict[str, Any]:
    """Runs on a Dask worker: sandbox from the shared CAS, the action in a warm worker process, outputs to the CAS."""
    try:
        from distributed import get_worker

        where = f"{get_worker().address} ({socket.gethostname()})"
    except (ImportError, ValueError):
        where = f"dask ({socket.gethostname()})"
    shared = payload["open_store"](payload["shared"])
    base = _farm_base()
    base.mkdir(parents=True, exist_ok=True)
    sb = Path(tempfile.mkdtemp(dir=base, prefix="job-"))
    try:
        inputs, outputs, log = sb / "in", sb / "out", sb / "action.log"
        inputs.mkdir()
        outputs.mkdir()
        for rel, digest in payload["inputs"]:
            shared.place_blob(digest, inputs / rel)
        log.write_text(f"# {payload['description']}\n", encoding="utf-8")
        threads = _threads_here(payload.get("host_threads"))
        pool = _take_pool(payload.get("toolchain_tmp"), threads)
        limit, source = payload.get("timeout") or (0.0, "")  # the pool kills the action's process tree after it
        pool.submit("job", {"kind": payload["kind"], "spec": payload["spec"], "inputs": str(inputs),
                            "outputs": str(outputs), "log": str(log), "expect": payload.get("expect")},
                    float(limit) or None, str(source))
        key = str(payload.get("key") or "")
        _RUNNING[key] = pool
        results: list[Any] = []
        try:
            while not results and key not in _CANCELLED:
                results = pool.wait(1.0)
        finally:
            _RUNNING.pop(key, None)
            cancelled = key in _CANCELLED
            _CANCELLED.discard(key)
            if pool.busy:  # cancelled (or interrupted) mid-task: its worker is being killed; start afresh next time
                pool.kill_all()
            _give_back(pool, payload.get("toolchain_tmp"), threads)
        if cancelled or not results:
            return {"ok": False, "error": "cancelled", "duration_s": 0.0, "worker": where}
        res = dict(results[0].result)
        if res.get("ok"):
            outs: dict[str, list[Any]] = {}
            for name in payload["outputs"]:
                p = outputs / name
                if not p.is_file():
                    res = {"ok": False, "error": f"the action did not produce its declared output '{name}'",
                           "duration_s": res.get("duration_s", 0.0)}
                    break
                digest, size = shared.put_file(p)  # a blob the store has is not sent again
                outs[name] = [digest, size]
            else:
                res["outputs"] = outs
        res["worker"] = where
        try:
            res["log"] = log.read_text(encoding="utf-8", errors="replace")[-_LOG_TAIL:]
        except OSError:
            res["log"] = ""
        return res
    finally:
        shutil.rmtree(sb, ignore_errors=True)


def worker_toolchain() -> dict[str, Any]:
    """Runs on a Dask worker (Client.run): what this host would build with, as fingerprints record it."""
    from neuronbuild.analysis.plan_settings import find_neuronx_cc, neuronx_cc_version
    from neuronbuild.analysis.toolchain_versions import trace_toolchain
    from neuronbuild.platforms import cxx_version, host_isa

    out: dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid(), **trace_toolchain(),
                           "cxx": cxx_version(), "isa": host_isa()}
    try:
        cc = find_neuronx_cc(None)
        out["neuronx-cc"] = neuronx_cc_version(cc) if cc else None
    except Exception as e:  # noqa: BLE001 - a broken compiler is reported, not raised
        out["neuronx-cc"] = f"broken ({e})"
    return out
