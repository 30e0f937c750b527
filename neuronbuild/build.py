"""One build end to end: loading -> analysis -> execution -> materialisation (+ bundles), returning a BuildResult."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from neuronbuild import after_answer, incremental, plugins, streams
from neuronbuild.analysis.action_graph import ActionGraph
from neuronbuild.analysis.explain import ignored_option_warnings
from neuronbuild.cache.farm_store import open_farm_store
from neuronbuild.cache.gc import auto_gc
from neuronbuild.cache.local import LocalCache
from neuronbuild.cache.roots import record_roots
from neuronbuild.context import BuildContext
from neuronbuild.errors import UserInputError
from neuronbuild.execution.env import action_environment, undeclared_warning
from neuronbuild.execution.events import EventBus, JsonLinesWriter, Listener
from neuronbuild.execution.jobs import Executor
from neuronbuild.execution.limits import LimitSettings
from neuronbuild.execution.progress import make_progress
from neuronbuild.execution.scheduler import BuildResult, Scheduler, SchedulerOptions
from neuronbuild.packaging.materialize import materialize
from neuronbuild.plugin_api.toolchain import PlanSettings
from neuronbuild.workspace import OUTPUT_DIR

if TYPE_CHECKING:
    from neuronbuild.loading.target_graph import TargetGraph
    from neuronbuild.report.invocation import Invocation


@dataclass(frozen=True)
class BuildRequest:
    """What the user asked for, beyond the build context: which targets and how to run them."""

    patterns: tuple[str, ...]
    jobs: int
    keep_going: bool = False
    retries: int = 0
    local_ram_mb: int = 0  # 0: no cap
    executor: str = "local"
    scheduler: str | None = None  # Dask scheduler address (--executor dask)
    profile: Path | None = None
    event_file: Path | None = None
    action_timeout: float = 0.0  # seconds an action may run; 0: no limit
    limits: LimitSettings | None = None  # each action's limits (None: automatic but action_timeout; execution/limits.py)


def settings_notes(settings: PlanSettings, ag: ActionGraph, toolchains: Sequence[str] | None = None) -> list[str]:
    """Said once per build: ignored compile-affecting variables, and what the toolchains want said (e.g. that no
    NEFFs are produced without neuronx-cc). `toolchains`: only these (default: every one the plan uses)."""
    notes = [w for w in (undeclared_warning(settings.action_env),) if w]
    for name in ag.toolchains if toolchains is None else toolchains:
        notes.extend(plugins.toolchain(name).notes(settings))
    return notes


def toolchain_notes(settings: PlanSettings, ag: ActionGraph, executed: Sequence[str]) -> list[str]:
    """The toolchains' notes, once per build, from the toolchains that ran actions in it: a plan or a fully cached
    build made no graphs, so it has nothing to say about how they were made."""
    ran = list(dict.fromkeys(ag.actions[fp].toolchain for fp in executed if ag.actions[fp].toolchain))
    return [n for name in ran for n in plugins.toolchain(name).notes(settings)]


def action_timeouts(graph: TargetGraph, ag: ActionGraph) -> dict[str, tuple[float, str]]:
    """{fingerprint: (seconds, what set it)} from neuron_compile `timeout` attributes; an action shared by several
    targets (a trace) gets the most generous one."""
    out: dict[str, tuple[float, str]] = {}
    for ct in ag.compiles:
        t = graph.targets.get(ct.label)
        limit = float(t.attrs.get("timeout") or 0.0) if t is not None else 0.0
        if limit <= 0:
            continue
        for _bucket, fp in ct.buckets:
            for a in ag.closure(fp):
                if limit > out.get(a, (0.0, ""))[0]:
                    out[a] = (limit, f"timeout = {limit:g} on {ct.label}")
    return out


def _check_keys_unreadable(ctx: BuildContext, env: Mapping[str, str]) -> None:
    """A private key that model code could read would let any model sign forged records or releases: refused."""
    from neuronbuild.execution.confine import readable_by_actions
    from neuronbuild.runtime.signing import key_too_open

    keys = (("--remote-cache-signing-key", ctx.cache.signing_key),
            ("--signing-key", str(ctx.signing_key) if ctx.signing_key else None))
    for flag, key in keys:
        too_open = key_too_open(key) if key else None
        if too_open is not None:
            raise UserInputError(f"{flag}: {too_open}")
        root = readable_by_actions(key, env) if key else None
        if root is not None:
            raise UserInputError(f"{flag} {key}: actions can read it (it is under {root}, which confined model code "
                                 "may read): keep the key elsewhere (e.g. a 0600 file under your home directory)")


def make_executor(ctx: BuildContext, req: BuildRequest, cache: LocalCache,
                  timeouts: dict[str, tuple[float, str]] | None = None) -> Executor:
    root = ctx.workspace.root
    env = action_environment(cache.toolchain_tmp, cache.root / "home", ctx.settings.action_env)
    _check_keys_unreadable(ctx, env)
    if req.executor == "local":
        from neuronbuild.execution.local_executor import FRESH_POOLS, LocalExecutor

        return LocalExecutor(root, cache, req.jobs, env, req.action_timeout, timeouts, req.limits,
                             ctx.command.pools if ctx.command is not None and ctx.command.pools is not None else
                             FRESH_POOLS)
    from neuronbuild.execution.dask_executor import DaskExecutor

    remote = ctx.cache.remote
    store = functools.partial(open_farm_store, endpoint_url=ctx.cache.s3_endpoint_url)
    if req.executor == "dask":
        assert req.scheduler and remote
        return DaskExecutor(root, cache, remote, req.scheduler, req.jobs, store,
                            action_timeout=req.action_timeout, timeouts=timeouts, limits=req.limits)
    # dask-local: workers on this machine can use the local cache as the shared store.
    return DaskExecutor(root, cache, remote or str(ctx.cache.dir), None, req.jobs, store, same=remote is None,
                        toolchain_tmp=cache.toolchain_tmp, action_timeout=req.action_timeout, timeouts=timeouts,
                        limits=req.limits)


def default_listeners(ctx: BuildContext, req: BuildRequest) -> list[Listener]:
    from neuronbuild.execution.profile import TraceProfile

    listeners: list[Listener] = [make_progress(ctx.verbosity)]
    if req.event_file is not None:
        listeners.append(JsonLinesWriter(req.event_file))
    if req.profile is not None:
        listeners.append(TraceProfile(req.profile))
    return listeners


def built_roots(ag: ActionGraph) -> dict[str, set[str]]:
    """{compile or bundle label: every action fingerprint its outputs came from} for the build roots record."""
    out: dict[str, set[str]] = {}
    for ct in ag.compiles:
        out[str(ct.label)] = set().union(*(ag.closure(fp, ct.ships_of(fp)) for _bucket, fp in ct.buckets))
    for lbl, info in ag.bundles.items():
        out[str(lbl)] = set().union(*(out[str(s)] for s in info.srcs))
    return out


def run_build(ctx: BuildContext, req: BuildRequest, noop_key: str | None = None,
              invocation: Invocation | None = None) -> BuildResult:
    """Raises KeyboardInterrupt after ending running actions cleanly if interrupted (nothing half-written is cached).

    With `noop_key` (see neuronbuild.noop), a successful build leaves a stamp that lets the next no-op skip it all.
    With `invocation` (neuronbuild.report), the build is recorded in the output base, also when it fails or stops."""
    if invocation is None:
        return _run_build(ctx, req, noop_key, None)
    try:
        result = _run_build(ctx, req, noop_key, invocation)
    except BaseException as e:
        if invocation.ag is not None:  # (bad input before planning is not an invocation worth a page)
            invocation.page = invocation.store.page(invocation.id)
            after_answer.later(functools.partial(
                invocation.finish, "interrupted" if isinstance(e, KeyboardInterrupt) else "error"))
        raise
    # In the build server the record is written and its page started once the answer is sent (~0.2 s at 1,000
    # graphs); the page's path, printed with the answer, is known now.
    invocation.page = invocation.store.page(invocation.id)
    after_answer.later(functools.partial(invocation.finish, "ok" if result.ok else "failed", result.not_started,
                                         noop_key=noop_key, results=result.results))
    return result


def _run_build(ctx: BuildContext, req: BuildRequest, noop_key: str | None,
               invocation: Invocation | None) -> BuildResult:
    started = time.time_ns()
    root = ctx.workspace.root
    graph = ctx.load(req.patterns)
    errors: list[UserInputError] | None = [] if req.keep_going else None
    ag = ctx.plan(graph, errors=errors)
    for e in errors or ():  # (said now, even when quiet: the build goes on without these targets)
        print(str(e), file=streams.err(), flush=True)
    for note in settings_notes(ctx.settings, ag, toolchains=()):  # toolchain notes: after execution, if it ran any
        ctx.report(note)
    for note in ignored_option_warnings(graph, ag):
        ctx.report(note)
    cache = ctx.open_cache()
    bus = EventBus(default_listeners(ctx, req))
    if invocation is not None:
        invocation.ag, invocation.cache = ag, cache
        bus.listeners.append(invocation.recorder)
    try:
        try:
            executor = make_executor(ctx, req, cache, action_timeouts(graph, ag))
            try:
                options = SchedulerOptions(req.keep_going, req.retries, req.local_ram_mb)
                result = Scheduler(root, cache, executor, options, bus).run(ag)
            finally:
                executor.shutdown()
        finally:
            bus.close()
        for note in toolchain_notes(ctx.settings, ag, result.executed):
            ctx.report(note)
        start = len(f"{root}/{OUTPUT_DIR}/")  # (materialize's directories are under it: no pathlib per target)
        outputs = [f"{str(d)[start:]}/" for d in materialize(root, ag, cache, result.results)]
        if ag.bundles:
            from neuronbuild.packaging.bundle import build_bundles

            bundles, skipped = build_bundles(root, graph, ag, cache, result.results, ctx.signing_key)
            outputs += [str(b.archive.relative_to(root / OUTPUT_DIR)) for b in bundles]
            for b in bundles:
                ctx.report(f"Bundle {b.label}: {b.archive} ({b.size} bytes{'' if b.written else ', up to date'})")
            for line in skipped:
                ctx.report(line)
        if outputs:
            result = dataclasses.replace(result, outputs_dir=str(root / OUTPUT_DIR), outputs=tuple(outputs))
        if errors:
            result = dataclasses.replace(result, analysis_errors=tuple(map(str, errors)))
        cache.stats.summary = (len(result.executed), len(result.cached))  # for `cache stats`, as summarised
        if result.ok:
            record_roots(cache.root, root, built_roots(ag), graph.packages, (str(t) for t in graph.targets))
    finally:
        cache.finish()
        auto_gc(cache, set(ag.actions))
    if noop_key is not None:  # (in the build server: after the answer, before its next command)
        where = result.summary().rpartition("\n")[2] if result.outputs_dir else ""  # "Outputs in ..."
        after_answer.later(functools.partial(incremental.record_noop, noop_key, root, ctx.workspace.cwd_package,
                                             req.patterns, ctx.cache.dir, graph, ag, cache, result.results, result.ok,
                                             started, where))
    return result
