"""One build end to end: loading -> analysis -> execution -> materialisation, returning a BuildResult."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from neuronbuild import incremental
from neuronbuild.analysis.planner import plan
from neuronbuild.cache.local import LocalCache
from neuronbuild.execution.env import action_environment
from neuronbuild.execution.local_executor import LocalExecutor
from neuronbuild.execution.scheduler import BuildResult, Scheduler
from neuronbuild.loading.target_graph import load_targets
from neuronbuild.packaging.materialize import materialize
from neuronbuild.workspace import Workspace


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


def run_build(ws: Workspace, req: BuildRequest, report: Callable[[str], None] | None = None,
              noop_key: str | None = None) -> BuildResult:
    """With `noop_key` (see neuronbuild.noop), a successful build leaves a stamp that lets the next no-op skip it all."""
    started = time.time_ns()
    load_cache = incremental.open_caches(req.cache_dir, ws.root)
    with incremental.analysis_gc():
        graph = load_targets(ws.root, req.patterns, ws.cwd_package, load_cache)
        ag = plan(graph)
    incremental.save_caches(req.cache_dir, ws.root, load_cache)
    cache = LocalCache(req.cache_dir)
    env = action_environment(cache.toolchain_tmp, cache.root / "home")
    executor = LocalExecutor(req.jobs, env)
    try:
        result = Scheduler(ws.root, cache, executor, req.keep_going, report).run(ag)
    finally:
        executor.shutdown(cancel=True)
    materialize(ws.root, ag, cache, {f.action.fingerprint for f in result.failures})
    if noop_key is not None:
        incremental.record_noop(noop_key, ws.root, ws.cwd_package, req.patterns, req.cache_dir, graph, ag, cache,
                                result.ok, started)
    return result


def print_report(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def patterns_or_default(patterns: Sequence[str]) -> tuple[str, ...]:
    return tuple(patterns) if patterns else ("//...",)
