"""The continuous-batching engine over a deployed hf_causal_lm's serving graphs: requests, their KV-cache lines, and
the scheduler's step (admit into free lines through the smallest fitting context bucket, then decode every active
request by one token through the smallest fitting token bucket). torch only.

The graphs (hf_causal_lm(continuous_batching = True, ...), docs/llm.md "Serving") take, in NxD Inference's order,
input_ids, attention_mask, position_ids, seq_ids [, sampling_params, rand], kv, and return [tokens,] [logits,] kv,
the kv output aliasing its input. The engine holds that one cache (max_batch lines + a scratch line, where padding
rows, seq_ids = -1, write) and feeds each call's kv output to the next call as is. A request owns one line from its
admission to its last token; its tokens sit at slots 0..n-1 of the line (slot = position). It calls graphs only
through the per-graph loader interface (`family.bucket_fn(name)`), so any runtime loader serves it.

Sampling happens in the graph when it returns `tokens` (the sampler of toolchains/hf_causal_lm.py `sample`), from
each row's (top_k, top_p, temperature) and a uniform draw from the request's own generator (seeded by `seed`), so
a request's tokens do not depend on what shares its batch. Graphs returning logits only serve greedy requests
(argmax on the host)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from neuronbuild.runtime.router import NoBucketFits

CONTEXT, TOKEN = "context", "token"
SERVING_INPUTS = ("input_ids", "attention_mask", "position_ids", "seq_ids")
SAMPLING_INPUTS = ("sampling_params", "rand")
PADDING_LINE = -1  # seq_ids of a padding row: the graph writes its keys/values into the cache's scratch line


@dataclass(frozen=True)
class Sampling:
    """A request's sampling parameters: greedy when temperature <= 0 or top_k == 1; top_k 0 = no top-k limit (the
    graph's static top-k, 256); top_p in (0, 1]."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0 or self.top_k == 1

    def row(self) -> list[float]:
        return [float(self.top_k), float(self.top_p), float(self.temperature)]


@dataclass
class Request:
    """One request's state: its prompt, limits, sampling, generator, line and tokens so far."""

    rid: int
    prompt: list[int]
    max_new_tokens: int
    sampling: Sampling
    eos_token_id: int | None
    generator: torch.Generator
    line: int = -1
    tokens: list[int] = field(default_factory=list)
    done: bool = False
    draws: list[float] = field(default_factory=list)  # sampled requests: one uniform draw per new token, in order

    @property
    def position(self) -> int:
        """The slot the next fed token (the last generated one) is written to."""
        return len(self.prompt) + len(self.tokens) - 1

    def draw(self) -> float:
        """The draw of the next token: the request's own stream (drawn at admission from its seeded generator, all
        at once), so its tokens do not depend on its neighbours; greedy requests take none (0)."""
        return self.draws[len(self.tokens)] if self.draws else 0.0

    def fresh_draw(self) -> float:
        """A new uniform draw in [0, 1) from the request's own generator, in the order asked: for speculation,
        which draws several times per token (a proposal, its acceptance test, a residual token), each independent."""
        return float(torch.rand((), generator=self.generator))


@dataclass
class _Inputs:
    """A token bucket's input tensors of the last decode, reused while the same lines decode in the same rows (each
    step then updates them in place: the new tokens, positions + 1, one more attended slot per row)."""

    name: str
    lines: tuple[int, ...]
    args: list[torch.Tensor]



def left_padded(seqs: list[list[int]], batch: int, width: int, pad: int) -> tuple[Any, Any, Any]:
    """A context call's input_ids, attention_mask and position_ids [batch, width]: each sequence right-aligned in its
    row (left padding, masked out); padding rows attend to their own pad tokens; positions as generate derives them."""
    ids = torch.full((batch, width), pad, dtype=torch.int32)
    mask = torch.ones((batch, width), dtype=torch.int32)
    for b, seq in enumerate(seqs):
        ids[b, width - len(seq):] = torch.tensor(seq, dtype=torch.int32)
        mask[b, : width - len(seq)] = 0
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1).to(torch.int32)
    return ids, mask, positions

