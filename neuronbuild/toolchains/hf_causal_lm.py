"""The graphs of a transformers causal LM as served (hf_causal_lm): context encoding and token generation over a static
KV cache that is an explicit input and output (never a mutated buffer), so artifacts need no transformers at run time.

Config (written by rules/llm.bzl hf_causal_lm): {"model_type": "llama", "hf": {HF config fields}, "max_seq": N}.
The module is the transformers model itself with its forward replaced, so its state-dict keys are the HF checkpoint's.

- context(input_ids int64[batch, seq], attention_mask int64[batch, seq]; prompts left-padded, 1 = token) ->
  {"logits": [batch, vocab] at the last position, "kv": [layers, 2, batch, kv_heads, max_seq, head_dim]} with the
  prompt's keys/values in cache slots 0..seq-1 (slot = position in the padded prompt).
- token(input_ids int64[batch, 1], position_ids int64[batch, 1], cache_mask int64[batch, max_seq] (1 = slot to attend,
  the written one included), slot int64[1] (the cache slot this token writes), kv) -> {"logits", "kv"}: `kv` is
  declared as aliasing the input `kv` (the runtime feeds it back)."""

from __future__ import annotations

import sys
import types
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs


class _SlotLayer(CacheLayerMixin):
    """One layer of StaticKV as transformers' mask builders see it: a full-length static layer (sliding or not, as the
    config's layer types say) whose query offset is the written cache slot."""

    is_compileable = True

    def __init__(self, owner: StaticKV, idx: int, sliding: bool) -> None:
        super().__init__()
        self.owner, self.idx, self.is_sliding = owner, idx, sliding

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        width = self.owner.latent_width
        kw, vw = key_states.shape[-1], value_states.shape[-1]
        if width is None or (kw == width and vw == width):
            return self.owner.write(key_states, value_states, self.idx)
        # A latent cache (MLA): "key" and "value" of different widths, each held zero-padded to the cache's width
        # and handed back at its own
        pad = nn.functional.pad
        k, v = self.owner.write(pad(key_states, (0, width - kw)), pad(value_states, (0, width - vw)), self.idx)
        return k[..., :kw], v[..., :vw]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return (query_length if self.owner.kv is None else self.owner.max_seq), 0

    def get_seq_length(self) -> Any:
        return 0 if self.owner.slot is None else self.owner.slot[0]

    def get_max_length(self) -> int:
        return self.owner.max_seq


SERVED_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


def layer_types(config: Any) -> list[str]:
    """The attention type of every layer, as transformers' own caches read them from the config object (layer_types,
    or sliding_window for all layers; use_sliding_window=False already cleared it). Full, sliding and chunked
    attention are served (chunked: Llama 4's attention_chunk_size; transformers builds its mask, chunks counted from
    each row's first attended slot, which every cache view here makes the row's position 0): anything else is a
    ValueError naming the field."""
    types, _kwargs = get_layer_types_and_kwargs(config)
    bad = sorted({t for t in types if t not in SERVED_LAYER_TYPES})
    if bad:
        raise ValueError(f"config field layer_types: layer type(s) {', '.join(bad)} are not supported by hf_causal_lm "
                         f"({', '.join(SERVED_LAYER_TYPES)} are)")
    return list(types)


def cache_width(config: Any) -> int | None:
    """The width of a latent KV cache (multi-head latent attention, DeepSeek-V2/V3: transformers caches the compressed
    latent, kv_lora_rank wide, as the "key" and the rotary key, qk_rope_head_dim wide, as the "value", one head):
    both held in a cache line as wide as the wider; None for every other attention (keys and values of head_dim).
    rules/llm.bzl declares the cache with the same width and one key/value head."""
    rank = getattr(config, "kv_lora_rank", None)
    if not rank:
        return None
    return max(int(rank), int(getattr(config, "qk_rope_head_dim", 0) or 0))


