"""The generic engine's own cost per node (engine.py), on a graph shaped like a plan's at scale.

N target-like nodes (key: an int), each reading its package's shared node (an option set) and 1-2 earlier nodes of
its package, and checking one outside input through `unchanged` (as a target node checks its Target value and file
digests). CPU seconds, printed side by side:

  build      the first computation of every node (a cold plan's analysis pays this on top of the kinds' work)
  no-op      a new revision with nothing changed: `valid` over every node (the validity walk the planner's segments
             and groups stand in for at scale: they check every node's own inputs in one pass and the rest below)
  replaced   `replaced` over every node, none replaced (a projection's staleness check, e.g. the planner's groups')
  edit       one package's outside input changed: `get` of every root (its nodes recomputed, the others verified)
  cutoff     that input changed again, its node's value equal: that node recomputed, cut off, the rest verified

    .venv/bin/python benchmarks/engine_bench.py [--nodes 160000] [--package 32] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from neuronbuild.engine import Engine, Node  # noqa: E402


class Graph:
    """The function of int keys: node n of package n // size reads the package's first node and the one before it;
    a package's first node reads the package's outside input (`world`) and checks it with `unchanged`."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.world: dict[int, int] = {}  # per package: its outside input (a BUILD file's digest, say)

    def compute(self, n: int, ctx: Engine) -> Any:
        first = n - n % self.size
        if n == first:
            w = self.world.get(n // self.size, 0)
            return (w % 2, w)  # (the value, the input read)
        v = ctx.get(first)[0] + (ctx.get(n - 1)[0] if n - 1 != first else 0)
        return (v % 2, None)

    @staticmethod
    def equal(old: Any, new: Any) -> bool:
        return bool(old[0] == new[0])

    def unchanged(self, n: int, node: Node) -> bool:
        return n % self.size != 0 or node.value[1] == self.world.get(n // self.size, 0)


def timed(f: Any) -> float:
    """CPU seconds of f() (one thread: on this shared machine CPU time moves far less with other load than wall)."""
    t = time.process_time()
    f()
    return time.process_time() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=160_000)
    ap.add_argument("--package", type=int, default=32, help="nodes per package")
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    n, size = a.nodes, a.package
    roots = range(size - 1, n, size)  # (each package's last node: it reads the whole package)
    rows: dict[str, list[float]] = {"build": [], "no-op": [], "replaced": [], "edit": [], "cutoff": []}
    for _ in range(a.runs):
        g = Graph(size)
        e = Engine({int: g})
        rows["build"].append(timed(lambda: [e.get(r) for r in roots]))  # noqa: B023
        e.advance()
        rows["no-op"].append(timed(lambda: all(e.valid(r) for r in roots)))  # noqa: B023
        held = tuple(e.nodes.values())
        rows["replaced"].append(timed(lambda: e.replaced(held)))  # noqa: B023
        g.world[len(roots) // 2] = 1
        e.advance()
        rows["edit"].append(timed(lambda: [e.get(r) for r in roots]))  # noqa: B023
        assert e.computed == size
        g.world[len(roots) // 2] = 3  # (another input, an equal value: cut off)
        e.advance()
        rows["cutoff"].append(timed(lambda: [e.get(r) for r in roots]))  # noqa: B023
        assert e.computed == 1 and e.cutoffs == 1
    print(f"# engine_bench: {n} nodes, {n // size} packages of {size}, median of {a.runs} (load "
          f"{__import__('os').getloadavg()[0]:.1f})")
    print("| pass | CPU | per node |")
    print("|---|---|---|")
    for what, ts in rows.items():
        m = statistics.median(ts)
        print(f"| {what} | {m:.3f} s | {m / n * 1e6:.2f} us |")


if __name__ == "__main__":
    main()
