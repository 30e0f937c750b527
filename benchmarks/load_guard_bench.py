"""Loading with the NUL/cycle guard on every native call vs natives registered directly (#15), side by side.

starlark-go truncates strings at a NUL when they cross into Python, so the loader registers Starlark wrappers that
check every rule call's arguments first (neuronbuild/loading/starlark_adapter.py). This measures what that costs: a
cold load (no load cache) of a generated workspace (benchmarks/gen_monorepo.py), in fresh processes, alternating the
two modes; prints the median wall and CPU time (all threads of the process: less disturbed by other load on a shared
machine than wall time) of each and their ratios.

    python benchmarks/load_guard_bench.py [--graphs 20000] [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gen_monorepo  # noqa: E402

# The unguarded mode: the interpreter as it was before the guard (natives set under their own names).
_UNGUARDED = '''
from neuronbuild.loading import starlark_adapter as sa
def _init(self, natives, print_prefix):
    self._natives = dict(natives)
    self._print = sa._safe_print(print_prefix)
    import starlark_go
    self._sl = starlark_go.Starlark(print=self._print)
    if self._natives:
        self._sl.set(**self._natives)
sa.Interpreter.__init__ = _init
'''

_LOAD = '''
import json, sys, time
from pathlib import Path
from neuronbuild.loading.target_graph import load_targets
t0, c0 = time.perf_counter(), time.process_time()
g = load_targets(Path(sys.argv[1]), ["//..."], "", None, warn=None)
t1, c1 = time.perf_counter(), time.process_time()
print(json.dumps({"load": t1 - t0, "cpu": c1 - c0, "targets": sum(len(p.targets) for p in g.packages.values()),
                  "packages": len(g.packages)}))
'''


def _run(ws: Path, guarded: bool) -> dict[str, float]:
    code = ("" if guarded else _UNGUARDED) + _LOAD
    p = subprocess.run([sys.executable, "-c", code, str(ws)], capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(p.stderr[-3000:])
    return json.loads(p.stdout)  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--graphs", type=int, default=20_000)
    ap.add_argument("--buckets", type=int, default=4)
    ap.add_argument("--compiles", type=int, default=5)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "nb-load-guard-bench")
    args = ap.parse_args()
    ws = args.workdir / "ws"
    n = gen_monorepo.generate(ws, args.graphs, args.buckets, args.compiles)
    times: dict[bool, list[float]] = {True: [], False: []}
    cpu: dict[bool, list[float]] = {True: [], False: []}
    info: dict[str, float] = {}
    for _ in range(args.runs):
        for guarded in (False, True):
            info = _run(ws, guarded)
            times[guarded].append(info["load"])
            cpu[guarded].append(info["cpu"])
    old, new = statistics.median(times[False]), statistics.median(times[True])
    old_c, new_c = statistics.median(cpu[False]), statistics.median(cpu[True])
    print(f"cold load of //... : {n} generated packages, {info['packages']:.0f} packages, {info['targets']:.0f} "
          f"targets ({args.graphs} graphs); median of {args.runs} fresh processes each, alternating; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("| loader | load wall (median) | load CPU (median) | wall, all runs |")
    print("|---|---|---|---|")
    print(f"| natives registered directly (before) | {old:.3f} s | {old_c:.3f} s | "
          f"{', '.join(f'{t:.2f}' for t in times[False])} |")
    print(f"| guarded natives (now) | {new:.3f} s | {new_c:.3f} s | {', '.join(f'{t:.2f}' for t in times[True])} |")
    print(f"ratio guarded / direct: wall {new / old:.3f}, CPU {new_c / old_c:.3f}")
    shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
