"""`neuronbuild validate PATTERNS`: run every built artifact against eager on seeded inputs, per bucket."""

from __future__ import annotations

import argparse
import sys

from neuronbuild.commands.common import add_context_args
from neuronbuild.errors import EXIT_BUILD_FAILED, EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    v = sub.add_parser("validate", help="compare built artifacts with the eager model (max abs/rel error per bucket)")
    v.add_argument("patterns", nargs="*", help="target patterns (default //...); neuron_bundle targets check their srcs")
    v.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    add_context_args(v)


def run(args: argparse.Namespace) -> int:
    import tempfile
    from pathlib import Path
    from typing import Any

    from neuronbuild.commands.common import context_from_args

    ctx = context_from_args(args)
    ws = ctx.workspace
    graph = ctx.load(args.patterns)
    ag = ctx.plan(graph)
    cache = ctx.open_cache()
    if not ag.compiles:
        print("neuronbuild: nothing to validate: the patterns match no neuron_compile target", file=sys.stderr)
        return EXIT_OK

    graphs = sum(len(ct.buckets) for ct in ag.compiles)
    print(f"validating {graphs} graph(s) of {len(ag.compiles)} target(s) against eager (loading torch) ...",
          file=sys.stderr, flush=True)
    from neuronbuild import plugins
    from neuronbuild.toolchains.validate import compare, eager_model, value_config

    failed = 0
    models: dict[str, Any] = {}
    plats = {ct.label: ct.description + ("*" if plugins.toolchain(ct.toolchain).validate_note else "")
             for ct in ag.compiles}
    w_t = max([len("target"), *(len(str(ct.label)) for ct in ag.compiles)])  # columns fit the longest names
    w_b = max([len("bucket"), *(len(b.name) for ct in ag.compiles for b, _fp in ct.buckets)])
    w_p = max([len("platform"), *map(len, plats.values())])
    print(f"{'target':<{w_t}}  {'bucket':<{w_b}}  {'platform':<{w_p}} {'max abs':>10} {'max rel':>10} "
          f"{'tolerance':>10}  result", flush=True)
    for ct in ag.compiles:
        tol = ct.tolerance
        tc = plugins.toolchain(ct.toolchain)
        plat = plats[ct.label]
        for bucket, fp in ct.buckets:
            res = cache.lookup(fp)
            row = f"{str(ct.label):<{w_t}}  {bucket.name:<{w_b}}  {plat:<{w_p}}"
            if res is None:
                failed += 1
                print(f"{row} {'-':>10} {'-':>10} {tol:>10.1e}  NOT BUILT (run neuronbuild build {ct.label})",
                      flush=True)
                continue
            spec = dict(ag.trace_of(fp).model)
            spec["libraries"] = sorted(spec.get("deps") or {})
            key = repr(sorted(spec.items(), key=lambda kv: kv[0]))
            if key not in models:
                models[key] = eager_model(spec, ws.root)
            with tempfile.TemporaryDirectory(prefix="neuronbuild-validate-") as tmp:
                files = {}
                for name, ref in res.outputs.items():
                    cache.copy_blob(ref.digest, Path(tmp) / name)
                    files[name] = Path(tmp) / name
                fn = tc.load_artifact(files)
                ranges = graph.targets[ct.model].attrs.get("input_ranges")  # validate-only: not in fingerprints
                cmp = compare(fn, models[key], spec["inputs"], bucket.as_dict(), value_config(spec, ws.root),
                              args.seed, ranges)
            ok = cmp.max_abs <= tol and not cmp.error
            failed += not ok
            if cmp.error:
                print(f"{row} {'-':>10} {'-':>10} {tol:>10.1e}  ERROR {cmp.error}", flush=True)
                continue
            print(f"{row} {cmp.max_abs:>10.2e} {cmp.max_rel:>10.2e} {tol:>10.1e}  {'ok' if ok else 'FAIL'}", flush=True)
    for name in ag.toolchains:
        if plugins.toolchain(name).validate_note:
            print(f"* {plugins.toolchain(name).validate_note}")
    if failed:
        print(f"{failed} graph(s) failed validation", file=sys.stderr)
        return EXIT_BUILD_FAILED
    print("every graph is within its tolerance")
    return EXIT_OK
