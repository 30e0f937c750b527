"""Tensor parallelism on the example llama (trn2; context batch 1 x seq 16 + token batch 1), per tp_degree 1, 2, 4:
cold build time (fresh cache: trace + Lower + flags per graph), `validate` max abs error vs transformers per graph,
greedy generate vs transformers, and the bytes of one rank's weights shard vs the whole weights file.

Run: .venv/bin/python benchmarks/tp_bench.py   (a few minutes; builds in a temporary copy of examples/)"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEGREES = (1, 2, 4)


def cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, NEURONBUILD_NO_SERVER="1")
    return subprocess.run([sys.executable, "-m", "neuronbuild", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=3600)


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="tp-bench-"))
    try:
        ws = root / "ws"
        shutil.copytree(REPO / "examples", ws, ignore=shutil.ignore_patterns("neuronbuild-out", "__pycache__", "hf"))
        build = ws / "models" / "BUILD"
        text = build.read_text() + '\nllm_buckets(name = "tpb", batch_sizes = [1], context_lengths = [16])\n'
        for tp in DEGREES:
            text += (f'neuron_compile(name = "tp{tp}", model = ":llama", target = ":trn2", tp_degree = {tp},\n'
                     '    buckets = {"context": [":tpb_context"], "token": [":tpb_token"]})\n')
        build.write_text(text)
        print(f"{'tp':>3} {'build s':>8} {'context max abs':>16} {'token max abs':>14} {'generate':>9} "
              f"{'rank shard / whole':>19}")
        for tp in DEGREES:
            cache = root / f"cache{tp}"
            start = time.perf_counter()
            proc = cli(["build", f"//models:tp{tp}", "--jobs", "2", "--cache-dir", str(cache)], ws)
            seconds = time.perf_counter() - start
            if proc.returncode:
                sys.exit(proc.stdout + proc.stderr)
            val = cli(["validate", f"//models:tp{tp}", "--generate", "8", "--cache-dir", str(cache)], ws)
            errs = {m.group(1): m.group(2) for m in re.finditer(r"(context|token)_\S+\s+trn2\*\s+(\S+)", val.stdout)}
            gen = "equal" if "against transformers: ok" in val.stdout else "DIFFERS"
            out = ws / "neuronbuild-out" / "models" / f"tp{tp}" / "token_batch1"
            whole = (REPO / "examples" / "models" / "llama.safetensors").stat().st_size
            shard = (out / ("rank_0.safetensors" if tp > 1 else "constants.safetensors")).stat().st_size
            print(f"{tp:>3} {seconds:>8.1f} {errs.get('context', '-'):>16} {errs.get('token', '-'):>14} {gen:>9} "
                  f"{shard / whole:>19.3f}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
