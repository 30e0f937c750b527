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
HF_BLOCK_KV = "neuronbuild.toolchains.hf_block_kv"  # the block layout's graphs (shard as hf_causal_lm's: kv heads on dim 3)
TP_OPS = "neuronbuild.toolchains.tp_ops"  # the per-rank model's code: its digest enters sharded traces' records
# transformers families with a sharding plan (toolchains/tp_ops.py), each verified against transformers at tp 2
# (tests/test_tensor_parallel.py, tests/test_tp_families.py, and by hand: docs/neuron.md lists which).
TP_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "mixtral", "qwen2_moe",
               "qwen3_moe",
               # q/k/v biases; row-parallel output projections with a bias (added once, after the all-reduce)
               "glm", "glm4", "smollm3", "cohere2", "starcoder2", "phi",
               # experts: OLMoE's whole-width q/k norms; gpt-oss's biased transposed experts and attention sinks;
               # DeepSeek-V3's latent attention (the latent cache replicated) and shared experts; Llama 4's
               "olmoe", "gpt_oss", "deepseek_v3", "llama4_text",
               # module-patched: fused q|k|v per head (BLOOM with its ALiBi slopes, multi-head Falcon), per kv group
               # (Falcon's new decoder architecture), multi-query, or [q | k | v] in GPT-2's transposed Conv1D layers
               "falcon", "bloom", "gpt_bigcode", "gpt2")
# expert parallelism (hf_causal_lm's moe_ep_degree x moe_tp_degree = tp_degree): the families whose experts go
# through transformers' experts interface ([experts, ...] parameters; Llama 4's own experts module does not), the
# config key of their expert count and of each expert's intermediate width (split over moe_tp_degree ranks)
EP_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
EXPERT_WIDTH = {"mixtral": "intermediate_size", "olmoe": "intermediate_size", "gpt_oss": "intermediate_size",
                "qwen2_moe": "moe_intermediate_size", "qwen3_moe": "moe_intermediate_size",
                "deepseek_v3": "moe_intermediate_size"}
MOE_KEYS = ("moe_ep_degree", "moe_tp_degree")  # hf_causal_lm's config keys: read at tp_degree > 1 only
# MLP widths each rank holds 1/tp of (config key -> its class default when absent: a multiple of the hidden size)
WIDTHS = {"intermediate_size": 0, "moe_intermediate_size": 0, "shared_expert_intermediate_size": 0,
          "intermediate_size_mlp": 0, "ffn_hidden_size": 4, "n_inner": 4}
KV_INPUT = "kv"
KV_HEADS_DIM = 3  # kv: [layers, 2, batch, kv_heads, max_seq, head_dim]


