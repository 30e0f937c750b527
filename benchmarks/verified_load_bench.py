"""Strict open_cache with every loaded byte verified (this runtime) vs the same open without verification, in one run.

Builds the example's //models:llama_cpu into a bundle (reusing --cache-dir), deploys it, then alternates fresh
processes that time `open_cache(strict=True)` (manifest, weights once, every bucket's AOTInductor package loaded) after
`import torch`:
  verified:   as shipped: weights read once and hashed (the manifest's BLAKE3); each model.pt2 read once straight
              into a private in-memory file, hashed as read, and loaded from it: one memfd, allocated and mapped
              once (fallocate + MAP_POPULATE) and reused for every package of the open
  fresh:      the same without the reused memfd: a fresh mapped memfd per package, page-faulted in as it is read
              into (how the 2026-12-01 05:13 loader copied packages; its weights path is today's)
  unverified: the loader before verification (weights by safetensors.load_file, packages loaded from the release dir
              in place), patched in for this measurement only
Also times open + the first inference of every bucket (what a server's start pays; the unverified loader's mmap
defers reading the weights to that first use). Prints medians and ratios (goal: verified <= 1.1x unverified).

    .venv/bin/python benchmarks/verified_load_bench.py [--cache-dir DIR] [--repeat N] [--breakdown]
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

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "benchmarks" / "out"
LABEL = "//models:llama_cpu"

RUN = r"""
import json, sys, time
import torch
import neuronbuild.runtime.deployed as d
if sys.argv[3] == "unverified":
    from neuronbuild.runtime.aoti_loader import read_constants

    def weights_for(self, path, ref):
        if path not in self._weights:
            self._weights[path] = read_constants(path)
        return self._weights[path]

    import contextlib

    @contextlib.contextmanager
    def in_place(path, ref, tmp_dir, scratch=None):  # the deployed file itself, unchecked
        yield path

    d.DeployedCache._weights_for = weights_for
    d.verified_path = in_place
if sys.argv[3] != "verified":  # unverified, and fresh (a fresh memfd per package: verified_path without a scratch)
    class NoScratch:
        @staticmethod
        def create(capacity):
            return None

    d.Scratch = NoScratch
steps = {}
if len(sys.argv) > 4:  # --breakdown: time the steps of the open (wrapping them costs a few microseconds a call)
    import neuronbuild.runtime.aoti_loader as al
    import neuronbuild.runtime.verified as v

    def timed(owner, name, key):
        f = getattr(owner, name)

        def g(*a, **k):
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                steps[key] = steps.get(key, 0.0) + time.perf_counter() - t0
        setattr(owner, name, g)

    timed(d, "read_releases", "read manifests")
    timed(d.DeployedCache, "_weights_for", "weights (read, check, tensors)")
    timed(v.Scratch, "create", "allocate the reused memfd")
    timed(v.Scratch, "_fill", "packages read+checked into it")
    timed(v, "_copy_hashing", "packages read+checked into fresh memfds")
    timed(al, "load_package", "torch package loader")
t = time.perf_counter()
cache = d.open_cache(sys.argv[1], strict=True, require=[sys.argv[2]])
t_open = time.perf_counter() - t
model = cache.model(sys.argv[2])
for name, b in model.buckets.items():  # every graph (of every family) once, on zeros of its exact input shapes
    g = model.graph(name)
    args = [torch.zeros([b[d] if isinstance(d, str) else d for d in spec["dims"]], dtype=getattr(torch, spec["dtype"]))
            for spec in g.inputs.values()]
    model.bucket_fn(name)(*args)
print(json.dumps({"open_s": t_open, "start_s": time.perf_counter() - t, "hits": cache.counters.hit, "steps": steps}))
"""


def run(mode: str, serve: Path, breakdown: bool = False) -> tuple[float, float, dict[str, float]]:
    proc = subprocess.run([sys.executable, "-c", RUN, str(serve), LABEL, mode, *(["steps"] if breakdown else [])],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["hits"] >= 1
    return float(out["open_s"]), float(out["start_s"]), dict(out["steps"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache-dir", default=str(OUT / "cache"), help="neuronbuild cache (reused between runs)")
    ap.add_argument("--repeat", type=int, default=7, help="fresh processes per side (alternating; median reported)")
    ap.add_argument("--breakdown", action="store_true", help="also time the steps of the open (median ms per side)")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="verified-load-bench-", dir=OUT))
    try:
        ws = work / "ws"
        shutil.copytree(REPO / "examples", ws, ignore=shutil.ignore_patterns("neuronbuild-out", "__pycache__"))
        with open(ws / "models" / "BUILD", "a") as f:
            f.write('\nneuron_bundle(name = "bench_cpu", srcs = [":llama_cpu"])\n')
        nb = [sys.executable, "-m", "neuronbuild"]
        t = time.perf_counter()
        subprocess.run([*nb, "build", "//models:bench_cpu", "--cache-dir", args.cache_dir], cwd=ws, check=True)
        print(f"build (cached after the first run): {time.perf_counter() - t:.1f} s")
        serve = work / "serve"
        subprocess.run([*nb, "deploy", str(ws / "neuronbuild-out/models/bench_cpu.tar.zst"), "--cache-dir",
                        str(serve)], cwd=ws, check=True)
        run("verified", serve)  # warm the page cache for both sides
        modes = ("unverified", "fresh", "verified")
        times: dict[str, list[tuple[float, float, dict[str, float]]]] = {m: [] for m in modes}
        for _ in range(args.repeat):
            for mode in modes:
                times[mode].append(run(mode, serve, args.breakdown))
        print(f"\n{LABEL} from a deployed bundle, strict, median of {args.repeat} alternating fresh processes each "
              f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})")
        print(f"{'':<40}{'unverified':>12}{'previous (fresh memfd)':>24}{'ratio':>7}{'verified':>10}{'ratio':>7}")
        for i, what in enumerate(("open_cache (every bucket loaded)", "open + first inference of every bucket")):
            u, p, v = (statistics.median(r[i] for r in times[m]) for m in modes)
            print(f"{what:<40}{u * 1000:>10.1f}ms{p * 1000:>22.1f}ms{p / u:>7.3f}{v * 1000:>8.1f}ms{v / u:>7.3f}")
        if args.breakdown:
            print("\nsteps of the open (median ms per side; a step a side does not take is absent)")
            names = list(dict.fromkeys(k for m in modes for r in times[m] for k in r[2]))
            for k in names:
                cells = [f"{statistics.median(r[2].get(k, 0.0) for r in times[m]) * 1000:.2f}"
                         if any(k in r[2] for r in times[m]) else "-" for m in modes]
                print(f"  {k:<42}" + "".join(f"{c:>12}" for c in cells) + f"   ({', '.join(modes)})")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
