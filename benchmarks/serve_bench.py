"""Serving throughput (#42): 64 requests of mixed prompt and output lengths from a deployed cpu bundle, side by side
in one run: the continuous-batching engine (hf_causal_lm(continuous_batching = True, max_batch = 4,
on_device_sampling = True), greedy requests), static batching (today's `generate` over the static graphs in waves of
4 prompts, each wave decoding until its longest request is done) and transformers' own batched `generate` (eager, all
64 prompts in one left-padded batch). Prints tokens/s (requested tokens only: a wave's or a batch's extra tokens
for shorter requests are not counted), time to first token (median, p90; every request arrives at t = 0) and the
token graph's per-call time at two max_seq (the engine's step cost against the cache size). Throughput also per
process CPU second, which other sessions' load moves far less than the wall (run it with OMP_NUM_THREADS=1 on a
shared machine: 2 OpenMP threads oversubscribed by other sessions spin, the wall then measures the neighbours).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/serve_bench.py [--requests 64] [--workdir DIR]  # DIR: kept
        [--bigger]      # also a hidden 512, 4-layer model (graph calls costlier than the engine's host work)
        [--functional]  # also the token graph compiled with kv a fresh output per call (before #42's in-place kv)

Prints the graph-call counts of both (static: per wave one prefill + its longest request's tokens - 1) and their
ratio, the ceiling of the engine's gain when a call costs the same whatever it does.

Static batching's time to first token is its wave's start plus that wave's prefill (generate with max_new_tokens=1,
timed separately). Not part of the test suite: one build of ~10 cpu graphs (~5 min on 2 cores)."""

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
HF = {"vocab_size": 1024, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048, "eos_token_id": 2,
      "bos_token_id": 1, "pad_token_id": 0}
# --bigger: the same comparison on a model whose graph calls cost more than the engine's host work per step
BIGGER = {**HF, "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 8,
          "num_key_value_heads": 4}
MAX_SEQ, BIG_SEQ, SLOTS, PROMPT = 128, 1024, 4, 32


def build_file(bigger: bool = False) -> str:
    cfg = json.dumps(HF)
    more = ""
    if bigger:
        big = json.dumps(BIGGER)
        more = f'''
hf_causal_lm(name = "static_h512", model_type = "llama", config = {big}, weights = "h512.safetensors",
             max_seq = {MAX_SEQ})
hf_causal_lm(name = "cb_h512", model_type = "llama", config = {big}, weights = "h512.safetensors", max_seq = {MAX_SEQ},
             continuous_batching = True, max_batch = {SLOTS}, on_device_sampling = True)
neuron_compile(name = "static_h512_cpu", model = ":static_h512", target = ":cpu",
               buckets = {{"context": [":static_ctx"], "token": [":static_tok"]}})
neuron_compile(name = "cb_h512_cpu", model = ":cb_h512", target = ":cpu",
               buckets = {{"context": [":cb_ctx"], "token": [":cb_tok"]}})
'''
    srcs = '":static_cpu", ":cb_cpu", ":cb_big_cpu"' + (', ":static_h512_cpu", ":cb_h512_cpu"' if bigger else "")
    return f'''load("@neuronbuild//rules:llm.bzl", "hf_causal_lm")
neuron_target(name = "cpu", platform = "cpu", isa = "native")
hf_causal_lm(name = "static", model_type = "llama", config = {cfg}, weights = "llama.safetensors", max_seq = {MAX_SEQ})
hf_causal_lm(name = "cb", model_type = "llama", config = {cfg}, weights = "llama.safetensors", max_seq = {MAX_SEQ},
             continuous_batching = True, max_batch = {SLOTS}, on_device_sampling = True)
hf_causal_lm(name = "cb_big", model_type = "llama", config = {cfg}, weights = "llama.safetensors",
             max_seq = {BIG_SEQ}, continuous_batching = True, max_batch = {SLOTS}, on_device_sampling = True)
neuron_buckets(name = "static_ctx", shapes = [{{"batch": {SLOTS}, "seq": {PROMPT}}}])
neuron_buckets(name = "static_tok", shapes = [{{"batch": {SLOTS}}}])
neuron_buckets(name = "cb_ctx", shapes = [{{"batch": 1, "seq": {PROMPT}}}, {{"batch": {SLOTS}, "seq": {PROMPT}}}])
neuron_buckets(name = "cb_tok", shapes = [{{"batch": 2}}, {{"batch": {SLOTS}}}])
neuron_buckets(name = "big_tok", shapes = [{{"batch": {SLOTS}}}])
neuron_compile(name = "static_cpu", model = ":static", target = ":cpu",
               buckets = {{"context": [":static_ctx"], "token": [":static_tok"]}})
neuron_compile(name = "cb_cpu", model = ":cb", target = ":cpu", buckets = {{"context": [":cb_ctx"], "token": [":cb_tok"]}})
neuron_compile(name = "cb_big_cpu", model = ":cb_big", target = ":cpu",
               buckets = {{"context": [":static_ctx"], "token": [":big_tok"]}})
neuron_bundle(name = "release", srcs = [{srcs}])
''' + more


