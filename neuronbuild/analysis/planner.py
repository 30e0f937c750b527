"""Turns a TargetGraph into an ActionGraph by asking each requested target's rule kind (neuronbuild.plugins) for its
analysis: kinds return providers and register actions here; one trace per (model, graph, bucket) is shared by all.

Analysis runs on the generic engine (neuronbuild/engine.py; `AnalysisMemo` holds it): one node per target (key: its
Label) holding its provider and what it did, in order (providers it asked for, actions it added, compile targets and
bundles it registered), and what it read: its Target value and the files it digested (checked by the node function's
`unchanged`) and, recorded by the engine, the revision of every node it asked for. A node is replayed only when the
engine finds it valid; an analysis run again with an equal result keeps its revision (early cutoff). Batch commands
run the same engine starting empty, the build server keeps it between commands: so the server's plan is the one a fresh
process makes, by construction. The server's engine also keeps two declared projections (analysis_nodes.SEGMENTS,
GROUPS): each requested root's whole analysis and each slice of GROUP_ROOTS roots', provided in one step while every
node they hold is current."""

from __future__ import annotations

import functools
import itertools
from typing import Any

from neuronbuild.analysis.action_graph import ActionGraph
from neuronbuild.analysis.analysis_context import AnalysisContext
from neuronbuild.analysis.analysis_nodes import GROUP_ROOTS, GROUPS, SEGMENTS, AnalysisMemo, _make_group
from neuronbuild.errors import UserInputError
from neuronbuild.loading.labels import Label
from neuronbuild.loading.target_graph import TargetGraph
from neuronbuild.plugin_api import registry as plugins
from neuronbuild.plugin_api.toolchain import PlanSettings

__all__ = ["plan"]


def plan(graph: TargetGraph, settings: PlanSettings | None = None, memo: AnalysisMemo | None = None,
         errors: list[UserInputError] | None = None) -> ActionGraph:
    """Analyse every requested target whose kind plans actions (compiles; bundles and the compiles they ship).

    `errors` (--keep-going): a requested target whose analysis fails (bad input: UserInputError) is appended there and
    left out of the plan, with everything its analysis added (a target depending on it fails with it); the others are
    planned as without it. None: the first analysis error is raised.

    `settings` adds declared --action-env values (to every record, when any), toolchain configuration (e.g. the
    neuronx-cc version) and toolchain overrides (what-if plans for explain and upgrade-impact).

    `memo`: the analysis engine's state (the build server keeps one per workspace and settings); None starts it empty
    (batch mode). Either way the same engine runs, so the plan is the one a fresh process makes."""
    settings = settings or PlanSettings()
    kept = memo is not None  # (the server's engine: it keeps segments and groups; a batch one is used once, without)
    if memo is None:
        memo = AnalysisMemo()
    memo.begin(settings)
    ctx = AnalysisContext(graph, settings, memo)
    plans_actions = {kind: bool(r.plans_actions) for kind, r in plugins.rules().items()}
    targets = graph.targets
    roots = [lbl for lbl in graph.requested if plans_actions[targets[lbl].kind]]
    provide = ctx.provider if errors is None else functools.partial(_provide_or_drop, ctx, errors)
    if not kept:
        for lbl in roots:
            provide(lbl)
        return memo.action_graph(ctx.actions, tuple(ctx.compiles), dict(ctx.bundles))
    engine = memo.engine
    segments, groups = engine.kept(SEGMENTS) or {}, engine.kept(GROUPS) or {}
    made: list[Label] = []  # (roots provided otherwise: their segments are made afresh)
    regroup: list[int] = []  # (slices provided otherwise: their groups are made afresh)
    closed = True  # (every root provided from a closed segment or group so far)
    for start in range(0, len(roots), GROUP_ROOTS):
        chunk = tuple(roots[start:start + GROUP_ROOTS])
        g = groups.get(start)
        if g is not None and g.roots == chunk and ctx.use_group(g):
            closed = closed and g.closed
            continue
        regroup.append(start)
        for lbl in chunk:
            seg = segments.get(lbl)
            if seg is None or not ctx.use_segment(seg):
                if provide(lbl) is _DROPPED:
                    segments.pop(lbl, None)  # (no segment: a group made over this slice is none either)
                else:
                    made.append(lbl)
    if ctx._volatile_actions:  # (a volatile analysis added actions: they are in no segment)
        engine.keep(SEGMENTS, None)
        engine.keep(GROUPS, None)
        return memo.action_graph(ctx.actions, tuple(ctx.compiles), dict(ctx.bundles))
    for lbl in made:
        seg = ctx.make_segment(lbl)
        if seg is None:
            segments.pop(lbl, None)
        else:
            segments[lbl] = seg
    if len(segments) > 2 * len(memo.entries) + 1000:  # (roots gone: keep the memory bounded)
        segments = {lbl: seg for lbl, seg in segments.items() if lbl in memo.entries}
    groups = {start: g for start, g in groups.items() if start < len(roots)}  # (fewer roots than before)
    for start in regroup:
        g = groups[start] = _make_group(tuple(roots[start:start + GROUP_ROOTS]), segments)
        closed = closed and g is not None and g.closed
    engine.keep(SEGMENTS, segments)
    engine.keep(GROUPS, groups)  # (a slice without a group: None)
    # Providing the roots in order adds each one's segment's actions not yet added, in its order: the registration
    # order is topological when every segment's is (a group's is when its segments' are).
    return memo.action_graph(ctx.actions, tuple(ctx.compiles), dict(ctx.bundles), closed)


_DROPPED = object()


def _provide_or_drop(ctx: AnalysisContext, errors: list[UserInputError], label: Label) -> Any:
    """ctx.provider(label), or, when its analysis is bad input, the error appended to `errors` and whatever that
    analysis registered (actions, compile targets, bundles) removed again: _DROPPED. Providers of the targets it
    analysed successfully on the way (its model, a compile a bundle ships) stay; shared traces and weights actions
    are re-added by the next target that asks for them."""
    actions, compiles, bundles = ctx.actions, ctx.compiles, ctx.bundles
    n_actions, n_compiles, had_bundles = len(actions), len(compiles), set(bundles)
    try:
        return ctx.provider(label)
    except UserInputError as e:
        for fp in list(itertools.islice(actions, n_actions, None)):
            del actions[fp]
        del compiles[n_compiles:]
        for lbl in [b for b in bundles if b not in had_bundles]:
            dict.__delitem__(bundles, lbl)
        if any(str(e) == str(seen) for seen in errors):  # (the error of a target it depends on, said already)
            from neuronbuild.loading.target_graph import locate

            e = UserInputError(f"{label} is not built: a target it depends on failed analysis (above)",
                               locate(ctx.graph, ctx.target(label)))
        errors.append(e)
        return _DROPPED

