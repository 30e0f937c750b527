"""One build end to end: loading -> analysis -> execution -> materialisation (+ bundles), returning a BuildResult."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from neuronbuild import incremental
from neuronbuild.analysis.plan_settings import PlanSettings
from neuronbuild.analysis.planner import plan
from neuronbuild.cache.local import LocalCache
from neuronbuild.cache.tiered import open_cache
from neuronbuild.execution.env import action_environment, undeclared_warning
from neuronbuild.execution.events import EventBus, JsonLinesWriter, Listener
from neuronbuild.execution.jobs import Executor
from neuronbuild.execution.progress import NORMAL, QUIET, make_progress
from neuronbuild.execution.scheduler import BuildResult, Scheduler, SchedulerOptions
from neuronbuild.loading.target_graph import load_targets
from neuronbuild.packaging.materialize import materialize
from neuronbuild.workspace import OUTPUT_DIR, Workspace

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
    remote_cache: str | None = None  # shared tier: a directory or s3://bucket/prefix (a directory for Dask)
    remote_cache_readonly: bool = False
    s3_endpoint_url: str | None = None
    settings: PlanSettings = field(default_factory=PlanSettings)  # --action-env, neuronx-cc
    verbosity: int = NORMAL
    profile: Path | None = None
    event_file: Path | None = None


def settings_notes(settings: PlanSettings, ag_has_neuron: bool) -> list[str]:
    """Said once per build: ignored compile-affecting variables, and NEFFs not produced without neuronx-cc."""
    notes = [w for w in (undeclared_warning(settings.action_env),) if w]
    note = neuronx_cc_note(settings)
    if ag_has_neuron and note:
        notes.append(note)
    return notes


def neuronx_cc_note(settings: PlanSettings) -> str | None:
    """Said once by a build that made Neuron graphs without neuronx-cc (not by plans or fully cached builds)."""
    if settings.neuronx_cc is not None:
        return None
    return ("note: no neuronx-cc found (--neuronx-cc PATH, $NEURONX_CC or PATH): Neuron targets get lowered "
            "programs only; NEFFs were not produced")


def make_executor(ws: Workspace, req: BuildRequest, cache: LocalCache) -> Executor:
    env = action_environment(cache.toolchain_tmp, cache.root / "home", req.settings.action_env)
    if req.executor == "local":
        from neuronbuild.execution.local_executor import LocalExecutor

        return LocalExecutor(ws.root, cache, req.jobs, env)
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


def run_build(ws: Workspace, req: BuildRequest, listeners: Sequence[Listener] | None = None,
              noop_key: str | None = None) -> BuildResult:
    """Raises KeyboardInterrupt after ending running actions cleanly if interrupted (nothing half-written is cached).

    With `noop_key` (see neuronbuild.noop), a successful build leaves a stamp that lets the next no-op skip it all."""

    def report(msg: str) -> None:
        if req.verbosity != QUIET or msg.startswith(("warning", "error")):
            print(msg, file=sys.stderr, flush=True)

    started = time.time_ns()
    load_cache = incremental.open_caches(req.cache_dir, ws.root)
    with incremental.analysis_gc():
        graph = load_targets(ws.root, req.patterns, ws.cwd_package, load_cache)
        ag = plan(graph, req.settings)
    incremental.save_caches(req.cache_dir, ws.root, load_cache)
    for note in settings_notes(req.settings, False):  # the neuronx-cc note: below, once Neuron graphs were made
        report(note)
    cache = open_cache(req.cache_dir, req.remote_cache, req.remote_cache_readonly, req.s3_endpoint_url, report)
    bus = EventBus(default_listeners(req) if listeners is None else listeners)
    try:
        try:
            executor = make_executor(ws, req, cache)
            try:
                options = SchedulerOptions(req.keep_going, req.retries, req.local_ram_mb)
                result = Scheduler(ws.root, cache, executor, options, bus).run(ag)
            finally:
                executor.shutdown()
        finally:
            bus.close()
        made = {ag.actions[fp].platform for fp in result.executed if ag.actions[fp].kind == "compile"}
        cc_note = neuronx_cc_note(req.settings)
        if made - {"cpu"} and cc_note:
            report(cc_note)
        failed = {f.action.fingerprint for f in result.failures}
        outputs = [str(d.relative_to(ws.root / OUTPUT_DIR)) + "/" for d in materialize(ws.root, ag, cache, failed)]
        if any(graph.targets[lbl].kind == "neuron_bundle" for lbl in graph.requested):
            from neuronbuild.packaging.bundle import build_bundles

            bundles, skipped = build_bundles(ws.root, graph, ag, cache, failed)
            outputs += [str(b.archive.relative_to(ws.root / OUTPUT_DIR)) for b in bundles]
            for b in bundles:
                report(f"Bundle {b.label}: {b.archive} ({b.size} bytes{'' if b.written else ', up to date'})")
            for line in skipped:
                report(line)
        if outputs:
            result = dataclasses.replace(result, outputs_dir=str(ws.root / OUTPUT_DIR), outputs=tuple(outputs))
    finally:
        cache.finish(keep=ag.actions)
    if noop_key is not None:
        incremental.record_noop(noop_key, ws.root, ws.cwd_package, req.patterns, req.cache_dir, graph, ag, cache,
                                result.ok, started)
    return result


def patterns_or_default(patterns: Sequence[str]) -> tuple[str, ...]:
    return tuple(patterns) if patterns else ("//...",)
