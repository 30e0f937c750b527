"""`neuronbuild validate` of a mixture-of-experts hf_causal_lm at any expert width. Its reference, transformers' own
model, computes the experts with transformers' eager experts (toolchains/validate.py reference_model): the default
grouped_mm experts refuse, on CPU, an expert whose intermediate rows are not a multiple of 16 bytes (a width of 6 in
float32: 24 bytes), where validate printed an ERROR row for every graph and failed generate. Built: one Qwen3-MoE of
expert width 6 for trn2 (its HLO run on XLA:CPU), one context and one token bucket, validated with --generate.
Eager (no build): every MoE family's reference at width 6 gives the logits of the wrapper's context graph
(neuronbuild's dense experts) on the same weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_cli, write_ws

WIDTH = 6  # each expert's intermediate width: rows of 24 bytes in float32
SEQ, NEW, MAX_SEQ = 8, 4, 16
_BASE: dict[str, object] = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
                            "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 32,
                            "initializer_range": 0.2}  # (10x the default: experts and routing that matter to the logits)
FAMILIES: dict[str, tuple[str, dict[str, object]]] = {
    "mixtral": ("mixtral", _BASE | {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": WIDTH}),
    "qwen2_moe": ("qwen2_moe", _BASE | {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": WIDTH,
                                        "shared_expert_intermediate_size": 16}),
    "qwen3_moe": ("qwen3_moe", _BASE | {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
                                        "moe_intermediate_size": WIDTH}),
    "olmoe": ("olmoe", _BASE | {"num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": WIDTH}),
    "gpt_oss": ("gpt_oss", _BASE | {"intermediate_size": WIDTH, "head_dim": 8, "num_local_experts": 4,
                                    "num_experts_per_tok": 2, "sliding_window": 4, "max_position_embeddings": 131072}),
    "deepseek_v3": ("deepseek_v3", _BASE | {"moe_intermediate_size": WIDTH, "num_key_value_heads": 2,
                                            "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2,
                                            "topk_group": 1, "first_k_dense_replace": 1, "kv_lora_rank": 8,
                                            "q_lora_rank": 12, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4,
                                            "v_head_dim": 6, "max_position_embeddings": 64}),
    "llama4_text": ("llama4_text", _BASE | {"intermediate_size": WIDTH, "intermediate_size_mlp": 32, "head_dim": 8,
                                            "num_local_experts": 2, "num_experts_per_tok": 1,
                                            "max_position_embeddings": 64}),
}
BUILT = "qwen3_moe"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_validates_reference_of_each_moe_family_at_24_byte_expert_rows_gives_the_graphs_logits(name: str) -> None:
    import torch

    from neuronbuild.toolchains import hf_causal_lm
    from neuronbuild.toolchains.validate import reference_model

    model_type, hf = FAMILIES[name]
    cfg = {"model_type": model_type, "hf": hf, "max_seq": MAX_SEQ}
    torch.manual_seed(0)
    ref = reference_model(cfg)
    graph = hf_causal_lm.context(cfg).eval()
    graph.load_state_dict(ref.state_dict())
    gen = torch.Generator().manual_seed(1)
    mask = torch.ones(2, SEQ, dtype=torch.int64)
    mask[1, :3] = 0  # a left-padded row
    ids = torch.randint(1, 64, (2, SEQ), generator=gen).masked_fill(mask == 0, 0)
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask,
                   position_ids=(mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)).logits[:, -1]
        got = graph(ids, mask)["logits"]
    err = float((got - want).abs().max())
    assert err < 1e-4 < float(want.abs().max()), (name, err)


@pytest.mark.timeout(1800)
def test_validate_passes_an_moe_model_whose_expert_rows_are_24_bytes_and_generates_transformers_tokens(
        tmp_path: Path, cache_dir: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from neuronbuild.toolchains.hf_causal_lm import hf_model

    model_type, hf = FAMILIES[BUILT]
    torch.manual_seed(0)
    model = hf_model({"model_type": model_type, "hf": hf, "max_seq": MAX_SEQ})
    build = ['load("@neuronbuild//rules:llm.bzl", "hf_causal_lm", "llm_buckets")',
             'neuron_target(name = "trn2", platform = "trn2")',
             f'llm_buckets(name = "serve", batch_sizes = [2], context_lengths = [{SEQ}])',
             f'hf_causal_lm(name = "moe", model_type = "{model_type}", config = {json.dumps(hf)}, '
             f'weights = "w.safetensors", max_seq = {MAX_SEQ})',
             'neuron_compile(name = "moe_trn2", model = ":moe", target = ":trn2", '
             'buckets = {"context": [":serve_context"], "token": [":serve_token"]})']
    ws = write_ws(tmp_path / "ws", {"BUILD": "\n".join(build) + "\n"})
    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, str(ws / "w.safetensors"))
    proc = run_cli(["build", "//...", "--jobs", "2", "--cache-dir", str(cache_dir)], ws)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    proc = run_cli(["validate", "//...", "--generate", str(NEW), "--cache-dir", str(cache_dir)], ws)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    rows = [line for line in out.splitlines() if line.startswith("//:moe_trn2 ")]
    assert [r.split()[1] for r in rows] == ["context_batch2_seq8", "token_batch2"], out
    assert all(r.endswith(" ok") and "ERROR" not in r for r in rows), out
    gen = [line for line in out.splitlines() if line.startswith("//:moe_trn2: generate ")]
    assert [g.split()[2] for g in gen] == ["batch1", "batch2_padded"], out
    assert all(f": ok ({NEW} tokens x " in g for g in gen), out
