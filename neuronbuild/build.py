"""One build end to end: loading -> analysis -> execution -> materialisation, returning a BuildResult."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from neuronbuild.analysis.planner import plan
from neuronbuild.cache.tiered import open_cache
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
    remote_cache: str | None = None  # shared tier: a directory or s3://bucket/prefix
    remote_cache_readonly: bool = False
    s3_endpoint_url: str | None = None


def run_build(ws: Workspace, req: BuildRequest, report: Callable[[str], None] | None = None) -> BuildResult:
    graph = load_targets(ws.root, req.patterns, ws.cwd_package)
    ag = plan(graph)
    cache = open_cache(req.cache_dir, req.remote_cache, req.remote_cache_readonly, req.s3_endpoint_url, report)
    env = action_environment(cache.toolchain_tmp, cache.root / "home")
    executor = LocalExecutor(req.jobs, env)
    try:
        result = Scheduler(ws.root, cache, executor, req.keep_going, report).run(ag)
    finally:
        executor.shutdown(cancel=True)
    try:
        materialize(ws.root, ag, cache, {f.action.fingerprint for f in result.failures})
    finally:
        cache.finish(keep=ag.actions)
    return result


def print_report(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def patterns_or_default(patterns: Sequence[str]) -> tuple[str, ...]:
    return tuple(patterns) if patterns else ("//...",)
