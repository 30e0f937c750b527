"""The continuous-batching engine over a block KV cache (hf_causal_lm(kv_layout = "block", ...), docs/llm.md "Block
KV cache"): a BlockManager hands out the pool's blocks (free list, reference counts, full prompt blocks shared by a
content hash chain, least recently used eviction of cached blocks nobody references) and the BlockEngine gives the
graphs each row's block table instead of its cache line. torch only.

A request reserves at admission every block it can need (prompt + max_new_tokens - 1 positions), so a running
request never runs out of blocks: admission is by free blocks (FIFO; the head of the queue waits until blocks free
up), and there is no preemption. Prefix caching: the full blocks of a prompt are keyed by the hash chain of their
tokens; a later prompt starting with the same full blocks references them (prefix_hits counts them) and its context
graph is handed the scratch block in their place, so the shared blocks are never rewritten. The prefill still
computes the whole prompt (no context buckets over a cached prefix yet): prefix caching saves KV memory and the
writes, not prefill compute."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from neuronbuild.runtime.engine import CONTEXT, Engine, Request
from neuronbuild.runtime.router import NoBucketFits


class BlockLayoutMismatch(ValueError):
    """A host configuration asking for another block layout than the one the graphs were compiled for."""


def check_num_blocks(lm: Any, num_blocks: int | None) -> None:
    """engine(num_blocks=M): M must be the compiled block count (the pool's shape is baked into the graphs)."""
    if num_blocks is None:
        return
    layout = lm.block_layout
    if layout is None:
        raise BlockLayoutMismatch(f"{lm.label}: num_blocks={num_blocks} requested, but its graphs were compiled "
                                  "without kv_layout = \"block\" (a contiguous cache of sequence lines)")
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks != layout["num_blocks"]:
        raise BlockLayoutMismatch(f"{lm.label}: num_blocks={num_blocks!r} requested, but its graphs were compiled "
                                  f"for num_blocks={layout['num_blocks']} (block_size {layout['block_size']}); the "
                                  "block count is part of the graphs' shapes: rebuild with num_blocks = "
                                  f"{num_blocks!r} or serve with {layout['num_blocks']}")


class BlockManager:
    """The pool's blocks 0..num_blocks-1 (block num_blocks is the graphs' scratch block, never handed out)."""

    def __init__(self, num_blocks: int, block_size: int, order: Sequence[int] | None = None) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        free = list(range(num_blocks)) if order is None else [int(b) for b in order]
        if sorted(free) != list(range(num_blocks)):
            raise ValueError(f"block_order must be a permutation of 0..{num_blocks - 1}")
        self.free: list[int] = free[::-1]  # popped from the end: handed out in `order`
        self.refs: dict[int, int] = {}  # block -> references (blocks in use)
        self.by_hash: dict[int, int] = {}  # content hash chain of a full prompt block -> block
        self.hash_of: dict[int, int] = {}
        self.cached: OrderedDict[int, None] = OrderedDict()  # hashed blocks nobody references, oldest first
        self.prefix_queries = 0  # full prompt blocks looked up
        self.prefix_hits = 0  # ... found cached (shared, not written again)

    @property
    def available(self) -> int:
        return len(self.free) + len(self.cached)

    @property
    def in_use(self) -> int:
        return len(self.refs)

    def chain(self, prompt: Sequence[int]) -> list[int]:
        """The hash chain of the prompt's full blocks: block i's key covers every token up to its end."""
        keys, h, size = [], 0, self.block_size
        for i in range(len(prompt) // size):
            h = hash((h, tuple(prompt[i * size:(i + 1) * size])))
            keys.append(h)
        return keys

    def _take(self) -> int:
        if self.free:
            return self.free.pop()
        block, _ = self.cached.popitem(last=False)  # evict the least recently used cached block
        del self.by_hash[self.hash_of.pop(block)]
        return block

    def _ref(self, block: int) -> None:
        self.cached.pop(block, None)
        self.refs[block] = self.refs.get(block, 0) + 1

    def allocate(self, prompt: Sequence[int], positions: int) -> tuple[list[int], int] | None:
        """Blocks for `positions` positions of a request whose prompt is `prompt`: (its blocks in order, how many
        leading ones were cached), or None when the pool cannot hold it now (nothing taken)."""
        need = -(-positions // self.block_size)
        keys = self.chain(prompt)[:need]
        hits: list[int] = []
        for k in keys:
            b = self.by_hash.get(k)
            if b is None:
                break
            hits.append(b)
        fresh = need - len(hits)
        if fresh > len(self.free) + len([b for b in self.cached if b not in hits]):
            return None
        for b in hits:
            self._ref(b)
        blocks = list(hits)
        for _ in range(fresh):
            b = self._take()
            self._ref(b)
            blocks.append(b)
        for i in range(len(hits), len(keys)):  # this request writes these full prompt blocks: later prompts share them
            old = self.by_hash.get(keys[i])
            if old is not None:  # (a cached block whose predecessor was evicted: unreachable, freed)
                del self.hash_of[old]
                if old in self.cached:
                    del self.cached[old]
                    self.free.insert(0, old)
            self.by_hash[keys[i]] = blocks[i]
            self.hash_of[blocks[i]] = keys[i]
        self.prefix_queries += len(keys)
        self.prefix_hits += len(hits)
        return blocks, len(hits)

    def release(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                del self.refs[b]
                if b in self.hash_of:
                    self.cached[b] = None  # kept for a later prompt with the same prefix, evicted last-used last
                else:
                    self.free.append(b)


class BlockEngine(Engine):
    """The Engine over block-layout graphs: the same scheduling (admission FIFO, smallest fitting buckets, one decode
    per step), admission also by free blocks, rows given their block tables."""

    def __init__(self, lm: Any, seed: int = 0, block_order: Sequence[int] | None = None) -> None:
        super().__init__(lm, seed)
        layout = lm.block_layout
        self.block_size: int = int(layout["block_size"])
        self.blocks_per_seq: int = int(layout["blocks_per_seq"])
        self.scratch: int = int(layout["num_blocks"])  # the pool's last block: padding rows and unused entries
        self.blocks = BlockManager(int(layout["num_blocks"]), self.block_size, block_order)
        self._held: dict[int, tuple[list[int], int]] = {}  # rid -> (blocks, cached leading blocks)

    def _needs(self, r: Request) -> int:
        return len(r.prompt) + r.max_new_tokens - 1

    def add(self, prompt_ids: Sequence[int], max_new_tokens: int = 16, temperature: float = 0.0, top_k: int = 0,
            top_p: float = 1.0, seed: int | None = None, eos_token_id: int | None | str = "config") -> int:
        rid = super().add(prompt_ids, max_new_tokens, temperature, top_k, top_p, seed, eos_token_id)
        r = self.waiting[-1]
        need = -(-self._needs(r) // self.block_size)
        if need > self.blocks.num_blocks:
            self.waiting.pop()
            raise NoBucketFits(f"{self.label}: a prompt of {len(r.prompt)} tokens + {max_new_tokens} new tokens need "
                               f"{need} blocks of {self.block_size}; the pool holds num_blocks="
                               f"{self.blocks.num_blocks}")
        return rid

    def step(self) -> dict[int, list[int]]:
        got: dict[int, list[int]] = {}
        with torch.inference_mode():
            while self.waiting and self.free:
                reqs = self._admissible()
                if not reqs:
                    break  # the queue's head waits for blocks
                self._prefill(reqs, got)
            rows = [self.active[line] for line in sorted(self.active)]
            for i in range(0, len(rows), self._largest):
                self._decode(rows[i:i + self._largest], got)
        return got

    def _admissible(self) -> list[Request]:
        """The longest FIFO prefix of the waiting requests that free lines, free blocks and a context bucket hold;
        their blocks are taken here."""
        n = min(len(self.waiting), len(self.free))
        while n > 1 and self._context_bucket(list(self.waiting)[:n]) is None:
            n -= 1
        taken: list[Request] = []
        for r in list(self.waiting)[:n]:
            got = self.blocks.allocate(r.prompt, self._needs(r))
            if got is None:
                break
            self._held[r.rid] = got
            taken.append(r)
        for _ in taken:
            self.waiting.popleft()
        return taken

    def _rows_input(self, family: str, rows: Sequence[Request], batch: int) -> torch.Tensor:
        """block_table int32 [batch, max_seq / block_size]: each row's blocks in position order, then the scratch
        block; a context graph gets the scratch block in place of cached prefix blocks (written by an earlier
        request, shared, never rewritten)."""
        table = torch.full((batch, self.blocks_per_seq), self.scratch, dtype=torch.int32)
        for b, r in enumerate(rows):
            blocks, cached = self._held[r.rid]
            table[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            if family == CONTEXT:
                table[b, :cached] = self.scratch
        return table

    def _finish(self, r: Request) -> None:
        super()._finish(r)
        blocks, _cached = self._held.pop(r.rid)
        self.blocks.release(blocks)

    def counters(self) -> dict[str, int]:
        """Blocks in use, free, cached (unreferenced, kept for prefix hits) and the prefix lookups and hits."""
        m = self.blocks
        return {"blocks_in_use": m.in_use, "blocks_free": len(m.free), "blocks_cached": len(m.cached),
                "prefix_queries": m.prefix_queries, "prefix_hits": m.prefix_hits}
