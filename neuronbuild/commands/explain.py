"""`neuronbuild explain PATTERNS`: for each action a build would execute, why (new identity, or the changed fields)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from neuronbuild import streams
from neuronbuild.commands.common import add_context_args, add_limit_args, add_output_arg, bad_input
from neuronbuild.errors import EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("explain", help="why each action that would execute is not cached (the fields that changed)")
    p.add_argument("patterns", nargs="*", help="target patterns (default //...)")
    p.add_argument("--key", metavar="FINGERPRINT", help="the named parts of this action's key (a fingerprint "
                                                       "prefix), each with its digest, and those that differ from "
                                                       "its identity's most recent result")
    add_output_arg(p)
    add_limit_args(p)  # (each action to execute is shown with the limits a build with these flags gives it)
    add_context_args(p, what_if=True)


def run(args: argparse.Namespace) -> int:
    from neuronbuild.analysis.explain import display_order, explain, ignored_options
    from neuronbuild.commands.common import context_from_args, limit_settings
    from neuronbuild.execution.cutoff import reason
    from neuronbuild.execution.scheduler import needed_actions

    try:
        settings = limit_settings(args)
    except ValueError as bad:
        return bad_input(str(bad))
    ctx = context_from_args(args)
    graph = ctx.load(args.patterns)
    ag = ctx.plan(graph)
    cache = ctx.open_cache()
    if args.key is not None:
        return _key(args, ag, cache, ctx.history(cache))
    todo, cached = needed_actions(ag, cache, probe=True)
    found = explain(ag, todo, ctx.history(cache))
    reused = _cutoffs(ag, cache, cached)
    order = {a.fingerprint: i for i, a in enumerate(display_order(ag, [a for a, _prev in reused]))}
    reused.sort(key=lambda r: order[r[0].fingerprint])
    # Early cutoff may skip an action whose inputs re-run, when it has an earlier result to find again
    running = {t.fingerprint for t in todo}
    waits = {e.action.fingerprint for e in found if e.may_cut_off and any(d.action in running
                                                                          for d in e.action.dep_inputs)}
    ignored = ignored_options(ag)
    limits = _limits(ctx, graph, ag, cache, [e.action for e in found], settings)
    if args.output == "json":
        print(json.dumps({"total": len(ag.actions), "cached": len(cached),
                          "ignored_options": [{"label": str(ct.label), "toolchain": ct.toolchain,
                                               "options": list(ct.ignored_options)} for ct, _text in ignored],
                          "execute": [e.to_json() | {"early_cutoff": e.action.fingerprint in waits,
                                                     "limits": limits[e.action.fingerprint]} for e in found],
                          "cutoff": [{"description": a.describe(), "fingerprint": a.fingerprint, "reuses": prev,
                                      "reason": reason(a)} for a, prev in reused]},
                         indent=1, sort_keys=True), file=streams.out())
        return EXIT_OK
    for e in found:
        print("\n".join(e.lines()), file=streams.out())
        print(f"  limits: {limits[e.action.fingerprint]['text']}", file=streams.out())
        if e.action.fingerprint in waits:
            print(f"  (skipped if its inputs re-run to identical outputs: {reason(e.action)})", file=streams.out())
    for a, prev in reused:
        print(f"{a.describe()}  ({a.fingerprint[:12]})\n  {reason(a)}: cached, the result of {prev[:12]}", file=streams.out())
    for _ct, text in ignored:
        print(f"options: {text}", file=streams.out())
    if found:
        from neuronbuild.execution.limits import host_offers

        print(f"{len(found)} of {len(ag.actions)} actions would execute ({len(cached)} cached); their limits are "
              f"enforced by {host_offers()}", file=streams.out())
    else:
        print(f"nothing would execute: all {len(ag.actions)} actions are cached", file=streams.out())
    return EXIT_OK


def _cutoffs(ag: Any, cache: Any, cached: list[str]) -> list[tuple[Any, str]]:
    """Cached actions whose result is an earlier one's, reused because their inputs' outputs were unchanged."""
    from neuronbuild.execution import cutoff

    out = []
    for fp in cached:
        a = ag.actions[fp]
        if not a.dep_inputs:
            continue
        prev = cutoff.reused_from(cache, fp) or cutoff.peek(a, cache, probe=True)  # local tier only
        if prev:
            out.append((a, prev))
    return out


def _key(args: argparse.Namespace, ag: Any, cache: Any, history: Any) -> int:
    """`explain --key FP`: the action's key as named parts, and which differ from the nearest earlier record."""

    from neuronbuild.analysis.key_parts import differing, key_parts

    prefix = args.key.strip().lower()
    found = [a for fp, a in ag.actions.items() if fp.startswith(prefix)] if prefix else []
    if len(found) != 1:
        why = "no action of this plan has" if not found else f"{len(found)} actions of this plan have"
        return bad_input(f"--key {args.key}: {why} a fingerprint starting so (explain lists them)")
    a = found[0]
    parts = key_parts(a.record)
    latest = history.latest(a.identity)
    prev = history.result(latest.fingerprint) if latest is not None and latest.fingerprint != a.fingerprint else None
    differs = differing(parts, prev.record) if prev is not None else []
    cached = cache.peek(a.fingerprint)
    if args.output == "json":
        print(json.dumps({"description": a.describe(), "fingerprint": a.fingerprint, "cached": cached,
                          "parts": [{"name": p.name, "digest": p.digest, "value": p.value} for p in parts],
                          "compared_with": latest.fingerprint if prev is not None and latest is not None else None,
                          "differs": differs}, indent=1, sort_keys=True, default=str), file=streams.out())
        return EXIT_OK
    print(f"{a.describe()}  ({a.fingerprint})", file=streams.out())
    width = max(len(p.name) for p in parts)
    for p in parts:
        mark = "*" if p.name in differs else " "
        print(f" {mark}{p.name:<{width}}  {p.digest[:12]}  {p.text()}", file=streams.out())
    if cached:
        print("cached: this key has a result", file=streams.out())
    elif prev is not None and latest is not None:
        print(f"not cached; against its identity's most recent result ({latest.fingerprint[:12]}) "
              f"{len(differs)} part{' differs' if len(differs) == 1 else 's differ'} (*): {', '.join(differs)}", file=streams.out())
    elif latest is not None and latest.fingerprint == a.fingerprint:
        print("not cached: its result's outputs are no longer complete in the cache", file=streams.out())
    else:
        print("not cached: no earlier record of this identity to compare with", file=streams.out())
    return EXIT_OK


def _limits(ctx: Any, graph: Any, ag: Any, cache: Any, todo: list[Any], settings: Any) -> dict[str, dict[str, Any]]:
    """{fingerprint: the limits a build would give the action (execution/limits.py), as JSON and a line}."""
    from neuronbuild.analysis.estimate import Estimator, declared_weight_mb
    from neuronbuild.build import action_timeouts
    from neuronbuild.execution.limits import for_action

    est = Estimator(ctx.history(cache))
    weight_mb = declared_weight_mb(todo, ag.actions, ctx.workspace.root)
    attrs = action_timeouts(graph, ag)
    out = {}
    for a in todo:
        peak = est.peak_mb(a, weight_mb[a.fingerprint])
        lim = for_action(settings, a.kind, a.toolchain, est.estimate(a).seconds, peak.mb, attrs.get(a.fingerprint),
                         peak.recorded)
        out[a.fingerprint] = {"timeout_s": lim.timeout_s, "timeout_source": lim.timeout_source,
                              "memory_mb": lim.memory_mb, "memory_source": lim.memory_source, "pids": lim.pids,
                              "pids_source": lim.pids_source, "text": lim.describe()}
    return out
