"""Quantized builds (hf_causal_lm's `quantization`, docs/quantization.md): one tiny Llama workspace (fp32 compute) built
once, int8 per_channel (cpu, trn2), float8_e4m3 per_channel (cpu, trn2, trn2 at tp 2) and int8 blockwise (trn2, trn2
at tp 2), deployed: greedy tokens and context logits equal transformers run with the dequantized weights computed
here from the documented formulas (numpy and ml_dtypes, independently of neuronbuild's code); the weights files hold
exactly those values and scales; a pre-quantized checkpoint is taken as it is and one with an fp8 value beyond +-240
fails the trn2 build naming the tensor; a scheme change re-runs only that model's weights action and its graphs."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import run_cli, write_ws

# Linear layers dominate (as in real LLMs, more so): the int8 weights file is under 0.3x the fp32 checkpoint.
CONFIG = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 1536,
          "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 64, "eos_token_id": 2, "bos_token_id": 1, "pad_token_id": 0}
# name -> (dtype, scheme, block_size)
MODELS = {"int8_pc": ("int8", "per_channel", None), "e4m3_pc": ("float8_e4m3", "per_channel", None),
          "int8_blk": ("int8", "blockwise", 32)}
# The matrix, kept cheap: AOTInductor compiles (~20 s a graph here) for fp8 only (the dequantising graph is the same
# code for int8); every model on trn2 (XLA:CPU); tp 2 where the split matters (fp8 per rank; blocks of a
# row-parallel layer's input split across ranks).
COMPILES = {"int8_pc_trn2": ("int8_pc", ":trn2", 1),
            "e4m3_pc_cpu": ("e4m3_pc", ":cpu", 1), "e4m3_pc_trn2": ("e4m3_pc", ":trn2", 1),
            "e4m3_pc_tp2": ("e4m3_pc", ":trn2", 2), "int8_blk_trn2": ("int8_blk", ":trn2", 1),
            "int8_blk_tp2": ("int8_blk", ":trn2", 2), "kv8_trn2": ("kv8", ":trn2", 1)}
PROMPT = [1, 17, 99, 25, 3, 48, 7, 11]  # fills the context bucket (seq 8): no padding
NEW = 8
QMAX = {"int8": 127.0, "float8_e4m3": 240.0, "float8_e5m2": 57344.0}
LINEARS = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")


def _quant(dtype: str, scheme: str, block: int | None) -> str:
    return json.dumps({"dtype": dtype, "scheme": scheme} | ({"block_size": block} if block else {}))


def _build_file() -> str:
    lines = ['load("@neuronbuild//rules:llm.bzl", "hf_causal_lm", "llm_buckets")',
             f"CONFIG = {json.dumps(CONFIG)}",
             'llm_buckets(name = "b", batch_sizes = [1], context_lengths = [8])',
             'B = {"context": [":b_context"], "token": [":b_token"]}',
             'neuron_target(name = "trn2", platform = "trn2")',
             'neuron_target(name = "cpu", platform = "cpu", isa = "native")']
    for name, q in MODELS.items():
        lines.append(f'hf_causal_lm(name = "{name}", config = CONFIG, weights = "llama.safetensors", max_seq = 32, '
                     f"quantization = {_quant(*q)})")
    for name, (model, target, tp) in COMPILES.items():
        lines.append(f'neuron_compile(name = "{name}", model = ":{model}", buckets = B, target = "{target}", '
                     f"tp_degree = {tp})")
    # float weights, an fp8 KV cache
    lines.append('hf_causal_lm(name = "kv8", config = CONFIG, weights = "llama.safetensors", max_seq = 32, '
                 'kv_cache_dtype = "float8_e4m3")')
    lines.append(f'neuron_bundle(name = "release", srcs = {json.dumps([":" + c for c in COMPILES])})')
    # Pre-quantized fp8 checkpoints (NxD Inference's layout: fp8 weight + <module>.scale): one as the e4m3_pc
    # reference quantizes it, one with a value planted at 250.
    e4m3 = _quant("float8_e4m3", "per_channel", None)
    for name in ("pre_ok", "pre_bad"):
        lines.append(f'hf_causal_lm(name = "{name}", config = CONFIG, weights = "{name}.safetensors", max_seq = 32, '
                     f"quantization = {e4m3})")
        lines.append(f'neuron_compile(name = "{name}_trn2", model = ":{name}", buckets = B, target = ":trn2")')
    return "\n".join(lines) + "\n"


def reference_quantize(w: np.ndarray, dtype: str, scheme: str, block: int | None) -> tuple[np.ndarray, np.ndarray]:
    """docs/quantization.md's formulas, written out here: (q as float32, float32 scale) of w [out, in]."""
    import ml_dtypes

    w = w.astype(np.float32)
    out, inp = w.shape
    groups = {"per_tensor": w.reshape(1, 1, -1), "per_channel": w.reshape(out, 1, inp),
              "blockwise": w.reshape(out, inp // (block or 1), block or 1)}[scheme]
    amax = np.abs(groups).max(axis=2, keepdims=True)
    scale = np.where(amax > 0, amax / np.float32(QMAX[dtype]), np.float32(1)).astype(np.float32)
    x = (groups / scale).astype(np.float32)
    if dtype == "int8":
        q = np.clip(np.round(x), -127, 127)  # numpy rounds half to even
    else:  # IEEE-style fp8 (ml_dtypes' float8_e4m3 is Neuron's +-240 format), round to nearest even
        q = x.astype(ml_dtypes.float8_e4m3 if dtype == "float8_e4m3" else ml_dtypes.float8_e5m2).astype(np.float32)
    shape = {"per_tensor": (1,), "per_channel": (out, 1), "blockwise": (out, inp // (block or 1))}[scheme]
    return q.reshape(out, inp).astype(np.float32), scale.reshape(shape)


def dequantized(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """q * scale, each scale over its group (blockwise: its block of input columns)."""
    if scale.ndim == 2 and scale.shape[1] > 1:
        scale = np.repeat(scale, q.shape[1] // scale.shape[1], axis=1)
    return (q * scale).astype(np.float32)


def _hf_model(state: dict[str, Any]) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in CONFIG.items() if k != "model_type"}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **fields)).eval()
    model.load_state_dict(state, strict=False)
    return model


@pytest.fixture(scope="module")
def weights() -> dict[str, Any]:
    """The fp32 checkpoint (seeded transformers init) as torch tensors."""
    import torch

    torch.manual_seed(0)
    model = _hf_model({})
    return {k: v.detach().contiguous() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def qws(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path, weights: dict[str, Any]) -> Path:
    import ml_dtypes  # noqa: F401  (the reference's fp8)
    import torch
    from safetensors.torch import save_file

    ws = write_ws(tmp_path_factory.mktemp("quant") / "ws", {"models/BUILD": _build_file()})
    save_file(weights, str(ws / "models" / "llama.safetensors"))
    pre: dict[str, Any] = {}
    for k, v in weights.items():
        if LINEARS.fullmatch(k):
            q, s = reference_quantize(v.numpy(), "float8_e4m3", "per_channel", None)
            pre[k] = torch.from_numpy(q).to(torch.float8_e4m3fn)
            pre[k[:-len("weight")] + "scale"] = torch.from_numpy(s)
        else:
            pre[k] = v
    save_file(pre, str(ws / "models" / "pre_ok.safetensors"))
    bad = dict(pre)
    planted = bad["model.layers.0.mlp.up_proj.weight"].float()
    planted[3, 5] = 250.0
    bad["model.layers.0.mlp.up_proj.weight"] = planted.to(torch.float8_e4m3fn)
    save_file(bad, str(ws / "models" / "pre_bad.safetensors"))
    proc = run_cli(["build", "//models:release", "//models:pre_ok_trn2", "--jobs", "2", "--cache-dir",
                    str(cache_dir)], ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return ws


@pytest.fixture(scope="module")
def deployed(qws: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("quant_serve") / "cache"
    proc = run_cli(["deploy", str(qws / "neuronbuild-out/models/release.tar.zst"), "--cache-dir", str(dest)], qws)
    assert proc.returncode == 0, proc.stderr
    return dest


def fp8_rounding_cache(config: Any) -> Any:
    """transformers' DynamicCache holding what an fp8 KV cache holds: keys and values cast to e4m3 and back."""
    import torch
    from transformers import DynamicCache

    class Fp8Cache(DynamicCache):
        def update(self, k: Any, v: Any, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
            fp8 = torch.float8_e4m3fn
            return super().update(k.to(fp8).to(k.dtype), v.to(fp8).to(v.dtype), layer_idx, *args, **kwargs)

    return Fp8Cache(config=config)


@pytest.fixture(scope="module")
def references(weights: dict[str, Any]) -> dict[str, tuple[list[int], Any]]:
    """Per model (and the unquantized one, "fp32"): transformers' greedy tokens and context logits with the
    dequantized weights (kv8: float weights, the cache as fp8 holds it)."""
    import torch

    out = {}
    ids = torch.tensor([PROMPT])
    for name, q in {**MODELS, "fp32": None, "kv8": None}.items():
        state = dict(weights)
        if q is not None:
            for k, v in weights.items():
                if LINEARS.fullmatch(k):
                    state[k] = torch.from_numpy(dequantized(*reference_quantize(v.numpy(), *q)))
        model = _hf_model(state)

        def cache() -> Any:
            return fp8_rounding_cache(model.config) if name == "kv8" else None  # noqa: B023 (used at once)

        with torch.no_grad():
            logits = model(ids, attention_mask=torch.ones_like(ids), past_key_values=cache()).logits[0, -1]
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                                 past_key_values=cache())
        out[name] = (gen[0, len(PROMPT):].tolist(), logits)
    return out


# One fresh process serves every compile from the deployed release (tp 2 runs on two XLA:CPU devices, which jax
# must be started with: not this test process, where another file may have started it already).
SERVE = r"""
import json, sys
import torch
from neuronbuild.runtime import open_cache

root, labels, prompt, new = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
cache = open_cache(root, strict=True, emulate="xla-cpu")
ids = torch.tensor([prompt])
out = {}
for label in labels:
    tokens = cache.causal_lm(label).generate([prompt], max_new_tokens=new)[0, len(prompt):].tolist()
    logits = cache.model(label).family("context").bucket_fn("context_batch1_seq8")(ids, torch.ones_like(ids))[0]
    out[label] = {"tokens": tokens, "logits": logits[0].tolist()}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def served(deployed: Path) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", SERVE, str(deployed), json.dumps([f"//models:{c}" for c in COMPILES]),
                           json.dumps(PROMPT), str(NEW)], capture_output=True, text=True, timeout=600, cwd=deployed)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.parametrize("compile_", list(COMPILES))
def test_greedy_tokens_and_context_logits_equal_transformers_on_the_dequantized_weights(
        served: dict[str, Any], references: dict[str, tuple[list[int], Any]], compile_: str) -> None:
    import torch

    got = served[f"//models:{compile_}"]
    ref_tokens, ref_logits = references[COMPILES[compile_][0]]
    assert got["tokens"] == ref_tokens
    logits = torch.tensor(got["logits"])
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    # ... and the quantization is real: the unquantized model's logits differ (the error validate reports)
    assert float((logits - references["fp32"][1]).abs().max()) > 1e-4


@pytest.mark.parametrize("model", list(MODELS))
def test_weights_files_hold_the_documented_quantized_values_and_scales(
        qws: Path, weights: dict[str, Any], model: str) -> None:
    import torch
    from safetensors.torch import load_file

    compile_ = next(c for c, (m, t, tp) in COMPILES.items() if m == model and tp == 1)
    path = qws / f"neuronbuild-out/models/{compile_}/token_batch1/constants.safetensors"
    got = load_file(str(path))
    dtype = {"int8": torch.int8, "float8_e4m3": torch.float8_e4m3fn}[MODELS[model][0]]
    for k, v in weights.items():
        if LINEARS.fullmatch(k):
            q, s = reference_quantize(v.numpy(), *MODELS[model])
            assert got[k].dtype == dtype, k
            assert np.array_equal(got[k].float().numpy(), q), k
            assert np.array_equal(got[k[:-len("weight")] + "scale"].numpy(), s), k
        else:  # embeddings, norms, lm_head: as they were
            assert got[k].dtype == torch.float32 and torch.equal(got[k], v), k
    if model == "int8_pc":  # linear layers dominate this model: int8 weights take under 0.3x the fp32 checkpoint
        assert path.stat().st_size <= 0.3 * (qws / "models/llama.safetensors").stat().st_size


def test_tp2_shards_split_quantized_weights_and_their_scales(qws: Path) -> None:
    from safetensors.torch import load_file

    whole = load_file(str(qws / "neuronbuild-out/models/int8_blk_trn2/token_batch1/constants.safetensors"))
    ranks = [load_file(str(qws / f"neuronbuild-out/models/int8_blk_tp2/token_batch1/rank_{r}.safetensors"))
             for r in range(2)]
    for name, dim in (("mlp.up_proj", 0), ("mlp.down_proj", 1), ("self_attn.o_proj", 1)):
        for leaf in ("weight", "scale"):
            key = f"model.layers.0.{name}.{leaf}"
            joined = np.concatenate([r[key].numpy() for r in ranks], axis=dim)
            assert np.array_equal(joined, whole[key].numpy()), key  # quantized whole, then split


def test_fp8_modules_lower_to_f8_parameters_and_their_compile_sets_the_special_scalar_env(qws: Path) -> None:
    from jax._src.lib import xla_client as xc

    out = qws / "neuronbuild-out/models"
    text = xc.XlaComputation((out / "e4m3_pc_trn2/token_batch1/model.hlo.pb").read_bytes()).as_hlo_text()
    assert re.search(r"f8e4m3fn\[64,64\]\{1,0\} parameter\(", text)
    assert json.loads((out / "e4m3_pc_trn2/token_batch1/compile_flags.json").read_text())["env"] == {
        "XLA_HANDLE_SPECIAL_SCALAR": "1"}
    # an fp8 KV cache: an f8e4m3fn input and output, the same environment
    text = xc.XlaComputation((out / "kv8_trn2/token_batch1/model.hlo.pb").read_bytes()).as_hlo_text()
    assert re.search(r"f8e4m3fn\[1,2,1,2,32,16\]\{[0-9,]+\} parameter\(", text)
    assert json.loads((out / "kv8_trn2/token_batch1/compile_flags.json").read_text())["env"] == {
        "XLA_HANDLE_SPECIAL_SCALAR": "1"}
    text = xc.XlaComputation((out / "int8_pc_trn2/token_batch1/model.hlo.pb").read_bytes()).as_hlo_text()
    assert re.search(r"s8\[64,64\]\{1,0\} parameter\(", text)
    assert "env" not in json.loads((out / "int8_pc_trn2/token_batch1/compile_flags.json").read_text())


def test_a_prequantized_checkpoint_is_taken_as_it_is(qws: Path) -> None:
    out = qws / "neuronbuild-out/models"
    for bucket in ("context_batch1_seq8", "token_batch1"):
        assert (out / "pre_ok_trn2" / bucket / "constants.safetensors").read_bytes() == \
            (out / "e4m3_pc_trn2" / bucket / "constants.safetensors").read_bytes()


def test_an_fp8_value_beyond_240_fails_the_trn2_build_naming_the_tensor(qws: Path, cache_dir: Path) -> None:
    proc = run_cli(["build", "//models:pre_bad_trn2", "--cache-dir", str(cache_dir)], qws)
    assert proc.returncode == 1
    text = proc.stdout + proc.stderr
    # (250 is stored as the nearest e4m3fn value, 256)
    assert "fp8 e4m3 tensor model.layers.0.mlp.up_proj.weight holds values up to 256, beyond Neuron's +-240" in text
    assert "Traceback" not in text


def test_a_scheme_change_reruns_only_that_models_weights_action_and_graphs(
        qws: Path, tmp_path: Path, cache_dir: Path) -> None:
    ws = tmp_path / "ws"
    shutil.copytree(qws, ws, ignore=shutil.ignore_patterns("neuronbuild-out"))
    build = ws / "models" / "BUILD"
    before = _quant("int8", "per_channel", None)
    assert before in build.read_text()
    build.write_text(build.read_text().replace(before, _quant("int8", "per_tensor", None)))
    proc = run_cli(["plan", "//models:release", "--cache-dir", str(cache_dir)], ws)
    assert proc.returncode == 0, proc.stderr
    # int8_pc: its weights action, 2 traces, 2 lowerings, 2 compiles; nothing of the other models
    assert re.search(r"\n\d+ actions: 7 to execute, \d+ cached", proc.stdout), proc.stdout
    for name in COMPILES:
        rows = proc.stdout.split(f"//models:{name} ")[1].split("\n//models:")[0]
        assert ("build" in rows) == name.startswith("int8_pc"), (name, rows)


def test_validate_checks_the_dequantized_model_and_reports_the_quantization_error(qws: Path, cache_dir: Path) -> None:
    labels = ["//models:int8_blk_tp2", "//models:kv8_trn2"]
    proc = run_cli(["validate", *labels, "--generate", "4", "--cache-dir", str(cache_dir)], qws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for label in labels:
        rows = [line for line in proc.stdout.splitlines() if line.startswith(label + " ")]
        assert len([line for line in rows if line.endswith("  ok")]) == 2  # within fp32 tolerance of the reference
        errors = [float(m.group(1)) for line in rows
                  if (m := re.search(r"against the unquantized model: max abs (\S+),", line))]
        assert len(errors) == 2 and all(1e-4 < e < 0.05 for e in errors), rows
        assert f"{label}: generate batch1 against transformers: ok (4 tokens x 1 equal)" in proc.stdout


@pytest.mark.parametrize("dtype", list(QMAX))
@pytest.mark.parametrize("scheme,block", [("per_tensor", None), ("per_channel", None), ("blockwise", 16)])
def test_quantize_follows_the_documented_formulas(dtype: str, scheme: str, block: int | None) -> None:
    import torch

    from neuronbuild.toolchains.quantize import QuantSpec, dequantize, quantize

    gen = torch.Generator().manual_seed(3)
    w = torch.randn(24, 64, generator=gen) * torch.logspace(-3, 1, 24).reshape(24, 1)  # rows of very unequal ranges
    w[5] = 0.0  # an all-zero row (and block): scale 1, q 0
    w[7, 3] = 2.5 * float(w.abs().max())  # one outlier
    spec = QuantSpec.parse({"dtype": dtype, "scheme": scheme} | ({"block_size": block} if block else {}))
    q, scale = quantize(w, spec)
    ref_q, ref_scale = reference_quantize(w.numpy(), dtype, scheme, block)
    assert np.array_equal(q.float().numpy(), ref_q) and np.array_equal(scale.numpy(), ref_scale)
    assert scale.dtype == torch.float32 and float(q.float().abs().max()) <= QMAX[dtype]
    assert np.array_equal(dequantize(q, scale, torch.float32).numpy(), dequantized(ref_q, ref_scale))
    if scheme != "per_tensor":
        assert not q[5].float().any()


def test_modules_to_not_convert_keeps_matching_layers_in_the_model_dtype() -> None:
    import torch

    from neuronbuild.toolchains.quantize import QuantLinear, quantize_linears

    def converted(skip: list[str]) -> set[str]:
        model = _hf_model({})
        quantize_linears(model, {"quantization": {"dtype": "int8", "scheme": "per_channel",
                                                  "modules_to_not_convert": skip}})
        return {n for n, m in model.named_modules() if isinstance(m, QuantLinear)}

    every = converted([])
    assert every == {f"model.layers.0.{p}" for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                     "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                                     "mlp.down_proj")}  # lm_head, embeddings, norms: never
    assert converted(["mlp"]) == {n for n in every if ".mlp." not in n}
    assert converted(["*.down_proj", "layers.0.self_attn.q_proj"]) == every - {
        "model.layers.0.mlp.down_proj", "model.layers.0.self_attn.q_proj"}
    with pytest.raises(ValueError, match="pattern 'layers.1' matches no quantizable layer"):
        converted(["layers.1"])
    model = _hf_model({})
    with pytest.raises(ValueError, match="model.layers.0.self_attn.q_proj's input width 64 is not a multiple of "
                                         "block_size 48"):
        quantize_linears(model, {"quantization": {"dtype": "int8", "scheme": "blockwise", "block_size": 48}})
    assert torch.get_default_dtype() == torch.float32


@pytest.mark.parametrize("quant,message", [
    ('{"dtype": "int4"}', "quantization dtype \"int4\" is not one of int8, float8_e4m3, float8_e5m2"),
    ('{"dtype": "int8", "scheme": "blockwise"}', "scheme blockwise needs a positive int block_size, got None"),
    ('{"dtype": "int8", "block_size": 32}', "block_size is for scheme blockwise only (scheme is per_channel)"),
    ('{"dtype": "int8", "group": 4}', "quantization: unknown key \"group\""),
])
def test_a_bad_quantization_is_a_located_error(tmp_path: Path, quant: str, message: str) -> None:
    build = _build_file().replace(_quant("int8", "per_channel", None), quant, 1)
    ws = write_ws(tmp_path / "ws", {"models/BUILD": build, "models/llama.safetensors": "",
                                    "models/pre_ok.safetensors": "", "models/pre_bad.safetensors": ""})
    proc = run_cli(["plan", "//models:int8_pc_trn2", "--cache-dir", str(tmp_path / "c")], ws)
    assert proc.returncode == 2
    assert "models/BUILD:" in proc.stderr and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


# A compiler that records the variable it ran with into the NEFF it writes (the hand-off itself: run_neuronx_cc).
ENV_RECORDER = """#!/bin/sh
if [ "$1" = "--version" ]; then echo "NeuronX Compiler version 9.9.9"; exit 0; fi
echo "XLA_HANDLE_SPECIAL_SCALAR=$XLA_HANDLE_SPECIAL_SCALAR" > model.neff
"""


def test_neuronx_cc_runs_with_the_special_scalar_env_for_fp8_modules_only(qws: Path, tmp_path: Path) -> None:
    from neuronbuild.toolchains.neuron_steps import compile_env
    from neuronbuild.toolchains.neuronx_cc import run_neuronx_cc

    exe = tmp_path / "neuronx-cc"
    exe.write_text(ENV_RECORDER)
    exe.chmod(0o755)
    for compile_, want in (("e4m3_pc_trn2", "1"), ("kv8_trn2", "1"), ("int8_pc_trn2", "")):
        built = qws / f"neuronbuild-out/models/{compile_}/token_batch1"
        out = tmp_path / compile_
        out.mkdir()
        shutil.copyfile(built / "model.hlo.pb", out / "model.hlo.pb")
        run_neuronx_cc({"path": str(exe), "version": "9.9.9", "timeout_s": 60}, "trn2", {}, out,
                       tmp_path / "work" / compile_, [], compile_env((built / "params.json").read_bytes()))
        assert (out / "model.neff").read_text().strip() == f"XLA_HANDLE_SPECIAL_SCALAR={want}", compile_
