"""Speculative decoding over a deployed hf_causal_lm built with `speculation = {"draft": ..., "length": k}`
(docs/llm.md "Speculative decoding"): the draft model's own context and token graphs propose k tokens per request,
the target's `verify` graph scores the last accepted token and the k proposals in one call (k + 1 positions written
into the request's cache line), and the engine keeps the longest agreeing prefix plus the target's next token. torch
only.

Built on runtime/engine.py's Engine (requests, lines, admission, prefill through the context graphs); this module
adds the draft's cache, the speculation step and the acceptance rule:

- Greedy requests: a proposal is accepted while it equals the target's greedy token at its position; the tokens a
  step yields are the accepted proposals and the target's token after them, so the output is the target's own
  greedy decoding, token for token, whatever the draft proposes.
- Sampled requests: the standard rejection-sampling rule (Leviathan et al. 2023, Chen et al. 2023) over the
  distributions the engine's sampler defines (temperature, top-k, top-p as in toolchains/hf_causal_lm.py `sample`):
  the draft's proposal x ~ q; accepted with probability min(1, p(x) / q(x)); at the first rejection the token is
  drawn from norm(max(0, p - q)) and the step ends; when all k are accepted, one more from p. Each token is then
  distributed as p, the target's own sampler. It needs the logits of both models (graphs built with
  output_logits = True, or without on_device_sampling); every draw comes from the request's own generator.
- Rollback: a cache line holds a sequence at slot = position and every call attends only the slots before the
  position it writes, so rejected entries (target: the verify call's slots past the accepted ones; draft: its
  proposals past them) are dropped by moving the request's length back: the next call overwrites them before any
  read. The draft lags the target by one token (two when all k proposals were accepted: one catch-up call feeds it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from neuronbuild.runtime.engine import CONTEXT, PADDING_LINE, TOKEN, Engine, Request
from neuronbuild.runtime.router import NoBucketFits

VERIFY = "verify"
FUSED = "fused"  # speculation fused = True: the draft's k steps and the verification in one graph
SAMPLER_TOP_K = 256  # the graphs' static top-k (toolchains/hf_causal_lm.py SAMPLER_TOP_K)


class SpeculationMismatch(ValueError):
    """A speculation configuration the deployed bundle was not built for."""


def speculation_of(model: Any) -> dict[str, Any] | None:
    """The speculation a deployed model's verify (or fused) graphs were built for ({"draft", "length", "fused"}), or
    None."""
    family = next((f for f in (FUSED, VERIFY) if f in model.families), None)
    if family is None:
        return None
    fam = model.family(family)
    g = fam.graph(next(iter(fam.buckets)))
    spec = ((g.trace_record.get("model") or {}).get("config") or {}).get("speculation")
    return dict(spec) if isinstance(spec, Mapping) else None


def _draft_label(lm: Any, draft_model: str) -> str:
    """The compile label, in the same deployed directory, of the draft model's graphs for the target's platform."""
    cache = lm.model._cache
    first = lm.model.graph(next(iter(lm.model.buckets)))
    found: dict[str, None] = {}
    for r in cache._releases:
        for g in r.manifest.graphs:
            if g.model == draft_model and g.platform == first.platform and g.isa == first.isa:
                found.setdefault(g.label, None)
    if not found:
        raise SpeculationMismatch(f"{lm.label}: its draft model {draft_model} has no graphs for platform "
                                  f"{first.platform} in {cache.root} (bundle the draft's neuron_compile with the target's, or "
                                  "serve without speculating: engine(speculation=False))")
    return next(iter(found))


def speculative_engine(lm: Any, seed: int, speculation: Mapping[str, Any] | bool | None) -> Engine:
    """CausalLM.engine(): a SpeculativeEngine when the bundle has verify graphs (or `speculation` asks for one,
    checked against what the bundle was built for), else the plain Engine."""
    built = lm.speculation
    if speculation is False or (speculation is None and built is None):
        return Engine(lm, seed)
    if built is None:
        raise SpeculationMismatch(f"{lm.label}: speculation {dict(speculation) if isinstance(speculation, Mapping) else speculation} "
                                  "requested, but the bundle has no verify graphs (built without hf_causal_lm "
                                  "speculation = {...})")
    want = dict(speculation) if isinstance(speculation, Mapping) else {}
    unknown = sorted(set(want) - {"draft", "length", "fused"})
    if unknown:
        raise ValueError(f"speculation: unknown key {unknown[0]!r} (known: draft, length, fused)")
    k = int(built["length"])
    if "length" in want and want["length"] != k:
        what = (f"its fused graph proposes {k} draft tokens and scores {k + 1} positions per row" if built.get("fused")
                else f"its verify graph scores {k + 1} positions per row")
        raise SpeculationMismatch(
            f"{lm.label}: speculation length {want['length']} requested, but the bundle was built for length {k} "
            f"({what}; rebuild with speculation length {want['length']} or serve with {k})")
    if "fused" in want and bool(want["fused"]) != bool(built.get("fused")):
        has = "a fused graph per bucket (draft steps and verification in one call)" if built.get("fused") else \
            "separate draft token and verify graphs"
        raise SpeculationMismatch(f"{lm.label}: speculation fused={bool(want['fused'])} requested, but the bundle was "
                                  f"built with fused={bool(built.get('fused'))} ({has}; rebuild with speculation "
                                  f"fused = {bool(want['fused'])} or serve with fused={bool(built.get('fused'))})")
    draft = want.get("draft")
    if draft is None or isinstance(draft, str):
        if isinstance(draft, str) and draft != built["draft"]:
            raise SpeculationMismatch(f"{lm.label}: draft {draft} requested, but the bundle was built with draft "
                                      f"{built['draft']}")
        draft = lm.model._cache.causal_lm(_draft_label(lm, str(built["draft"])))
    else:
        model_label = draft.model.graph(next(iter(draft.model.buckets))).model
        if model_label != built["draft"]:
            raise SpeculationMismatch(f"{lm.label}: draft {draft.label} (model {model_label}) given, but the bundle "
                                      f"was built with draft {built['draft']}")
    return SpeculativeEngine(lm, draft, k, seed)


def distribution(logits: torch.Tensor, sampling: Any) -> torch.Tensor:
    """The probabilities [vocab] the graphs' sampler draws a token from (toolchains/hf_causal_lm.py `sample`): the
    K = min(vocab, 256) largest logits, a row's top_k (< 1 or > K: K), / temperature, softmax, top_p over the
    sorted ranks (a rank is kept when the mass before it is < top_p), renormalised; zero elsewhere."""
    logits = logits.double()
    k = min(int(logits.shape[-1]), SAMPLER_TOP_K)
    values, index = torch.topk(logits, k)
    kk = k if sampling.top_k < 1 or sampling.top_k > k else int(sampling.top_k)
    probs = torch.softmax(values[:kk] / sampling.temperature, -1)
    before = probs.cumsum(-1) - probs
    probs = torch.where(before < sampling.top_p, probs, torch.zeros_like(probs))
    out = torch.zeros_like(logits)
    out[index[:kk]] = probs / probs.sum()
    return out


def _draw(probs: torch.Tensor, r: Request) -> int:
    """A token from `probs` by inverse CDF with a fresh draw from the request's own generator (each draw of the rule
    independent: Request.fresh_draw)."""
    cdf = probs.cumsum(-1)
    u = r.fresh_draw() * float(cdf[-1])
    return int(min(int((cdf < u).sum()), int(probs.shape[0]) - 1))


class SpeculativeEngine(Engine):
    """The continuous-batching engine (add / step / run, as Engine) decoding by speculation: each step runs k draft
    token calls, one verify call, and yields 1..k + 1 tokens per request. `stats[rid]` counts the request's
    proposed and accepted draft tokens and its verify calls."""

    def __init__(self, lm: Any, draft: Any, length: int, seed: int = 0) -> None:
        super().__init__(lm, seed)
        if not draft.serving:
            raise SpeculationMismatch(f"{lm.label}: draft {draft.label} needs continuous-batching graphs")
        if draft.max_batch < self.max_batch or draft.max_seq < self.max_seq:
            raise SpeculationMismatch(
                f"{lm.label}: draft {draft.label} holds max_batch={draft.max_batch}, max_seq={draft.max_seq}; the "
                f"target's cache needs at least max_batch={self.max_batch}, max_seq={self.max_seq}")
        if draft.vocab_size != lm.vocab_size:
            raise SpeculationMismatch(f"{lm.label}: draft {draft.label} has vocab_size {draft.vocab_size}, the target "
                                      f"{lm.vocab_size}: the models must share a tokenizer")
        self.draft = draft
        self.k = length
        self.fused = FUSED in lm.model.families  # one fused call per round instead of k draft calls + verify
        self.family = FUSED if self.fused else VERIFY
        self._verify = lm.model.family(self.family)
        self.verify_buckets: dict[str, dict[str, int]] = self._verify.buckets
        g = self._verify.graph(next(iter(self.verify_buckets)))
        self._verify_out = [str(o["name"]) for o in g.outputs]
        spec = draft.kv_spec
        if self.fused:
            width = next(int(o["shape"][1]) for o in g.outputs if o["name"] == "draft_tokens")
            if width != length:
                raise SpeculationMismatch(f"{lm.label}: the fused graph proposes {width} draft tokens, not the "
                                          f"speculation length {length}")
            built = g.inputs["draft_kv"]
            if [int(d) for d in built["dims"]] != [int(d) for d in spec["dims"]] or built["dtype"] != spec["dtype"]:
                raise SpeculationMismatch(
                    f"{lm.label}: its fused graph holds the draft cache {built['dtype']}{list(built['dims'])}, but "
                    f"draft {draft.label} has {spec['dtype']}{list(spec['dims'])} (not the draft it was built with)")
        else:
            width = int(g.inputs["input_ids"]["dims"][1])
            if width != length + 1:
                raise SpeculationMismatch(f"{lm.label}: the verify graph scores {width} positions, not length + 1 = "
                                          f"{length + 1}")
        self._verify_sampling = "sampling_params" in g.inputs
        self.logits = "logits" in self._verify_out and ("draft_logits" in self._verify_out if self.fused
                                                        else "logits" in draft._out_index[TOKEN])
        self.draft_kv = torch.zeros([int(d) for d in spec["dims"]], dtype=getattr(torch, str(spec["dtype"])))
        self._draft_fed: dict[int, int] = {}  # rid -> tokens whose keys/values the draft's line holds
        self.stats: dict[int, dict[str, int]] = {}
        if lm.strict:
            unusable = [g.describe() for n in self.verify_buckets if self._verify.bucket_fn(n) is None
                        for g in (self._verify.graph(n),)]
            if unusable:
                raise RuntimeError(f"strict mode: {lm.label}: {self.family} graph(s) cannot run here: "
                                   f"{', '.join(unusable)}")

    # -- requests ------------------------------------------------------------------------------------------------

    def add(self, prompt_ids: Sequence[int], max_new_tokens: int = 16, temperature: float = 0.0, top_k: int = 0,
            top_p: float = 1.0, seed: int | None = None, eos_token_id: int | None | str = "config") -> int:
        """As Engine.add; a request also needs room for the k slots a verify call writes past its last token."""
        prompt = [self.lm.token_id(t) for t in prompt_ids]
        if prompt and isinstance(max_new_tokens, int) and not isinstance(max_new_tokens, bool) \
                and len(prompt) + max_new_tokens + self.k - 1 > self.max_seq:
            raise NoBucketFits(f"{self.label}: a prompt of {len(prompt)} tokens + {max_new_tokens} new tokens + "
                               f"speculation length {self.k} need {len(prompt) + max_new_tokens + self.k - 1} cache "
                               f"slots; the KV cache holds max_seq={self.max_seq}")
        greedy = not isinstance(temperature, int | float) or temperature <= 0 or top_k == 1  # (add() checks types)
        if not greedy and not self.logits:
            raise ValueError(f"{self.label}: sampling with speculation needs the logits of the verify graph and the "
                             f"draft's token graph (build both with output_logits = True)")
        if prompt:
            self.draft.pick(CONTEXT, self.draft.context_buckets, {"batch": 1, "seq": len(prompt)})
        rid = super().add(prompt, max_new_tokens, temperature, top_k, top_p, seed, eos_token_id)
        self.stats[rid] = {"proposed": 0, "accepted": 0, "verify_calls": 0}
        return rid

    # -- scheduling ----------------------------------------------------------------------------------------------

    def step(self) -> dict[int, list[int]]:
        """Admit waiting requests (both models prefill them), then one speculation round for every active request:
        up to k + 1 new tokens each."""
        got: dict[int, list[int]] = {}
        while self.waiting and self.free:
            reqs = self._admissible()
            self._prefill(reqs, got)  # the target's prefill: lines, the first token (Engine)
            live = [r for r in reqs if not r.done]  # (a request of one new token ended at its prefill)
            if live:
                self._draft_prefill(live)
        rows = sorted(self.active.values(), key=lambda r: r.line)
        largest = max(b["batch"] for b in self.verify_buckets.values())
        if not self.fused:
            largest = min(largest, max(b["batch"] for b in self.draft.token_buckets.values()))
        for i in range(0, len(rows), largest):
            (self._speculate_fused if self.fused else self._speculate)(rows[i:i + largest], got)
        return got

    @property
    def acceptance(self) -> float:
        """Accepted / proposed draft tokens over every request so far (0 when none was proposed)."""
        proposed = sum(s["proposed"] for s in self.stats.values())
        return sum(s["accepted"] for s in self.stats.values()) / proposed if proposed else 0.0

    # -- the draft -----------------------------------------------------------------------------------------------

    def _draft_call(self, family: str, name: str, args: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        fn = self.draft.fn(family, name)
        with torch.inference_mode():
            out = self.draft.named(family, fn(*args, self.draft_kv))
        self.calls["draft_" + name] = self.calls.get("draft_" + name, 0) + 1
        self.draft_kv = out["kv"]
        return out  # type: ignore[no-any-return]

    def _greedy_params(self, batch: int) -> list[torch.Tensor]:
        return [torch.tensor([[1.0, 1.0, 0.0]] * batch), torch.zeros(batch)] if self.draft.sampling else []

    def _draft_prefill(self, reqs: list[Request]) -> None:
        try:
            name = self.draft.pick(CONTEXT, self.draft.context_buckets,
                                   {"batch": len(reqs), "seq": max(len(r.prompt) for r in reqs)})
        except NoBucketFits:  # (add() checked each prompt fits a batch-1 bucket of the draft)
            for r in reqs:
                self._draft_prefill([r])
            return
        bucket = self.draft.context_buckets[name]
        cb, seq = bucket["batch"], bucket["seq"]
        ids = torch.full((cb, seq), self.draft.pad_token_id, dtype=torch.int32)
        mask = torch.ones((cb, seq), dtype=torch.int32)
        seq_ids = torch.full((cb,), PADDING_LINE, dtype=torch.int32)
        for b, r in enumerate(reqs):
            ids[b, seq - len(r.prompt):] = torch.tensor(r.prompt, dtype=torch.int32)
            mask[b, : seq - len(r.prompt)] = 0
            seq_ids[b] = r.line
            self._draft_fed[r.rid] = len(r.prompt)
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1).to(torch.int32)
        self._draft_call(CONTEXT, name, [ids, mask, positions, seq_ids, *self._greedy_params(cb)])

    def _draft_token(self, rows: list[Request], feed: list[int], positions: list[int]) -> dict[str, torch.Tensor]:
        """One draft token call: row b feeds token feed[b] at position positions[b] of its line."""
        name = self.draft.pick(TOKEN, self.draft.token_buckets, {"batch": len(rows)})
        pad = self.draft.token_buckets[name]["batch"] - len(rows)
        ids = torch.tensor([[t] for t in feed] + [[self.draft.pad_token_id]] * pad, dtype=torch.int32)
        pos = torch.tensor([[p] for p in positions] + [[0]] * pad, dtype=torch.int32)
        seq_ids = torch.tensor([r.line for r in rows] + [PADDING_LINE] * pad, dtype=torch.int32)
        mask = (torch.arange(self.draft.max_seq, dtype=torch.int32)[None, :] <= pos).to(torch.int32)
        return self._draft_call(TOKEN, name, [ids, mask, pos, seq_ids, *self._greedy_params(len(rows) + pad)])

    # -- one speculation round -----------------------------------------------------------------------------------

    def _speculate(self, rows: list[Request], got: dict[int, list[int]]) -> None:
        k = self.k
        seqs = [r.prompt + r.tokens for r in rows]
        # catch up: a draft two tokens behind (all k proposals accepted last round) is fed the older one
        behind = [(r, s) for r, s in zip(rows, seqs, strict=True) if len(s) - self._draft_fed[r.rid] >= 2]
        if behind:
            self._draft_token([r for r, _s in behind], [s[self._draft_fed[r.rid]] for r, s in behind],
                              [self._draft_fed[r.rid] for r, _s in behind])
            for r, _s in behind:
                self._draft_fed[r.rid] += 1
        sampled = [not r.sampling.greedy for r in rows]
        proposals: list[list[int]] = [[] for _ in rows]
        q: list[list[torch.Tensor]] = [[] for _ in rows]
        for i in range(k):
            feed = [(s[-1] if i == 0 else p[-1]) for s, p in zip(seqs, proposals, strict=True)]
            out = self._draft_token(rows, feed, [len(s) - 1 + i for s in seqs])
            logits = out.get("logits")
            nxt = (out["tokens"] if "tokens" in out else out["logits"].argmax(-1)).tolist()
            for b, r in enumerate(rows):
                if sampled[b]:
                    assert logits is not None
                    q[b].append(distribution(logits[b], r.sampling))
                    proposals[b].append(_draw(q[b][-1], r))
                else:
                    proposals[b].append(int(nxt[b]))
        verified = self._verify_call(rows, seqs, proposals)
        self._accept(rows, seqs, proposals, q, verified, got)

    def _accept(self, rows: list[Request], seqs: list[list[int]], proposals: list[list[int]],
                q: list[list[torch.Tensor]], verified: dict[str, torch.Tensor], got: dict[int, list[int]]) -> None:
        """Per row: the accepted proposals and the target's token (greedy), or the rejection-sampling rule's tokens
        (sampled); the counters; the request's length moved to the kept tokens (the rollback)."""
        k = self.k
        for b, r in enumerate(rows):
            p0 = len(seqs[b]) - 1
            if not r.sampling.greedy:
                new, j = self._reject_sample(r, proposals[b], q[b], verified["logits"][b])
            else:
                target = [int(t) for t in verified["tokens"][b].tolist()]
                j = 0
                while j < k and proposals[b][j] == target[j]:
                    j += 1
                new = proposals[b][:j] + [target[j]]
            st = self.stats[r.rid]
            st["proposed"] += k
            st["accepted"] += j
            st["verify_calls"] += 1
            # the draft's line holds the fed tokens through the last accepted proposal (or d_{k-1}): roll back the rest
            self._draft_fed[r.rid] = p0 + 1 + min(j, k - 1)
            for t in new:
                if self._take(r, t, got):
                    self._draft_fed.pop(r.rid, None)
                    break

    def _speculate_fused(self, rows: list[Request], got: dict[int, list[int]]) -> None:
        """One fused call for the rows: the draft's k proposals (its first step feeds the tokens at p - 1 and p, so
        a draft left one token behind by a fully accepted round catches up in the same call) and the target's
        k + 1 tokens; then acceptance and rollback as unfused."""
        k = self.k
        seqs = [r.prompt + r.tokens for r in rows]
        name = self.lm.pick(FUSED, self.verify_buckets, {"batch": len(rows)})
        batch = self.verify_buckets[name]["batch"]
        pad = batch - len(rows)
        ids = torch.tensor([s[-2:] for s in seqs] + [[self.lm.pad_token_id] * 2] * pad, dtype=torch.int32)
        pos = torch.tensor([[len(s) - 2, len(s) - 1] for s in seqs] + [[0, 1]] * pad, dtype=torch.int32)
        seq_ids = torch.tensor([r.line for r in rows] + [PADDING_LINE] * pad, dtype=torch.int32)
        mask = (torch.arange(self.max_seq, dtype=torch.int32)[None, :] < pos[:, 1:]).to(torch.int32)
        args = [ids, mask, pos, seq_ids]
        if self._verify_sampling:  # the draft samples a sampled row's proposals in the graph, from its own draws
            params = [[1.0, 1.0, 0.0] if r.sampling.greedy else
                      [float(r.sampling.top_k), float(r.sampling.top_p), float(r.sampling.temperature)] for r in rows]
            draws = [[0.0] * k if r.sampling.greedy else [r.fresh_draw() for _ in range(k)] for r in rows]
            args += [torch.tensor(params + [[1.0, 1.0, 0.0]] * pad), torch.zeros((batch, k + 1)),
                     torch.tensor(draws + [[0.0] * k] * pad, dtype=torch.float32)]
        out = self._call(name, args + [self.kv, self.draft_kv])
        self.draft_kv = out["draft_kv"]
        proposals = [[int(t) for t in out["draft_tokens"][b].tolist()] for b in range(len(rows))]
        q: list[list[torch.Tensor]] = [[] for _ in rows]
        for b, r in enumerate(rows):
            if not r.sampling.greedy:  # the distribution each proposal was drawn from (a greedy draft's: one-hot)
                if self._verify_sampling:
                    q[b] = [distribution(out["draft_logits"][b, i], r.sampling) for i in range(k)]
                else:
                    q[b] = [torch.nn.functional.one_hot(torch.tensor(x), out["logits"].shape[-1]).double()
                            for x in proposals[b]]
        self._accept(rows, seqs, proposals, q, out, got)

    def _call(self, name: str, args: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        fn = self._verify.bucket_fn(name)
        if fn is None:
            raise RuntimeError(f"{self.label}: graph {self._verify.graph(name).describe()} is not usable")
        with torch.inference_mode():
            raw = fn(*args)
        tensors = [raw] if isinstance(raw, torch.Tensor) else list(raw)
        out = dict(zip(self._verify_out, tensors, strict=True))
        self.calls[name] = self.calls.get(name, 0) + 1
        self.kv = out["kv"]  # rejected slots are rolled back by the request's length (never attended, overwritten)
        return out

    def _verify_call(self, rows: list[Request], seqs: list[list[int]], proposals: list[list[int]]
                     ) -> dict[str, torch.Tensor]:
        k = self.k
        name = self.lm.pick(VERIFY, self.verify_buckets, {"batch": len(rows)})
        pad = self.verify_buckets[name]["batch"] - len(rows)
        ids = torch.tensor([[s[-1], *p] for s, p in zip(seqs, proposals, strict=True)]
                           + [[self.lm.pad_token_id] * (k + 1)] * pad, dtype=torch.int32)
        pos = torch.tensor([[len(s) - 1 + i for i in range(k + 1)] for s in seqs]
                           + [list(range(k + 1))] * pad, dtype=torch.int32)
        seq_ids = torch.tensor([r.line for r in rows] + [PADDING_LINE] * pad, dtype=torch.int32)
        # the line's slots before the first written one (the written k + 1 are attended causally by the graph)
        mask = (torch.arange(self.max_seq, dtype=torch.int32)[None, :] < pos[:, :1]).to(torch.int32)
        args = [ids, mask, pos, seq_ids]
        if self._verify_sampling:  # the graph's own tokens serve greedy rows: greedy parameters for every row
            args += [torch.tensor([[1.0, 1.0, 0.0]] * (len(rows) + pad)), torch.zeros((len(rows) + pad, k + 1))]
        return self._call(name, args + [self.kv])

    def _reject_sample(self, r: Request, proposals: list[int], q: list[torch.Tensor], logits: torch.Tensor
                       ) -> tuple[list[int], int]:
        """Leviathan et al. / Chen et al.: accept x_i ~ q_i with probability min(1, p_i(x) / q_i(x)); at the first
        rejection draw from norm(max(0, p_i - q_i)); all accepted: one more token from p_k."""
        new: list[int] = []
        for i, x in enumerate(proposals):
            token, ok = _accept_or_resample(r, x, q[i], distribution(logits[i], r.sampling))
            new.append(token)
            if not ok:
                return new, i
        new.append(_draw(distribution(logits[len(proposals)], r.sampling), r))
        return new, len(proposals)


def _accept_or_resample(r: Request, x: int, q: torch.Tensor, p: torch.Tensor) -> tuple[int, bool]:
    """One position of the rule: (x, True) with probability min(1, p(x) / q(x)), else (a draw from
    norm(max(0, p - q)), False)."""
    if r.fresh_draw() < min(1.0, float(p[x] / q[x])):
        return x, True
    residual = (p - q).clamp(min=0)
    return _draw(residual if float(residual.sum()) > 0 else p, r), False


def speculative_rule_draw(r: Request, q: torch.Tensor, p: torch.Tensor) -> tuple[int, bool]:
    """A proposal drawn from q, then the rule's token for that position and whether the proposal was kept: the
    token is distributed as p whatever q is (the rule's guarantee)."""
    return _accept_or_resample(r, _draw(q, r), q, p)
