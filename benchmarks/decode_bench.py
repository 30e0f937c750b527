"""Decode speed, time to first token and memory of the example LLM (//models:llama, an HF Llama): the deployed cpu
bundle (CausalLM.generate) vs transformers' eager generate vs torch.compile of the same model, side by side, each in a
fresh process (import included). Usage: .venv/bin/python benchmarks/decode_bench.py [--new 32] [--cache-dir DIR]"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPT = [1, 17, 99, 250, 3, 48, 7, 300]

CHILD = r"""
import json, resource, sys, time
mode, root, new = sys.argv[1], sys.argv[2], int(sys.argv[3])
prompt = json.loads(sys.argv[4])
import torch
torch.set_num_threads(1)
if mode == "bundle":
    from neuronbuild.runtime import open_cache
    lm = open_cache(root, strict=True).causal_lm("//models:llama_cpu")
    def gen(n):
        return lm.generate([prompt], max_new_tokens=n)
else:
    sys.path.insert(0, root)
    from make_weights import HF_CONFIG
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM
    fields = {k: v for k, v in HF_CONFIG.items() if k != "model_type"}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(HF_CONFIG["model_type"], **fields)).eval()
    model.load_state_dict(load_file(root + "/llama.safetensors"), strict=False)
    extra = {}
    if mode == "compile":
        model.forward = torch.compile(model.forward)
        extra = {"cache_implementation": "static"}
    ids = torch.tensor([prompt])
    def gen(n):
        with torch.no_grad():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, pad_token_id=0, **extra)
first = gen(1)
t_first = time.time()
runs = []
for _ in range(3):
    t0 = time.perf_counter(); gen(1); t1 = time.perf_counter(); out = gen(new); t2 = time.perf_counter()
    runs.append(((t2 - t1) - (t1 - t0)) / (new - 1))
print(json.dumps({"first_token_at": t_first, "s_per_token": min(runs), "tokens": out[0, -new:].tolist(),
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "transformers": "transformers" in sys.modules}))
"""


def run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    return proc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new", type=int, default=32, help="new tokens per generate (<= 33 for the example's max_seq)")
    ap.add_argument("--cache-dir", default=None, help="neuronbuild cache to build the bundle with (default: temp)")
    args = ap.parse_args()
    nb = [sys.executable, "-m", "neuronbuild"]
    with tempfile.TemporaryDirectory(prefix="decode-bench-") as tmp:
        ws = Path(tmp) / "examples"
        shutil.copytree(REPO / "examples", ws, ignore=shutil.ignore_patterns("neuronbuild-out"))
        cache = args.cache_dir or str(Path(tmp) / "cache")
        run([*nb, "build", "//models:release_cpu", "--cache-dir", cache, "--quiet"], ws)
        deployed = Path(tmp) / "deployed"
        run([*nb, "deploy", str(ws / "neuronbuild-out/models/release_cpu.tar.zst"), "--cache-dir", str(deployed)], ws)
        rows = {}
        for mode, root in (("bundle", deployed), ("eager", ws / "models"), ("compile", ws / "models")):
            start = time.time()
            proc = run([sys.executable, "-c", CHILD, mode, str(root), str(args.new), json.dumps(PROMPT)], REPO)
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            r["ttft_s"] = r["first_token_at"] - start
            rows[mode] = r
    base = rows["bundle"]
    print(f"example //models:llama (HF Llama, 2 layers, hidden 64, vocab 512), batch 1, prompt {len(PROMPT)} tokens, "
          f"{args.new} new tokens, 1 torch thread, fresh process each")
    print(f"{'path':<28}{'decode tok/s':>13}{'ttft s':>9}{'peak RSS MB':>13}{'same tokens':>13}"
          f"{'transformers':>14}")
    names = {"bundle": "deployed cpu bundle", "eager": "transformers eager", "compile": "torch.compile + static"}
    for mode, r in rows.items():
        print(f"{names[mode]:<28}{1 / r['s_per_token']:>13.1f}{r['ttft_s']:>9.2f}{r['peak_rss_mb']:>13.0f}"
              f"{str(r['tokens'] == base['tokens']):>13}{str(r['transformers']):>14}")
    for mode in ("eager", "compile"):
        r = rows[mode]
        print(f"bundle vs {names[mode]}: decode {r['s_per_token'] / base['s_per_token']:.2f}x faster, ttft "
              f"{r['ttft_s'] / base['ttft_s']:.2f}x shorter, peak RSS {r['peak_rss_mb'] / base['peak_rss_mb']:.2f}x "
              f"smaller")


if __name__ == "__main__":
    main()
