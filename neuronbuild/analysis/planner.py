"""Turns a TargetGraph into an ActionGraph by asking each requested target's rule kind (neuronbuild.plugins) for its
analysis: kinds return providers and register actions here; one trace per (model, graph, bucket) is shared by all.

Analysis runs on the generic engine (neuronbuild/engine.py; `AnalysisMemo` holds it): one node per target (key: its
Label) holding its provider and what it did, in order (providers it asked for, actions it added, compile targets and
bundles it registered), and what it read: its Target value and the files it digested (checked by the node function's
`unchanged`) and, recorded by the engine, the revision of every node it asked for. A node is replayed only when the
engine finds it valid; an analysis run again with an equal result keeps its revision (early cutoff). Batch commands run the same engine starting empty, the build server keeps it between commands: so the
server's plan is the one a fresh process makes, by construction."""

from __future__ import annotations

import functools
import itertools
from typing import Any

from neuronbuild.analysis.action_graph import ActionGraph
from neuronbuild.analysis.analysis_context import AnalysisContext
from neuronbuild.analysis.analysis_nodes import GROUP_ROOTS, AnalysisMemo, _make_group
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
    if memo is None:
        memo = AnalysisMemo(segments=False)
    memo.begin(settings)
    ctx = AnalysisContext(graph, settings, memo)
    segments = memo.segments if memo.keep_segments else None
    plans_actions = {kind: bool(r.plans_actions) for kind, r in plugins.rules().items()}
    targets = graph.targets
    roots = [lbl for lbl in graph.requested if plans_actions[targets[lbl].kind]]
    made: list[Label] = []
    provide = ctx.provider if errors is None else functools.partial(_provide_or_drop, ctx, errors)
    if segments is None:
        for lbl in roots:
            provide(lbl)
        return memo.action_graph(ctx.actions, tuple(ctx.compiles), dict(ctx.bundles))
    groups = memo.groups
    regroup: list[int] = []  # (slices provided otherwise: their groups are made afresh)
    closed = True  # (every root provided from a closed segment or group so far)
    for start in range(0, len(roots), GROUP_ROOTS):
        chunk = roots[start:start + GROUP_ROOTS]
        g = groups.get(start)
        if g is not None and g.roots == tuple(chunk) and ctx.use_group(g):
            closed = closed and g.closed
            continue
        regroup.append(start)
        for lbl in chunk:
            if not ctx.use_segment(lbl):
                if provide(lbl) is _DROPPED:
                    segments.pop(lbl, None)  # (no segment: a group made over this slice is none either)
                else:
                    made.append(lbl)
    topological = False
    if ctx._volatile_actions:  # (a volatile analysis added actions: they are in no segment)
        segments.clear()
        groups.clear()
    else:
        for lbl in made:
            seg = ctx.make_segment(lbl)
            if seg is None:
                segments.pop(lbl, None)
            else:
                segments[lbl] = seg
        if len(segments) > 2 * len(memo.entries) + 1000:  # (roots gone: keep the memory bounded)
            for lbl in [k for k in segments if k not in memo.entries]:
                del segments[lbl]
        if len(memo.retired) > 100_000:  # (forgetting them needs every segment gone that could hold one)
            segments.clear()
            groups.clear()
            memo.retired.clear()
        for start in regroup:
            g = _make_group(tuple(roots[start:start + GROUP_ROOTS]), segments)
            if g is None:
                groups.pop(start, None)
            else:
                groups[start] = g
            closed = closed and g is not None and g.closed
        for start in [k for k in groups if k >= len(roots)]:  # (fewer roots than before)
            del groups[start]
        # Providing the roots in order adds each one's segment's actions not yet added, in its order: the
        # registration order is topological when every segment's is (a group's is when its segments' are).
        topological = closed
    return memo.action_graph(ctx.actions, tuple(ctx.compiles), dict(ctx.bundles), topological)


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

