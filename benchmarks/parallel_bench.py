"""Cold builds of 6 traces + 6 AOTInductor compiles: `neuronbuild build --jobs 1`, `--jobs 2`, and a hand-written serial
export + aoti_compile_and_package script, in one run; prints wall times and ratios to the script.

    .venv/bin/python benchmarks/parallel_bench.py            # ~5-15 minutes on 2 cores

Cold means: a fresh cache directory (and so fresh precompiled headers) per build, and a model variant of its own per
run (vocab 1000 + a per-run offset) so that no run hits another's inductor caches; the script gets a fresh
TORCHINDUCTOR_CACHE_DIR and TMPDIR. The three runs compile the same graphs up to that vocab size."""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BATCH, SEQ = [1, 4], [32, 64, 128]

BUILD = """
neuron_model(name = "llama", srcs = ["llama.py"], entry = "llama:build_model",
             config = {{"vocab": {vocab}, "hidden": 128, "layers": 2, "heads": 4}},
             inputs = {{"input_ids": "int64[batch, seq]"}})
neuron_buckets(name = "b", dims = {{"batch": {batch}, "seq": {seq}}})
neuron_target(name = "cpu", platform = "cpu", isa = "native")
neuron_compile(name = "llama_cpu", model = ":llama", buckets = [":b"], target = ":cpu")
"""

# The script a user would write without a build system: one process, export then AOTInductor per bucket, in turn.
SCRIPT = """
import sys, time
import torch
sys.path.insert(0, sys.argv[1])
from llama import build_model
from torch._inductor import aoti_compile_and_package

vocab, out = int(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
model = build_model({{"vocab": vocab, "hidden": 128, "layers": 2, "heads": 4}}).eval()
for batch in {batch}:
    for seq in {seq}:
        x = torch.zeros((batch, seq), dtype=torch.int64)
        with torch.no_grad():
            ep = torch.export.export(model, (x,), strict=False)
            aoti_compile_and_package(ep, package_path=f"{{out}}/b{{batch}}_s{{seq}}.pt2",
                                     inductor_configs={{"cpp.dynamic_threads": True,
                                                        "aot_inductor.package_constants_in_so": True,
                                                        "aot_inductor.enable_line_tables": False}})
"""


def _workspace(root: Path, vocab: int) -> Path:
    ws = root / f"ws-{vocab}"
    (ws / "models").mkdir(parents=True)
    (ws / "WORKSPACE.neuronbuild").write_text("")
    shutil.copyfile(REPO / "examples/models/llama.py", ws / "models/llama.py")
    (ws / "models/BUILD").write_text(BUILD.format(vocab=vocab, batch=BATCH, seq=SEQ))
    return ws


def _neuronbuild(root: Path, vocab: int, jobs: int) -> float:
    ws = _workspace(root, vocab)
    cmd = [sys.executable, "-m", "neuronbuild", "build", "//models:llama_cpu", "--jobs", str(jobs),
           "--cache-dir", str(root / f"cache-{vocab}"), "--profile", str(root / f"profile-jobs{jobs}.json")]
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ws, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if proc.returncode != 0 or "12 actions: 12 executed" not in proc.stdout:
        sys.exit(f"neuronbuild --jobs {jobs} failed:\n{proc.stdout}\n{proc.stderr}")
    return wall


def _script(root: Path, vocab: int) -> float:
    ws = _workspace(root, vocab)
    out, tmp = root / "script-out", root / "script-tmp"
    out.mkdir()
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp), TORCHINDUCTOR_CACHE_DIR=str(tmp / "inductor"))
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(batch=BATCH, seq=SEQ), str(ws / "models"),
                           str(vocab), str(out)], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if proc.returncode != 0 or len(list(out.glob("*.pt2"))) != len(BATCH) * len(SEQ):
        sys.exit(f"the serial script failed:\n{proc.stdout}\n{proc.stderr}")
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory (profiles, outputs)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="neuronbuild-bench-"))
    base = 1000 + random.randrange(1, 50_000) * 3
    load0 = os.getloadavg()[0]
    try:
        script = _script(root, base)
        print(f"serial script       {script:7.1f} s", flush=True)
        j1 = _neuronbuild(root, base + 1, 1)
        print(f"neuronbuild -j 1    {j1:7.1f} s", flush=True)
        j2 = _neuronbuild(root, base + 2, 2)
        print(f"neuronbuild -j 2    {j2:7.1f} s", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(f"\n{len(BATCH) * len(SEQ)} traces + {len(BATCH) * len(SEQ)} AOTInductor compiles, cold; "
          f"{os.cpu_count()} cores; load average {load0:.1f} before, {os.getloadavg()[0]:.1f} after")
    print(f"--jobs 1 / script = {j1 / script:.2f}   (goal <= 1.0)")
    print(f"--jobs 2 / script = {j2 / script:.2f}   (goal <= 0.45)")
    if args.keep:
        print(f"kept {root}")


if __name__ == "__main__":
    main()
