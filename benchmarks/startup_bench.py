"""Production start from a deployed bundle vs a torch.compile warm start, same model and buckets, in one run.

Builds the example's //models:llama_cpu into a bundle (reusing --cache-dir), deploys it, then times in fresh processes:
  neuronbuild: open_cache(strict) + load every bucket + first inference of every bucket
  torch.compile: build the model + torch.compile + first inference of every bucket, warm (its own caches, filled by a
                 cold run first)
Both spans start after `import torch`; whole-process wall times are printed too. Also prints the bundle's size
against weights + per-bucket code. Slow (a cold torch.compile and possibly AOTI compiles); not part of the tests.

    .venv/bin/python benchmarks/startup_bench.py [--cache-dir DIR] [--repeat N]
"""

from __future__ import annotations

import argparse
import json
import os
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
CFG = {"vocab": 1000, "hidden": 128, "layers": 2, "heads": 4}

PROD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
from neuronbuild.runtime import open_cache
cache = open_cache(sys.argv[1], strict=True, require=[sys.argv[2]])
model = cache.model(sys.argv[2])
for name, b in model.buckets.items():
    x = torch.zeros(b["batch"], b["seq"], dtype=torch.int64)
    model(x)
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "start_s": t2 - t1, "hits": cache.counters.hit}))
"""

TC = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
sys.path.insert(0, sys.argv[1])
from llama import build_model
torch.manual_seed(0)
model = build_model(json.loads(sys.argv[2])).eval()
compiled = torch.compile(model, dynamic=False)
with torch.no_grad():
    for b in json.loads(sys.argv[3]):
        compiled(torch.zeros(b["batch"], b["seq"], dtype=torch.int64))
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "start_s": t2 - t1}))
"""


def run_py(code: str, args: list[str], env: dict[str, str]) -> tuple[dict[str, float], float]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=1800)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"benchmark process failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache-dir", default=str(OUT / "cache"), help="neuronbuild cache (reused between runs)")
    ap.add_argument("--repeat", type=int, default=3, help="warm starts timed per side (median reported)")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="startup-bench-", dir=OUT))
    try:
        ws = work / "ws"
        shutil.copytree(REPO / "examples", ws, ignore=shutil.ignore_patterns("neuronbuild-out", "__pycache__", "hf"))
        with open(ws / "models" / "BUILD", "a") as f:
            f.write('\nneuron_bundle(name = "bench_cpu", srcs = [":llama_cpu"])\n')
        nb = [sys.executable, "-m", "neuronbuild"]
        t = time.perf_counter()
        subprocess.run([*nb, "build", "//models:bench_cpu", "--cache-dir", args.cache_dir], cwd=ws, check=True)
        print(f"build (cached after the first run): {time.perf_counter() - t:.1f} s")
        bundle = ws / "neuronbuild-out/models/bench_cpu.tar.zst"
        serve = work / "serve"
        subprocess.run([*nb, "deploy", str(bundle), "--cache-dir", str(serve)], cwd=ws, check=True)
        manifest = json.loads((ws / "neuronbuild-out/models/bench_cpu.manifest.json").read_text())
        buckets = [g["bucket"] for g in manifest["graphs"]]

        env = dict(os.environ)
        env["TORCHINDUCTOR_CACHE_DIR"] = str(work / "tc-cache")
        tc_args = [str(ws / "models"), json.dumps(CFG), json.dumps(buckets)]
        cold, cold_wall = run_py(TC, tc_args, env)
        print(f"torch.compile cold start (fills its caches): {cold['start_s']:.2f} s")
        prod, tc = [], []
        for _ in range(args.repeat):
            prod.append(run_py(PROD, [str(serve), LABEL], env))
            tc.append(run_py(TC, tc_args, env))
        p_start = statistics.median(r[0]["start_s"] for r in prod)
        t_start = statistics.median(r[0]["start_s"] for r in tc)
        p_wall = statistics.median(r[1] for r in prod)
        t_wall = statistics.median(r[1] for r in tc)
        print(f"\nstart-up, {len(buckets)} buckets of {LABEL} (median of {args.repeat}; 2-core machine shared with "
              f"other builds: noisy)")
        print(f"{'':<34}{'neuronbuild':>14}{'torch.compile warm':>20}{'ratio':>10}")
        print(f"{'open+load+first inference (s)':<34}{p_start:>14.3f}{t_start:>20.3f}{p_start / t_start:>10.4f}")
        print(f"{'whole process incl. import (s)':<34}{p_wall:>14.3f}{t_wall:>20.3f}{p_wall / t_wall:>10.4f}")

        weights = {g["weights"]["path"]: g["weights"]["size"] for g in manifest["graphs"] if g["weights"]}
        code = sum(a["size"] for g in manifest["graphs"] for a in g["artifacts"].values())
        base = sum(weights.values()) + code
        size = bundle.stat().st_size
        per_bucket_weights = sum(g["weights"]["size"] for g in manifest["graphs"] if g["weights"]) + code
        print(f"\nbundle {size} bytes; weights once ({sum(weights.values())}) + per-bucket code ({code}) = {base} "
              f"bytes; ratio {size / base:.3f} (weights per bucket would be {per_bucket_weights} bytes)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
