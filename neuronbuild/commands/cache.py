"""`neuronbuild cache verify|gc|stats|pin|unpin`: check, bound, inspect and protect the cache."""

from __future__ import annotations

import argparse
from typing import Any

from neuronbuild import streams
from neuronbuild.commands.common import add_cache_args, bad_input
from neuronbuild.errors import EXIT_BUILD_FAILED, EXIT_OK

# `cache gc` with neither --max-size nor --max-age: the cache's configured automatic limits ($NEURONBUILD_CACHE_MAX_*,
# <cache>/config.json), else these (docs/cache.md); a `.neuronbuildrc` line `cache --max-size 50G` replaces them.
DEFAULT_MAX_SIZE = "20G"
DEFAULT_MAX_AGE = "30d"


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    c = sub.add_parser("cache", help="verify, garbage-collect, inspect or pin the cache")
    cs = c.add_subparsers(dest="cache_command", required=True)
    v = cs.add_parser("verify", help="re-hash every blob and check every entry (shared-tier records against "
                                     "--remote-cache-trusted-keys)")
    v.add_argument("--repair", action="store_true", help="remove corrupt blobs and broken entries")
    g = cs.add_parser("gc", help="evict least recently used entries not referenced by the workspace or pins")
    g.add_argument("--max-size", help=f"size cap, e.g. 20G (default policy, when neither limit is given: "
                                      f"--max-size {DEFAULT_MAX_SIZE} --max-age {DEFAULT_MAX_AGE}, or the automatic "
                                      f"limits configured for the cache; set yours with a `cache --max-size ...` "
                                      f".neuronbuildrc line)")
    g.add_argument("--max-age", help="evict entries unused for longer than this, e.g. 30d")
    g.add_argument("--no-workspace", action="store_true",
                   help="do not protect what the last successful builds of workspaces referenced (pins still are)")
    s = cs.add_parser("stats", help="entries and bytes per tier, counters of recent builds")
    s.add_argument("--builds", type=int, default=10, help="how many recent builds to show")
    p = cs.add_parser("pin", help="protect from gc what the last successful build of targets (default //...) used")
    p.add_argument("name")
    p.add_argument("patterns", nargs="*")
    p.add_argument("--fingerprint", action="append", default=[], help="pin this action fingerprint too")
    u = cs.add_parser("unpin", help="remove a pin")
    u.add_argument("name")
    for q in (v, g, s, p, u):
        add_cache_args(q)


def run(args: argparse.Namespace) -> int:
    from neuronbuild.commands.common import context_from_args

    ctx = context_from_args(args, need_workspace=args.cache_command == "pin")
    handler = {"verify": _verify, "gc": _gc, "stats": _stats, "pin": _pin, "unpin": _unpin}[args.cache_command]
    return handler(ctx, args)


def _shared(ctx: Any) -> Any:
    if not ctx.cache.remote:
        return None
    from neuronbuild.cache.tiered import open_shared

    return open_shared(ctx.cache.remote, ctx.cache.s3_endpoint_url)


def _local(ctx: Any) -> Any:
    from neuronbuild.cache.local import LocalCache

    return LocalCache(ctx.cache.dir)