class StaticKV(Cache):
    """The transformers cache the attention layers call `update(k, v, layer_idx)` on: it writes the new keys/values
    into per-layer tensors functionally (index_copy, no in-place input mutation) and keeps the results. transformers
    builds every layer's mask itself from the 2-D padding mask, this cache's sizes and the config (sliding windows,
    ALiBi, soft-capping stay the model's own): context masks span the prompt, token masks the max_seq slots with the
    written slot as the query's position in the cache."""

    def __init__(self, config: Any, kv: torch.Tensor | None, slot: torch.Tensor | None, max_seq: int,
                 kv_dtype: torch.dtype | None = None) -> None:
        self.kv = kv
        self.slot = slot
        self.max_seq = max_seq
        self.kv_dtype = kv_dtype  # an fp8 cache (kv_cache_dtype, toolchains/quantize.py); None: the model dtype
        self.latent_width = cache_width(config)  # the cache's last dim when keys and values are narrower (MLA); or None
        types = layer_types(config)
        super().__init__(layers=[_SlotLayer(self, i, t == "sliding_attention") for i, t in enumerate(types)])
        self.updated: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(types)

    def write(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kv_dtype is not None:  # attention reads what an fp8 cache holds: the values cast to it and back
            key, value = key.to(self.kv_dtype).to(key.dtype), value.to(self.kv_dtype).to(value.dtype)
        if self.kv is None:  # context: attention over the prompt only; the cache gets it padded to max_seq
            pad = self.max_seq - key.shape[2]
            self.updated[layer_idx] = (nn.functional.pad(key, (0, 0, 0, pad)), nn.functional.pad(value, (0, 0, 0, pad)))
            return key, value
        assert self.slot is not None
        held_k, held_v = self.kv[layer_idx, 0], self.kv[layer_idx, 1]
        if self.kv_dtype is not None:  # (read back in the model dtype; written back as fp8 by stacked())
            held_k, held_v = held_k.to(key.dtype), held_v.to(value.dtype)
        k = held_k.index_copy(2, self.slot, key.to(held_k.dtype))
        v = held_v.index_copy(2, self.slot, value.to(held_v.dtype))
        self.updated[layer_idx] = (k, v)
        return k, v

    # Whether each row's tokens sit at slot = position (LineKV and the block caches: rows left-aligned in their lines)
    # rather than at their slot in a left-padded batch (this class: the static context and token graphs)
    left_aligned = False

    def query_positions(self, position_ids: torch.Tensor, q_len: int) -> torch.Tensor:
        """[batch or 1, q_len]: each query's position as transformers' Llama 4 counts it for its NoPE layers'
        temperature tuning (the cache's length before it: its slot in a left-padded batch, as `generate` pads it; for
        left-aligned rows, the row's own position)."""
        if self.left_aligned:
            return position_ids.long()
        start = 0 if self.kv is None or self.slot is None else self.slot[0]
        return (start + torch.arange(q_len, device=position_ids.device))[None, :]

    def stacked(self) -> torch.Tensor:
        if any(u is None for u in self.updated):
            raise RuntimeError("the model did not update every layer's cache (unsupported architecture)")
        out = torch.stack([torch.stack([k, v]) for k, v in self.updated])  # type: ignore[misc]
        return out if self.kv_dtype is None else out.to(self.kv_dtype)


def _model_forward(self: Any, logits_to_keep: int = 1, **kwargs: Any) -> Any:
    """The transformers model's own causal-LM forward (its masks, final norm, logit scaling and soft-capping), for the
    last position only (or the last `logits_to_keep`)."""
    self._nb_query_positions = kwargs["past_key_values"].query_positions(kwargs["position_ids"],
                                                                        int(kwargs["input_ids"].shape[1]))
    return super(type(self), self).forward(use_cache=True, logits_to_keep=logits_to_keep, **kwargs)


def _temperature_tuning(model: Any) -> None:
    """Llama 4's NoPE layers scale their queries by log1p(floor((p + 1) / floor_scale)) * attn_scale + 1, p counted by
    transformers as the cache's length before the query: one vector for the whole batch, which holds for a
    left-padded batch (the static graphs) but not for rows left-aligned in their own lines at different positions
    (continuous batching, block KV, speculation: a graph's `get_seq_length` is then one slot of the rotated view).
    So the graphs scale q_proj's output themselves, per row, by the positions the cache gives (`query_positions`,
    set by _model_forward), and the attention's own scaling is turned off; other families are untouched."""
    for module in model.modules():
        if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
            continue
        module.attn_temperature_tuning = False
        floor, scale = float(module.floor_scale), float(module.attn_scale)

        def hook(_m: nn.Module, _args: Any, out: torch.Tensor, floor: float = floor, scale: float = scale) -> Any:
            pos = model._nb_query_positions.float()
            scales = torch.log1p(torch.floor((pos + 1.0) / floor)) * scale + 1.0  # [batch or 1, q_len]
            return (out * scales[..., None]).to(out.dtype)

        module.q_proj.register_forward_hook(hook)


def _context_forward(self: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    # position ids as transformers' generate derives them from a left-padded mask
    position_ids = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
    cache = StaticKV(self.config, None, None, self._nb_max_seq, self._nb_kv_dtype)
    out = _model_forward(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=cache)
    return {"logits": out.logits[:, -1].float(), "kv": cache.stacked()}


def _token_forward(self: Any, input_ids: torch.Tensor, position_ids: torch.Tensor, cache_mask: torch.Tensor,
                   slot: torch.Tensor, kv: torch.Tensor) -> dict[str, torch.Tensor]:
    cache = StaticKV(self.config, kv, slot, self._nb_max_seq, self._nb_kv_dtype)
    out = _model_forward(self, input_ids=input_ids, attention_mask=cache_mask, position_ids=position_ids,
                         past_key_values=cache)
    return {"logits": out.logits[:, -1].float(), "kv": cache.stacked()}


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_dtype(hf: dict[str, Any]) -> torch.dtype:
    """The dtype an HF config's model computes in: its `dtype` (or older `torch_dtype`), float32 when it names none.
    rules/llm.bzl hf_causal_lm writes `dtype` (its attribute, else the config's) and declares the KV cache in it."""
    name = str(hf.get("dtype") or hf.get("torch_dtype") or "float32").removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"config field dtype: {name!r} is not supported by hf_causal_lm (float32, bfloat16, float16)")
    return DTYPES[name]


def hf_model(config: dict[str, Any]) -> nn.Module:
    """The transformers model of `config` in the config's dtype (random init; weights are loaded by neuronbuild
    afterwards, in that dtype: a bf16 checkpoint stays bf16 end to end). With config["tp_degree"] > 1, one rank's
    model of a Megatron tensor-parallel split (tp_ops.per_rank_hf, tp_ops.shard_hf_model)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = dict(config.get("hf") or {})
    model_type = str(config.get("model_type") or hf.pop("model_type", ""))
    hf.pop("model_type", None)
    tp = int(config.get("tp_degree") or 1)
    if tp > 1:  # one rank's model (toolchains/tp_ops.py: its config here, the rest below)
        from neuronbuild.toolchains.tp_ops import per_rank_hf, shard_hf_model

        hf = per_rank_hf(model_type, hf, tp)
    dtype = model_dtype(hf)
    hf.pop("torch_dtype", None)
    hf["dtype"] = dtype
    cfg = AutoConfig.for_model(model_type, **hf)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    if config.get("quantization"):  # (before the tensor-parallel hooks: they attach to the layers it replaces)
        from neuronbuild.toolchains.quantize import quantize_linears

        quantize_linears(model, config)
    if tp > 1:
        shard_hf_model(model, model_type, dict(config.get("hf") or {}), tp,
                       moe_ep_degree=int(config.get("moe_ep_degree") or 1))
    return model


EXPERTS = "neuronbuild_dense"


def _dense_experts(self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                   top_k_weights: torch.Tensor) -> torch.Tensor:
    """Mixture-of-experts as a static graph: every expert over every token (two batched matmuls), weighted by a dense
    [tokens, experts] routing matrix (zero where an expert is not chosen). Intermediates are tokens x experts x
    the expert's intermediate width, never an expert matrix per (token, expert) pair, and no data-dependent shapes or
    custom ops (transformers' grouped_mm registers one that deserialisation would need). Every layout transformers'
    experts interface declares: weights [experts, out, in] or transposed [experts, in, out], biases, a gated
    gate_up projection (the class's own `_apply_gate`, concatenated or interleaved: gpt-oss clamps and offsets) or an
    up projection and activation, and a post-expert norm, each as transformers' `batched_mm` applies it."""
    transposed = bool(getattr(self, "is_transposed", False))
    gated = bool(getattr(self, "has_gate", True))
    bias = bool(getattr(self, "has_bias", False))
    up_w = self.gate_up_proj if gated else self.up_proj
    up = torch.einsum("th,ehi->eti" if transposed else "th,eih->eti", hidden_states, up_w)  # [experts, tokens, out]
    if bias:
        up = up + (self.gate_up_proj_bias if gated else self.up_proj_bias)[:, None, :]
    up = self._apply_gate(up) if gated else self.act_fn(up)
    down = torch.einsum("eti,eih->eth" if transposed else "eti,ehi->eth", up, self.down_proj)  # [experts, tokens, hidden]
    if bias:
        down = down + self.down_proj_bias[:, None, :]
    if getattr(self, "has_post_expert_norm", False):
        down = self.post_expert_norm(down)
    experts = down.shape[0]
    whole = int(getattr(self, "nb_ep_experts", experts))  # expert parallelism (tp_ops): this rank's block of them
    routing = torch.zeros(hidden_states.shape[0], whole + 1, dtype=down.dtype,
                          device=down.device)  # one spare column: transformers marks dropped slots with E
    routing = routing.scatter_add(1, top_k_index, top_k_weights.to(down.dtype))[:, :-1]
    if whole != experts:  # its group's experts' columns (rank id // the group's ranks: tp_ops.ep_coordinates)
        first = (self.nb_tp_rank.to(torch.int64) // int(getattr(self, "nb_moe_tp", 1))) * experts
        routing = routing.index_select(1, first + torch.arange(experts, device=routing.device))
    return torch.einsum("eth,te->th", down, routing).to(hidden_states.dtype)


def _use_dense_experts(model: nn.Module) -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if EXPERTS not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(EXPERTS, _dense_experts)
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_experts_implementation"):
            cfg._experts_implementation = EXPERTS


def _within_one_chunk(cfg: Any, max_seq: int) -> None:
    """Chunked-attention layers (Llama 4) as full attention when every sequence the graphs hold fits one chunk
    (attention_chunk_size >= max_seq): the chunked mask is then the causal one, and the graph needs no chunk
    arithmetic. Shorter chunks keep their layers chunked (transformers' chunked mask over the cache's view). The
    graphs' config only: validate's transformers keeps its chunked layers and masks."""
    types = getattr(cfg, "layer_types", None)
    chunk = getattr(cfg, "attention_chunk_size", None)
    if types and "chunked_attention" in types and (chunk is None or int(chunk) >= max_seq):
        cfg.layer_types = ["full_attention" if t == "chunked_attention" else t for t in types]


def _dense_weight(linear: nn.Module) -> torch.Tensor:
    """A linear layer's [out, in] weight in its compute dtype (a quantized one's dequantized, as its forward does)."""
    scale = getattr(linear, "scale", None)
    if scale is None:
        return linear.weight  # type: ignore[return-value]
    from neuronbuild.toolchains.quantize import dequantize

    return dequantize(linear.weight, scale, linear.compute_dtype)  # type: ignore[arg-type]


def _absorbed_mla_forward(self: Any, hidden_states: torch.Tensor,
                          position_embeddings: tuple[torch.Tensor, torch.Tensor], attention_mask: torch.Tensor | None,
                          past_key_values: Any = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """DeepSeek-V3's multi-head latent attention with kv_b's weights absorbed (NxD Inference's and vLLM's MLA decode),
    for the graphs that attend over a cache: kv_b_proj's key half is folded into the query (q_nope @ W_UK, per head:
    [nope] -> [kv_lora_rank]), scores are taken against the cached latent and rotary key as one shared key/value head
    (the latent is the value too), and W_UV maps each head's attention-weighted latent to its value width: no
    per-head key or value is materialised (transformers up-projects the whole cache every step). Context graphs (no
    cache to read: the prompt's own keys) keep transformers' forward, as vLLM's prefill does. Equal to transformers'
    up to float rounding: q.k = q_nope.(W_UK c) + q_rot.k_rot = (q_nope W_UK).c + q_rot.k_rot; p.(W_UV c) = W_UV (p.c)."""
    cache = past_key_values
    q_len = hidden_states.shape[1]
    if cache is None or getattr(cache, "kv", None) is None or (attention_mask is None and q_len > 1):
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, past_key_values,
                                  **kwargs)  # type: ignore[no-any-return]
    batch = hidden_states.shape[0]
    nope, rope, rank, v_dim = self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank, self.v_head_dim
    if self.q_lora_rank is None:
        q = self.q_proj(hidden_states)
    else:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
    q = q.view(batch, q_len, -1, self.qk_head_dim).transpose(1, 2)
    q_pass, q_rot = torch.split(q, [nope, rope], dim=-1)
    latent, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden_states), [rank, rope], dim=-1)
    latent = self.kv_a_layernorm(latent).view(batch, 1, q_len, rank)
    k_rot = k_rot.view(batch, 1, q_len, rope)
    family = sys.modules[type(self).__module__]  # (the family's own rotary functions)
    rotate = family.apply_rotary_pos_emb_interleave if self.config.rope_interleave else family.apply_rotary_pos_emb
    q_rot, k_rot = rotate(q_rot, k_rot, *position_embeddings)
    latent, k_rot = cache.update(latent, k_rot, self.layer_idx)  # [batch, 1, slots, rank], [batch, 1, slots, rope]
    heads = q.shape[1]  # (this rank's, at tp > 1: q_b and kv_b are split by head)
    w = _dense_weight(self.kv_b_proj).view(heads, nope + v_dim, rank)
    lat, kr = latent[:, 0], k_rot[:, 0]
    q_lat = torch.einsum("bhqd,hdr->bhqr", q_pass, w[:, :nope])
    scores = (torch.einsum("bhqr,bsr->bhqs", q_lat, lat) + torch.einsum("bhqd,bsd->bhqs", q_rot, kr)) * self.scaling
    if attention_mask is not None:  # transformers' 4-D mask: boolean (sdpa) or additive (eager)
        mask = attention_mask[:, :, :, : scores.shape[-1]]
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min) if mask.dtype == torch.bool else scores + mask
    probs = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.einsum("bhqr,hvr->bqhv", torch.einsum("bhqs,bsr->bhqr", probs, lat), w[:, nope:])
    return self.o_proj(out.reshape(batch, q_len, heads * v_dim)), None


def _absorbed_latent_attention(model: nn.Module) -> None:
    """DeepSeek-V3's attention modules decode with absorbed weights (_absorbed_mla_forward); other families untouched."""
    for module in model.modules():
        if type(module).__name__ == "DeepseekV3Attention":
            module.forward = types.MethodType(_absorbed_mla_forward, module)


def _graph(config: dict[str, Any], forward: Any, suffix: str) -> nn.Module:
    model: Any = hf_model(config)
    _within_one_chunk(model.config, int(config["max_seq"]))
    _temperature_tuning(model)
    _absorbed_latent_attention(model)
    _use_dense_experts(model)
    cls = type(model)
    # A subclass whose forward is the graph's: same parameters and state-dict keys as the checkpoint.
    graph_cls = type(f"{cls.__name__}{suffix}", (cls,), {"forward": forward, "__module__": __name__})
    model.__class__ = graph_cls
    model._nb_max_seq = int(config["max_seq"])
    from neuronbuild.toolchains.quantize import kv_cache_dtype

    model._nb_kv_dtype = kv_cache_dtype(config)
    model.config.use_cache = True
    return model  # type: ignore[no-any-return]


def context(config: dict[str, Any]) -> nn.Module:
    """The context-encoding (prefill) graph."""
    return _graph(config, _context_forward, "ContextGraph")


def token(config: dict[str, Any]) -> nn.Module:
    """The token-generation (decode) graph."""
    return _graph(config, _token_forward, "TokenGraph")


# -- serving graphs: continuous batching (a KV cache of max_batch lines, rows named by seq_ids) and on-device sampling

SAMPLER_TOP_K = 256  # the sampler's static top-k (NxD Inference's global top-k): what top_k = 0 samples from


def sample(logits: torch.Tensor, sampling_params: torch.Tensor, rand: torch.Tensor) -> torch.Tensor:
    """The next token per row, as NxD Inference's on-device sampler computes it. logits float32 [batch, vocab];
    sampling_params float32 [batch, 3] = (top_k, top_p, temperature); rand float32 [batch], a uniform draw in [0, 1).

    1. K = min(vocab, SAMPLER_TOP_K); the K largest logits, sorted descending (ties: torch.topk's order).
    2. A row's top_k: values < 1 or > K mean K; ranks >= top_k are dropped.
    3. Divide by the temperature; softmax over the kept ranks; p_i, cumulative c_i.
    4. top_p: rank i is kept when c_i - p_i < top_p (the mass before it), so the first is always kept.
    5. Inverse CDF: C = cumsum of the kept p_i; the sampled rank is the number of ranks with C_i < rand * C_last.
    A row with top_k == 1 or temperature <= 0 takes argmax(logits) (transformers' greedy choice, first of ties)."""
    k = min(int(logits.shape[-1]), SAMPLER_TOP_K)
    top_k, top_p, temperature = sampling_params[:, 0], sampling_params[:, 1], sampling_params[:, 2]
    values, index = torch.topk(logits, k, dim=-1)
    rank = torch.arange(k, device=logits.device, dtype=torch.float32)
    kk = torch.where((top_k < 1) | (top_k > k), torch.full_like(top_k, k), top_k)
    scaled = values / torch.where(temperature > 0, temperature, torch.ones_like(temperature))[:, None]
    scaled = scaled.masked_fill(rank[None, :] >= kk[:, None], float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    before = probs.cumsum(-1) - probs
    probs = torch.where(before < top_p[:, None], probs, torch.zeros_like(probs))
    cdf = probs.cumsum(-1)
    u = rand * cdf[:, -1]
    choice = (cdf < u[:, None]).sum(-1).clamp(max=k - 1)
    sampled = index.gather(1, choice[:, None])[:, 0]
    greedy = (top_k == 1) | (temperature <= 0)
    return torch.where(greedy, logits.argmax(-1), sampled).to(torch.int32)


def _read_lines(cache: Any, layer_idx: int, j: int, like: torch.Tensor) -> torch.Tensor:
    """The batch rows' cache lines of one layer's keys (j = 0) or values (1), in `like`'s dtype when the cache is fp8
    (kv_cache_dtype: torch's CPU gather has no float8 kernel, and attention reads the model dtype)."""
    held = cache.lines_kv[layer_idx, j].index_select(0, cache.lines)
    return held if cache.kv_dtype is None else held.to(like.dtype)


def _as_held(cache: Any, new: torch.Tensor) -> torch.Tensor:
    """New keys/values as attention must see them: rounded through the cache's fp8 dtype when it has one (what a
    later call reads back), else as they are."""
    return new if cache.kv_dtype is None else new.to(cache.kv_dtype).to(new.dtype)


class LineKV(StaticKV):
    """The serving cache: kv [layers, 2, max_batch + 1, kv_heads, max_seq, head_dim], one line per sequence slot (the
    last line is where padding rows, seq_ids < 0, write). A row's tokens sit in its line at slots 0..n-1, slot =
    position. Context graphs attend within the prompt (as StaticKV) and write each prompt, left-aligned, into its
    line. Token graphs give each row a view of its line rotated so that the slot it writes (its position) is the
    last one: transformers then sees every row as a left-padded sequence whose query is at slot max_seq - 1 (one
    query offset for the batch), so its own masks (causal, sliding windows, ALiBi from the 2-D mask) hold per row."""

    left_aligned = True

    def __init__(self, config: Any, kv: torch.Tensor, seq_ids: torch.Tensor, max_seq: int,
                 positions: torch.Tensor | None, kv_dtype: torch.dtype | None = None) -> None:
        super().__init__(config, kv if positions is not None else None,
                         None if positions is None else torch.tensor([max_seq - 1]), max_seq, kv_dtype)
        self.lines_kv = kv
        self.lines = torch.where(seq_ids < 0, torch.full_like(seq_ids, kv.shape[2] - 1), seq_ids).long()
        self.positions = positions  # token graphs: [batch] the slot each row writes
        self.written: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * kv.shape[0]
        if positions is not None:
            self.view = rotation(positions, max_seq)  # [batch, max_seq]: view index -> slot

    def write(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.positions is None:
            return super().write(key, value, layer_idx)
        idx = self.view[:, None, :, None].expand(-1, key.shape[1], -1, key.shape[3])
        out = []
        for j, new in enumerate((key, value)):
            line = _read_lines(self, layer_idx, j, new)  # the rows' lines (an fp8 cache read back in the model dtype)
            line = line.gather(2, idx)  # rotated
            out.append(torch.cat([line[:, :, :-1], _as_held(self, new).to(line.dtype)], dim=2))
        self.written[layer_idx] = (key, value)
        return out[0], out[1]

    def new_cache(self, prompt_mask: torch.Tensor | None = None) -> torch.Tensor:
        """kv with this call's writes, as ONE scatter into the kv input (no per-layer stack: the output is the input
        updated where written, which XLA's aliasing and a compiler's in-place scatter keep in place): a context
        graph's prompts (left-aligned by `prompt_mask`) into whole lines, a token graph's one slot per row."""
        kv = self.lines_kv
        layers = torch.arange(kv.shape[0], device=kv.device)[:, None, None, None]
        pair = torch.arange(2, device=kv.device)[None, :, None, None]
        lines = self.lines[None, None, :, None]
        heads = torch.arange(kv.shape[3], device=kv.device)[None, None, None, :]
        if self.positions is None:
            assert prompt_mask is not None
            shift = prompt_mask.shape[1] - prompt_mask.sum(-1)  # left padding per row
            src = (torch.arange(self.max_seq, device=shift.device)[None, :] + shift[:, None]).clamp(max=self.max_seq - 1)
            rows = []
            for k, v in self.updated:  # type: ignore[misc]  # [batch, kv_heads, max_seq, head_dim], prompt-padded
                idx = src[:, None, :, None].expand_as(k)
                rows.append(torch.stack([k.gather(2, idx), v.gather(2, idx)]))
            values = torch.stack(rows).to(kv.dtype)  # [layers, 2, batch, kv_heads, max_seq, head_dim]
            return torch.index_put(kv, (layers, pair, lines, heads), values)
        written = torch.stack([torch.stack([k[:, :, 0], v[:, :, 0]]) for k, v in self.written])  # type: ignore[misc]
        slots = self.positions.long()[None, None, :, None]
        return torch.index_put(kv, (layers, pair, lines, heads, slots), written.to(kv.dtype))


def rotation(positions: torch.Tensor, max_seq: int) -> torch.Tensor:
    """[batch, max_seq]: the cache slot at each index of a row's rotated view, the row's position last."""
    i = torch.arange(max_seq, device=positions.device)
    return (i[None, :] + positions.long()[:, None] + 1) % max_seq


def _serving_outputs(logits: torch.Tensor, kv: torch.Tensor, sampled: tuple[torch.Tensor, ...],
                     want_logits: bool) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if sampled:
        out["tokens"] = sample(logits, sampled[0], sampled[1])
    if want_logits or not sampled:
        out["logits"] = logits
    out["kv"] = kv
    return out


def _prefill(self: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
             seq_ids: torch.Tensor, sampled: tuple[torch.Tensor, ...], kv: torch.Tensor) -> dict[str, torch.Tensor]:
    """Prefill of left-padded prompts into the lines seq_ids name (positions as generate derives them)."""
    cache = LineKV(self.config, kv, seq_ids, self._nb_max_seq, None, self._nb_kv_dtype)
    mask = attention_mask.long()
    out = _model_forward(self, input_ids=input_ids.long(), attention_mask=mask, position_ids=position_ids.long(),
                         past_key_values=cache)
    return _serving_outputs(out.logits[:, -1].float(), cache.new_cache(mask), sampled, self._nb_logits)


def _decode(self: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
            seq_ids: torch.Tensor, sampled: tuple[torch.Tensor, ...], kv: torch.Tensor) -> dict[str, torch.Tensor]:
    """One token per row: position_ids [batch, 1] is the slot it writes in its line, attention_mask [batch, max_seq]
    the line's slots it attends (1; the written one included)."""
    positions = position_ids[:, 0]
    cache = LineKV(self.config, kv, seq_ids, self._nb_max_seq, positions, self._nb_kv_dtype)
    view_mask = attention_mask.long().gather(1, cache.view)
    out = _model_forward(self, input_ids=input_ids.long(), attention_mask=view_mask,
                         position_ids=position_ids.long(), past_key_values=cache)
    return _serving_outputs(out.logits[:, -1].float(), cache.new_cache(), sampled, self._nb_logits)


# The graphs' forwards: parameter names are the declared input names (the HLO's parameters are named after them).
def _serving_context_forward(self: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                             position_ids: torch.Tensor, seq_ids: torch.Tensor, kv: torch.Tensor
                             ) -> dict[str, torch.Tensor]:
    return _prefill(self, input_ids, attention_mask, position_ids, seq_ids, (), kv)


def _serving_token_forward(self: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                           position_ids: torch.Tensor, seq_ids: torch.Tensor, kv: torch.Tensor
                           ) -> dict[str, torch.Tensor]:
    return _decode(self, input_ids, attention_mask, position_ids, seq_ids, (), kv)


def _sampling_context_forward(self: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                              position_ids: torch.Tensor, seq_ids: torch.Tensor, sampling_params: torch.Tensor,
                              rand: torch.Tensor, kv: torch.Tensor) -> dict[str, torch.Tensor]:
    return _prefill(self, input_ids, attention_mask, position_ids, seq_ids, (sampling_params, rand), kv)


def _sampling_token_forward(self: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                            position_ids: torch.Tensor, seq_ids: torch.Tensor, sampling_params: torch.Tensor,
                            rand: torch.Tensor, kv: torch.Tensor) -> dict[str, torch.Tensor]:
    return _decode(self, input_ids, attention_mask, position_ids, seq_ids, (sampling_params, rand), kv)


def _serving(config: dict[str, Any], forward: Any, suffix: str, logits: bool) -> nn.Module:
    model: Any = _graph(config, forward, suffix)
    model._nb_logits = logits
    return model  # type: ignore[no-any-return]


def serving_context(config: dict[str, Any]) -> nn.Module:
    """continuous_batching context graph: logits and the cache (no sampling)."""
    return _serving(config, _serving_context_forward, "ServingContextGraph", True)


def serving_token(config: dict[str, Any]) -> nn.Module:
    """continuous_batching token graph: logits and the cache (no sampling)."""
    return _serving(config, _serving_token_forward, "ServingTokenGraph", True)


def sampling_context(config: dict[str, Any]) -> nn.Module:
    """continuous_batching + on_device_sampling context graph: tokens and the cache."""
    return _serving(config, _sampling_context_forward, "SamplingContextGraph", False)


def sampling_token(config: dict[str, Any]) -> nn.Module:
    """continuous_batching + on_device_sampling token graph: tokens and the cache."""
    return _serving(config, _sampling_token_forward, "SamplingTokenGraph", False)


def sampling_logits_context(config: dict[str, Any]) -> nn.Module:
    """on_device_sampling with output_logits: tokens, logits and the cache."""
    return _serving(config, _sampling_context_forward, "SamplingLogitsContextGraph", True)


def sampling_logits_token(config: dict[str, Any]) -> nn.Module:
    """on_device_sampling with output_logits: tokens, logits and the cache."""
    return _serving(config, _sampling_token_forward, "SamplingLogitsTokenGraph", True)


# -- speculative decoding: the target's verification graph (hf_causal_lm(speculation = {...}), docs/llm.md)

class VerifyKV(LineKV):
    """The verification graph's cache: each row writes n = k + 1 consecutive slots of its line (positions p..p+k, the
    last accepted token and k draft tokens). As for a token graph, the row's line is seen rotated so that the written
    slots are the last n of the view; transformers then sees n queries at cache positions max_seq - n..max_seq - 1 and
    builds its causal (and sliding-window) masks itself, each draft token attending to the ones before it."""

    def __init__(self, config: Any, kv: torch.Tensor, seq_ids: torch.Tensor, max_seq: int,
                 position_ids: torch.Tensor, kv_dtype: torch.dtype | None = None) -> None:
        n = int(position_ids.shape[1])
        Cache.__init__(self, layers=[_SlotLayer(self, i, t == "sliding_attention")
                                     for i, t in enumerate(layer_types(config))])
        self.kv, self.slot, self.max_seq, self.kv_dtype = kv, torch.tensor([max_seq - n]), max_seq, kv_dtype
        self.latent_width = cache_width(config)
        self.updated = [None] * kv.shape[0]
        self.lines_kv = kv
        self.lines = torch.where(seq_ids < 0, torch.full_like(seq_ids, kv.shape[2] - 1), seq_ids).long()
        self.width = n
        self.slots = position_ids.long()  # [batch, n]: the slots each row writes
        self.positions = position_ids[:, 0]
        self.written = [None] * kv.shape[0]
        i = torch.arange(max_seq, device=position_ids.device)
        self.view = (i[None, :] + self.positions.long()[:, None] + n) % max_seq  # view index -> slot, p+k last

    def write(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = self.view[:, None, :, None].expand(-1, key.shape[1], -1, key.shape[3])
        out = []
        for j, new in enumerate((key, value)):
            line = _read_lines(self, layer_idx, j, new).gather(2, idx)
            out.append(torch.cat([line[:, :, : -self.width], _as_held(self, new).to(line.dtype)], dim=2))
        self.written[layer_idx] = (key, value)
        return out[0], out[1]

    def new_cache(self, prompt_mask: torch.Tensor | None = None) -> torch.Tensor:
        """kv with the n slots of every row written: one scatter into the kv input."""
        kv = self.lines_kv
        layers = torch.arange(kv.shape[0], device=kv.device)[:, None, None, None, None]
        pair = torch.arange(2, device=kv.device)[None, :, None, None, None]
        lines = self.lines[None, None, :, None, None]
        heads = torch.arange(kv.shape[3], device=kv.device)[None, None, None, :, None]
        slots = self.slots[None, None, :, None, :]
        # [layers, 2, batch, kv_heads, n, head_dim]
        written = torch.stack([torch.stack([k, v]) for k, v in self.written])  # type: ignore[misc]
        return torch.index_put(kv, (layers, pair, lines, heads, slots), written.to(kv.dtype))


def _verify(self: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
            seq_ids: torch.Tensor, sampled: tuple[torch.Tensor, ...], kv: torch.Tensor) -> dict[str, torch.Tensor]:
    """k + 1 tokens per row at positions position_ids[b] (consecutive), attending to the line's slots the mask names
    (those before the first position, 1) and causally to each other; returns the target's token after each: the
    greedy argmax, or the sampler's choice from rand[:, i] with on-device sampling."""
    n = int(input_ids.shape[1])
    cache = VerifyKV(self.config, kv, seq_ids, self._nb_max_seq, position_ids, self._nb_kv_dtype)
    view_mask = attention_mask.long().gather(1, cache.view)[:, :-n]  # the written slots: always attended (causally,
    view_mask = torch.cat([view_mask, view_mask.new_ones((view_mask.shape[0], n))], 1)  # by transformers' own mask)
    out = _model_forward(self, logits_to_keep=n, input_ids=input_ids.long(), attention_mask=view_mask,
                         position_ids=position_ids.long(), past_key_values=cache)
    logits = out.logits[:, -n:].float()  # [batch, n, vocab]
    batch, vocab = logits.shape[0], logits.shape[2]
    if sampled:
        params = sampled[0][:, None, :].expand(batch, n, 3).reshape(batch * n, 3)
        tokens = sample(logits.reshape(batch * n, vocab), params, sampled[1].reshape(batch * n)).reshape(batch, n)
    else:
        tokens = logits.argmax(-1).to(torch.int32)
    result = {"tokens": tokens}
    if self._nb_logits or not sampled:
        result["logits"] = logits
    result["kv"] = cache.new_cache()
    return result


def _serving_verify_forward(self: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                            position_ids: torch.Tensor, seq_ids: torch.Tensor, kv: torch.Tensor
                            ) -> dict[str, torch.Tensor]:
    return _verify(self, input_ids, attention_mask, position_ids, seq_ids, (), kv)


def _sampling_verify_forward(self: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                             position_ids: torch.Tensor, seq_ids: torch.Tensor, sampling_params: torch.Tensor,
                             rand: torch.Tensor, kv: torch.Tensor) -> dict[str, torch.Tensor]:
    return _verify(self, input_ids, attention_mask, position_ids, seq_ids, (sampling_params, rand), kv)


def serving_verify(config: dict[str, Any]) -> nn.Module:
    """speculation verification graph (continuous_batching, no on-device sampling): greedy tokens, logits, cache."""
    return _serving(config, _serving_verify_forward, "ServingVerifyGraph", True)


def sampling_verify(config: dict[str, Any]) -> nn.Module:
    """speculation verification graph with on-device sampling: tokens (+ logits with output_logits), cache."""
    return _serving(config, _sampling_verify_forward, "SamplingVerifyGraph", False)


def sampling_logits_verify(config: dict[str, Any]) -> nn.Module:
    """speculation verification graph with on-device sampling and output_logits: tokens, logits, cache."""
    return _serving(config, _sampling_verify_forward, "SamplingLogitsVerifyGraph", True)


# -- fused speculation: the draft's k steps and the target's verification in one graph (speculation fused = True)

DRAFT = "draft"  # the draft model's submodule in a fused graph: its state is the draft's weights file under "draft."


def _fused(self: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
           seq_ids: torch.Tensor, sampled: tuple[torch.Tensor, ...], kv: torch.Tensor, draft_kv: torch.Tensor
           ) -> dict[str, torch.Tensor]:
    """One speculation round per row (NxD Inference's enable_fused_speculation). input_ids [batch, 2]: the token
    before the last accepted one and the last accepted one, at position_ids [batch, 2] = (p - 1, p); attention_mask
    [batch, max_seq]: the target line's slots before p. The draft (self.draft, a graph module of the draft's config)
    feeds both tokens in one step (slot p - 1 again: it already holds it, or it is the one the draft never fed after
    a round that accepted every proposal) and then its own k - 1 proposals one at a time, each step as its token graph
    computes it; the target scores the last accepted token and the k proposals at p..p + k as the verify graph does.
    With on-device sampling, a draft step samples its proposal from draft_rand (sampled = (sampling_params, rand,
    draft_rand)); otherwise it takes the argmax."""
    draft = getattr(self, DRAFT)
    k = int(self._nb_spec_length)
    batch = input_ids.shape[0]
    p = position_ids[:, 1:2].long()  # [batch, 1]
    params = sampled[:1]

    def draft_sampled(i: int, width: int) -> tuple[torch.Tensor, ...]:
        if not sampled:
            return ()
        return (params[0], sampled[2][:, i:i + 1].expand(batch, width).contiguous())

    slots = torch.arange(draft._nb_max_seq, device=input_ids.device)[None, :]
    first = _verify(draft, input_ids, (slots < p - 1).to(torch.int32), position_ids, seq_ids, draft_sampled(0, 2),
                    draft_kv)
    proposals, logits = [first["tokens"][:, -1]], [first["logits"][:, -1]]
    dkv = first["kv"]
    for i in range(1, k):
        pos = p + i
        out = _decode(draft, proposals[-1][:, None].to(torch.int32), (slots <= pos).to(torch.int32), pos, seq_ids,
                      (params[0], sampled[2][:, i]) if sampled else (), dkv)
        proposals.append(out["tokens"] if sampled else out["logits"].argmax(-1).to(torch.int32))
        logits.append(out["logits"])
        dkv = out["kv"]
    draft_tokens = torch.stack(proposals, 1).to(torch.int32)  # [batch, k]
    ids = torch.cat([input_ids[:, 1:2].to(torch.int32), draft_tokens], 1)
    positions = p + torch.arange(k + 1, device=p.device)[None, :]
    verified = _verify(self, ids, attention_mask, positions, seq_ids, sampled[:2], kv)
    result = {"draft_tokens": draft_tokens, "tokens": verified["tokens"]}
    if "logits" in verified:
        result["draft_logits"] = torch.stack(logits, 1)  # [batch, k, vocab]
        result["logits"] = verified["logits"]
    result["kv"] = verified["kv"]
    result["draft_kv"] = dkv
    return result


def _serving_fused_forward(self: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                           position_ids: torch.Tensor, seq_ids: torch.Tensor, kv: torch.Tensor, draft_kv: torch.Tensor
                           ) -> dict[str, torch.Tensor]:
    return _fused(self, input_ids, attention_mask, position_ids, seq_ids, (), kv, draft_kv)


def _sampling_fused_forward(self: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                            position_ids: torch.Tensor, seq_ids: torch.Tensor, sampling_params: torch.Tensor,
                            rand: torch.Tensor, draft_rand: torch.Tensor, kv: torch.Tensor, draft_kv: torch.Tensor
                            ) -> dict[str, torch.Tensor]:
    return _fused(self, input_ids, attention_mask, position_ids, seq_ids, (sampling_params, rand, draft_rand), kv,
                  draft_kv)


def _fused_graph(config: dict[str, Any], forward: Any, suffix: str, logits: bool) -> nn.Module:
    """The target's graph module with the draft's (its config from the fused graph's `speculation_draft` key, filled
    in at analysis from the draft hf_causal_lm) as the submodule `draft`: the graph binds the target's weights under
    their own names and the draft's under "draft." (the draft's weights file, shipped beside the target's)."""
    model: Any = _serving(config, forward, suffix, logits)
    draft: Any = _serving(dict(config["speculation_draft"]["config"]), _serving_token_forward, "FusedDraft", True)
    setattr(model, DRAFT, draft)
    model._nb_spec_length = int(config["speculation"]["length"])
    return model  # type: ignore[no-any-return]


def serving_fused(config: dict[str, Any]) -> nn.Module:
    """fused speculation graph (no on-device sampling): the draft's k greedy proposals, the target's tokens and
    logits (both models'), both caches."""
    return _fused_graph(config, _serving_fused_forward, "ServingFusedGraph", True)


def sampling_fused(config: dict[str, Any]) -> nn.Module:
    """fused speculation graph with on-device sampling: proposals and tokens, both caches."""
    return _fused_graph(config, _sampling_fused_forward, "SamplingFusedGraph", False)


def sampling_logits_fused(config: dict[str, Any]) -> nn.Module:
    """fused speculation graph with on-device sampling and output_logits: + both models' logits."""
    return _fused_graph(config, _sampling_fused_forward, "SamplingLogitsFusedGraph", True)
