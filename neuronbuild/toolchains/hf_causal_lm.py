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

from typing import Any

import torch
from torch import nn


class StaticKV:
    """The duck-typed transformers cache the attention layers call `update(k, v, layer_idx)` on: it writes the new
    keys/values into per-layer tensors functionally (index_copy, no in-place input mutation) and keeps the results."""

    def __init__(self, layers: int, kv: torch.Tensor | None, slot: torch.Tensor | None, max_seq: int) -> None:
        self.kv = kv
        self.slot = slot
        self.max_seq = max_seq
        self.updated: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * layers
        self.is_compileable = True
        self.layers: list[Any] = []

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kv is None:  # context: attention over the prompt only; the cache gets it padded to max_seq
            pad = self.max_seq - key.shape[2]
            self.updated[layer_idx] = (nn.functional.pad(key, (0, 0, 0, pad)), nn.functional.pad(value, (0, 0, 0, pad)))
            return key, value
        assert self.slot is not None
        k = self.kv[layer_idx, 0].index_copy(2, self.slot, key.to(self.kv.dtype))
        v = self.kv[layer_idx, 1].index_copy(2, self.slot, value.to(self.kv.dtype))
        self.updated[layer_idx] = (k, v)
        return k, v

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def stacked(self) -> torch.Tensor:
        if any(u is None for u in self.updated):
            raise RuntimeError("the model did not update every layer's cache (unsupported architecture)")
        return torch.stack([torch.stack([k, v]) for k, v in self.updated])  # type: ignore[misc]


def _min(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).min)


def _base(model: Any) -> nn.Module:
    return getattr(model, str(model.base_model_prefix))  # type: ignore[no-any-return]


def _context_forward(self: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    b, s = input_ids.shape
    mask = attention_mask != 0
    position_ids = (attention_mask.cumsum(-1) - 1).masked_fill(~mask, 1)
    idx = torch.arange(s, device=input_ids.device)
    causal = idx[None, :] <= idx[:, None]
    # Padded query rows attend to themselves only: never an all-masked row (NaN), and real rows never see them.
    allowed = (causal[None] & mask[:, None, :]) | torch.eye(s, dtype=torch.bool, device=input_ids.device)[None]
    dtype = self.get_output_embeddings().weight.dtype
    additive = torch.where(allowed, 0.0, _min(dtype)).to(dtype)[:, None]
    cache = StaticKV(self.config.num_hidden_layers, None, None, self._nb_max_seq)
    out = _base(self)(input_ids=input_ids, attention_mask=additive, position_ids=position_ids,
                      past_key_values=cache, use_cache=True)
    hidden = out[0][:, -1]
    return {"logits": self.get_output_embeddings()(hidden).float(), "kv": cache.stacked()}


def _token_forward(self: Any, input_ids: torch.Tensor, position_ids: torch.Tensor, cache_mask: torch.Tensor,
                   slot: torch.Tensor, kv: torch.Tensor) -> dict[str, torch.Tensor]:
    dtype = self.get_output_embeddings().weight.dtype
    additive = torch.where(cache_mask != 0, 0.0, _min(dtype)).to(dtype)[:, None, None, :]
    cache = StaticKV(self.config.num_hidden_layers, kv, slot, self._nb_max_seq)
    out = _base(self)(input_ids=input_ids, attention_mask=additive, position_ids=position_ids,
                      past_key_values=cache, use_cache=True)
    hidden = out[0][:, -1]
    return {"logits": self.get_output_embeddings()(hidden).float(), "kv": cache.stacked()}


def hf_model(config: dict[str, Any]) -> nn.Module:
    """The transformers model of `config` (random init; weights are loaded by neuronbuild afterwards)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = dict(config.get("hf") or {})
    model_type = str(config.get("model_type") or hf.pop("model_type", ""))
    hf.pop("model_type", None)
    cfg = AutoConfig.for_model(model_type, **hf)
    return AutoModelForCausalLM.from_config(cfg)


def _graph(config: dict[str, Any], forward: Any, suffix: str) -> nn.Module:
    model: Any = hf_model(config)
    cls = type(model)
    # A subclass whose forward is the graph's: same parameters and state-dict keys as the checkpoint.
    graph_cls = type(f"{cls.__name__}{suffix}", (cls,), {"forward": forward, "__module__": __name__})
    model.__class__ = graph_cls
    model._nb_max_seq = int(config["max_seq"])
    model.config.use_cache = True
    return model  # type: ignore[no-any-return]


def context(config: dict[str, Any]) -> nn.Module:
    """The context-encoding (prefill) graph."""
    return _graph(config, _context_forward, "ContextGraph")


def token(config: dict[str, Any]) -> nn.Module:
    """The token-generation (decode) graph."""
    return _graph(config, _token_forward, "TokenGraph")
