"""`neuronbuild query EXPR`: deps, rdeps, kind, attr, filter, labels, somepath, allpaths and set operators."""

from __future__ import annotations

import argparse
import json

from neuronbuild import streams
from neuronbuild.errors import EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("query", help="query the target graph, e.g. 'rdeps(//..., //models:llama.py)'")
    p.add_argument("expr", nargs="+", help="query expression (quote it; words are joined with spaces)")
    p.add_argument("--output", choices=("label", "json", "graph"), default="label",
                   help="label (one per line), json, or graph (Graphviz dot)")


def run(args: argparse.Namespace) -> int:
    from neuronbuild import command, plugins
    from neuronbuild.analysis.query import run_query, to_dot, to_json
    from neuronbuild.workspace import find_workspace

    ws = find_workspace(command.current().cwd)
    plugins.load()
    qg, result = run_query(ws.root, " ".join(args.expr), ws.cwd_package)
    if args.output == "json":
        print(json.dumps(to_json(qg, result), indent=1, sort_keys=True), file=streams.out())
    elif args.output == "graph":
        print(to_dot(qg, result), end="", file=streams.out())
    else:
        for label in result:
            print(label, file=streams.out())
    _want_workers()
    return EXIT_OK


def _want_workers() -> None:
    """In the build server: the workers a build with the default cache and jobs would use (warmed once answered)."""
    from neuronbuild import command

    pools = command.current().pools
    if pools is None or not pools.wanting:
        return
    from neuronbuild.cache.local import LocalCache, resolve_cache_dir
    from neuronbuild.execution import local_executor
    from neuronbuild.execution.env import default_jobs

    local_executor.want_workers(pools, LocalCache(resolve_cache_dir(None)), default_jobs())
