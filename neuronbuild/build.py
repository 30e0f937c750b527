"""One build end to end: loading -> analysis -> execution -> materialisation, returning a BuildResult."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from neuronbuild import incremental
from neuronbuild.analysis.plan_settings import PlanSettings
from neuronbuild.analysis.planner import plan
from neuronbuild.cache.tiered import open_cache
from neuronbuild.execution.env import action_environment, undeclared_warning
from neuronbuild.execution.local_executor import LocalExecutor
from neuronbuild.execution.scheduler import BuildResult, Scheduler
from neuronbuild.loading.target_graph import load_targets
from neuronbuild.packaging.bundle import build_bundles
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
    settings: PlanSettings = field(default_factory=PlanSettings)  # --action-env, neuronx-cc
    remote_cache: str | None = None  # shared tier: a directory or s3://bucket/prefix
    remote_cache_readonly: bool = False
    s3_endpoint_url: str | None = None


def settings_notes(settings: PlanSettings, ag_has_neuron: bool) -> list[str]:
    """Said once per build: ignored compile-affecting variables, and NEFFs not produced without neuronx-cc."""
    notes = [w for w in (undeclared_warning(settings.action_env),) if w]
    if ag_has_neuron and settings.neuronx_cc is None:
        notes.append("note: no neuronx-cc found (--neuronx-cc PATH, $NEURONX_CC or PATH): Neuron targets get "
                     "lowered programs only; NEFFs were not produced")
    return notes


def run_build(ws: Workspace, req: BuildRequest, report: Callable[[str], None] | None = None,
              noop_key: str | None = None) -> BuildResult:
    """With `noop_key` (see neuronbuild.noop), a successful build leaves a stamp that lets the next no-op skip it all."""
    started = time.time_ns()
    load_cache = incremental.open_caches(req.cache_dir, ws.root)
    with incremental.analysis_gc():
        graph = load_targets(ws.root, req.patterns, ws.cwd_package, load_cache)
        ag = plan(graph, req.settings)
    incremental.save_caches(req.cache_dir, ws.root, load_cache)
    for note in settings_notes(req.settings, any(ct.platform != "cpu" for ct in ag.compiles)):
        (report or print_report)(note)
    cache = open_cache(req.cache_dir, req.remote_cache, req.remote_cache_readonly, req.s3_endpoint_url, report)
    env = action_environment(cache.toolchain_tmp, cache.root / "home", req.settings.action_env)
    executor = LocalExecutor(req.jobs, env)
    try:
        result = Scheduler(ws.root, cache, executor, req.keep_going, report).run(ag)
    finally:
        executor.shutdown(cancel=True)
    failed = {f.action.fingerprint for f in result.failures}
    try:
        materialize(ws.root, ag, cache, failed)
        if any(graph.targets[lbl].kind == "neuron_bundle" for lbl in graph.requested):
            bundles, skipped = build_bundles(ws.root, graph, ag, cache, failed)
            for b in bundles:
                (report or print_report)(
                    f"Bundle {b.label}: {b.archive} ({b.size} bytes{'' if b.written else ', up to date'})")
            for line in skipped:
                (report or print_report)(line)
    finally:
        cache.finish(keep=ag.actions)
    if noop_key is not None:
        incremental.record_noop(noop_key, ws.root, ws.cwd_package, req.patterns, req.cache_dir, graph, ag, cache,
                                result.ok, started)
    return result


def print_report(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def patterns_or_default(patterns: Sequence[str]) -> tuple[str, ...]:
    return tuple(patterns) if patterns else ("//...",)