def requests(n: int) -> list[tuple[list[int], int]]:
    import random

    rng = random.Random(42)
    return [([1] + [rng.randrange(3, HF["vocab_size"]) for _ in range(rng.randrange(3, PROMPT))],
             rng.randrange(8, 65)) for _ in range(n)]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def run_engine(lm, reqs):  # type: ignore[no-untyped-def]
    eng = lm.engine()
    c0 = time.process_time()
    t0 = time.perf_counter()
    rids = [eng.add(p, max_new_tokens=n, eos_token_id=None) for p, n in reqs]
    first: dict[int, float] = {}
    while eng.pending:
        for rid in eng.step():
            first.setdefault(rid, time.perf_counter() - t0)
    took, cpu = time.perf_counter() - t0, time.process_time() - c0
    out = eng.finished
    return took, cpu, [first[r] for r in rids], [out[r] for r in rids], dict(eng.calls)


def run_static(lm, reqs):  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    c0 = time.process_time()
    ttft, outs, prefill, prefill_cpu = [], [], 0.0, 0.0
    for i in range(0, len(reqs), SLOTS):
        wave = reqs[i:i + SLOTS]
        start = time.perf_counter() - t0 - prefill
        p0, q0 = time.perf_counter(), time.process_time()
        lm.generate([p for p, _n in wave], max_new_tokens=1, eos_token_id=None)  # the wave's prefill, timed apart
        first = time.perf_counter() - p0
        prefill += first
        prefill_cpu += time.process_time() - q0
        out = lm.generate([p for p, _n in wave], max_new_tokens=max(n for _p, n in wave), eos_token_id=None)
        outs += [out[j, out.shape[1] - max(n for _p, n in wave):][:n].tolist() for j, (_p, n) in enumerate(wave)]
        ttft += [start + first] * len(wave)
    return time.perf_counter() - t0 - prefill, time.process_time() - c0 - prefill_cpu, ttft, outs


def run_transformers(weights: Path, reqs, hf=HF):  # type: ignore[no-untyped-def]
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in hf.items() if k != "model_type"}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **fields)).eval()
    model.load_state_dict(load_file(str(weights)))
    width = max(len(p) for p, _n in reqs)
    ids = torch.zeros((len(reqs), width), dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, (p, _n) in enumerate(reqs):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=max(n for _p, n in reqs), do_sample=False,
                       eos_token_id=None, pad_token_id=0)
    return time.perf_counter() - t0, time.process_time() - c0


def token_call_ms(lm, calls: int = 200) -> float:  # type: ignore[no-untyped-def]
    """The token graph of batch SLOTS: process CPU ms per call, its kv output fed back (as the engine does)."""
    import torch

    name = lm.pick("token", lm.token_buckets, {"batch": SLOTS})
    fn = lm.fn("token", name)
    kv = torch.zeros([int(d) for d in lm.kv_spec["dims"]], dtype=torch.float32)
    mask = torch.zeros((SLOTS, lm.max_seq), dtype=torch.int32)
    mask[:, :20] = 1
    args = [torch.ones((SLOTS, 1), dtype=torch.int32), mask, torch.full((SLOTS, 1), 19, dtype=torch.int32),
            torch.arange(SLOTS, dtype=torch.int32), torch.tensor([[1.0, 1.0, 0.0]] * SLOTS), torch.zeros(SLOTS)]
    with torch.inference_mode():
        for _ in range(10):
            kv = lm.named("token", fn(*args, kv))["kv"]
        t0 = time.process_time()
        for _ in range(calls):
            kv = lm.named("token", fn(*args, kv))["kv"]
    return (time.process_time() - t0) / calls * 1e3


