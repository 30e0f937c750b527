"""`neuronbuild build PATTERNS`: load, plan, execute what is missing, materialise outputs."""

from __future__ import annotations

import argparse
import sys

from neuronbuild.commands.cache import add_remote_cache_args
from neuronbuild.commands.common import add_cache_args
from neuronbuild.commands.plan import add_settings_args, settings_from_args
from neuronbuild.errors import EXIT_BAD_INPUT, EXIT_BUILD_FAILED, EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    b = sub.add_parser("build", help="build targets (default //...)")
    b.add_argument("patterns", nargs="*", help="target patterns: //pkg:name, //pkg/..., //pkg:all, //...")
    b.add_argument("--jobs", "-j", type=int, default=None, help="parallel workers (default: min(8, cores))")
    b.add_argument("--keep-going", "-k", action="store_true", help="continue independent actions after a failure")
    b.add_argument("--dry-run", action="store_true", help="show what would execute (the `plan` command); run nothing")
    add_cache_args(b)
    add_settings_args(b)
    add_remote_cache_args(b)


def run(args: argparse.Namespace) -> int:
    from neuronbuild import noop
    from neuronbuild.cache.local import resolve_cache_dir
    from neuronbuild.workspace import find_workspace

    if args.jobs is not None and args.jobs < 1:
        print("neuronbuild: error: --jobs must be at least 1", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.dry_run:
        from neuronbuild.commands import plan

        return plan.run(args)
    ws = find_workspace()
    cache_dir = resolve_cache_dir(args.cache_dir)
    patterns = tuple(args.patterns) or ("//...",)
    key = noop.request_key(ws.root, ws.cwd_package, patterns, cache_dir, vars(args))
    line = noop.check(cache_dir, key)  # nothing changed since the last successful build: say so, import nothing
    if line is not None:
        print(line, flush=True)
        return EXIT_OK

    from neuronbuild.build import BuildRequest, default_jobs, print_report, run_build

    req = BuildRequest(patterns, cache_dir, args.jobs or default_jobs(), args.keep_going, settings_from_args(args),
                       remote_cache=args.remote_cache or None, remote_cache_readonly=args.remote_cache_readonly,
                       s3_endpoint_url=args.s3_endpoint_url)
    result = run_build(ws, req, print_report, noop_key=key)
    print(result.summary(), flush=True)
    if result.failures:
        for f in result.failures:
            print(f"  FAILED {f.action.describe()}: {f.error}\n    log: {f.log}", file=sys.stderr)
        return EXIT_BUILD_FAILED
    return EXIT_OK
