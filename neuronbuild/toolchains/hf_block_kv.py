"""The block-KV-cache graphs of hf_causal_lm(kv_layout = "block", ...) (docs/llm.md "Block KV cache"): the serving
graphs of toolchains/hf_causal_lm.py over a pool of blocks addressed through a per-row block table. A module of its
own: the trace fingerprints of hf_causal_lm's other graphs cover hf_causal_lm.py's digest, so they stay unchanged."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache

from neuronbuild.toolchains.hf_causal_lm import (
    LineKV,
    StaticKV,
    _model_forward,
    _serving,
    _serving_outputs,
    _SlotLayer,
    cache_width,
    layer_types,
)


class BlockKV(LineKV):
    """The block-layout serving cache: a pool kv [layers, 2, num_blocks + 1, kv_heads, block_size, head_dim] (the last
    block is scratch: where padding rows and the table's unused entries point) and a per-row block table
    int32 [batch, max_seq / block_size] (NxD Inference's active_block_table). A row's position p lives at slot
    table[row, p // block_size] * block_size + p % block_size (NxD's slot_mapping, derived here in the graph from the
    table and the positions). Reads gather the row's blocks into a line of max_seq slots and attend as LineKV does
    (the same rotated view, so transformers' own masks hold per row); writes scatter into the pool through the table."""

    def __init__(self, config: Any, pool: torch.Tensor, block_table: torch.Tensor, max_seq: int,
                 positions: torch.Tensor | None) -> None:
        table = block_table.long()
        batch, per_row = int(table.shape[0]), int(table.shape[1])
        self.pool, self.table, self.block_size = pool, table, int(pool.shape[4])
        rows = torch.arange(batch, device=table.device)
        if positions is None:  # a context graph reads no cache: its writes go straight to the pool (new_cache)
            lines = pool
        else:  # the rows' lines: [layers, 2, batch, kv_heads, per_row * block_size, head_dim]
            got = pool.index_select(2, table.reshape(-1))
            shape = got.shape
            got = got.reshape(shape[0], shape[1], batch, per_row, shape[3], shape[4], shape[5])
            lines = got.permute(0, 1, 2, 4, 3, 5, 6).reshape(shape[0], shape[1], batch, shape[3],
                                                             per_row * self.block_size, shape[5])
        super().__init__(config, lines, rows, max_seq, positions)
        self.lines = rows

    def new_cache(self, prompt_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The pool with this call's writes, as ONE scatter into the kv input: a context graph's prompts
        (left-aligned) into every slot of the row's table (entries naming the scratch block write nowhere that is
        read), a token graph's one slot per row."""
        pool, size = self.pool, self.block_size
        layers = torch.arange(pool.shape[0], device=pool.device)
        pair = torch.arange(2, device=pool.device)
        heads = torch.arange(pool.shape[3], device=pool.device)
        if self.positions is None:
            assert prompt_mask is not None
            shift = prompt_mask.shape[1] - prompt_mask.sum(-1)  # left padding per row
            src = (torch.arange(self.max_seq, device=shift.device)[None, :] + shift[:, None]).clamp(max=self.max_seq - 1)
            rows = []
            for k, v in self.updated:  # type: ignore[misc]  # [batch, kv_heads, max_seq, head_dim], prompt-padded
                idx = src[:, None, :, None].expand_as(k)
                rows.append(torch.stack([k.gather(2, idx), v.gather(2, idx)]))
            values = torch.stack(rows).to(pool.dtype)  # [layers, 2, batch, kv_heads, max_seq, head_dim]
            pos = torch.arange(self.max_seq, device=pool.device)
            blocks = self.table[:, pos // size]  # [batch, max_seq]
            offsets = (pos % size)[None, None, None, None, :]
            index = (layers[:, None, None, None, None], pair[None, :, None, None, None],
                     blocks[None, None, :, None, :], heads[None, None, None, :, None], offsets)
            return torch.index_put(pool, index, values)
        written = torch.stack([torch.stack([k[:, :, 0], v[:, :, 0]]) for k, v in self.written])  # type: ignore[misc]
        pos = self.positions.long()
        blocks = self.table.gather(1, (pos // size)[:, None])[:, 0]
        index = (layers[:, None, None, None], pair[None, :, None, None], blocks[None, None, :, None],
                 heads[None, None, None, :], (pos % size)[None, None, :, None])
        return torch.index_put(pool, index, written.to(pool.dtype))


class PrefixKV(StaticKV):
    """The prefix graphs' cache (prefix_caching = True): `seq` new tokens per row (left-padded; attention_mask marks
    them) at positions c..c+n-1 after c cached positions (prefix_mask [batch, prefix] marks them, c <= prefix) held in
    the row's blocks. The row's first ceil(prefix / B) blocks are gathered into a line of `prefix` slots (only those:
    the bucket's prefix length bounds what is read), and each layer attends over a view of prefix + seq slots in which
    the row's c cached and n new positions are contiguous and last, so transformers sees a left-padded sequence whose
    queries are the view's last `seq` slots and builds its own causal / sliding-window / ALiBi masks per row. The new
    tokens' keys and values are then written through the block table (NxD Inference's slot_mapping, derived here from
    the positions); padding queries write zeros into the scratch block."""

    left_aligned = True  # (a row's positions are its own: query_positions are its position_ids)

    def __init__(self, config: Any, pool: torch.Tensor, block_table: torch.Tensor, prefix_mask: torch.Tensor,
                 new_mask: torch.Tensor, position_ids: torch.Tensor) -> None:
        table = block_table.long()
        batch, prefix, seq = int(table.shape[0]), int(prefix_mask.shape[1]), int(new_mask.shape[1])
        size = int(pool.shape[4])
        Cache.__init__(self, layers=[_SlotLayer(self, i, t == "sliding_attention")
                                     for i, t in enumerate(layer_types(config))])
        self.max_seq, self.slot, self.kv_dtype = prefix + seq, torch.tensor([prefix]), None
        self.latent_width = cache_width(config)
        self.pool, self.table, self.block_size = pool, table, size
        nblk = -(-prefix // size)
        got = pool.index_select(2, table[:, :nblk].reshape(-1))  # [layers, 2, batch * nblk, heads, size, dim]
        shape = got.shape
        got = got.reshape(shape[0], shape[1], batch, nblk, shape[3], shape[4], shape[5])
        self.lines = got.permute(0, 1, 2, 4, 3, 5, 6).reshape(shape[0], shape[1], batch, shape[3], nblk * size,
                                                               shape[5])[:, :, :, :, :prefix]
        self.kv = self.lines  # (not None: _SlotLayer's mask sizes are then this view's prefix + seq)
        cached = prefix_mask.long().sum(-1)  # c per row
        new = new_mask.long()
        fresh = new.sum(-1)  # n per row
        view = torch.arange(prefix + seq, device=table.device)[None, :]
        q = view - (prefix + seq - cached - fresh)[:, None]  # the row's position at each view index (< 0: none)
        self.src = torch.where(q >= cached[:, None], view, q.clamp(min=0))  # index into cat([cached line, new])
        self.view_mask = (q >= 0).long()
        self.valid = new.bool()
        self.positions = torch.where(self.valid, position_ids.long(), torch.zeros_like(position_ids).long())
        self.updated = [None] * len(self.layers)
        self.written: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(self.layers)

    def write(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        out = []
        for j, new in enumerate((key, value)):
            held = self.lines[layer_idx, j].to(new.dtype)  # [batch, heads, prefix, dim]
            line = torch.cat([held, new], dim=2)
            idx = self.src[:, None, :, None].expand(-1, new.shape[1], -1, new.shape[3])
            out.append(line.gather(2, idx))
        self.written[layer_idx] = (key, value)
        return out[0], out[1]

    def new_cache(self, prompt_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The pool with every valid new token written at its position through the table: one scatter."""
        pool, size = self.pool, self.block_size
        layers = torch.arange(pool.shape[0], device=pool.device)[:, None, None, None, None]
        pair = torch.arange(2, device=pool.device)[None, :, None, None, None]
        heads = torch.arange(pool.shape[3], device=pool.device)[None, None, None, :, None]
        blocks = self.table.gather(1, self.positions // size)
        blocks = torch.where(self.valid, blocks, torch.full_like(blocks, pool.shape[2] - 1))
        offsets = torch.where(self.valid, self.positions % size, torch.zeros_like(self.positions))
        written = torch.stack([torch.stack([k, v]) for k, v in self.written])  # type: ignore[misc]
        keep = self.valid[None, None, :, None, :, None]
        written = torch.where(keep, written, torch.zeros_like(written))  # [layers, 2, batch, heads, seq, dim]
        index = (layers, pair, blocks[None, None, :, None, :], heads, offsets[None, None, :, None, :])
        return torch.index_put(pool, index, written.to(pool.dtype))


def _block_prefix(self: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                  block_table: torch.Tensor, prefix_mask: torch.Tensor, sampled: tuple[torch.Tensor, ...],
                  kv: torch.Tensor) -> dict[str, torch.Tensor]:
    """Prefill of new tokens after a cached prefix (prefix_caching = True): the rows' cached positions read from their
    blocks, only the new tokens computed and written; logits (or the sampled token) at the last new token."""
    if int(prefix_mask.shape[1]) >= self._nb_max_seq:
        raise ValueError(f"prefix bucket: prefix={int(prefix_mask.shape[1])} must be below max_seq "
                         f"({self._nb_max_seq}): a prefix call reads at most the positions before the last")
    cache = PrefixKV(self.config, kv, block_table, prefix_mask, attention_mask, position_ids)
    out = _model_forward(self, input_ids=input_ids.long(), attention_mask=cache.view_mask,
                         position_ids=position_ids.long(), past_key_values=cache)
    return _serving_outputs(out.logits[:, -1].float(), cache.new_cache(), sampled, self._nb_logits)


def _block_prefill(self: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                   block_table: torch.Tensor, sampled: tuple[torch.Tensor, ...], kv: torch.Tensor
                   ) -> dict[str, torch.Tensor]:
    """Prefill of left-padded prompts into the blocks each row's table names (as _prefill into lines)."""
    cache = BlockKV(self.config, kv, block_table, self._nb_max_seq, None)
    mask = attention_mask.long()
    out = _model_forward(self, input_ids=input_ids.long(), attention_mask=mask, position_ids=position_ids.long(),
                         past_key_values=cache)
    return _serving_outputs(out.logits[:, -1].float(), cache.new_cache(mask), sampled, self._nb_logits)


def _block_decode(self: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                  block_table: torch.Tensor, sampled: tuple[torch.Tensor, ...], kv: torch.Tensor
                  ) -> dict[str, torch.Tensor]:
    """One token per row at position position_ids[b], attending to the positions attention_mask [batch, max_seq]
    names (the written one included), its keys/values read from and written to the row's blocks."""
    positions = position_ids[:, 0]
    cache = BlockKV(self.config, kv, block_table, self._nb_max_seq, positions)
    view_mask = attention_mask.long().gather(1, cache.view)
    out = _model_forward(self, input_ids=input_ids.long(), attention_mask=view_mask,
                         position_ids=position_ids.long(), past_key_values=cache)
    return _serving_outputs(out.logits[:, -1].float(), cache.new_cache(), sampled, self._nb_logits)


def _block_serving_context_forward(self: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                   position_ids: torch.Tensor, block_table: torch.Tensor, kv: torch.Tensor
                                   ) -> dict[str, torch.Tensor]:
    return _block_prefill(self, input_ids, attention_mask, position_ids, block_table, (), kv)


def _block_serving_token_forward(self: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                 position_ids: torch.Tensor, block_table: torch.Tensor, kv: torch.Tensor
                                 ) -> dict[str, torch.Tensor]:
    return _block_decode(self, input_ids, attention_mask, position_ids, block_table, (), kv)


def _block_sampling_context_forward(self: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                    position_ids: torch.Tensor, block_table: torch.Tensor,
                                    sampling_params: torch.Tensor, rand: torch.Tensor, kv: torch.Tensor
                                    ) -> dict[str, torch.Tensor]:
    return _block_prefill(self, input_ids, attention_mask, position_ids, block_table, (sampling_params, rand), kv)


def _block_sampling_token_forward(self: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                  position_ids: torch.Tensor, block_table: torch.Tensor,
                                  sampling_params: torch.Tensor, rand: torch.Tensor, kv: torch.Tensor
                                  ) -> dict[str, torch.Tensor]:
    return _block_decode(self, input_ids, attention_mask, position_ids, block_table, (sampling_params, rand), kv)


def _block_serving_prefix_forward(self: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                  position_ids: torch.Tensor, block_table: torch.Tensor, prefix_mask: torch.Tensor,
                                  kv: torch.Tensor) -> dict[str, torch.Tensor]:
    return _block_prefix(self, input_ids, attention_mask, position_ids, block_table, prefix_mask, (), kv)


def _block_sampling_prefix_forward(self: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                   position_ids: torch.Tensor, block_table: torch.Tensor, prefix_mask: torch.Tensor,
                                   sampling_params: torch.Tensor, rand: torch.Tensor, kv: torch.Tensor
                                   ) -> dict[str, torch.Tensor]:
    return _block_prefix(self, input_ids, attention_mask, position_ids, block_table, prefix_mask,
                         (sampling_params, rand), kv)


def block_serving_context(config: dict[str, Any]) -> nn.Module:
    """kv_layout = "block" context graph: logits and the block pool (no sampling)."""
    return _serving(config, _block_serving_context_forward, "BlockServingContextGraph", True)


def block_serving_token(config: dict[str, Any]) -> nn.Module:
    """kv_layout = "block" token graph: logits and the block pool (no sampling)."""
    return _serving(config, _block_serving_token_forward, "BlockServingTokenGraph", True)


def block_sampling_context(config: dict[str, Any]) -> nn.Module:
    """kv_layout = "block" + on_device_sampling context graph: tokens and the block pool."""
    return _serving(config, _block_sampling_context_forward, "BlockSamplingContextGraph", False)


def block_sampling_token(config: dict[str, Any]) -> nn.Module:
    """kv_layout = "block" + on_device_sampling token graph: tokens and the block pool."""
    return _serving(config, _block_sampling_token_forward, "BlockSamplingTokenGraph", False)


def block_sampling_logits_context(config: dict[str, Any]) -> nn.Module:
    """kv_layout = "block" + on_device_sampling with output_logits: tokens, logits and the block pool."""
    return _serving(config, _block_sampling_context_forward, "BlockSamplingLogitsContextGraph", True)


def block_sampling_logits_token(config: dict[str, Any]) -> nn.Module:
    """kv_layout = "block" + on_device_sampling with output_logits: tokens, logits and the block pool."""
    return _serving(config, _block_sampling_token_forward, "BlockSamplingLogitsTokenGraph", True)


def block_serving_prefix(config: dict[str, Any]) -> nn.Module:
    """kv_layout = "block" + prefix_caching prefix graph (new tokens after a cached prefix): logits and the pool."""
    return _serving(config, _block_serving_prefix_forward, "BlockServingPrefixGraph", True)


def block_sampling_prefix(config: dict[str, Any]) -> nn.Module:
    """... with on_device_sampling: tokens and the pool."""
    return _serving(config, _block_sampling_prefix_forward, "BlockSamplingPrefixGraph", False)


def block_sampling_logits_prefix(config: dict[str, Any]) -> nn.Module:
    """... with on_device_sampling and output_logits: tokens, logits and the pool."""
    return _serving(config, _block_sampling_prefix_forward, "BlockSamplingLogitsPrefixGraph", True)