def _verify(ctx: Any, args: argparse.Namespace) -> int:
    from neuronbuild.cache.shared_fs import SharedDirTier
    from neuronbuild.cache.tier import TierReadOnly, TierUnavailable
    from neuronbuild.cache.verify import verify_tier

    cache = _local(ctx)
    tiers: list[tuple[str, Any]] = [("local", SharedDirTier(cache.base))]
    shared = _shared(ctx)
    if shared is not None:
        tiers.append(("shared", shared))
    bad = 0
    for label, tier in tiers:
        if label == "local" and not cache.base.is_dir():
            print(f"local {cache.base}: empty (no cache directory)", file=streams.out())
            continue
        try:
            rep = verify_tier(tier, args.repair, ctx.cache.trusted if label == "shared" else None)
        except (TierUnavailable, TierReadOnly, OSError) as e:
            print(f"neuronbuild: error: {label} cache {tier.url} is unavailable: {e}", file=streams.err())
            return EXIT_BUILD_FAILED
        for p in rep.problems:
            print(f"{label}: {p}", file=streams.out())
        state = "ok" if rep.ok else (f"{len(rep.problems)} problems, removed" if args.repair
                                     else f"{len(rep.problems)} problems (run with --repair to remove them)")
        signed = ""
        if label == "shared":
            checked = ctx.cache.trusted is not None and not getattr(ctx.cache.trusted, "implicit", False)
            signed = (f"; records signed by a key in {ctx.cache.trusted.path}" if checked
                      else "; records not authenticated (no --remote-cache-trusted-keys)")
        print(f"{label} {rep.tier}: {rep.blobs} blobs, {rep.records} entries verified: {state}{signed}", file=streams.out())
        if not rep.ok and not args.repair:
            bad += 1
    return EXIT_BUILD_FAILED if bad else EXIT_OK


def _gc(ctx: Any, args: argparse.Namespace) -> int:
    from neuronbuild.cache.gc import collect, parse_age, parse_size
    from neuronbuild.cache.pins import PinError
    from neuronbuild.cache.roots import live_roots

    cache = _local(ctx)
    try:
        max_size = parse_size(args.max_size) if args.max_size else None
        max_age = parse_age(args.max_age) if args.max_age else None
    except ValueError as e:
        return bad_input(str(e))
    if max_size is None and max_age is None:
        from neuronbuild.cache.gc import configured_limits

        max_size, max_age = configured_limits(cache) if cache.root.is_dir() else (None, None)
        where = "the cache's configured limits"
        if max_size is None and max_age is None:
            max_size, max_age = parse_size(DEFAULT_MAX_SIZE), parse_age(DEFAULT_MAX_AGE)
            where = f"the default policy --max-size {DEFAULT_MAX_SIZE} --max-age {DEFAULT_MAX_AGE}"
        print(f"gc: no --max-size or --max-age given: using {where} (docs/cache.md)", file=streams.out())
    if not cache.root.is_dir():
        print("gc: the cache is empty", file=streams.out())
        return EXIT_OK
    if not args.no_workspace:
        fps, n = live_roots(cache.root)
        print(f"gc: protecting {len(fps)} actions that the last successful builds of {n} workspace(s) used", file=streams.out())
    try:
        result = collect(cache, max_size, max_age, protect_roots=not args.no_workspace)
    except PinError as e:
        return bad_input(str(e))
    print(result.summary(), file=streams.out())
    return EXIT_OK


def _usage(tier: Any) -> tuple[int, int, int]:
    blobs = list(tier.blobs())
    return sum(1 for _ in tier.records()), len(blobs), sum(s for _d, s in blobs)


