"""Real-size models (#28): random bf16 weights in a given HF config's shape, built for trn2 (HLO) and cpu through
`hf_causal_lm`, bundled, deployed and asked for tokens; prints each action's wall and peak RSS and the bytes of the
cache, each output target and the bundle against the checkpoint's.

    .venv/bin/python benchmarks/big_model_bench.py --shape llama-3.2-1b --targets trn2 [--workdir DIR] [--keep]
    .venv/bin/python benchmarks/big_model_bench.py --shape tiny --targets trn2,cpu --generate   # a quick check
    .venv/bin/python benchmarks/big_model_bench.py --shape llama-3.2-1b --tp 2 --no-bundle     # tensor parallel (#29)
    .venv/bin/python benchmarks/big_model_bench.py --shape llama-3.2-1b --targets cpu --generate --lean  # + transformers tokens
    .venv/bin/python benchmarks/big_model_bench.py --shape llama-3.1-8b-2l --tp 8 --no-bundle --validate
    .venv/bin/python benchmarks/big_model_bench.py --shape llama-3.2-1b --quantization int8 --generate  # (#44)
    .venv/bin/python benchmarks/big_model_bench.py --shape llama-3.1-8b --tp 8 --no-bundle \
        --workdir /big/dir --keep            # both families: ~2x the checkpoint on disk at peak (--graphs context
                                             # [--reuse-checkpoint] builds one family at a time)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/big_model_bench.py --graphs-only \
        --shape llama-3.1-8b:8,llama-3.1-70b:32,llama-3.1-405b:64 --jobs 1   # (#51) no checkpoint at all

`--graphs-only` (#51) builds each shape's trn2 graphs from `hf_causal_lm(..., weights = None)`: no checkpoint is
written, none is needed; one shape after another in one run (SHAPE:TP), each action's wall, CPU and peak RSS, the HLO
modules' sizes, and how they grow from shape to shape. (It replaces `--drop-checkpoint`, which deleted the checkpoint
under a running build: since big inputs are linked into sandboxes, not copied, that fails the weights action with
"input 'model.safetensors' changed during the build"; a graphs-only build never has one.)

Not part of the test suite (CI keeps tiny models). Watch the machine's memory: each action's peak is printed as it
is recorded by the build (`--profile`). The 8B shape writes a 16 GB checkpoint first."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

SHAPES: dict[str, dict[str, object]] = {
    "tiny": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True},
    "llama-3.2-1b": {"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": True,
                     "rope_theta": 500000.0, "rms_norm_eps": 1e-5},
    # the 1B's vocabulary and widths with 2 layers: its embedding (the largest tensor) at a tenth of the disk (#29)
    "llama-3.2-1b-2l": {"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 2,
                        "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": True,
                        "rope_theta": 500000.0, "rms_norm_eps": 1e-5},
    # the 8B's vocabulary, widths and heads with 2 layers: the tp 8 correctness check against transformers (#29)
    "llama-3.1-8b-2l": {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 2,
                        "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False,
                        "rope_theta": 500000.0, "rms_norm_eps": 1e-5},
    "llama-3.1-8b": {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False,
                     "rope_theta": 500000.0, "rms_norm_eps": 1e-5},
    # (#51) graphs only: no host here holds their checkpoints (141 GB, 810 GB in bf16)
    "llama-3.1-70b": {"vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                      "num_attention_heads": 64, "num_key_value_heads": 8, "tie_word_embeddings": False,
                      "rope_theta": 500000.0, "rms_norm_eps": 1e-5},
    "llama-3.1-405b": {"vocab_size": 128256, "hidden_size": 16384, "intermediate_size": 53248,
                       "num_hidden_layers": 126, "num_attention_heads": 128, "num_key_value_heads": 8,
                       "tie_word_embeddings": False, "rope_theta": 500000.0, "rms_norm_eps": 1e-5},
}
COMMON = {"model_type": "llama", "max_position_embeddings": 131072, "eos_token_id": 2, "bos_token_id": 1,
          "pad_token_id": 0}


def llama_shapes(cfg: dict[str, object]) -> dict[str, tuple[int, ...]]:
    """Checkpoint keys and shapes of a Llama config, as transformers saves them (a tied lm_head is not stored)."""
    h, i, v = int(cfg["hidden_size"]), int(cfg["intermediate_size"]), int(cfg["vocab_size"])  # type: ignore[call-overload]
    heads, kvh = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])  # type: ignore[call-overload]
    kv = h // heads * kvh
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg.get("tie_word_embeddings"):
        out["lm_head.weight"] = (v, h)
    for layer in range(int(cfg["num_hidden_layers"])):  # type: ignore[call-overload]
        p = f"model.layers.{layer}."
        out |= {p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i),
                p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
    return out


def write_checkpoint(path: Path, cfg: dict[str, object], seed: int = 0) -> int:
    """Random bf16 weights (N(0, 0.02); norms 1), written one tensor at a time."""
    import torch

    from neuronbuild.toolchains.weights import Entry, write_safetensors

    g = torch.Generator().manual_seed(seed)

    def value(e: Entry) -> torch.Tensor:
        if len(e.shape) == 1:
            return torch.ones(e.shape, dtype=torch.bfloat16)
        return (torch.randn(e.shape, generator=g) * 0.02).to(torch.bfloat16)

    return write_safetensors(path, [Entry(k, torch.bfloat16, s) for k, s in llama_shapes(cfg).items()], value)


BUILD = """load("@neuronbuild//rules:llm.bzl", "hf_causal_lm", "llm_buckets")

