"""`neuronbuild validate` for hf_causal_lm's block-KV graphs (kv_layout = "block", docs/llm.md "Block KV cache"): the
inputs of a context, token or prefix graph over a pool whose blocks are handed out to the rows in a seeded random
order, the cached positions written into them from the wrapper's eager context graph, and transformers' logits for the
same sequences (toolchains/validate.py compares them as for the other hf_causal_lm graphs)."""

from __future__ import annotations

from typing import Any

BLOCK_ENTRY = "neuronbuild.toolchains.hf_block_kv:"


def is_block(model_spec: Any) -> bool:
    return str(model_spec.get("entry") or "").startswith(BLOCK_ENTRY)


def _tables(ref: Any, gen: Any, need: list[int], required: bool = True) -> tuple[Any, int]:
    """block_table int32 [batch, max_seq / B]: rows take `need[b]` blocks each from a seeded permutation of the pool,
    in row order, while the pool holds them; the rest (and every unused entry) name the scratch block. Returns the
    table and how many rows (the first ones) hold their blocks (`required`: at least one)."""
    import torch

    num_blocks, size = ref.kv_dims[2] - 1, ref.kv_dims[4]
    table = torch.full((len(need), ref.max_seq // size), num_blocks, dtype=torch.int32)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    taken = held = 0
    for b, k in enumerate(need):
        if taken + k > num_blocks:
            break
        table[b, :k] = torch.tensor(perm[taken:taken + k], dtype=torch.int32)
        taken, held = taken + k, b + 1
    if not held and required:
        raise ValueError(f"the pool's {num_blocks} blocks of {size} hold no row of this bucket")
    return table, held


def _pool(ref: Any, table: Any, held: int, kv: Any, width: int, cached: list[int]) -> Any:
    """The pool with row b's first cached[b] positions (its prompt, left-padded to `width` in the eager context
    graph's kv [layers, 2, batch, kv_heads, width, head_dim]) written at positions 0.. of its blocks."""
    import torch

    pool = torch.zeros(ref.kv_dims, dtype=getattr(torch, ref.lines_dtype))
    size = ref.kv_dims[4]
    for b in range(held):
        n = cached[b]
        nblk = -(-n // size)
        line = torch.zeros((*kv.shape[:2], kv.shape[3], nblk * size, kv.shape[5]), dtype=pool.dtype)
        line[:, :, :, :n] = kv[:, :, b, :, width - n:width]
        blocks = line.reshape(*line.shape[:3], nblk, size, line.shape[-1]).permute(0, 1, 3, 2, 4, 5)
        pool[:, :, table[b, :nblk].long()] = blocks
    return pool


def context_case(ref: Any, gen: Any, batch: int, seq: int) -> tuple[tuple[Any, ...], Any]:
    """Left-padded prompts written into shuffled blocks; transformers' last logits of the same prompts."""
    ids, mask = ref.prompts(gen, batch, seq)
    size = ref.kv_dims[4]
    table, _held = _tables(ref, gen, [-(-int(n) // size) for n in mask.sum(-1).tolist()], required=False)
    import torch

    args = (ids.int(), mask.int(), ref.positions(mask).int(), table, *ref.greedy_sampling(batch),
            torch.zeros(ref.kv_dims, dtype=getattr(torch, ref.lines_dtype)))
    return args, ref.context_logits(ids, mask)


def token_case(ref: Any, gen: Any, batch: int) -> tuple[tuple[Any, ...], Any]:
    """After a prefill of up to max_seq // 2 positions (fewer in a smaller pool) into shuffled blocks, one token per row; transformers' next
    logits after its own prefill of the same prompts (rows the pool cannot hold read the scratch block: left out)."""
    import torch

    width = max(1, min(ref.max_seq // 2, (ref.kv_dims[2] - 1) * ref.kv_dims[4] - 1))  # (row 0 fits the pool)
    ids, mask = ref.prompts(gen, batch, width)
    nxt = torch.randint(0, ref.vocab, (batch, 1), generator=gen, dtype=torch.int64)
    pos = mask.sum(-1, keepdim=True)
    size = ref.kv_dims[4]
    table, held = _tables(ref, gen, [int(n) // size + 1 for n in pos[:, 0].tolist()])
    kv = ref.context(ids, mask)["kv"]
    pool = _pool(ref, table, held, kv, width, pos[:, 0].tolist())
    attend = (torch.arange(ref.max_seq)[None, :] <= pos).to(torch.int32)
    args = (nxt.int(), attend, pos.int(), table, *ref.greedy_sampling(batch), pool)
    pre = ref.model(input_ids=ids, attention_mask=mask, position_ids=ref.positions(mask), use_cache=True,
                    past_key_values=ref.cache())
    full = torch.cat([mask, torch.ones((batch, 1), dtype=torch.int64)], dim=1)
    out = ref.model(input_ids=nxt, attention_mask=full, position_ids=pos, past_key_values=pre.past_key_values,
                    use_cache=True).logits[:, -1]
    return args, out[:held]


def prefix_case(ref: Any, gen: Any, batch: int, seq: int, prefix: int) -> tuple[tuple[Any, ...], Any]:
    """Row b: c cached positions (1..prefix; row 0 the most a max_seq holds after `seq` new ones) in shuffled blocks,
    then n new tokens (1..seq; row 0 seq); transformers' last logits of the row's c + n tokens."""
    import torch

    most = max(1, min(prefix, ref.max_seq - seq, (ref.kv_dims[2] - 1) * ref.kv_dims[4] - seq))
    cached = [most] + torch.randint(1, most + 1, (max(batch - 1, 0),), generator=gen).tolist()
    new = [seq] + torch.randint(1, seq + 1, (max(batch - 1, 0),), generator=gen).tolist()
    tokens = torch.randint(0, ref.vocab, (batch, most + seq), generator=gen, dtype=torch.int64)
    size = ref.kv_dims[4]
    table, held = _tables(ref, gen, [-(-(c + n) // size) for c, n in zip(cached, new, strict=True)])
    head = torch.zeros((batch, most), dtype=torch.int64)
    head_mask = torch.zeros((batch, most), dtype=torch.int64)
    ids = torch.zeros((batch, seq), dtype=torch.int64)
    mask = torch.zeros((batch, seq), dtype=torch.int64)
    pos = torch.zeros((batch, seq), dtype=torch.int64)
    whole = torch.zeros((batch, most + seq), dtype=torch.int64)
    whole_mask = torch.zeros((batch, most + seq), dtype=torch.int64)
    pmask = torch.zeros((batch, prefix), dtype=torch.int32)
    for b, (c, n) in enumerate(zip(cached, new, strict=True)):
        head[b, most - c:], head_mask[b, most - c:] = tokens[b, :c], 1
        ids[b, seq - n:], mask[b, seq - n:] = tokens[b, c:c + n], 1
        pos[b, seq - n:] = torch.arange(c, c + n)
        whole[b, most + seq - c - n:], whole_mask[b, most + seq - c - n:] = tokens[b, :c + n], 1
        pmask[b, :c] = 1
    pool = _pool(ref, table, held, ref.context(head, head_mask)["kv"], most, cached)
    args = (ids.int(), mask.int(), pos.int(), table, pmask, *ref.greedy_sampling(batch), pool)
    return args, ref.context_logits(whole, whole_mask)[:held]