def _hf(record: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    config = record.get("config") or {}
    hf = config.get("hf") if isinstance(config, Mapping) else None
    return str(config.get("model_type") or ""), hf if isinstance(hf, Mapping) else {}


def _heads(hf: Mapping[str, Any]) -> int:
    return int(hf.get("num_attention_heads") or hf.get("n_head") or 0)


def _cache_heads(record: Mapping[str, Any]) -> int | None:
    """The key/value heads the graph's KV cache holds (rules/llm.bzl declares them from each family's own keys:
    Falcon's and GPT-BigCode's multi_query, one latent line for DeepSeek's latent attention), or None."""
    for name, spec in [*(record.get("inputs") or []), *(record.get("outputs") or [])]:
        dims = spec.get("dims") if name == KV_INPUT and isinstance(spec, Mapping) else None
        if dims and len(dims) > KV_HEADS_DIM and isinstance(dims[KV_HEADS_DIM], int):
            return int(dims[KV_HEADS_DIM])
    return None


def _kv_heads(record: Mapping[str, Any]) -> int:
    _mt, hf = _hf(record)
    held = _cache_heads(record)
    return held if held is not None else int(hf.get("num_key_value_heads") or _heads(hf))


def _family_problem(model_type: str, hf: Mapping[str, Any], tp: int) -> str | None:
    """What of a supported family's config has no sharding plan, or None."""
    if model_type == "falcon" and hf.get("new_decoder_architecture"):
        groups = int(hf.get("num_kv_heads") or _heads(hf))
        if groups % tp and groups != 1:  # (a rank's q|k|v is a block of whole kv groups, or the one group's k and v)
            return (f"tp_degree {tp}: falcon's new_decoder_architecture with num_kv_heads {groups}: the kv groups must "
                    "divide by it (or be one)")
    if model_type == "bloom" and hf.get("slow_but_exact") and int(hf.get("pretraining_tp") or 1) > 1:
        return f"tp_degree {tp}: bloom with slow_but_exact and pretraining_tp > 1 has no sharding plan"
    if model_type in ("gpt_bigcode", "gpt2") and hf.get("add_cross_attention"):
        return f"tp_degree {tp}: {model_type} with cross-attention has no sharding plan"
    if model_type == "deepseek_v3" and int(hf.get("num_key_value_heads") or _heads(hf)) != _heads(hf):
        return f"tp_degree {tp}: deepseek_v3 with num_key_value_heads != num_attention_heads has no sharding plan"
    return None


def check(record: Mapping[str, Any], platform: str, tp: int, allowed: tuple[int, ...] = (1,)) -> str | None:
    """Why `record` (a graph's model record) cannot be compiled for `platform` at tp_degree `tp`, or None. `allowed`:
    the degrees the platform's runtime accepts (its toolchain's `tp_degrees`)."""
    if tp not in allowed:
        return f"tp_degree {tp} is not one {platform} accepts ({', '.join(map(str, allowed))})"
    if tp == 1 or record.get("tp_plan"):  # a declared plan: its dims are checked against the shapes at trace time
        return None
    entry = str(record.get("entry") or "")
    model_type, hf = _hf(record)
    if not entry.startswith((HF_CAUSAL_LM + ":", HF_BLOCK_KV + ":")) or model_type not in TP_FAMILIES:
        return (f"tp_degree {tp}: only hf_causal_lm models of the {', '.join(TP_FAMILIES)} families, or a "
                f"neuron_model with a tp_plan, can be sharded (this model: {model_type or entry})")
    heads = _heads(hf)
    kv = _kv_heads(record)
    if heads % tp:
        return f"tp_degree {tp} does not divide the model's {heads} attention heads"
    if kv % tp and tp % kv:
        return f"tp_degree {tp}: the model's {kv} key/value heads neither divide by it nor divide it"
    degrees = moe_degrees(record, tp)
    if isinstance(degrees, str):
        return f"tp_degree {tp}: {degrees}"
    ep, moe_tp = degrees
    problem = _ep_problem(model_type, hf, tp, ep)
    if problem:
        return problem
    hidden = int(hf.get("hidden_size") or hf.get("n_embd") or 0)
    for key, default in WIDTHS.items():
        width = int(hf.get(key) or 0) or (default * hidden if _uses(model_type, key) else 0)
        if ep > 1 and key == EXPERT_WIDTH.get(model_type):  # each expert whole on its EP group, split over moe_tp
            if width % moe_tp:
                return (f"tp_degree {tp}: moe_tp_degree {moe_tp} does not divide the model's {key} {width} (each "
                        "expert's intermediate width is split over moe_tp_degree ranks)")
            if not (model_type == "deepseek_v3" and hf.get("n_shared_experts", 1)):
                continue  # (DeepSeek's shared experts are moe_intermediate_size x n_shared_experts wide, over tp)
        if width % tp:
            return f"tp_degree {tp} does not divide the model's {key} {width}"
    vocab = int(hf.get("vocab_size") or 0)
    if vocab < tp:  # (each rank holds a block of the vocabulary, padded to a multiple of tp)
        return f"tp_degree {tp}: the model's vocab_size {vocab} is smaller than it"
    return _family_problem(model_type, hf, tp)


def moe_degrees(record: Mapping[str, Any], tp: int) -> tuple[int, int] | str:
    """(moe_ep_degree, moe_tp_degree) of a model compiled at tp_degree `tp` > 1, as NxD Inference's: the experts on an
    EP x TP grid of the tp ranks, moe_ep_degree x moe_tp_degree = tp. Neither written: (1, tp), each expert split by
    width over every rank; one written: the other is tp divided by it; both: their product must be tp. What is
    wrong otherwise (a sentence)."""
    config = record.get("config") or {}
    config = config if isinstance(config, Mapping) else {}
    written: dict[str, int] = {}
    for key in MOE_KEYS:
        value = config.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            return f"the model's {key} must be a positive int, got {value!r}"
        written[key] = value
    if not written:
        return 1, tp
    if len(written) == 2:
        ep, moe_tp = written["moe_ep_degree"], written["moe_tp_degree"]
        if ep * moe_tp != tp:
            return f"the model's moe_tp_degree {moe_tp} x moe_ep_degree {ep} = {ep * moe_tp} must equal it"
        return ep, moe_tp
    ((key, given),) = written.items()
    if tp % given:
        return f"the model's {key} {given} must equal it or divide it (moe_tp_degree x moe_ep_degree = tp_degree)"
    return (given, tp // given) if key == "moe_ep_degree" else (tp // given, given)


def for_degree(record: Mapping[str, Any], tp: int) -> dict[str, Any]:
    """A model record as a build at tp_degree `tp` reads it (its trace's and weights action's records): at tp 1 without
    what only sharding reads (a tp_plan, hf_causal_lm's moe degrees), so writing them changes no unsharded
    fingerprint; at tp > 1 with the moe degrees resolved (moe_degrees): none when the experts are split by width only
    (the record as if not written), both otherwise, so one plan written two ways is one record."""
    config = record.get("config")
    rec = dict(record)
    if tp <= 1:
        rec.pop("tp_plan", None)
    if not isinstance(config, Mapping) or not any(k in config for k in MOE_KEYS):
        return rec
    degrees = (1, 1) if tp <= 1 else moe_degrees(record, tp)
    if isinstance(degrees, str):  # (refused by check: left as written)
        return rec
    ep, moe_tp = degrees
    rec["config"] = {k: v for k, v in config.items() if k not in MOE_KEYS} | (
        {"moe_ep_degree": ep, "moe_tp_degree": moe_tp} if ep > 1 else {})
    return rec


def _ep_problem(model_type: str, hf: Mapping[str, Any], tp: int, ep: int) -> str | None:
    """What keeps a model's experts from being split over `ep` expert-parallel groups, or None."""
    if ep == 1:
        return None
    if model_type not in EP_FAMILIES:
        return f"tp_degree {tp}: moe_ep_degree is supported for the {', '.join(EP_FAMILIES)} families ({model_type})"
    experts = next((int(hf[k]) for k in EXPERT_KEYS if hf.get(k)), 0)
    if not experts or experts % ep:
        what = f"its {experts} experts" if experts else "its config's expert count (which it must write)"
        return f"tp_degree {tp}: moe_ep_degree {ep} does not divide {what}"
    return None


def _uses(model_type: str, key: str) -> bool:
    """Whether the family's config class fills `key` in with its default when the config leaves it out."""
    return (model_type, key) in (("falcon", "ffn_hidden_size"), ("gpt_bigcode", "n_inner"), ("gpt2", "n_inner"))


def kv_heads_per_rank(record: Mapping[str, Any], tp: int) -> int:
    """Key/value heads each rank holds: kv/tp, or 1 (replicated) when there are fewer kv heads than ranks."""
    return max(1, _kv_heads(record) // tp)


def builtin_digest(module: str) -> str:
    """The digest of a module neuronbuild ships (read, not imported: it imports torch)."""
    from pathlib import Path

    import neuronbuild
    from neuronbuild.digests import digest_file

    return digest_file(Path(neuronbuild.__file__).resolve().parent.joinpath(*module.split(".")[1:]).with_suffix(".py"))


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
    # the rank's program is made by tp_ops (the plan's, or the family's sharding): its code is in the trace's record
    record = for_degree(record, tp)
    builtin = dict(record.get("builtin") or {}) | {TP_OPS: builtin_digest(TP_OPS)}
    if record.get("tp_plan"):  # a plain model with a declared plan: every input and output the same on every rank
        return dict(record) | {"whole_inputs": record["inputs"], "builtin": builtin,
                               "tp": {"degree": tp, "rank_dims": {}, "blocks": tp, "output_rank_dims": {}}}
    kv_r = kv_heads_per_rank(record, tp)
    kv = _kv_heads(record)
    rec = dict(record)
    rec["builtin"] = builtin
    rec["whole_inputs"] = record["inputs"]  # what callers feed (bundle manifests list these)
    rec["inputs"] = _with_kv_heads(record["inputs"], kv_r)
    if record.get("outputs"):
        rec["outputs"] = _with_kv_heads(record["outputs"], kv_r)
    outs = [i for i, (name, _s) in enumerate(record.get("outputs") or []) if name == KV_INPUT]
    rec["tp"] = {"degree": tp, "rank_dims": {KV_INPUT: KV_HEADS_DIM}, "blocks": kv // kv_r,
                 "output_rank_dims": {str(i): KV_HEADS_DIM for i in outs}}
    return rec