class Engine:
    """`add(prompt_ids, ...)` -> request id; `step()` admits and decodes once; `run()` until every request ends.
    Built by `CausalLM.engine()` over a model with continuous-batching graphs."""

    def __init__(self, lm: Any, seed: int = 0) -> None:
        if not lm.serving:
            raise TypeError(f"{lm.label}: the engine needs continuous-batching graphs "
                            "(hf_causal_lm(continuous_batching = True, max_batch = N))")
        self.lm = lm
        self.label = lm.label
        self.max_seq: int = lm.max_seq
        self.max_batch: int = lm.max_batch
        self.sampling_graphs: bool = lm.sampling
        spec = lm.kv_spec
        self.kv = torch.zeros([int(d) for d in spec["dims"]], dtype=getattr(torch, str(spec["dtype"])))
        self.free = list(range(self.max_batch))
        self.waiting: deque[Request] = deque()
        self.active: dict[int, Request] = {}  # line -> request
        self.finished: dict[int, list[int]] = {}
        self._next = 0
        self._seed = seed
        self.calls: dict[str, int] = {}  # graph calls by bucket name (context_batch2_seq16, token_batch4, ...)
        # Host work per step is of the order of a small graph call: what does not change between steps is looked up
        # once (buckets, the token bucket of each row count, loaded graphs, output positions).
        self._ctx_buckets: dict[str, dict[str, int]] = lm.context_buckets
        self._tok_buckets: dict[str, dict[str, int]] = lm.token_buckets
        self._largest = max(b["batch"] for b in self._tok_buckets.values())
        self._tok_for = {n: lm.pick(TOKEN, self._tok_buckets, {"batch": n}) for n in range(1, self._largest + 1)}
        self._fns: dict[tuple[str, str], Any] = {}
        self._slots = torch.arange(self.max_seq, dtype=torch.int32)
        self._last: _Inputs | None = None  # the last decode's inputs (None after a prefill or a finished request)

    # -- requests ------------------------------------------------------------------------------------------------

    def add(self, prompt_ids: Sequence[int], max_new_tokens: int = 16, temperature: float = 0.0, top_k: int = 0,
            top_p: float = 1.0, seed: int | None = None, eos_token_id: int | None | str = "config") -> int:
        """Queue one request; returns its id. A request no graph can serve is refused here (ValueError or
        NoBucketFits naming the request's problem); the engine's other requests are unaffected."""
        prompt = [self.lm.token_id(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("a prompt needs at least one token")
        self.lm.check_ids([prompt], self.lm.pad_token_id)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        if not (isinstance(top_p, int | float) and 0 < top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0: no limit), got {top_k!r}")
        if not isinstance(temperature, int | float) or not math.isfinite(temperature) or temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
        sampling = Sampling(float(temperature), int(top_k), float(top_p))
        if not sampling.greedy and not self.sampling_graphs:
            raise ValueError(f"{self.label}: sampling (temperature > 0, top_k != 1) needs graphs built with "
                             "on_device_sampling = True; these return logits only (greedy)")
        if eos_token_id == "config":
            eos_token_id = self.lm.eos_token_id
        if eos_token_id is not None and (isinstance(eos_token_id, bool) or not isinstance(eos_token_id, int)):
            raise ValueError(f"eos_token_id must be an int, None or 'config', got {eos_token_id!r}")
        self._check_prompt(prompt)
        if len(prompt) + max_new_tokens - 1 > self.max_seq:
            raise NoBucketFits(f"{self.label}: a prompt of {len(prompt)} tokens + {max_new_tokens} new tokens need "
                               f"{len(prompt) + max_new_tokens - 1} cache slots; the KV cache holds "
                               f"max_seq={self.max_seq}")
        rid = self._next
        self._next += 1
        gen = torch.Generator().manual_seed(int(seed) if seed is not None else self._seed * 1_000_003 + rid)
        draws = [] if sampling.greedy else torch.rand(max_new_tokens, generator=gen).tolist()
        self.waiting.append(Request(rid, prompt, max_new_tokens, sampling, eos_token_id, gen, draws=draws))
        return rid

    def _check_prompt(self, prompt: Sequence[int]) -> None:
        """NoBucketFits when no prefill can take the prompt: here, when it fits no context bucket (the block engine
        also prefills it in chunks through its prefix graphs)."""
        longest = max(b["seq"] for b in self.lm.context_buckets.values())
        if len(prompt) > longest:
            raise NoBucketFits(f"{self.label}: a prompt of {len(prompt)} tokens fits no context bucket (the longest "
                               f"holds seq={longest})")

    @property
    def pending(self) -> bool:
        return bool(self.waiting or self.active)

    # -- scheduling ----------------------------------------------------------------------------------------------

    def step(self) -> dict[int, list[int]]:
        """Admit waiting requests into free lines (prefill), then decode every active request by one token. Returns
        the tokens each request got in this step."""
        got: dict[int, list[int]] = {}
        with torch.inference_mode():
            while self.waiting and self.free:
                self._prefill(self._admissible(), got)
            rows = [self.active[line] for line in sorted(self.active)]
            largest = self._largest
            for i in range(0, len(rows), largest):
                self._decode(rows[i:i + largest], got)
        return got

    def run(self) -> dict[int, list[int]]:
        """Step until no request is waiting or active; every finished request's new tokens by id."""
        while self.pending:
            self.step()
        return dict(self.finished)

    def _admissible(self) -> list[Request]:
        """The longest FIFO prefix of the waiting requests (at most the free lines) some context bucket holds."""
        n = min(len(self.waiting), len(self.free))
        while n > 1 and self._context_bucket(list(self.waiting)[:n]) is None:
            n -= 1
        return [self.waiting.popleft() for _ in range(n)]

    def _context_bucket(self, reqs: Sequence[Request]) -> str | None:
        try:
            return self.lm.pick(CONTEXT, self._ctx_buckets,
                                {"batch": len(reqs), "seq": max(len(r.prompt) for r in reqs)})
        except NoBucketFits:
            return None

    def _sampling_inputs(self, rows: Sequence[Request], batch: int) -> list[torch.Tensor]:
        if not self.sampling_graphs:
            return []
        pad = batch - len(rows)  # padding rows: greedy
        params = [r.sampling.row() for r in rows] + [[1.0, 1.0, 0.0]] * pad
        rand = [r.draw() for r in rows] + [0.0] * pad  # (greedy rows: 0, unused)
        return [torch.tensor(params, dtype=torch.float32), torch.tensor(rand, dtype=torch.float32)]

    def _prefill(self, reqs: list[Request], got: dict[int, list[int]]) -> None:
        name = self._context_bucket(reqs)
        if name is None:  # (add() checked every prompt fits a batch-1 bucket)
            raise NoBucketFits(f"{self.label}: no context bucket holds a prompt of {len(reqs[0].prompt)} tokens")
        bucket = self._ctx_buckets[name]
        self._last = None
        cb = bucket["batch"]
        for r in reqs:
            r.line = self.free.pop(0)
            self.active[r.line] = r
        ids, mask, positions = left_padded([r.prompt for r in reqs], cb, bucket["seq"], self.lm.pad_token_id)
        seq_ids = self._rows_input(CONTEXT, reqs, cb)
        args = [ids, mask, positions, seq_ids, *self._sampling_inputs(reqs, cb)]
        self._emit(CONTEXT, name, args, reqs, got)

    def _decode(self, rows: list[Request], got: dict[int, list[int]]) -> None:
        name = self._tok_for[len(rows)]
        lines = tuple(r.line for r in rows)
        last = self._last
        if last is not None and last.name == name and last.lines == lines:
            # the same requests in the same rows as the last call (a decode): update its inputs in place
            ids, mask, positions, _seq_ids, *sampling = last.args
            n = len(rows)
            ids[:n, 0] = torch.tensor([r.tokens[-1] for r in rows], dtype=torch.int32)
            positions[:n] += 1
            mask[:n].scatter_(1, positions[:n].long(), 1)
            if sampling and any(r.draws for r in rows):
                sampling[1][:n] = torch.tensor([r.draw() for r in rows], dtype=torch.float32)
            args = last.args
        else:
            pad = self._tok_buckets[name]["batch"] - len(rows)
            ids = torch.tensor([[r.tokens[-1]] for r in rows] + [[self.lm.pad_token_id]] * pad, dtype=torch.int32)
            positions = torch.tensor([[r.position] for r in rows] + [[0]] * pad, dtype=torch.int32)
            seq_ids = self._rows_input(TOKEN, rows, len(rows) + pad)
            # slots 0..position (padding rows: slot 0 of the scratch line)
            mask = (self._slots[None, :] <= positions).to(torch.int32)
            args = [ids, mask, positions, seq_ids, *self._sampling_inputs(rows, len(rows) + pad)]
            self._last = _Inputs(name, lines, args)
        self._emit(TOKEN, name, args, rows, got)

    def _rows_input(self, family: str, rows: Sequence[Request], batch: int) -> torch.Tensor:
        """The graphs' per-row cache input: seq_ids, each row's line (padding rows: PADDING_LINE). The block engine
        (runtime/block_engine.py) returns block tables instead."""
        return torch.tensor([r.line for r in rows] + [PADDING_LINE] * (batch - len(rows)), dtype=torch.int32)

    def _run_graph(self, family: str, name: str, args: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """One call of a graph with the cache, its outputs by name."""
        fn = self._fns.get((family, name))
        if fn is None:
            fn = self._fns[(family, name)] = self.lm.fn(family, name)
        return self.lm.named(family, fn(*args, self.kv))  # type: ignore[no-any-return]

    def _emit(self, family: str, name: str, args: list[torch.Tensor], rows: Sequence[Request],
              got: dict[int, list[int]], emit: Sequence[bool] | None = None) -> None:
        """One call; the next token of each row (`emit`: of the rows whose prefill or decode it completes)."""
        out = self._run_graph(family, name, args)
        self.calls[name] = self.calls.get(name, 0) + 1
        self.kv = out["kv"]  # the output aliasing the kv input (on cpu: that very tensor, written in place)
        if emit is not None and not any(emit):
            return
        nxt = (out["tokens"] if "tokens" in out else out["logits"].argmax(-1)).tolist()
        for b, r in enumerate(rows):
            if emit is None or emit[b]:
                self._take(r, nxt[b], got)

    def _take(self, r: Request, t: int, got: dict[int, list[int]]) -> bool:
        """Append token `t` to the request's; finish it at its limit or its eos token (then True)."""
        r.tokens.append(t)
        got.setdefault(r.rid, []).append(t)
        if len(r.tokens) >= r.max_new_tokens or (r.eos_token_id is not None and t == r.eos_token_id):
            self._finish(r)
            return True
        return False

    def _finish(self, r: Request) -> None:
        r.done = True
        self._last = None
        del self.active[r.line]
        self.free.append(r.line)
        self.free.sort()
        self.finished[r.rid] = r.tokens


def serving_spec(inputs: Mapping[str, Any]) -> tuple[bool, bool]:
    """(serving, sampling) of a graph's declared inputs: the continuous-batching signature, with sampling inputs."""
    names = list(inputs)
    if "block_table" in names and "seq_ids" not in names:  # kv_layout = "block": the block table stands where seq_ids does
        names = ["seq_ids" if n == "block_table" else n for n in names]
    if names[: len(SERVING_INPUTS)] != list(SERVING_INPUTS) or names[-1] != "kv":
        return False, False
    middle = names[len(SERVING_INPUTS):-1]
    if middle == list(SAMPLING_INPUTS):
        return True, True
    return (True, False) if not middle else (False, False)