hf_causal_lm(name = "llm", config = {config}, weights = {weights}, max_seq = {max_seq}{quant})
llm_buckets(name = "serve", batch_sizes = [1], context_lengths = [{context}])
neuron_target(name = "trn2", platform = "trn2")
neuron_target(name = "cpu", platform = "cpu", isa = "native")
{compiles}
neuron_bundle(name = "release", srcs = [{srcs}])
"""
COMPILE = """neuron_compile(name = "llm_{t}", model = ":llm", buckets = {{{buckets}}},
               target = ":{t}"{tp})"""


def _inodes(path: Path) -> set[tuple[int, int]]:
    out = set()
    for root, _dirs, files in os.walk(path):
        for f in files:
            st = os.lstat(os.path.join(root, f))
            out.add((st.st_dev, st.st_ino))
    return out


def du(path: Path, beyond: Path | None = None) -> int:
    """Bytes on disk under `path`, hard links counted once (as the filesystem holds them); with `beyond`, only the
    files that are not also under `beyond` (an output target's read-only links to the cache's blobs cost nothing)."""
    seen, total = _inodes(beyond) if beyond is not None else set(), 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            st = os.lstat(os.path.join(root, f))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


PROMPT = [1, 17, 99, 250]
NEW_TOKENS = 8


def reference_tokens(cfg: dict[str, object], ckpt: Path, dtype: str | None = None) -> tuple[list[list[int]], list[list[float]]]:
    """transformers' own greedy tokens for PROMPT from the checkpoint, in `dtype` (default the config's), and its
    float32 logits for the prompt and each generated step (the model made on the meta device, the file's tensors
    converted to the dtype and assigned: no random init of a full-size model)."""
    import torch
    import transformers
    from safetensors.torch import load_file

    config = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "dtype"})
    dtype_ = getattr(torch, dtype or str(cfg.get("dtype") or "float32"))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype_)
    # assign=True keeps the state dict's dtype: converted first, or a float32 model would hold the bf16 tensors
    model.load_state_dict({k: v.to(dtype_) for k, v in load_file(str(ckpt)).items()}, strict=False, assign=True)
    model.tie_weights()
    model.eval()
    for name, mod in list(model.named_modules()):  # rotary tables (buffers computed in __init__): made on the CPU
        if type(mod).__name__.endswith("RotaryEmbedding"):
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, type(mod)(config=model.config))
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=int(cfg.get("pad_token_id") or 0), output_logits=True,
                             return_dict_in_generate=True)
    # the prompt and the new tokens, as the runtime's generate returns them; one logits row per new token
    return out.sequences.tolist(), [step[0].float().tolist() for step in out.logits]


def compare_logits(name: str, tokens: list[int], logits: list[list[float]], ref_tokens: list[int],
                   ref_logits: list[list[float]]) -> None:
    """Per step while the token sequences agree (the same context on both sides): the max abs difference of the two
    logits vectors and the reference's top-2 gap; a token differing where the gap is below the difference is
    rounding, not a different model."""
    import torch

    new = tokens[len(PROMPT):]
    want = ref_tokens[len(PROMPT):]
    for t, (a, b) in enumerate(zip(logits, ref_logits, strict=False)):
        x, y = torch.tensor(a), torch.tensor(b)
        top2 = y.topk(2).values
        diff, gap = float((x - y).abs().max()), float(top2[0] - top2[1])
        verdict = "equal" if new[t] == want[t] else ("DIVERGES: gap < diff (rounding)" if gap < diff
                                                      else "DIVERGES: gap >= diff (NOT rounding)")
        print(f"  {name} step {t}: max |logits - ref| {diff:.3g} (ref max |logit| {float(y.abs().max()):.3g}); "
              f"ref top-2 gap {gap:.3g}; token {new[t]} vs {want[t]} {verdict}")
        if new[t] != want[t]:
            break  # later steps see different contexts


def cli(args: list[str], cwd: Path, check: bool = True) -> tuple[float, subprocess.CompletedProcess[str]]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "neuronbuild", "--batch", *args], cwd=cwd, capture_output=True,
                          text=True)
    if check and proc.returncode != 0:
        sys.exit(f"neuronbuild {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - start, proc


def params_of(cfg: dict[str, object]) -> int:
    """The parameter count of a Llama config (every checkpoint tensor's values)."""
    total = 0
    for shape in llama_shapes(cfg).values():
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


def graphs_only(args: argparse.Namespace) -> None:
    """(#51) Each SHAPE:TP's trn2 graphs built from its config alone (`weights = None`: no checkpoint anywhere), one
    shape after another: per action wall, CPU and peak RSS, the HLO modules' bytes, and the growth between shapes."""
    work = args.workdir or Path(tempfile.mkdtemp(prefix="big-model-graphs-"))
    rows: list[dict[str, object]] = []
    for item in args.shape.split(","):
        shape, _, tp_text = item.partition(":")
        if shape not in SHAPES:
            sys.exit(f"unknown shape {shape!r} (known: {', '.join(sorted(SHAPES))})")
        tp = int(tp_text or args.tp)
        ws, cache = work / f"{shape}-tp{tp}" / "ws", work / f"{shape}-tp{tp}" / "cache"
        for d in (ws, cache):
            shutil.rmtree(d, ignore_errors=True)
        ws.mkdir(parents=True)
        (ws / "WORKSPACE.neuronbuild").write_text("")
        cfg = {**COMMON, **SHAPES[shape], "dtype": args.dtype}
        families = [g.strip() for g in args.graphs.split(",") if g.strip()]
        buckets = ", ".join(f'"{g}": [":serve_{g}"]' for g in families)
        (ws / "BUILD").write_text(BUILD.format(
            config=json.dumps(cfg).replace("true", "True").replace("false", "False"), weights="None",
            max_seq=args.max_seq, context=args.context, quant="",
            compiles=COMPILE.format(t="trn2", buckets=buckets, tp=f", tp_degree = {tp}" if tp > 1 else ""),
            srcs='":llm_trn2"'))
        (ws / "BUILD").write_text((ws / "BUILD").read_text().replace('neuron_bundle(name = "release", srcs = [":llm_trn2"])\n', ""))
        profile = ws.parent / "profile.json"
        wall, _ = cli(["build", "//:llm_trn2", "--jobs", str(args.jobs), "--cache-dir", str(cache), "--profile",
                       str(profile)], ws)
        events = json.loads(profile.read_text())
        events = events.get("traceEvents", events) if isinstance(events, dict) else events
        actions = sorted((e for e in events if e.get("cat") == "action"), key=lambda e: e["ts"])
        params = params_of(cfg)
        print(f"\n{shape} at tp {tp}: {params / 1e9:.1f}B parameters ({params * 2 / 1e9:.0f} GB in bf16: never "
              f"written, never read); build {wall:.0f} s wall, no checkpoint in the workspace")
        print(f"  {'action':<62} {'wall s':>7} {'cpu s':>7} {'peak RSS MiB':>12}")
        for e in actions:
            a = e.get("args") or {}
            print(f"  {e['name'][:62]:<62} {a.get('duration_s', 0):>7.1f} {a.get('cpu_s', 0):>7.1f} "
                  f"{a.get('peak_rss_mb', 0):>12.0f}")
        hlo = {p.parent.name: p.stat().st_size for p in sorted((ws / "neuronbuild-out/llm_trn2").glob("*/model.hlo.pb"))}
        for bucket, size in hlo.items():
            print(f"  HLO {bucket}: {size / 1e6:.2f} MB")
        def total(kind: str, key: str, actions: list[dict[str, object]] = actions) -> float:
            return float(sum((e.get("args") or {}).get(key, 0) for e in actions  # type: ignore[attr-defined]
                             if str(e["name"]).startswith(kind)))

        def peak(kind: str, actions: list[dict[str, object]] = actions) -> float:
            return float(max(((e.get("args") or {}).get("peak_rss_mb", 0) for e in actions  # type: ignore[attr-defined]
                              if str(e["name"]).startswith(kind)), default=0))

        rows.append({"shape": shape, "tp": tp, "params": params, "layers": int(SHAPES[shape]["num_hidden_layers"]),  # type: ignore[call-overload]
                     "wall": wall, "trace_rss": peak("Trace"), "lower_rss": peak("Lower"),
                     "trace_s": total("Trace", "duration_s"), "lower_s": total("Lower", "duration_s"),
                     "trace_cpu": total("Trace", "cpu_s"), "lower_cpu": total("Lower", "cpu_s"),
                     "hlo": sum(hlo.values()), "weights_actions": sum(1 for e in actions if str(e["name"]).startswith("Weights"))})
        if not args.keep:
            shutil.rmtree(ws.parent, ignore_errors=True)
    # Under load, wall seconds measure the neighbours: CPU seconds are each action's own (OMP_NUM_THREADS=1).
    print(f"\n{'shape':<16} {'tp':>3} {'params':>8} {'layers':>6} {'trace MiB':>9} {'Lower MiB':>9} {'trace cpu s':>11} "
          f"{'Lower cpu s':>11} {'trace wall s':>12} {'Lower wall s':>12} {'HLO MB':>7} {'build s':>7} {'weights':>7}")
    for r in rows:
        print(f"{r['shape']:<16} {r['tp']:>3} {float(r['params']) / 1e9:>7.1f}B {r['layers']:>6} {float(r['trace_rss']):>9.0f} "
              f"{float(r['lower_rss']):>9.0f} {float(r['trace_cpu']):>11.1f} {float(r['lower_cpu']):>11.1f} "
              f"{float(r['trace_s']):>12.1f} {float(r['lower_s']):>12.1f} {float(r['hlo']) / 1e6:>7.2f} "
              f"{float(r['wall']):>7.0f} {r['weights_actions']:>7}")
    for prev, r in zip(rows, rows[1:], strict=False):
        def x(key: str, r: dict[str, object] = r, prev: dict[str, object] = prev) -> str:
            return f"x{float(r[key]) / max(float(prev[key]), 1e-9):.2f}"  # type: ignore[arg-type]

        print(f"{prev['shape']} -> {r['shape']}: params {x('params')}, layers {x('layers')}; trace CPU {x('trace_cpu')}, "
              f"Lower CPU {x('lower_cpu')}, HLO bytes {x('hlo')}, trace peak RSS {x('trace_rss')}, Lower peak RSS "
              f"{x('lower_rss')}")
    if args.keep or args.workdir is not None:
        print(f"kept: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.2-1b", help=f"one of {', '.join(sorted(SHAPES))}; with "
                    "--graphs-only a comma-separated list of SHAPE[:TP]")
    ap.add_argument("--targets", default="trn2", help="comma-separated: trn2, cpu")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--max-seq", type=int, default=256)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", help="hf_causal_lm's dtype (the checkpoint is bf16 either way)")
    ap.add_argument("--generate", action="store_true", help="deploy the bundle, generate 8 tokens per target and compare "
                    "each step's logits with transformers' (max abs difference, top-2 gap)")
    ap.add_argument("--no-bundle", action="store_true", help="build the compile targets only (no bundle)")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--lean", action="store_true", help="delete the output target directories once measured (before "
                    "deploying): less disk at once")
    ap.add_argument("--tp", type=int, default=1, help="tp_degree of the trn2 compile (#29; cpu stays at 1)")
    ap.add_argument("--graphs", default="context,token",
                    help="graph families to build (one at a time keeps a large model's disk peak at one set of shards)")
    ap.add_argument("--reuse-checkpoint", action="store_true",
                    help="keep the workdir's checkpoint when it is this shape's (written by an earlier run)")
    ap.add_argument("--graphs-only", action="store_true",
                    help="(#51) trn2 graphs of each SHAPE[:TP] from the config alone (weights = None): no checkpoint")
    ap.add_argument("--validate", action="store_true",
                    help="`validate --generate 8` each compile against transformers (XLA:CPU; small shapes only)")
    ap.add_argument("--quantization", default=None, metavar="DTYPE[:SCHEME[:BLOCK]]",
                    help="hf_causal_lm's quantization (#44, docs/quantization.md), e.g. int8, float8_e4m3:per_channel, "
                         "int8:blockwise:128; --generate then compares with the unquantized model's tokens")
    args = ap.parse_args()
    if args.graphs_only:
        graphs_only(args)
        return
    if args.shape not in SHAPES:
        sys.exit(f"unknown shape {args.shape!r} (known: {', '.join(sorted(SHAPES))})")
    quant = ""
    if args.quantization:
        parts = args.quantization.split(":")
        q = {"dtype": parts[0], "scheme": parts[1] if len(parts) > 1 else "per_channel"}
        if len(parts) > 2:
            q["block_size"] = int(parts[2])
        quant = f", quantization = {json.dumps(q)}"
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    work = args.workdir or Path(tempfile.mkdtemp(prefix="big-model-bench-"))
    ws, cache, deployed = work / "ws", work / "cache", work / "deployed"
    cfg = {**COMMON, **SHAPES[args.shape], "dtype": args.dtype}
    stamp = work / "checkpoint.json"  # which shape ws/model.safetensors holds (--reuse-checkpoint)
    kept = work / "model.safetensors.kept"
    reuse = args.reuse_checkpoint and stamp.is_file() and json.loads(stamp.read_text()) == SHAPES[args.shape] \
        and (ws / "model.safetensors").is_file()
    if reuse:
        (ws / "model.safetensors").rename(kept)
    for d in (ws, cache, deployed):
        shutil.rmtree(d, ignore_errors=True)
    ws.mkdir(parents=True)
    (ws / "WORKSPACE.neuronbuild").write_text("")
    start = time.perf_counter()
    if reuse:
        kept.rename(ws / "model.safetensors")
        ckpt = (ws / "model.safetensors").stat().st_size
        print(f"checkpoint: {args.shape}, {ckpt / 1e9:.2f} GB bf16, reused; built as {args.dtype}")
    else:
        stamp.unlink(missing_ok=True)
        ckpt = write_checkpoint(ws / "model.safetensors", cfg)
        stamp.write_text(json.dumps(SHAPES[args.shape]))
        print(f"checkpoint: {args.shape}, {ckpt / 1e9:.2f} GB bf16, written in {time.perf_counter() - start:.0f} s; "
              f"built as {args.dtype}")
    families = [g.strip() for g in args.graphs.split(",") if g.strip()]
    buckets = ", ".join(f'"{g}": [":serve_{g}"]' for g in families)
    (ws / "BUILD").write_text(BUILD.format(config=json.dumps(cfg).replace("true", "True").replace("false", "False"), weights='"model.safetensors"', max_seq=args.max_seq, context=args.context, quant=quant,
                                           compiles="\n".join(COMPILE.format(t=t, buckets=buckets, tp=f", tp_degree = {args.tp}" if t == "trn2" and args.tp > 1 else "")
                                                              for t in targets),
                                           srcs=", ".join(f'":llm_{t}"' for t in targets)))
    profile = work / "profile.json"
    goals = [f"//:llm_{t}" for t in targets]
    build_args = [*goals, "--jobs", str(args.jobs), "--cache-dir", str(cache), "--profile", str(profile)]
    wall, _ = cli(["build", *build_args], ws)
    print(f"build {' '.join(goals)}: {wall:.0f} s wall (under load: other work shares this machine)")
    for goal in goals if args.validate else ():
        vwall, proc = cli(["validate", goal, "--generate", "8", "--cache-dir", str(cache)], ws, check=False)
        print(f"validate {goal} --generate 8 ({vwall:.0f} s): {'ok' if proc.returncode == 0 else 'FAILED'}")
        print("\n".join("  " + line for line in (proc.stdout + proc.stderr).strip().splitlines()[-10:]))
    if not args.no_bundle:  # the graphs are cached now: this invocation only writes the bundle
        bwall, _ = cli(["build", "//:release", "--jobs", str(args.jobs), "--cache-dir", str(cache)], ws)
        print(f"bundle //:release (graphs cached: packaging only): {bwall:.0f} s wall, process start included")
    events = json.loads(profile.read_text())
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    print(f"{'action':<70} {'wall s':>8} {'cpu s':>8} {'peak RSS MiB':>12}")
    for e in sorted((e for e in events if e.get("cat") == "action"), key=lambda e: e["ts"]):
        a = e.get("args") or {}
        print(f"{e['name'][:70]:<70} {a.get('duration_s', 0):>8.1f} {a.get('cpu_s', 0):>8.1f} "
              f"{a.get('peak_rss_mb', 0):>12.0f}")
    out = ws / "neuronbuild-out"
    stored = du(cache) - sum(du(p) for p in cache.glob("*/toolchain-tmp"))  # (compiler working files, not results)
    print(f"checkpoint {ckpt / 1e9:.2f} GB; cache {stored / 1e9:.2f} GB ({stored / ckpt:.2f}x; compiler working "
          "files left out)")
    for t in targets:
        d = out / f"llm_{t}"
        if d.exists():
            own = du(d, beyond=cache)
            print(f"  out llm_{t}: {du(d) / 1e9:.2f} GB ({du(d) / ckpt:.2f}x); on disk beyond the cache's blobs "
                  f"{own / 1e9:.2f} GB ({own / ckpt:.2f}x: big files are read-only links to them)")
        for shard in sorted(d.glob("*/rank_0.safetensors"))[:1]:  # tensor parallel: every rank's shard is this size
            size = shard.stat().st_size
            print(f"  one rank's weights shard (of {args.tp}): {size / 1e9:.2f} GB ({size / ckpt:.3f}x the checkpoint)")
    bundles = sorted(b for b in out.glob("release.tar.*") if not b.name.endswith(".sha256"))
    for b in bundles:
        print(f"  bundle {b.name}: {b.stat().st_size / 1e9:.2f} GB ({b.stat().st_size / ckpt:.2f}x)")
    if args.lean:
        for t in targets:
            shutil.rmtree(out / f"llm_{t}", ignore_errors=True)
    if args.generate and bundles:
        wall, _ = cli(["deploy", str(bundles[0]), "--cache-dir", str(deployed)], ws)
        print(f"deploy: {wall:.0f} s; deployed {du(deployed) / 1e9:.2f} GB ({du(deployed) / ckpt:.2f}x)")
        start = time.perf_counter()
        want, want_logits = reference_tokens(cfg, ws / "model.safetensors")
        print(f"transformers greedy tokens ({time.perf_counter() - start:.0f} s): {want}")
        if args.dtype != "float32":  # scale: how far transformers itself in this dtype is from float32
            fp32, fp32_logits = reference_tokens(cfg, ws / "model.safetensors", "float32")
            print(f"transformers float32 greedy tokens: {fp32}")
            compare_logits(f"transformers-{args.dtype} vs transformers-float32", want[0], want_logits, fp32[0],
                           fp32_logits)
        for t in targets:
            # the logits of every step recorded as the runtime's generate computes them (its outputs by name)
            code = ("import sys, json; from neuronbuild.runtime import open_cache; "
                    f"lm = open_cache(sys.argv[1], strict=True, emulate={'None' if t == 'cpu' else repr('xla-cpu')})"
                    f".causal_lm('//:llm_{t}'); seen = []; named = lm._named\n"
                    "def record(family, out):\n"
                    "    d = named(family, out); seen.append(d['logits'][0].float().tolist()); return d\n"
                    f"lm._named = record; ids = lm.generate([{PROMPT}], max_new_tokens={NEW_TOKENS}).tolist()\n"
                    "json.dump(seen, open(sys.argv[2], 'w')); print(ids)")
            start = time.perf_counter()
            logits_file = work / f"logits_{t}.json"
            proc = subprocess.run([sys.executable, "-c", code, str(deployed), str(logits_file)], capture_output=True,
                                  text=True)
            tokens = proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 else proc.stderr[-500:]
            same = "equal to transformers'" if tokens == str(want) else "DIFFERENT from transformers'"
            print(f"generate llm_{t}: {time.perf_counter() - start:.0f} s: {tokens} ({same})")
            if proc.returncode == 0:
                compare_logits(f"llm_{t} vs transformers-{args.dtype}", json.loads(tokens)[0],
                               json.loads(logits_file.read_text()), want[0], want_logits)
    if not args.keep and args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"kept: {work}")


if __name__ == "__main__":
    main()
