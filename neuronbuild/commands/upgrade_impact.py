"""`neuronbuild upgrade-impact --toolchain torch=2.14.1 [PATTERNS]`: which results a toolchain change invalidates."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from neuronbuild.commands.common import add_cache_args
from neuronbuild.commands.plan import add_output_arg, add_settings_args
from neuronbuild.errors import EXIT_BAD_INPUT, EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("upgrade-impact", help="fingerprints a toolchain version change would invalidate, per target, "
                                              "and the estimated recompile time")
    p.add_argument("patterns", nargs="*", help="target patterns (default //...)")
    p.add_argument("--jobs", "-j", type=int, default=None, help="workers assumed for the wall-time estimate")
    add_output_arg(p)
    add_cache_args(p)
    add_settings_args(p, what_if=True)


def run(args: argparse.Namespace) -> int:
    from neuronbuild.analysis.planner import plan
    from neuronbuild.analysis.upgrade import upgrade_impact
    from neuronbuild.build import default_jobs, patterns_or_default
    from neuronbuild.cache.identity_index import CacheHistory
    from neuronbuild.cache.local import LocalCache, resolve_cache_dir
    from neuronbuild.commands.plan import settings_from_args
    from neuronbuild.loading.target_graph import load_targets
    from neuronbuild.workspace import find_workspace

    if not args.toolchain:
        print("neuronbuild: error: upgrade-impact needs at least one --toolchain COMPONENT=VERSION", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.jobs is not None and args.jobs < 1:
        print("neuronbuild: error: --jobs must be at least 1", file=sys.stderr)
        return EXIT_BAD_INPUT
    new_settings = settings_from_args(args)
    base_settings = dataclasses.replace(new_settings, toolchain_overrides={})
    ws = find_workspace()
    graph = load_targets(ws.root, patterns_or_default(args.patterns), ws.cwd_package)
    base, new = plan(graph, base_settings), plan(graph, new_settings)
    cache = LocalCache(resolve_cache_dir(args.cache_dir))
    history = CacheHistory(cache.root)
    cached = {fp for fp in base.actions if cache.lookup(fp) is not None}
    impact = upgrade_impact(base, new, new_settings.toolchain_overrides, history, cached, args.jobs or default_jobs())
    if args.output == "json":
        print(json.dumps(impact.to_json(), indent=1, sort_keys=True))
    else:
        print("\n".join(impact.lines()))
    return EXIT_OK
