"""Tensor parallelism at analysis time: which degrees a platform accepts, which models can be sharded, and the
per-rank model record a tp_degree > 1 trace is made from (no torch here).

The sharding itself (Megatron: q/k/v and gate/up column-parallel, o and down row-parallel with an all-reduce, GQA kv
heads replicated when fewer than ranks, embedding and lm_head over the vocabulary padded to a multiple of tp; for a
plain neuron_model, its declared tp_plan) happens in the trace (toolchains/hf_causal_lm.py, toolchains/tp_ops.py); the
collectives' HLO form lives in toolchains/neuron_collectives.py."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

HF_CAUSAL_LM = "neuronbuild.toolchains.hf_causal_lm"
# transformers families whose decoder layers have llama's projections (q/k/v/o, gate/up/down; q/k/v biases and per-head
# q/k norms shard with their heads; Gemma's scaled embedding keeps its scale): each verified against transformers at
# tp 2 (tests/test_tensor_parallel.py, tests/test_tp_families.py). Fused projections and experts need other splits.
TP_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "mixtral", "qwen2_moe",
               "qwen3_moe")
KV_INPUT = "kv"
KV_HEADS_DIM = 3  # kv: [layers, 2, batch, kv_heads, max_seq, head_dim]


def _hf(record: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    config = record.get("config") or {}
    hf = config.get("hf") if isinstance(config, Mapping) else None
    return str(config.get("model_type") or ""), hf if isinstance(hf, Mapping) else {}


def check(record: Mapping[str, Any], platform: str, tp: int, allowed: tuple[int, ...] = (1,)) -> str | None:
    """Why `record` (a graph's model record) cannot be compiled for `platform` at tp_degree `tp`, or None. `allowed`:
    the degrees the platform's runtime accepts (its toolchain's `tp_degrees`)."""
    if tp not in allowed:
        return f"tp_degree {tp} is not one {platform} accepts ({', '.join(map(str, allowed))})"
    if tp == 1 or record.get("tp_plan"):  # a declared plan: its dims are checked against the shapes at trace time
        return None
    entry = str(record.get("entry") or "")
    model_type, hf = _hf(record)
    if not entry.startswith(HF_CAUSAL_LM + ":") or model_type not in TP_FAMILIES:
        return (f"tp_degree {tp}: only hf_causal_lm models of the {', '.join(TP_FAMILIES)} families, or a "
                f"neuron_model with a tp_plan, can be sharded (this model: {model_type or entry})")
    heads = int(hf.get("num_attention_heads") or 0)
    kv = int(hf.get("num_key_value_heads") or heads)
    if heads % tp:
        return f"tp_degree {tp} does not divide the model's {heads} attention heads"
    if kv % tp and tp % kv:
        return f"tp_degree {tp}: the model's {kv} key/value heads neither divide by it nor divide it"
    for key in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        width = int(hf.get(key) or 0)
        if width % tp:
            return f"tp_degree {tp} does not divide the model's {key} {width}"
    vocab = int(hf.get("vocab_size") or 0)
    if vocab < tp:  # (each rank holds a block of the vocabulary, padded to a multiple of tp)
        return f"tp_degree {tp}: the model's vocab_size {vocab} is smaller than it"
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        return f"tp_degree {tp}: models with attention_bias or mlp_bias are not supported (row-parallel biases)"
    return None


def kv_heads_per_rank(record: Mapping[str, Any], tp: int) -> int:
    """Key/value heads each rank holds: kv/tp, or 1 (replicated) when there are fewer kv heads than ranks."""
    _mt, hf = _hf(record)
    heads = int(hf.get("num_attention_heads") or 0)
    kv = int(hf.get("num_key_value_heads") or heads)
    return max(1, kv // tp)


def _with_kv_heads(specs: Any, n: int) -> list[Any]:
    out = []
    for name, spec in specs:
        if name == KV_INPUT:
            dims = list(spec["dims"])
            dims[KV_HEADS_DIM] = n
            spec = {**spec, "dims": dims}
        out.append([name, spec])
    return out


def per_rank_record(record: Mapping[str, Any], tp: int) -> dict[str, Any]:
    """The record one rank's program is traced from: the KV cache holds this rank's heads. `tp` says how ranks
    combine: every user input is the same on every rank except those in `rank_dims` (name -> dim), which callers hold
    whole (the unsharded model's shape, so they see the model's own interface): rank r takes block r*blocks//tp of
    `blocks` equal blocks along that dim (kv heads replicated over tp/blocks ranks when fewer than ranks); outputs in
    `output_rank_dims` (index -> dim) are joined back from one rank per block."""
    if record.get("tp_plan"):  # a plain model with a declared plan: every input and output the same on every rank
        return dict(record) | {"whole_inputs": record["inputs"],
                               "tp": {"degree": tp, "rank_dims": {}, "blocks": tp, "output_rank_dims": {}}}
    kv_r = kv_heads_per_rank(record, tp)
    _mt, hf = _hf(record)
    heads = int(hf.get("num_attention_heads") or 0)
    kv = int(hf.get("num_key_value_heads") or heads)
    rec = dict(record)
    rec["whole_inputs"] = record["inputs"]  # what callers feed (bundle manifests list these)
    rec["inputs"] = _with_kv_heads(record["inputs"], kv_r)
    if record.get("outputs"):
        rec["outputs"] = _with_kv_heads(record["outputs"], kv_r)
    outs = [i for i, (name, _s) in enumerate(record.get("outputs") or []) if name == KV_INPUT]
    rec["tp"] = {"degree": tp, "rank_dims": {KV_INPUT: KV_HEADS_DIM}, "blocks": kv // kv_r,
                 "output_rank_dims": {str(i): KV_HEADS_DIM for i in outs}}
    return rec