def _stats(ctx: Any, args: argparse.Namespace) -> int:
    from neuronbuild.cache.gc import human
    from neuronbuild.cache.pins import PinError, load_pins
    from neuronbuild.cache.shared_fs import SharedDirTier
    from neuronbuild.cache.stats import recent
    from neuronbuild.cache.tier import TierReadOnly, TierUnavailable

    cache = _local(ctx)
    entries, nblobs, nbytes = _usage(SharedDirTier(cache.base)) if cache.base.is_dir() else (0, 0, 0)
    failures = len(list(cache.failures.glob("*/*.json"))) if cache.failures.is_dir() else 0
    print(f"local  {cache.base}: {entries} entries, {nblobs} blobs, {human(nbytes)}; {failures} recorded failures", file=streams.out())
    from neuronbuild.cache.usage import disk_usage

    du = disk_usage(cache.base)
    shown = [(p, b) for p, b in du.parts if b][:4]
    rest = du.total - sum(b for _p, b in shown)
    print(f"       on disk {human(du.total)} in all (what gc --max-size bounds): "
          + ", ".join([f"{p} {human(b)}" for p, b in shown] + ([f"the rest {human(rest)}"] if rest else [])), file=streams.out())
    shared = _shared(ctx)
    if shared is not None:
        try:
            entries, nblobs, nbytes = _usage(shared)
            print(f"shared {shared.url}: {entries} entries, {nblobs} blobs, {human(nbytes)}", file=streams.out())
        except (TierUnavailable, TierReadOnly, OSError) as e:
            print(f"shared {shared.url}: unavailable ({e})", file=streams.out())
    try:
        pins = load_pins(cache.root)
        if pins:
            print("pins: " + ", ".join(f"{p.name} ({len(p.fingerprints)} actions, {len(p.digests)} blobs)"
                                       for p in pins), file=streams.out())
    except PinError as e:
        print(f"pins: {e}", file=streams.out())
    builds = recent(cache.root, max(0, args.builds))
    if builds:
        # executed/cached: as each build's summary counted its actions (a result reused by early cutoff is cached);
        # then what the cache saw: lookups served (hits) or not (misses, each fingerprint once), entries saved
        print("recent builds (oldest first):  executed  cached  | cache: hits (local+shared)  misses  saves  uploads  "
              "errors", file=streams.out())
        import time

        for b in builds:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(b.started))
            ex, ca = (f"{b.executed:8d}", f"{b.cached:6d}") if b.executed >= 0 else (f"{'?':>8}", f"{'?':>6}")
            print(f"  {when}  {ex}  {ca}  |        {b.hits:5d} ({b.hits_local}+{b.hits_shared})  {b.misses:6d}  "
                  f"{b.saves:5d}  {b.uploads:7d}  {b.errors:6d}" + (f"  [{b.shared}]" if b.shared else ""), file=streams.out())
        known = [b for b in builds if b.executed >= 0]
        tot_c = sum(b.cached for b in known)
        tot = tot_c + sum(b.executed for b in known)
        if tot:
            print(f"cached over these builds: {100.0 * tot_c / tot:.0f}% of actions ({tot_c} cached, "
                  f"{tot - tot_c} executed)", file=streams.out())
    return EXIT_OK


def _pin(ctx: Any, args: argparse.Namespace) -> int:
    from neuronbuild import plugins
    from neuronbuild.cache.pins import PinError, check_name, write_pin
    from neuronbuild.cache.roots import workspace_roots

    cache = _local(ctx)
    try:
        check_name(args.name)
    except PinError as e:
        return bad_input(str(e))
    fps = set(args.fingerprint)
    if args.patterns or not fps:
        graph = ctx.load(args.patterns)
        built = workspace_roots(cache.root, ctx.workspace.root)
        wanted = [str(lbl) for lbl in graph.requested if str(lbl) in built or
                  plugins.rule(graph.targets[lbl].kind).plans_actions]
        missing = [lbl for lbl in wanted if lbl not in built]
        if missing:
            return bad_input(f"{missing[0]} has no successful build in this workspace to pin (run `neuronbuild "
                             f"build {missing[0]}` first{'' if len(missing) == 1 else f'; {len(missing) - 1} more'})")
        if not wanted:
            return bad_input("the patterns select no target that compiles graphs or bundles them")
        for lbl in wanted:
            fps.update(built[lbl])
    path = write_pin(cache.root, args.name, fps)
    print(f"pinned {len(fps)} actions as '{args.name}' ({path})", file=streams.out())
    return EXIT_OK


def _unpin(ctx: Any, args: argparse.Namespace) -> int:
    from neuronbuild.cache.pins import PinError, remove_pin

    cache = _local(ctx)
    try:
        found = remove_pin(cache.root, args.name)
    except PinError as e:
        return bad_input(str(e))
    if not found:
        return bad_input(f"no pin named '{args.name}'")
    print(f"unpinned '{args.name}'", file=streams.out())
    return EXIT_OK
