"""The continuous-batching engine over a block KV cache (hf_causal_lm(kv_layout = "block", ...), docs/llm.md "Block
KV cache"): a BlockManager hands out the pool's blocks (free list, reference counts, full blocks shared by a content
hash chain, least recently used eviction of cached blocks nobody references) and the BlockEngine gives the graphs
each row's block table instead of its cache line. torch only.

Admission (FIFO, the head waits) takes the blocks a request's prefill writes; a running request takes one more block
when its next position starts one, and when the pool has none left the most recently admitted request is preempted:
its blocks released (its full prompt blocks stay cached), queued first, and later prefilled again from its prompt
and its tokens so far (recompute), so its tokens are unchanged. Prefix caching: the full blocks of a prompt are keyed
by the hash chain of their tokens; a later prompt starting with the same full blocks references them (prefix_hits).
With prefix graphs (hf_causal_lm prefix_caching = True) its prefill computes only the tokens after them (a prefix
call reading them through the block table), and a prompt longer than the longest context bucket is prefilled in
chunks (a context call, then prefix calls each reading what the previous ones wrote). Prefills run in rounds, one per
step: a chunk of every request prefilling, batched over them (as many rows per call as a bucket holds), then the
other requests decode, so a long prompt's chunks alternate with their decode steps. Without prefix graphs a
prefix hit still saves the blocks: the context call recomputes the prompt and writes the scratch block in place of
the shared ones."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from neuronbuild.runtime.block_layout import BlockLayoutMismatch
from neuronbuild.runtime.engine import CONTEXT, Engine, Request, left_padded
from neuronbuild.runtime.router import NoBucketFits

PREFIX = "prefix"  # the prefix graph family (hf_causal_lm prefix_caching = True)
__all__ = ["PREFIX", "BlockEngine", "BlockLayoutMismatch", "BlockManager", "check_num_blocks"]


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

    def lookup(self, seq: Sequence[int]) -> int:
        """How many leading full blocks of `seq` are cached. The block holding its last token is never shared: a
        prefill always computes at least that token (its logits are the request's next token), and shared blocks are
        never rewritten."""
        n = 0
        for k in self.chain(seq[:-1]):
            if k not in self.by_hash:
                break
            n += 1
        return n

    def allocate(self, prompt: Sequence[int], positions: int, max_hits: int | None = None
                 ) -> tuple[list[int], int] | None:
        """Blocks for `positions` positions of a request whose prefill sequence is `prompt`: (its blocks in order, how
        many leading ones were cached: at most `max_hits`), or None when the pool cannot hold it now (nothing
        taken). The full blocks it writes are registered under their hash chain for later prompts."""
        need = -(-positions // self.block_size)
        keys = self.chain(prompt)[:need]
        looked = self.chain(prompt[:-1])[:need]
        hits: list[int] = []
        for k in looked[: len(looked) if max_hits is None else max_hits]:
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
        for i in range(len(hits), len(keys)):  # this request writes these full blocks: later prompts share them
            old = self.by_hash.get(keys[i])
            if old is not None:  # (a cached block not used here: its predecessor evicted, or past the hit cap)
                del self.hash_of[old]
                if old in self.cached:
                    del self.cached[old]
                    self.free.insert(0, old)
            self.by_hash[keys[i]] = blocks[i]
            self.hash_of[blocks[i]] = keys[i]
        self.prefix_queries += len(looked)
        self.prefix_hits += len(hits)
        return blocks, len(hits)

    def grow(self) -> int | None:
        """One more block for a running request (a free one, else the least recently used cached one), or None
        when every block is referenced."""
        if not self.free and not self.cached:
            return None
        b = self._take()
        self._ref(b)
        return b

    def release(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                del self.refs[b]
                if b in self.hash_of:
                    self.cached[b] = None  # kept for a later prompt with the same prefix, evicted last-used last
                else:
                    self.free.append(b)


@dataclass
class _Prefill:
    """One admitted request's prefill in progress: its sequence (prompt, and for a recompute its tokens so far) and
    the position its next chunk starts at (after the cached blocks it shares, then after its earlier chunks)."""

    r: Request
    seq: list[int]
    start: int


class BlockEngine(Engine):
    """The Engine over block-layout graphs: the same scheduling (admission FIFO, smallest fitting buckets, one decode
    per step), admission also by free blocks, rows given their block tables; with prefix graphs, prefills that skip
    a cached prefix and prompts longer than the largest context bucket prefilled in chunks, a round of chunks per
    step; a request that needs a block when none is left preempts the most recently admitted one that is not
    prefilling (recomputed later)."""

    def __init__(self, lm: Any, seed: int = 0, block_order: Sequence[int] | None = None) -> None:
        super().__init__(lm, seed)
        layout = lm.block_layout
        self.block_size: int = int(layout["block_size"])
        self.blocks_per_seq: int = int(layout["blocks_per_seq"])
        self.scratch: int = int(layout["num_blocks"])  # the pool's last block: padding rows and unused entries
        self.blocks = BlockManager(int(layout["num_blocks"]), self.block_size, block_order)
        self._held: dict[int, list[int]] = {}  # rid -> its blocks, in position order
        self._skip: dict[int, int] = {}  # rid -> cached leading blocks its context call must not rewrite
        self._start: dict[int, int] = {}  # rid -> cached leading blocks its prefix call reads (prefix graphs)
        self._admitted: dict[int, int] = {}  # rid -> admission count (preemption takes the latest)
        self._jobs: list[_Prefill] = []  # prefills in progress, in admission order (a chunk each per step)
        self._unwritten: dict[int, int] = {}  # block a prefill in progress is still to write -> its request
        self._admissions = 0
        self._ctx_longest = max(b["seq"] for b in self._ctx_buckets.values())
        self._prefix: Any = lm.model.family(PREFIX) if PREFIX in lm.model.families else None
        self.prefix_buckets: dict[str, dict[str, int]] = dict(self._prefix.buckets) if self._prefix else {}
        self._prefix_out: list[str] = []
        if self._prefix is not None:
            g = self._prefix.graph(next(iter(self.prefix_buckets)))
            self._prefix_out = [str(o["name"]) for o in g.outputs]
            if lm.strict:
                bad = [self._prefix.graph(n).describe() for n in self.prefix_buckets
                       if self._prefix.bucket_fn(n) is None]
                if bad:
                    raise RuntimeError(f"strict mode: {lm.label}: prefix graph(s) cannot run here: {', '.join(bad)}")
        self.preemptions = 0
        self.prefill_tokens = 0  # prompt tokens computed by context and prefix calls (recomputed ones included)
        self.cached_tokens = 0  # prompt tokens read from cached blocks instead of computed

    # -- requests ------------------------------------------------------------------------------------------------

    def _needs(self, r: Request) -> int:
        return len(r.prompt) + r.max_new_tokens - 1

    def _check_prompt(self, prompt: Sequence[int]) -> None:
        if self._plan(0, len(prompt)) is None:
            pfx = "; ".join(f"[{', '.join(f'{k}={v}' for k, v in b.items())}]" for b in self.prefix_buckets.values())
            raise NoBucketFits(f"{self.label}: a prompt of {len(prompt)} tokens fits no context bucket (the longest "
                               f"holds seq={self._ctx_longest}) and "
                               + (f"its prefix graphs ({pfx}) cannot prefill the rest in chunks" if pfx else
                                  "there are no prefix graphs to prefill it in chunks (hf_causal_lm prefix_caching)"))

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

    # -- prefill plans -------------------------------------------------------------------------------------------

    def _plan(self, start: int, end: int) -> list[tuple[str, str, int]] | None:
        """The calls prefilling positions start..end-1 of one request: (family, bucket, end of the chunk) each; the
        first chunk from position 0 is a context call (the longest bucket's seq when the prompt is longer), every
        later one a prefix call whose bucket reads at least the positions before it. None: no graphs can."""
        out: list[tuple[str, str, int]] = []
        while start < end:
            rest = end - start
            if start == 0:
                seq = min(rest, self._ctx_longest)
                out.append((CONTEXT, self.lm.pick(CONTEXT, self._ctx_buckets, {"batch": 1, "seq": seq}), seq))
                start = seq
                continue
            fits = {n: b for n, b in self.prefix_buckets.items() if b["prefix"] >= start}
            if not fits:
                return None
            seq = min(rest, max(b["seq"] for b in fits.values()))
            out.append((PREFIX, self.lm.pick(PREFIX, fits, {"batch": 1, "seq": seq, "prefix": start}), start + seq))
            start += seq
        return out

    def _recomputable(self, r: Request) -> bool:
        return self._plan(0, len(r.prompt) + len(r.tokens)) is not None

    # -- scheduling ----------------------------------------------------------------------------------------------

    def step(self) -> dict[int, list[int]]:
        got: dict[int, list[int]] = {}
        with torch.inference_mode():
            admitted = False
            while self.waiting and self.free:
                reqs = self._admissible()
                if not reqs:
                    break  # the queue's head waits for blocks
                admitted = True
                self._admit(reqs)
            if self._jobs:
                admitted = True
                self._prefill_round(got)
            prefilling = {j.r.rid for j in self._jobs}
            rows = [self.active[line] for line in sorted(self.active) if self.active[line].rid not in prefilling]
            ready = self._grow(rows)
            if rows and not ready and not admitted:
                raise RuntimeError(f"{self.label}: the block pool is exhausted and no running request can be "
                                   "preempted (recomputing one needs prefix graphs: hf_causal_lm prefix_caching)")
            for i in range(0, len(ready), self._largest):
                self._decode(ready[i:i + self._largest], got)
        return got

    def _admissible(self) -> list[Request]:
        """The FIFO head of the waiting requests that free lines and free blocks hold, each with the blocks its
        prefill writes (the prompt, or for a preempted request its prompt and tokens so far: recomputed), the
        cached leading ones shared: with prefix graphs only as many as a prefix call can follow."""
        taken: list[Request] = []
        while self.waiting and len(taken) < len(self.free):
            r = self.waiting[0]
            seq = r.prompt + r.tokens
            hits = self.blocks.lookup(seq)
            if self._prefix is not None:
                while hits and self._plan(hits * self.block_size, len(seq)) is None:
                    hits -= 1
            got = self.blocks.allocate(seq, len(seq), max_hits=hits)
            if got is None:
                break
            self._held[r.rid], cached = got
            self._admissions += 1
            self._admitted[r.rid] = self._admissions
            self.waiting.popleft()
            taken.append(r)
            if self._prefix is None:
                self._skip[r.rid] = cached  # recomputed by the context call, not rewritten (scratch in their place)
            else:
                self._start[r.rid] = cached  # its prefill starts after them
        return taken

    def _admit(self, reqs: list[Request]) -> None:
        """The admitted requests take their lines; their prefills start at the next round."""
        for r in reqs:
            cached = self._start.pop(r.rid, 0)
            r.line = self.free.pop(0)
            self.active[r.line] = r
            self.cached_tokens += cached * self.block_size
            job = _Prefill(r, r.prompt + r.tokens, cached * self.block_size)
            self._jobs.append(job)
            for b in self._held[r.rid][cached:]:
                self._unwritten[b] = r.rid

    def _prefill_round(self, got: dict[int, list[int]]) -> None:
        """One chunk of every prefill in progress whose reads are written (one round per step, so that the chunks of
        a long prompt alternate with the other requests' decode steps): first the context chunks (whole prompts; the
        first chunk of a prompt longer than the longest context bucket) in calls batched as one context bucket holds
        them, then the prefix chunks (after a cached prefix, or after the request's earlier chunks) of the others in
        calls batched as one prefix bucket holds them, in admission order. A request sharing full blocks that
        another request has yet to write (a prefix longer than that one's first chunk) waits for a later round; a
        request is not preempted while its prefill is in progress."""
        jobs, unwritten = self._jobs, self._unwritten
        first = [j for j in jobs if j.start == 0]
        started = {j.r.rid for j in first}
        for name, ends in self._groups(first, CONTEXT):
            self._context_call([j.r for j, _stop in ends], [j.seq[:stop] for j, stop in ends], name, got,
                               emit=[stop == len(j.seq) for j, stop in ends])
            self._written(ends, unwritten)
        ready = [j for j in jobs if j.r.rid not in started and not any(
            unwritten.get(b, j.r.rid) != j.r.rid for b in self._held[j.r.rid][: -(-j.start // self.block_size)])]
        for name, ends in self._groups(ready, PREFIX):
            self._prefix_call(ends, name, got)
            self._written(ends, unwritten)
        self._jobs = [j for j in jobs if j.start < len(j.seq)]

    def _groups(self, jobs: list[_Prefill], family: str) -> list[tuple[str, list[tuple[_Prefill, int]]]]:
        """The calls running one chunk of each job, in order: (bucket, [(job, end of its chunk)]), as many rows per
        call as one bucket of the family holds (chunks as _plan cuts them: a context chunk is the prompt or the
        longest context bucket's seq, a prefix chunk the largest prefix bucket's seq that reads its start)."""
        out: list[tuple[str, list[tuple[_Prefill, int]]]] = []
        ends = [(j, stop) for j in jobs for _f, _n, stop in [self._plan(j.start, len(j.seq))[0]]]  # type: ignore[index]
        buckets = self._ctx_buckets if family == CONTEXT else self.prefix_buckets
        while ends:
            n = len(ends)
            while True:
                want = {"batch": n, "seq": max(stop - j.start for j, stop in ends[:n])}
                if family == PREFIX:
                    want["prefix"] = max(j.start for j, _stop in ends[:n])
                try:
                    name = self.lm.pick(family, buckets, want)
                    break
                except NoBucketFits:
                    if n == 1:
                        raise
                    n -= 1
            out.append((name, ends[:n]))
            ends = ends[n:]
        return out

    def _written(self, ends: list[tuple[_Prefill, int]], unwritten: dict[int, int]) -> None:
        """After a call: each job's chunk written (its start moved on); the blocks it filled are readable by others."""
        for j, stop in ends:
            blocks = self._held[j.r.rid]
            for i in range(j.start // self.block_size, -(-stop // self.block_size)):
                if (i + 1) * self.block_size <= stop or stop == len(j.seq):
                    unwritten.pop(blocks[i], None)
            j.start = stop
    def _context_call(self, reqs: list[Request], seqs: list[list[int]], name: str, got: dict[int, list[int]],
                      emit: list[bool]) -> None:
        bucket = self._ctx_buckets[name]
        self._last = None
        cb = bucket["batch"]
        ids, mask, positions = left_padded(seqs, cb, bucket["seq"], self.lm.pad_token_id)
        table = self._rows_input(CONTEXT, reqs, cb)
        for r in reqs:
            self._skip.pop(r.rid, None)
        self.prefill_tokens += sum(len(s) for s in seqs)
        self._emit(CONTEXT, name, [ids, mask, positions, table, *self._sampling_inputs(reqs, cb)], reqs, got, emit)

    def _prefix_call(self, ends: list[tuple[_Prefill, int]], name: str, got: dict[int, list[int]]) -> None:
        """Positions start..stop-1 of each job's sequence, after the start positions already in its blocks, one row
        per job (padding rows: new tokens after nothing, written to the scratch block)."""
        bucket = self.prefix_buckets[name]
        self._last = None
        pb, width, prefix = bucket["batch"], bucket["seq"], bucket["prefix"]
        ids = torch.full((pb, width), self.lm.pad_token_id, dtype=torch.int32)
        mask = torch.ones((pb, width), dtype=torch.int32)
        positions = torch.arange(width, dtype=torch.int32)[None, :].repeat(pb, 1)
        cached = torch.zeros((pb, prefix), dtype=torch.int32)
        for b, (j, stop) in enumerate(ends):
            n = stop - j.start
            ids[b, width - n:] = torch.tensor(j.seq[j.start:stop], dtype=torch.int32)
            mask[b, : width - n] = 0
            positions[b] = 1
            positions[b, width - n:] = torch.arange(j.start, stop, dtype=torch.int32)
            cached[b, : j.start] = 1
            self.prefill_tokens += n
        rows = [j.r for j, _stop in ends]
        args = [ids, mask, positions, self._rows_input(PREFIX, rows, pb), cached, *self._sampling_inputs(rows, pb)]
        self._emit(PREFIX, name, args, rows, got, [stop == len(j.seq) for j, stop in ends])

    def _run_graph(self, family: str, name: str, args: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        if family != PREFIX:
            return super()._run_graph(family, name, args)
        fn = self._fns.get((family, name))
        if fn is None:
            fn = self._fns[(family, name)] = self._prefix.bucket_fn(name)
            if fn is None:
                raise RuntimeError(f"{self.label}: graph {self._prefix.graph(name).describe()} is not usable")
        res = fn(*args, self.kv)
        return dict(zip(self._prefix_out, [res] if isinstance(res, torch.Tensor) else list(res), strict=True))

    def _grow(self, rows: list[Request]) -> list[Request]:
        """Each running request's block for the position its next decode writes, taken from the pool; when none is
        left, the most recently admitted request that can be recomputed is preempted (its blocks released, its
        prompt blocks kept cached) and queued first, to be prefilled again with its tokens so far. Returns the rows
        that decode now, in line order (a row with no block and nothing to preempt waits)."""
        ready: set[int] = set()
        for r in sorted(rows, key=lambda x: self._admitted[x.rid]):
            if r.line not in self.active or self.active[r.line] is not r:
                continue  # preempted for an earlier request in this loop
            blocks = self._held[r.rid]
            while r.position // self.block_size >= len(blocks):
                b = self.blocks.grow()
                if b is not None:
                    blocks.append(b)
                    self._last = None
                    continue
                prefilling = {j.r.rid for j in self._jobs}
                victims = [v for v in self.active.values() if v.rid not in prefilling and self._recomputable(v)]
                if not victims:
                    break
                victim = max(victims, key=lambda v: self._admitted[v.rid])
                self._preempt(victim)
                ready.discard(victim.rid)  # (an earlier request when the later ones cannot be recomputed)
                if victim is r:
                    break
            else:
                ready.add(r.rid)
        return [r for r in rows if r.rid in ready]

    def _preempt(self, r: Request) -> None:
        self.blocks.release(self._held.pop(r.rid))
        del self.active[r.line]
        self.free.append(r.line)
        self.free.sort()
        r.line = -1
        self._last = None
        self.waiting.appendleft(r)
        self.preemptions += 1

    def _rows_input(self, family: str, rows: Sequence[Request], batch: int) -> torch.Tensor:
        """block_table int32 [batch, max_seq / block_size]: each row's blocks in position order, then the scratch
        block; a context call recomputing a cached prefix (no prefix graphs) gets the scratch block in place of its
        shared blocks (written by an earlier request, never rewritten)."""
        table = torch.full((batch, self.blocks_per_seq), self.scratch, dtype=torch.int32)
        for b, r in enumerate(rows):
            blocks = self._held[r.rid]
            table[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            if family == CONTEXT:
                table[b, : self._skip.get(r.rid, 0)] = self.scratch
        return table

    def _finish(self, r: Request) -> None:
        super()._finish(r)
        self.blocks.release(self._held.pop(r.rid))
        self._admitted.pop(r.rid, None)

    def counters(self) -> dict[str, int]:
        """Blocks in use, free, cached (unreferenced, kept for prefix hits); the prefix lookups and hits (full prompt
        blocks), prompt tokens computed and read from cache, preemptions."""
        m = self.blocks
        return {"blocks_in_use": m.in_use, "blocks_free": len(m.free), "blocks_cached": len(m.cached),
                "prefix_queries": m.prefix_queries, "prefix_hits": m.prefix_hits,
                "prefill_tokens": self.prefill_tokens, "cached_tokens": self.cached_tokens,
                "preemptions": self.preemptions}
