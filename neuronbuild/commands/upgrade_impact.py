"""`neuronbuild upgrade-impact --toolchain torch=2.14.1 [PATTERNS]`: which results a toolchain change invalidates."""

from __future__ import annotations

import argparse
import json

from neuronbuild import streams
from neuronbuild.commands.common import add_context_args, add_output_arg, bad_input
from neuronbuild.errors import EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("upgrade-impact", help="fingerprints a toolchain version change would invalidate, per target, "
                                              "and the estimated recompile time")
    p.add_argument("patterns", nargs="*", help="target patterns (default //...)")
    p.add_argument("--jobs", "-j", type=int, default=None, help="workers assumed for the wall-time estimate")
    add_output_arg(p)
    add_context_args(p, what_if=True)


def run(args: argparse.Namespace) -> int:
    from neuronbuild.analysis.upgrade import upgrade_impact
    from neuronbuild.commands.common import bad_jobs, context_from_args
    from neuronbuild.execution.env import default_jobs
    from neuronbuild.execution.scheduler import needed_actions

    if not args.toolchain:
        return bad_input("upgrade-impact needs at least one --toolchain COMPONENT=VERSION")
    if err := bad_jobs(args):
        return bad_input(err)
    ctx = context_from_args(args)
    base_ctx = ctx.without_overrides()
    graph = ctx.load(args.patterns)
    base, new = base_ctx.plan(graph), ctx.plan(graph)
    from neuronbuild.plugins import toolchain_components

    known = toolchain_components()
    recorded = {k for a in base.actions.values() for k in a.versions}
    for name in ctx.settings.toolchain_overrides:
        if name not in known and name not in recorded:
            return bad_input(f"--toolchain: unknown component {name!r} (known: {', '.join(known)}, or a distribution "
                             "a model imports; no model here imports it)")
    cache = ctx.open_cache()
    _todo, cached = needed_actions(base, cache, probe=True)
    impact = upgrade_impact(base, new, ctx.settings.toolchain_overrides, ctx.history(cache), set(cached),
                            args.jobs or default_jobs())
    if args.output == "json":
        print(json.dumps(impact.to_json(), indent=1, sort_keys=True), file=streams.out())
    else:
        print("\n".join(impact.lines()), file=streams.out())
    return EXIT_OK
