"""Neuron path, per example graph, side by side in one run: trace time vs HLO lowering time, HLO bytes vs the old
lowered.pt2 (core-ATen torch.export archive with embedded weights) bytes, XLA:CPU validate time; and the trn2 target's
deployed Neuron bytes before (one lowered.pt2 per graph) and after weights-once (HLO + params + one weights file).

Run: .venv/bin/python benchmarks/neuron_bench.py   (about a minute; uses the example's llama model and buckets)"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CFG = {"vocab": 1000, "hidden": 128, "layers": 2, "heads": 4}
BUCKETS = [{"batch": 1, "seq": 128}, {"batch": 1, "seq": 512}, {"batch": 4, "seq": 128}, {"batch": 4, "seq": 512},
           {"batch": 4, "seq": 1}]
INPUTS = {"input_ids": {"dtype": "int64", "dims": ["batch", "seq"]}}


def main() -> None:
    import torch
    from safetensors.torch import load_file

    from neuronbuild.runtime.xla_cpu import load
    from neuronbuild.toolchains.model_import import build_eager_model, example_inputs
    from neuronbuild.toolchains.neuron_steps import run_lower
    from neuronbuild.toolchains.passes import apply_passes
    from neuronbuild.toolchains.trace import load_program, program_bytes, run_trace

    tmp = Path(tempfile.mkdtemp(prefix="neuron-bench-"))
    try:
        sb = tmp / "sandbox"
        (sb / "models").mkdir(parents=True)
        shutil.copy(REPO / "examples/models/llama.py", sb / "models/llama.py")
        model = {"package": "models", "srcs": ["models/llama.py"], "entry": "llama:build_model", "config": CFG,
                 "weights": None, "seed": 0}
        eager = build_eager_model(model, sb)
        # warm both paths once (imports: torch.export, torchax/jax) so per-graph figures compare steady work
        warm = tmp / "warm"
        run_trace({"model": model, "inputs": INPUTS, "bucket": BUCKETS[-1]}, sb, warm)
        run_lower({"program": "program.pt2", "inputs": INPUTS, "bucket": BUCKETS[-1], "options": {}}, warm, warm)
        print(f"{'bucket':<18}{'trace s':>9}{'lower s':>9}{'ratio':>7}{'old pt2 s':>11}{'HLO KB':>9}"
              f"{'old pt2 KB':>12}{'validate s':>12}{'max abs err':>13}")
        before = after = 0
        weights_digests: set[bytes] = set()
        for bucket in BUCKETS:
            name = "_".join(f"{k}{v}" for k, v in bucket.items())
            d = tmp / name
            t0 = time.perf_counter()
            run_trace({"model": model, "inputs": INPUTS, "bucket": bucket}, sb, d)
            t_trace = time.perf_counter() - t0
            # the old Neuron "compile": core-ATen decomposition + passes, saved as a torch.export archive
            t0 = time.perf_counter()
            ep = load_program(d / "program.pt2").run_decompositions()
            ep = apply_passes(ep, {"auto_cast": "matmult"}, example_inputs(INPUTS, bucket))
            old = program_bytes(ep)
            t_old = time.perf_counter() - t0
            t0 = time.perf_counter()
            run_lower({"program": "program.pt2", "inputs": INPUTS, "bucket": bucket,
                       "options": {"auto_cast": "matmult"}}, d, d)
            t_lower = time.perf_counter() - t0
            hlo = (d / "model.hlo.pb").stat().st_size
            weights = (d / "constants.safetensors").read_bytes()
            t0 = time.perf_counter()
            run = load(d / "model.hlo.pb", d / "params.json").bind(load_file(d / "constants.safetensors"))
            args = example_inputs(INPUTS, bucket, seed=7, config=CFG)
            out = run(*args)[0]
            with torch.no_grad():
                ref = eager(*args)
            err = float((out - ref).abs().max())
            t_val = time.perf_counter() - t0
            print(f"{name:<18}{t_trace:>9.2f}{t_lower:>9.2f}{t_lower / t_trace:>7.2f}{t_old:>11.2f}{hlo / 1e3:>9.1f}"
                  f"{len(old) / 1e3:>12.1f}{t_val:>12.2f}{err:>13.2e}")
            before += len(old)
            after += hlo + (d / "params.json").stat().st_size
            if weights not in weights_digests:
                weights_digests.add(weights)
                after += len(weights)
        print(f"trn2 graphs' deployed Neuron bytes: before (lowered.pt2 each) {before / 1e6:.2f} MB, after "
              f"(HLO + params.json per graph, {len(weights_digests)} weights file) {after / 1e6:.2f} MB "
              f"({before / after:.1f}x smaller)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
