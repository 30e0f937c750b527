"""Introspection cost: plan / explain / query / upgrade-impact wall time against a load-only query, side by side.

Usage: .venv/bin/python benchmarks/introspect_overhead.py [--packages N] [--repeat R] [--cache-dir DIR]
Runs each command R times as a fresh process (as users run it) on (1) a copy of the example workspace and (2) a
generated workspace of N packages (one model + one 4-bucket compile each); prints median seconds and the ratio to
`query //...` (loading only). Nothing is compiled: with an empty cache every action is "to build"."""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def gen_ws(root: Path, n: int) -> Path:
    root.mkdir(parents=True)
    (root / "WORKSPACE.neuronbuild").write_text("")
    (root / "common").mkdir()
    (root / "common/BUILD").write_text('neuron_target(name = "trn2", platform = "trn2")\n'
                                       'compiler_options(name = "base", opt_level = 2)\n'
                                       'neuron_buckets(name = "bk", dims = {"batch": [1, 4], "seq": [128, 512]})\n')
    for i in range(n):
        d = root / f"models/m{i}"
        d.mkdir(parents=True)
        (d / "model.py").write_text(f"# model {i}\ndef build(config):\n    pass\n")
        (d / "BUILD").write_text(
            'neuron_model(name = "m", srcs = ["model.py"], entry = "model:build", '
            'inputs = {"x": "int64[batch, seq]"})\n'
            'neuron_compile(name = "c", model = ":m", buckets = ["//common:bk"], target = "//common:trn2", '
            'options = "//common:base")\n')
    return root


def timed(args: list[str], cwd: Path, repeat: int) -> float:
    runs = []
    for _ in range(repeat):
        t = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "neuronbuild", *args], cwd=cwd, capture_output=True, text=True)
        runs.append(time.perf_counter() - t)
        if p.returncode != 0:
            raise SystemExit(f"{args}: exit {p.returncode}: {p.stderr}")
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--packages", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cache-dir", default=None)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="nb-introspect-bench-"))
    try:
        cache = a.cache_dir or str(tmp / "cache")
        example = tmp / "example"
        shutil.copytree(REPO / "examples", example, ignore=shutil.ignore_patterns("neuronbuild-out", "__pycache__", "hf"))
        big = gen_ws(tmp / "big", a.packages)
        for name, ws, file_label in (("example", example, "//models:llama.py"),
                                     (f"generated {a.packages} packages", big, "//models/m0:model.py")):
            cmds = {
                "query //... (load only)": ["query", "//..."],
                f"query rdeps(//..., {file_label})": ["query", f"rdeps(//..., {file_label})"],
                "plan (= build --dry-run)": ["plan", "--cache-dir", cache],
                "explain": ["explain", "--cache-dir", cache],
                "upgrade-impact torch": ["upgrade-impact", "--toolchain", "torch=9.9", "--cache-dir", cache],
            }
            base = None
            print(f"\n{name} (median of {a.repeat} fresh processes)")
            for label, args in cmds.items():
                s = timed(args, ws, a.repeat)
                base = base or s
                print(f"  {label:<48} {s:6.2f} s   x{s / base:4.2f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
