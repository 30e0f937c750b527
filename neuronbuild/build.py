"""One build end to end: loading -> analysis -> execution -> materialisation, returning a BuildResult."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from neuronbuild.analysis.planner import plan
from neuronbuild.cache.local import LocalCache
from neuronbuild.execution.env import action_environment
from neuronbuild.execution.events import EventBus, JsonLinesWriter, Listener
from neuronbuild.execution.jobs import Executor
from neuronbuild.execution.progress import NORMAL, make_progress
from neuronbuild.execution.scheduler import BuildResult, Scheduler, SchedulerOptions
from neuronbuild.loading.target_graph import load_targets
from neuronbuild.packaging.materialize import materialize
from neuronbuild.workspace import Workspace

EXECUTORS = ("local", "dask", "dask-local")


def default_jobs() -> int:
    """The Neuron docs' default of 8 parallel compile workers, capped by this machine's cores."""
    return max(1, min(8, os.cpu_count() or 1))


@dataclass(frozen=True)
class BuildRequest:
    """What the user asked for."""

    patterns: tuple[str, ...]
    cache_dir: Path
    jobs: int
    keep_going: bool = False
    retries: int = 0
    local_ram_mb: int = 0  # 0: no cap
    executor: str = "local"
    scheduler: str | None = None  # Dask scheduler address (--executor dask)
    remote_cache: str | None = None  # the shared cache directory (required by --executor dask)
    verbosity: int = NORMAL
    profile: Path | None = None
    event_file: Path | None = None


def make_executor(ws: Workspace, req: BuildRequest, cache: LocalCache) -> Executor:
    if req.executor == "local":
        from neuronbuild.execution.local_executor import LocalExecutor

        return LocalExecutor(ws.root, cache, req.jobs, action_environment(cache.toolchain_tmp, cache.root / "home"))
    from neuronbuild.execution.dask_executor import DaskExecutor

    if req.executor == "dask":
        assert req.scheduler and req.remote_cache
        return DaskExecutor(ws.root, cache, Path(req.remote_cache), req.scheduler, req.jobs)
    # dask-local: workers on this machine can use the local cache as the shared tier.
    shared = Path(req.remote_cache) if req.remote_cache else req.cache_dir
    return DaskExecutor(ws.root, cache, shared, None, req.jobs, toolchain_tmp=cache.toolchain_tmp)


def default_listeners(req: BuildRequest) -> list[Listener]:
    from neuronbuild.execution.profile import TraceProfile

    listeners: list[Listener] = [make_progress(req.verbosity)]
    if req.event_file is not None:
        listeners.append(JsonLinesWriter(req.event_file))
    if req.profile is not None:
        listeners.append(TraceProfile(req.profile))
    return listeners


def run_build(ws: Workspace, req: BuildRequest, listeners: Sequence[Listener] | None = None) -> BuildResult:
    """Raises KeyboardInterrupt after ending running actions cleanly if interrupted (nothing half-written is cached)."""
    graph = load_targets(ws.root, req.patterns, ws.cwd_package)
    ag = plan(graph)
    cache = LocalCache(req.cache_dir)
    bus = EventBus(default_listeners(req) if listeners is None else listeners)
    try:
        executor = make_executor(ws, req, cache)
        try:
            options = SchedulerOptions(req.keep_going, req.retries, req.local_ram_mb)
            result = Scheduler(ws.root, cache, executor, options, bus).run(ag)
        finally:
            executor.shutdown()
    finally:
        bus.close()
    materialize(ws.root, ag, cache, {f.action.fingerprint for f in result.failures})
    return result


def patterns_or_default(patterns: Sequence[str]) -> tuple[str, ...]:
    return tuple(patterns) if patterns else ("//...",)
