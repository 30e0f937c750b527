"""`neuronbuild build PATTERNS`: load, plan, execute what is missing, materialise outputs."""

from __future__ import annotations

import argparse
import signal
import time
from pathlib import Path
from typing import Any

from neuronbuild import streams
from neuronbuild.commands import common
from neuronbuild.commands.common import add_context_args, add_limit_args, bad_input, context_from_args, limit_settings
from neuronbuild.errors import EXIT_BAD_INPUT, EXIT_BUILD_FAILED, EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    b = sub.add_parser("build", help="build targets (default //...)")
    b.add_argument("patterns", nargs="*", help="target patterns: //pkg:name, //pkg/..., //pkg:all, //...")
    b.add_argument("--jobs", "-j", type=int, default=None,
                   help="actions run at once (default: min(8, cores); with --executor dask: the cluster's threads)")
    b.add_argument("--local-ram", metavar="SIZE", default=None,
                   help="memory the build may plan for on this machine: MB, 16G, or HOST_RAM*.5 (default HOST_RAM*.67)")
    b.add_argument("--keep-going", "-k", action="store_true", help="continue independent actions after a failure")
    b.add_argument("--retries", type=int, default=0,
                   help="re-run an action whose worker died (killed, out of memory) up to N times (default 0)")
    v = b.add_mutually_exclusive_group()
    v.add_argument("--quiet", "-q", action="store_true", help="print failures only")
    v.add_argument("--verbose", "-v", action="store_true", help="also print starts, cache hits, workers, memory")
    b.add_argument("--profile", metavar="PATH", help="write a Chrome trace-event JSON of the build (Perfetto)")
    b.add_argument("--build-event-json-file", metavar="PATH", help="write one JSON object per build event")
    b.add_argument("--executor", choices=("local", "dask", "dask-local"), default="local",
                   help="where actions run: local worker processes (default), a Dask cluster, or a LocalCluster")
    b.add_argument("--scheduler", metavar="tcp://HOST:PORT", help="the Dask scheduler (--executor dask)")
    b.add_argument("--dry-run", action="store_true", help="show what would execute (the `plan` command); run nothing")
    add_limit_args(b)
    b.add_argument("--signing-key", metavar="FILE",
                   help="sign bundles' manifests with this Ed25519 private key (default: $NEURONBUILD_SIGNING_KEY)")
    add_context_args(b)


# Flags that change how a build runs or reports, never what a finished no-op build would contain.
NOOP_IGNORED = ("local_ram", "retries", "action_timeout", "action_memory", "action_pids", "quiet", "verbose", "profile", "build_event_json_file", "executor", "scheduler")


def _record_noop_stats(cache_dir: Path, line: str, started: float) -> None:
    """A no-op answered by the fast path still counts in `cache stats`: every action was a local hit."""
    import re

    from neuronbuild.cache.local import LAYOUT
    from neuronbuild.cache.stats import BuildStats, persist

    m = re.search(r"(\d+) cached", line)
    try:
        n = int(m.group(1)) if m else 0
        persist(cache_dir / LAYOUT, BuildStats(started, time.time(), hits_local=n, executed=0, cached=n))
    except OSError:
        pass  # statistics never fail a build


def failure_lines(failures: Any, describe: Any) -> list[str]:
    """The end-of-build account of failures, once per distinct error of an action kind and label: a mistake hit at
    every bucket is one entry naming the buckets (its message and log those of the first)."""
    from neuronbuild.execution.progress import error_key

    groups: dict[tuple[str, str, str, str], list[Any]] = {}
    for f in failures:
        a = f.action
        groups.setdefault((a.kind, str(a.label), a.platform, error_key(f.error)), []).append(f)
    lines: list[str] = []
    for same in groups.values():
        same.sort(key=lambda f: (f.action.bucket.graph, f.action.bucket.dims))
        lines += describe(same[0])
        if len(same) > 1:
            a = same[0].action
            buckets = ", ".join(f"[{x.action.bucket}]" for x in same)
            lines[-len(describe(same[0]))] = f"  FAILED {a.describe().replace(f'[{a.bucket}]', buckets, 1)} " \
                                            f"({len(same)} buckets, the same error)"
            lines[-1] += f" (and {len(same) - 1} more log(s), one per bucket)"
    return lines


def _check_settings_flags(args: argparse.Namespace) -> None:
    """The checks of the fingerprint-settings flags that need no subprocess, made before the no-op fast path."""
    from neuronbuild.analysis.plan_settings import check_tool_settings, parse_action_env, tool_values

    check_tool_settings(tool_values(args))  # each toolchain's own flags (e.g. a compiler path that is no executable)
    parse_action_env(args.action_env)


def _want_workers(args: argparse.Namespace, cache_dir: Path) -> None:
    """In the build server, after a build answered from its no-op stamp (which starts no worker): name the pool the next
    build would make, so the server warms it once the answer is sent (local_executor.want_workers). Outside the server
    nothing is imported."""
    from neuronbuild import command

    pools = command.current().pools
    if pools is None or not pools.wanting or args.executor != "local":
        return
    from neuronbuild.analysis.plan_settings import parse_action_env
    from neuronbuild.cache.local import LocalCache
    from neuronbuild.errors import UserInputError
    from neuronbuild.execution import local_executor as le
    from neuronbuild.execution.env import default_jobs

    try:
        declared = parse_action_env(args.action_env)
    except UserInputError:
        return
    le.want_workers(pools, LocalCache(cache_dir), args.jobs or default_jobs(), declared)