def functional_call_ms(ws: Path, work: Path, max_seq: int) -> float:
    """The same token graph (batch SLOTS) compiled as before in-place outputs: the aliased kv a fresh output per call
    (the cpu compile without write_in_place, from the same wrapper and weights); CPU ms per call, kv fed back."""
    import torch
    from safetensors.torch import load_file

    from neuronbuild.runtime.aoti_loader import load_package
    from neuronbuild.toolchains import hf_causal_lm as H
    from neuronbuild.toolchains.compile import compile_cpu, held_tensors
    from neuronbuild.toolchains.outputs import FlatForward
    from neuronbuild.toolchains.trace import write_program_constants

    cfg = {"model_type": "llama", "hf": {k: v for k, v in HF.items() if k != "model_type"}, "max_seq": max_seq}
    m = H.sampling_token(cfg).eval()
    m.load_state_dict(load_file(str(ws / "llama.safetensors")), strict=False)
    FlatForward(m)
    kv = torch.zeros(HF["num_hidden_layers"], 2, SLOTS + 1, HF["num_key_value_heads"], max_seq,
                     HF["hidden_size"] // HF["num_attention_heads"])
    mask = torch.zeros((SLOTS, max_seq), dtype=torch.int32)
    mask[:, :20] = 1
    args = [torch.ones((SLOTS, 1), dtype=torch.int32), mask, torch.full((SLOTS, 1), 19, dtype=torch.int32),
            torch.arange(SLOTS, dtype=torch.int32), torch.tensor([[1.0, 1.0, 0.0]] * SLOTS), torch.zeros(SLOTS)]
    with torch.no_grad():
        ep = torch.export.export(m, (*args, kv), strict=False)
    out = work / f"functional_{max_seq}"
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.clone() for k, v in held_tensors(ep).items()}
    write_program_constants(ep, out / "program_constants.safetensors")
    from neuronbuild.platforms import resolve_isa

    compile_cpu(ep, (*args, kv), resolve_isa("native"), {}, out, in_place=None)
    fn = load_package(out / "model.pt2", constants=weights)
    with torch.inference_mode():
        for _ in range(10):
            kv = fn(*args, kv)[-1]
        t0 = time.process_time()
        for _ in range(200):
            kv = fn(*args, kv)[-1]
    return (time.process_time() - t0) / 200 * 1e3


def static_calls(reqs) -> int:  # type: ignore[no-untyped-def]
    """Graph calls of static batching: per wave one prefill and its longest request's new tokens - 1 decodes."""
    return sum(1 + max(n for _p, n in reqs[i:i + SLOTS]) - 1 for i in range(0, len(reqs), SLOTS))


def compare(name: str, cb, static, weights: Path, hf, reqs) -> None:  # type: ignore[no-untyped-def]
    """Engine, static waves and transformers' batch on one model, side by side."""
    wanted = sum(n for _p, n in reqs)
    run_engine(cb, reqs[:4])  # warm both
    static.generate([p for p, _n in reqs[:4]], max_new_tokens=2)
    eng_s, eng_cpu, eng_ttft, eng_out, calls = run_engine(cb, reqs)
    st_s, st_cpu, st_ttft, st_out = run_static(static, reqs)
    hf_s, hf_cpu = run_transformers(weights, reqs, hf)
    same = sum(a == b for a, b in zip(eng_out, st_out, strict=True))
    print(f"\n{name}: engine calls: {calls}; static batching's: {static_calls(reqs)} (call-count ratio "
          f"{static_calls(reqs) / sum(calls.values()):.2f}x); requests whose greedy tokens equal static batching's: "
          f"{same}/{len(reqs)}")
    print(f"{'':24} {'tokens/s':>9} {'vs static':>9} {'TTFT med':>9} {'TTFT p90':>9} {'per CPU s':>10} "
          f"{'vs static':>9}")
    for row, took, cpu, ttft in (("engine (4 slots)", eng_s, eng_cpu, eng_ttft),
                                 ("static waves of 4", st_s, st_cpu, st_ttft),
                                 (f"transformers batch {len(reqs)}", hf_s, hf_cpu, None)):
        t = f"{statistics.median(ttft):8.2f}s {pct(ttft, 0.9):8.2f}s" if ttft else f"{'-':>9} {'-':>9}"
        print(f"{row:24} {wanted / took:9.0f} {st_s / took:8.2f}x {t} {wanted / cpu:10.0f} {st_cpu / cpu:8.2f}x",
              flush=True)


