"""Families beyond tests/test_llm_families.py's matrix, built as hf_causal_lm for trn2 (the HLO run on XLA:CPU) in one
workspace and one build, checked by `validate --generate` against transformers' own model: Llama 4 text (complex RoPE
lowered as real pairs, NoPE layers, mixture of experts; chunked attention layers served as full attention when max_seq
fits one chunk, with the chunk size its config class sets by default, and as chunks when it does not: chunks of 3
over max_seq 16, NoPE layers' temperature tuning from position 3 on) and gpt-oss (experts with biases, transposed
weights and its clamped SwiGLU, attention sinks, alternating sliding windows) and DeepSeek-V3 (multi-head latent
attention: the cache holds transformers' compressed latent and rotary key, one line per token, and decode attends
over the latent with kv_b's weights absorbed; grouped expert routing; a dense first layer). The continuous-batching
and block graphs of the chunked Llama 4 and of DeepSeek-V3 run eagerly against transformers (no compile)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_cli, write_ws

SEQ, NEW, MAX_SEQ = 8, 8, 16
LLAMA4 = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "intermediate_size_mlp": 32,
          "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
          "num_local_experts": 2, "num_experts_per_tok": 1, "max_position_embeddings": 64}
GPT_OSS = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 2,
           "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "num_local_experts": 4,
           "num_experts_per_tok": 2, "sliding_window": 4, "max_position_embeddings": 131072}  # (YaRN's 32 x 4096)
DEEPSEEK_V3 = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "moe_intermediate_size": 8,
               "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "n_routed_experts": 4,
               "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
               "kv_lora_rank": 8, "q_lora_rank": 12, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 6,
               "max_position_embeddings": 64, "initializer_range": 0.2}  # (10x: see LLAMA4_CHUNKED)
# Chunks of 3 (6 over max_seq 16: the prompt spans 3, generation 3 more; a padded row's chunks start at its first
# token), layer 0 chunked (RoPE), layer 1 full (NoPE) with temperature tuning at positions >= floor_scale - 1
LLAMA4_CHUNKED = LLAMA4 | {"attention_chunk_size": 3, "no_rope_layers": [1, 0], "floor_scale": 4, "attn_scale": 0.5,
                          "initializer_range": 0.2}  # (10x the default: a wrong mask or scale changes tokens)
FAMILIES = {"l4": ("llama4_text", LLAMA4), "l4c": ("llama4_text", LLAMA4_CHUNKED), "goss": ("gpt_oss", GPT_OSS),
            "dsv3": ("deepseek_v3", DEEPSEEK_V3)}


def _build_file(models: dict[str, tuple[str, dict[str, object]]]) -> str:
    lines = ['load("@neuronbuild//rules:llm.bzl", "hf_causal_lm", "llm_buckets", "llm_compile")',
             'neuron_target(name = "trn2", platform = "trn2")',
             f'llm_buckets(name = "serve", batch_sizes = [2], context_lengths = [{SEQ}])']
    for name, (model_type, hf) in models.items():
        lines += [f'hf_causal_lm(name = "{name}", model_type = "{model_type}", config = {json.dumps(hf)}, '
                  f'max_seq = {MAX_SEQ}, weights = "{name}.safetensors")',
                  f'llm_compile(name = "{name}", model = ":{name}", targets = [":trn2"], '
                  'buckets = {"context": [":serve_context"], "token": [":serve_token"]})']
    return "\n".join(lines) + "\n"


@pytest.mark.timeout(1800)
def test_llama4_gpt_oss_and_deepseek_v3_build_for_trn2_and_generate_transformers_tokens(
        tmp_path: Path, cache_dir: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from neuronbuild.toolchains.hf_causal_lm import hf_model

    ws = write_ws(tmp_path / "ws", {"BUILD": _build_file(FAMILIES)})  # llama4's attention_chunk_size: the class's 8192
    for name, (model_type, hf) in FAMILIES.items():
        torch.manual_seed(0)
        model = hf_model({"model_type": model_type, "hf": hf, "max_seq": MAX_SEQ})
        if name == "l4":
            assert "chunked_attention" in model.config.layer_types and model.config.attention_chunk_size == 8192
        elif name == "l4c":
            assert model.config.layer_types == ["chunked_attention", "full_attention"]
        save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()},
                  str(ws / f"{name}.safetensors"))
    proc = run_cli(["build", "//...", "--jobs", "2", "--cache-dir", str(cache_dir)], ws)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    proc = run_cli(["validate", "//...", "--generate", str(NEW), "--cache-dir", str(cache_dir)], ws)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    for name in FAMILIES:
        rows = [line for line in out.splitlines() if line.startswith(f"//:{name}_trn2 ")]
        assert len(rows) == 2 and all(r.endswith(" ok") for r in rows), (name, out)
        gen = [line for line in out.splitlines() if line.startswith(f"//:{name}_trn2: generate ")]
        assert len(gen) == 2 and all(f": ok ({NEW} tokens x " in g and "tie" not in g for g in gen), (name, out)


@pytest.mark.parametrize("name, layout", [("l4c", "lines"), ("l4c", "blocks"), ("dsv3", "lines"), ("dsv3", "blocks")])
def test_serving_graphs_of_chunked_llama4_and_absorbed_mla_give_each_request_transformers_logits_and_tokens(
        name: str, layout: str) -> None:
    """The continuous-batching graphs (one line per sequence, or blocks through a shuffled table; eager: their traced
    program is what the build above compiles for the static graphs) of the chunks-of-3 Llama 4 and of DeepSeek-V3
    (its decode absorbed: attention over the latent): a full and a 5-token prompt prefilled together, then decoded
    side by side to max_seq, each row at its own position. Every step's logits are transformers' for that request
    alone: chunks start at each row's first token, and the NoPE layer's temperature tuning follows each row's own
    position (not one slot of the graph's rotated view)."""
    import torch

    from neuronbuild.toolchains import hf_block_kv, hf_causal_lm

    model_type, hf = FAMILIES[name]
    cfg = {"model_type": model_type, "hf": hf, "max_seq": MAX_SEQ}
    torch.manual_seed(0)
    ref = hf_causal_lm.hf_model(cfg).eval()
    if layout == "lines":
        graphs = (hf_causal_lm.serving_context(cfg), hf_causal_lm.serving_token(cfg))
        where = torch.tensor([0, 1], dtype=torch.int32)  # seq_ids
        kv = torch.zeros(2, 2, 3, 1, MAX_SEQ, 8)  # [layers, 2, lines, kv_heads, max_seq, head_dim] (both: 1 x 8)
    else:
        graphs = (hf_block_kv.block_serving_context(cfg), hf_block_kv.block_serving_token(cfg))
        where = torch.tensor([[5, 2, 7, 0], [1, 6, 3, 4]], dtype=torch.int32)  # block tables, 4 blocks of 4 per row
        kv = torch.zeros(2, 2, 9, 1, 4, 8)  # 8 blocks + the scratch one
    ctx, tok = (g.eval() for g in graphs)
    calls = {"context": 0, "token": 0}  # DeepSeek-V3's per-head up-projection of the latent (kv_b_proj) runs
    for key, g in (("context", ctx), ("token", tok)):  # in the context graph only: decode is absorbed
        g.load_state_dict(ref.state_dict())
        for m in g.modules():
            if type(m).__name__ == "DeepseekV3Attention":
                m.kv_b_proj.register_forward_hook(lambda *_a, key=key: calls.__setitem__(key, calls[key] + 1))
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 64, (2, SEQ), generator=gen)
    mask = torch.ones(2, SEQ, dtype=torch.int64)
    mask[1, :3] = 0
    ids = ids.masked_fill(mask == 0, 0)
    new = MAX_SEQ - SEQ + 1  # row 0 decodes up to max_seq
    with torch.no_grad():
        want = [ref.generate(ids[b:b + 1, SEQ - int(mask[b].sum()):], max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, eos_token_id=None, pad_token_id=0, return_dict_in_generate=True,
                             output_logits=True) for b in range(2)]
        out = ctx(ids.int(), mask.int(), ((mask.cumsum(-1) - 1) * mask).int(), where, kv)
        pos = mask.sum(-1)
        for step in range(new):
            for b in range(2):
                err = (out["logits"][b] - want[b].logits[step][0]).abs().max().item()
                assert err < 1e-4, (name, layout, step, b, err)
                assert int(out["logits"][b].argmax()) == int(want[b].sequences[0, -new + step]), (name, layout, step)
            if step == new - 1:
                break
            nxt = torch.stack([w.sequences[0, -new + step] for w in want])[:, None].int()
            attend = (torch.arange(MAX_SEQ)[None, :] <= pos[:, None]).int()
            out = tok(nxt, attend, pos[:, None].int(), where, out["kv"])
            pos = pos + 1
    assert calls == ({"context": 2, "token": 0} if name == "dsv3" else {"context": 0, "token": 0}), calls
