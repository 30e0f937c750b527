"""Tensor parallelism beyond llama: families whose decoder layers are llama's in shape but not in detail (qwen2's q/k/v
biases, qwen3's per-head q/k norms, gemma3's scaled embedding and sliding-window layers), Phi-3's fused q|k|v and
gate|up projections (each part split on its own), Qwen2-MoE's experts and shared expert, BLOOM (per-head interleaved
q|k|v, ALiBi slopes taken by each rank for its heads, row-parallel biases added once), GPT-BigCode's multi-query
attention (the one k and v head replicated), gpt-oss (experts with biases, transposed and interleaved, attention
sinks split by head), DeepSeek-V3 (latent attention), Llama 4 (complex RoPE, experts), GPT-2 (Conv1D's transposed
weights, fused q|k|v) and Falcon's new decoder architecture with ALiBi (kv groups, each rank's slopes), built at
tp_degree 2 for trn2 in one workspace and one build, their HLO run on 2 XLA:CPU host
devices by `validate --generate`: logits within tolerance of transformers' own model and greedy tokens equal to
transformers' `generate` (batch 1 and a padded batch). Biases and norm weights are perturbed from transformers'
initial 0 and 1, so a bias added on every rank or a norm given another rank's block shows. A family without a
sharding plan is refused at analysis with the BUILD line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_cli, write_ws

WINDOW, SEQ, NEW, MAX_SEQ = 4, 8, 8, 16
_BASE = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 32}
FAMILIES = {
    "qwen2_sw": ("qwen2", _BASE | {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    "qwen3": ("qwen3", _BASE | {"head_dim": 8}),
    "gemma3_sw": ("gemma3_text", _BASE | {"head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": WINDOW,
                                          "layer_types": ["sliding_attention", "full_attention"]}),
    # fused q|k|v and gate|up projections, 2 kv heads split over the ranks
    "phi3": ("phi3", _BASE | {"num_attention_heads": 4, "num_key_value_heads": 2, "pad_token_id": 0, "eos_token_id": 1,
                              "bos_token_id": 1}),
    # experts (fused gate|up, their intermediate width split, an all-reduce after them) and a shared expert
    "qwen2_moe": ("qwen2_moe", _BASE | {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
                                        "shared_expert_intermediate_size": 16}),
    # ALiBi: 4 heads, each rank's 2 with their own slopes; biases on every linear
    "bloom": ("bloom", {"vocab_size": 64, "hidden_size": 16, "n_layer": 2, "n_head": 4}),
    # multi-query: q|k|v fused, 4 query heads split, the one k/v head replicated
    "gpt_bigcode_mqa": ("gpt_bigcode", {"vocab_size": 64, "n_embd": 16, "n_layer": 2, "n_head": 4, "n_positions": 32,
                                        "bos_token_id": 1, "eos_token_id": 1}),
    "gpt_oss": ("gpt_oss", _BASE | {"intermediate_size": 16, "head_dim": 8, "num_local_experts": 4,
                                    "num_experts_per_tok": 2, "sliding_window": WINDOW,
                                    "max_position_embeddings": 131072}),
    # latent attention (q_b / kv_b split by head, the latent cache line replicated), grouped routing, shared experts
    # split by width; its routed experts split by expert (EXPERT_PARALLEL: 2 whole experts per rank)
    "deepseek_v3": ("deepseek_v3", {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
                                    "moe_intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
                                    "num_key_value_heads": 2, "n_routed_experts": 4, "num_experts_per_tok": 2,
                                    "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1, "kv_lora_rank": 8,
                                    "q_lora_rank": 12, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 6,
                                    "max_position_embeddings": 64}),
    # complex RoPE, NoPE layers, transposed experts and a shared expert, dense layers' own width
    "llama4_text": ("llama4_text", _BASE | {"intermediate_size_mlp": 32, "head_dim": 8, "num_local_experts": 2,
                                            "num_experts_per_tok": 1, "max_position_embeddings": 64}),
    # GPT-2's Conv1D layers ([in, out]): c_attn's q|k|v each split by head along dim 1, c_proj's biases added once
    "gpt2": ("gpt2", {"vocab_size": 64, "n_embd": 16, "n_layer": 2, "n_head": 4, "n_positions": 32,
                      "bos_token_id": 1, "eos_token_id": 1}),
    # Falcon's new decoder architecture (2 kv groups [q q k v], one per rank; k and v broadcast to every query head,
    # so the cache holds 4 heads) with ALiBi (each rank's heads of the whole bias)
    "falcon_nda_alibi": ("falcon", {"vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 2,
                                    "num_attention_heads": 4, "num_kv_heads": 2, "new_decoder_architecture": True,
                                    "alibi": True, "bias": True}),
}


EXPERT_PARALLEL = ("deepseek_v3",)  # hf_causal_lm(moe_ep_degree = 2)


def _workspace(root: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    from neuronbuild.toolchains.hf_causal_lm import hf_model

    root.mkdir(parents=True, exist_ok=True)
    lines = ['load("@neuronbuild//rules:llm.bzl", "hf_causal_lm", "llm_buckets")',
             'neuron_target(name = "trn2", platform = "trn2")',
             f'llm_buckets(name = "serve", batch_sizes = [2], context_lengths = [{SEQ}])']
    for name, (model_type, hf) in FAMILIES.items():
        torch.manual_seed(0)
        model = hf_model({"model_type": model_type, "hf": hf, "max_seq": MAX_SEQ})
        g = torch.Generator().manual_seed(1)
        state = {k: v + 0.2 * torch.randn(v.shape, generator=g)
                 if (v.dim() == 1 or k.endswith("bias")) and v.is_floating_point() else v
                 for k, v in model.state_dict().items()}  # (biases, experts' [E, out] biases too, norms, sinks:
        # not transformers' 0 and 1)
        save_file({k: v.detach().clone().contiguous() for k, v in state.items()}, str(root / f"{name}.safetensors"))
        lines += [f'hf_causal_lm(name = "{name}", model_type = "{model_type}", config = {json.dumps(hf)}, '
                  f'weights = "{name}.safetensors", max_seq = {MAX_SEQ}'
                  f'{", moe_ep_degree = 2" if name in EXPERT_PARALLEL else ""})',
                  f'neuron_compile(name = "{name}_tp2", model = ":{name}", target = ":trn2", tp_degree = 2, '
                  'buckets = {"context": [":serve_context"], "token": [":serve_token"]})']
    return write_ws(root, {"BUILD": "\n".join(lines).replace("true", "True") + "\n"})


@pytest.mark.timeout(1800)
def test_every_family_of_the_workspace_at_tp2_validates_and_generates_like_transformers(
        tmp_path: Path, cache_dir: Path) -> None:
    ws = _workspace(tmp_path / "ws")
    proc = run_cli(["build", "//...", "--jobs", "2", "--cache-dir", str(cache_dir)], ws)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    proc = run_cli(["validate", "//...", "--generate", str(NEW), "--cache-dir", str(cache_dir)], ws)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    for name in FAMILIES:
        label = f"//:{name}_tp2"
        rows = [line for line in out.splitlines() if line.startswith(label + " ")]
        assert len(rows) == 2 and all(r.endswith(" ok") for r in rows), (label, out)
        gen = [line for line in out.splitlines() if line.startswith(f"{label}: generate ")]
        assert [g.split()[2] for g in gen] == ["batch1", "batch2_padded"], (label, out)
        assert all(f": ok ({NEW} tokens x " in g and "tie" not in g for g in gen), (label, out)
    # one SPMD program per graph, the weights in one shard per rank
    out_dir = ws / "neuronbuild-out/qwen3_tp2/token_batch2"
    assert {"model.hlo.pb", "rank_0.safetensors", "rank_1.safetensors"} <= {p.name for p in out_dir.iterdir()}


REFUSED = {
    "gpt_neox": ("gpt_neox", {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
                              "num_attention_heads": 2}, "only hf_causal_lm models of the"),
    # 3 kv groups [q q k v] over 2 ranks: a rank's q|k|v would cut a group
    "falcon_nda_kv3": ("falcon", {"vocab_size": 64, "hidden_size": 24, "num_hidden_layers": 2,
                                  "num_attention_heads": 6, "new_decoder_architecture": True, "num_kv_heads": 3},
                       "new_decoder_architecture with num_kv_heads 3: the kv groups must divide by it"),
    "gpt2_cross": ("gpt2", {"vocab_size": 64, "n_embd": 16, "n_layer": 2, "n_head": 2, "add_cross_attention": True},
                   "gpt2 with cross-attention has no sharding plan"),
    # expert parallelism: Llama 4's own experts module (not transformers' experts interface); a degree other than tp's
    "llama4_ep": ("llama4_text", FAMILIES["llama4_text"][1], "moe_ep_degree is supported for the mixtral, "),
    "qwen2_moe_ep4": ("qwen2_moe", FAMILIES["qwen2_moe"][1], "the model's moe_ep_degree 4 must equal it"),
}
EP_DEGREE = {"llama4_ep": 2, "qwen2_moe_ep4": 4}


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_family_or_feature_without_a_sharding_plan_is_refused_tp_at_analysis_with_its_line(
        tmp_path: Path, name: str) -> None:
    model_type, hf, message = REFUSED[name]
    ws = write_ws(tmp_path / "ws", {"BUILD": "\n".join([
        'load("@neuronbuild//rules:llm.bzl", "hf_causal_lm", "llm_buckets")',
        'neuron_target(name = "trn2", platform = "trn2")',
        f'llm_buckets(name = "serve", batch_sizes = [1], context_lengths = [{SEQ}])',
        f'hf_causal_lm(name = "{name}", model_type = "{model_type}", config = {json.dumps(hf)}, max_seq = {MAX_SEQ}, '
        f'weights = "{name}.safetensors"{f", moe_ep_degree = {EP_DEGREE[name]}" if name in EP_DEGREE else ""})'
        .replace("true", "True"),
        f'neuron_compile(name = "{name}_tp2", model = ":{name}", target = ":trn2", tp_degree = 2,',
        '    buckets = {"context": [":serve_context"], "token": [":serve_token"]})']) + "\n",
        f"{name}.safetensors": ""})
    proc = run_cli(["plan", "//...", "--cache-dir", str(tmp_path / "cache")], ws)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "BUILD:5" in proc.stderr and "tp_degree 2" in proc.stderr and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
