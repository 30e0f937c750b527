"""An fp8 KV cache (`kv_cache_dtype = "float8_e4m3"`) in the continuous-batching graphs: the serving cache of lines is
held in fp8 (written through a cast, read back in the model dtype), built for trn2 (the HLO run on XLA:CPU), and
`validate --generate` finds each graph's logits equal to transformers' with the same fp8 rounding of its cache, and
each request's greedy tokens equal to transformers' `generate` of it alone; the quantization error against the float
cache is reported."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import run_cli, write_ws

HF = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "max_position_embeddings": 64}
BUILD = f'''load("@neuronbuild//rules:llm.bzl", "hf_causal_lm")
neuron_target(name = "trn2", platform = "trn2")
hf_causal_lm(name = "llama", model_type = "llama", config = {json.dumps(HF)}, weights = "llama.safetensors",
             max_seq = 32, continuous_batching = True, max_batch = 4, on_device_sampling = True, output_logits = True,
             kv_cache_dtype = "float8_e4m3")
neuron_buckets(name = "ctx", shapes = [{{"batch": 2, "seq": 16}}])
neuron_buckets(name = "tok", shapes = [{{"batch": 2}}, {{"batch": 4}}])
neuron_compile(name = "llama_trn2", model = ":llama", target = ":trn2",
               buckets = {{"context": [":ctx"], "token": [":tok"]}})
'''


def test_fp8_kv_cache_serving_graphs_validate_and_generate_like_transformers(tmp_path: Path, cache_dir: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    ws = write_ws(tmp_path / "ws", {"BUILD": BUILD})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **HF))
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(ws / "llama.safetensors"))
    proc = run_cli(["build", "//...", "--jobs", "2", "--cache-dir", str(cache_dir)], ws)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    params = json.loads((ws / "neuronbuild-out/llama_trn2/token_batch2/params.json").read_text())
    assert "float8_e4m3fn" in json.dumps(params), params  # the cache parameter is fp8
    proc = run_cli(["validate", "//...", "--generate", "6", "--cache-dir", str(cache_dir)], ws)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    rows = [line for line in out.splitlines() if line.startswith("//:llama_trn2 ") and line.endswith(" ok")]
    assert len(rows) == 3, out
    errors = [float(line.split("max abs ")[1].split(",")[0]) for line in out.splitlines()
              if "against the unquantized model" in line]
    assert len(errors) == 3 and all(e > 0 for e in errors), out  # the fp8 cache's rounding: real, and reported
    gen = [line for line in out.splitlines() if line.startswith("//:llama_trn2: generate ")]
    assert len(gen) == 2 and all(": ok (6 tokens x " in g for g in gen), out