def run(args: argparse.Namespace) -> int:
    from neuronbuild import command, noop

    if args.jobs is not None and args.jobs < 1:
        return bad_input("--jobs must be at least 1")
    if args.retries < 0:
        return bad_input("--retries must be 0 or more")
    try:
        limits = limit_settings(args)
    except ValueError as e:
        return bad_input(str(e))
    if args.executor == "dask" and not args.scheduler:
        return bad_input("--executor dask needs --scheduler tcp://HOST:PORT")
    if args.executor == "dask" and not args.remote_cache:
        return bad_input("--executor dask needs --remote-cache PATH|s3://bucket/prefix (a store every worker can "
                         "read and write)")
    if args.scheduler and args.executor != "dask":
        return bad_input("--scheduler is only used with --executor dask")
    if args.executor != "local" and args.remote_cache and "://" in args.remote_cache and \
            not args.remote_cache.startswith("s3://"):
        return bad_input("the Dask executor needs --remote-cache to be a shared directory or s3://bucket/prefix")
    if args.executor != "local" and args.remote_cache and "://" not in args.remote_cache and \
            not Path(args.remote_cache).expanduser().is_dir():
        # A build without Dask warns and continues without a missing shared tier; a farm cannot work without one,
        # and creating it here could put the farm's cache on a local disk where the share is not mounted.
        return bad_input(f"--remote-cache {args.remote_cache}: no such directory (the Dask executor needs a "
                         "directory every worker can read and write; create it, or mount the share)")
    from neuronbuild.cache.local import resolve_cache_dir
    from neuronbuild.context import NORMAL, QUIET, VERBOSE, patterns_or_default
    from neuronbuild.execution.resources import parse_local_ram
    from neuronbuild.workspace import find_workspace

    try:  # every flag is checked before any fast path: a no-op build must not accept what a full one refuses
        ram = parse_local_ram(args.local_ram) if args.local_ram is not None else 0
    except ValueError as e:
        return bad_input(str(e))
    _check_settings_flags(args)
    if args.dry_run:
        from neuronbuild.commands.common import run_plan

        return run_plan(args)
    ws = find_workspace(command.current().cwd)
    cache_dir = resolve_cache_dir(args.cache_dir)
    patterns = patterns_or_default(args.patterns)
    noop_flags = {k: v for k, v in vars(args).items() if k not in NOOP_IGNORED}
    signing_key = command.current().signing_key(args.signing_key)  # (flag, else $NEURONBUILD_SIGNING_KEY)
    noop_flags["signing_key"] = str(signing_key) if signing_key else None  # the key a bundle is signed with
    key = noop.request_key(ws.root, ws.cwd_package, patterns, cache_dir, noop_flags)
    wants_events = args.profile or args.build_event_json_file
    started = time.time()
    # Nothing changed: say so, import nothing. --verbose lists every cached action, which only the normal path knows:
    # it takes that path, so every verbose no-op prints the same lines.
    line = None if wants_events or args.verbose else noop.check(cache_dir, key)
    if line is not None:
        from neuronbuild import after_answer
        from neuronbuild.report.invocation import note_line, record_noop

        after_answer.later(lambda: _record_noop_stats(cache_dir, line, started))  # (the server: after the answer)
        note = note_line(record_noop(args, ws.root, cache_dir, patterns, key, line))
        if not args.quiet:
            print(line + (f"\n{note}" if note else ""), flush=True, file=streams.out())
        _want_workers(args, cache_dir)
        return EXIT_OK

    from neuronbuild.build import BuildRequest, run_build
    from neuronbuild.execution.env import default_jobs
    from neuronbuild.execution.resources import default_local_ram_mb
    from neuronbuild.execution.scheduler import describe_failure

    ram = ram or default_local_ram_mb()
    ctx = context_from_args(args, QUIET if args.quiet else VERBOSE if args.verbose else NORMAL)
    req = BuildRequest(
        patterns, args.jobs or default_jobs(),
        keep_going=args.keep_going, retries=args.retries, local_ram_mb=ram, executor=args.executor,
        scheduler=args.scheduler,
        profile=Path(args.profile).resolve() if args.profile else None,
        event_file=Path(args.build_event_json_file).resolve() if args.build_event_json_file else None,
        action_timeout=limits.timeout_s or 0.0, limits=limits,
    )
    from neuronbuild.report.invocation import Invocation, note_line

    inv = Invocation.from_args("build", args, ws.root, cache_dir, patterns)
    previous = signal.signal(signal.SIGTERM, common.raise_interrupt)  # `kill` ends a build like Ctrl-C does
    try:
        result = run_build(ctx, req, noop_key=key, invocation=inv)
    except KeyboardInterrupt:
        note = note_line(inv.page)
        if note:
            print(note, file=streams.err(), flush=True)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    if not args.quiet or not result.ok:
        note = note_line(inv.page)
        print(result.summary() + (f"\n{note}" if note else ""), flush=True, file=streams.out())
    if result.failures:
        print("\n".join(failure_lines(result.failures, describe_failure)), file=streams.err())
    if result.analysis_errors:  # (--keep-going; said when analysis failed, as without it: bad input, exit 2)
        return EXIT_BAD_INPUT
    return EXIT_BUILD_FAILED if result.failures else EXIT_OK