def main() -> None:
    if "--speculation" in sys.argv[1:]:  # issue #47: speculative decoding, benchmarks/spec_bench.py
        from spec_bench import main as speculation_main  # (this directory is on sys.path when run as a script)
        return speculation_main([a for a in sys.argv[1:] if a != "--speculation"])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--bigger", action="store_true", help="also a hidden 512, 4-layer model (4 more graphs)")
    ap.add_argument("--functional", action="store_true",
                    help="also the token graph compiled without in-place kv (2 more compiles, in this process)")
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="serve-bench-"))
    ws = work / "ws"
    ws.mkdir(parents=True, exist_ok=True)
    (ws / "WORKSPACE.neuronbuild").write_text("")
    (ws / "BUILD").write_text(build_file(args.bigger))
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    for hf, file in ((HF, "llama.safetensors"), *([(BIGGER, "h512.safetensors")] if args.bigger else [])):
        torch.manual_seed(0)
        fields = {k: v for k, v in hf.items() if k != "model_type"}
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **fields, initializer_range=0.2))
        save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(ws / file))
    cli = [str(REPO / ".venv" / "bin" / "neuronbuild")]
    env = dict(os.environ, NEURONBUILD_NO_SERVER="1")
    t0 = time.monotonic()
    subprocess.run(cli + ["build", "//:release", "--jobs", "2", "--cache-dir", str(work / "cache")], cwd=ws, env=env,
                   check=True, capture_output=True)
    subprocess.run(cli + ["deploy", str(ws / "neuronbuild-out" / "release.tar.zst"), "--dest", str(work / "serve")],
                   cwd=ws, env=env, check=True, capture_output=True)
    print(f"built and deployed in {time.monotonic() - t0:.0f} s", flush=True)

    from neuronbuild.runtime import open_cache

    cache = open_cache(work / "serve", strict=True)
    static, cb, big = (cache.causal_lm(f"//:{n}_cpu") for n in ("static", "cb", "cb_big"))
    reqs = requests(args.requests)
    wanted = sum(n for _p, n in reqs)
    print(f"{len(reqs)} requests: prompts {min(len(p) for p, _n in reqs)}-{max(len(p) for p, _n in reqs)} tokens, "
          f"outputs {min(n for _p, n in reqs)}-{max(n for _p, n in reqs)} ({wanted} tokens); {SLOTS} slots, "
          f"torch threads {torch.get_num_threads()}", flush=True)
    compare("hidden 128, 2 layers", cb, static, ws / "llama.safetensors", HF, reqs)
    if args.bigger:
        compare("hidden 512, 4 layers", cache.causal_lm("//:cb_h512_cpu"), cache.causal_lm("//:static_h512_cpu"),
                ws / "h512.safetensors", BIGGER, reqs)
    small, large = token_call_ms(cb), token_call_ms(big)
    print(f"\ntoken graph (batch {SLOTS}) CPU per call, kv written in place: max_seq {MAX_SEQ}: {small:.2f} ms, "
          f"max_seq {BIG_SEQ}: {large:.2f} ms ({large / small:.2f}x; kv {cb.kv_spec['dims']} vs {big.kv_spec['dims']})")
    if args.functional:
        f_small, f_large = functional_call_ms(ws, work, MAX_SEQ), functional_call_ms(ws, work, BIG_SEQ)
        print(f"the same, kv a fresh output per call:    max_seq {MAX_SEQ}: {f_small:.2f} ms, max_seq {BIG_SEQ}: "
              f"{f_large:.2f} ms ({f_large / f_small:.2f}x)")
    if not args.keep and args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
