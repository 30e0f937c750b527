"""Greedy generation from a deployed hf_causal_lm: the context graph prefills, the token graph decodes, the KV cache
(declared state: the token graph's output `kv` aliases its input `kv`) is fed back between steps. torch only.

Bucket choice: the smallest context bucket (batch x seq) that fits the batch and the longest prompt, then the smallest
token bucket (batch) that fits the batch. Prompts are left-padded (their ends aligned, as transformers' generate wants
for decoder-only models), the batch padded with dummy rows; the cache is padded or sliced only along the dims its
declaration names as bucket dims (batch). A prompt or batch no bucket fits, or one that would overflow the static
cache, is a NoBucketFits naming the largest buckets: nothing is ever compiled or run eagerly."""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from neuronbuild.runtime.block_layout import served_layout
from neuronbuild.runtime.engine import Engine, left_padded, serving_spec
from neuronbuild.runtime.inputs import from_numpy
from neuronbuild.runtime.router import NoBucketFits

CONTEXT, TOKEN = "context", "token"
CONTEXT_INPUTS = ("input_ids", "attention_mask")
TOKEN_INPUTS = ("input_ids", "position_ids", "cache_mask", "slot", "kv")


def _token_id(t: Any) -> int:
    """A token id from a list: an integer (bool, float and str refused)."""
    if isinstance(t, bool) or isinstance(t, float | str | bytes):
        raise ValueError(f"input_ids must hold integer token ids, got {t!r}")
    try:
        return operator.index(t)
    except TypeError:
        raise ValueError(f"input_ids must hold integer token ids, got {t!r}") from None


def _describe(sizes: Mapping[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sizes.items())


class CausalLM:
    """A deployed causal LM: `generate(input_ids, max_new_tokens=N, attention_mask=None)`."""

    def __init__(self, model: Any, strict: bool = True) -> None:
        self.label = model.label
        self.strict = strict
        self.model = model
        missing = [f for f in (CONTEXT, TOKEN) if f not in model.families]
        if missing:
            raise TypeError(f"{model.label} is not an hf_causal_lm: it has no {' or '.join(missing)} graph "
                            f"(families: {', '.join(model.families) or 'none'})")
        self._context = model.family(CONTEXT)
        self._token = model.family(TOKEN)
        tok_graph = self._token.graph(next(iter(self._token.buckets)))
        ctx_graph = self._context.graph(next(iter(self._context.buckets)))
        serving, self.sampling = serving_spec(tok_graph.inputs)
        self.serving = serving and serving_spec(ctx_graph.inputs) == (serving, self.sampling)
        if not self.serving and (list(ctx_graph.inputs) != list(CONTEXT_INPUTS)
                                 or list(tok_graph.inputs) != list(TOKEN_INPUTS)):
            raise TypeError(f"{model.label}: the graphs' inputs are not those of an hf_causal_lm "
                            f"({list(ctx_graph.inputs)}, {list(tok_graph.inputs)})")
        self.aliases = dict(tok_graph.aliases)  # output -> input it updates
        if self.aliases.get("kv") != "kv":
            raise TypeError(f"{model.label}: the token graph declares no kv -> kv alias ({self.aliases})")
        self.kv_spec: dict[str, Any] = dict(tok_graph.inputs["kv"])
        kv_dims = list(self.kv_spec["dims"])
        # kv_layout = "block" (docs/llm.md "Block KV cache"): the layout its graphs were traced for, else None
        self.block_layout: dict[str, Any] | None = served_layout(tok_graph) if self.serving else None
        if self.block_layout is not None:
            self.max_batch = int(self.block_layout["max_batch"] or self.block_layout["num_blocks"])
            self.max_seq = int(tok_graph.inputs["attention_mask"]["dims"][1])
        elif self.serving:  # a cache of max_batch lines + the padding rows' scratch line: no bucket dim
            self.max_batch = int(kv_dims[2]) - 1
            self.max_seq = int(tok_graph.inputs["attention_mask"]["dims"][1])
        else:
            self._kv_batch_dim = kv_dims.index("batch")  # the only bucket dim of the cache
            self.max_seq = int(tok_graph.inputs["cache_mask"]["dims"][1])
        hf = ((ctx_graph.trace_record.get("model") or {}).get("config") or {}).get("hf") or {}
        eos, pad = hf.get("eos_token_id"), hf.get("pad_token_id")
        # transformers' defaults for generate: the config's eos (the first of a list) and pad tokens
        first = eos[0] if isinstance(eos, list) and eos else eos
        self.eos_token_id: int | None = first if isinstance(first, int) else None
        self.pad_token_id: int = int(pad) if isinstance(pad, int) else 0
        vocab = hf.get("vocab_size")  # token ids outside [0, vocab) would index past the embedding in a kernel
        self.vocab_size: int | None = vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None
        self._out_index = {g: [str(o["name"]) for o in fam.graph(next(iter(fam.buckets))).outputs]
                           for g, fam in ((CONTEXT, self._context), (TOKEN, self._token))}
        from neuronbuild.runtime.speculative import speculation_of

        self.speculation = speculation_of(model)  # {"draft", "length", "fused"} when built with verify graphs
        if strict:  # every graph generate may pick must run here: fail now, not at the first generate
            unusable = [f"{fam.graph(n).describe()}: {getattr(getattr(fam, '_slots', {}).get(n), 'problem', None)}"
                        for fam in (self._context, self._token) for n in fam.buckets if fam.bucket_fn(n) is None]
            if unusable:
                raise RuntimeError(f"strict mode: {self.label}: {len(unusable)} graph(s) cannot run here: "
                                   + "; ".join(unusable))

    @property
    def context_buckets(self) -> dict[str, dict[str, int]]:
        return self._context.buckets  # type: ignore[no-any-return]

    @property
    def token_buckets(self) -> dict[str, dict[str, int]]:
        return self._token.buckets  # type: ignore[no-any-return]

    # -- bucket choice -------------------------------------------------------------------------------------------

    def pick(self, family: str, buckets: Mapping[str, Mapping[str, int]], want: Mapping[str, int]) -> str:
        fits = [(math.prod(b[d] for d in want), tuple(b[d] for d in want), n) for n, b in buckets.items()
                if all(b.get(d, -1) >= v for d, v in want.items())]
        if not fits:
            largest = sorted(buckets.items(), key=lambda nb: tuple(nb[1].values()))[-3:]
            raise NoBucketFits(
                f"{self.label}: no {family} bucket fits {_describe(want)}; the largest {family} buckets are "
                f"{'; '.join(f'[{_describe(b)}]' for _n, b in reversed(largest))}"
                + (" (strict mode: nothing is compiled at run time)" if self.strict else ""))
        return min(fits)[2]

    def fn(self, family: str, name: str) -> Any:
        """The loaded graph of bucket `name` of `family` (context or token)."""
        return self._fn(self._context if family == CONTEXT else self._token, name)

    def _fn(self, family: Any, name: str) -> Any:
        fn = family.bucket_fn(name)
        if fn is None:
            raise RuntimeError(f"{self.label}: graph {family.graph(name).describe()} is not usable (see the log)")
        return fn

    def named(self, family: str, out: Any) -> dict[str, torch.Tensor]:
        tensors = [out] if isinstance(out, torch.Tensor) else list(out)
        return dict(zip(self._out_index[family], tensors, strict=True))

    def _resize_batch(self, kv: torch.Tensor, batch: int) -> torch.Tensor:
        """The cache at another batch bucket: sliced or zero-padded along its batch dim only."""
        d = self._kv_batch_dim
        have = kv.shape[d]
        if have == batch:
            return kv
        if have > batch:
            return kv.narrow(d, 0, batch)
        pad = list(kv.shape)
        pad[d] = batch - have
        return torch.cat([kv, kv.new_zeros(pad)], dim=d)

    @staticmethod
    def token_id(t: Any) -> int:
        return _token_id(t)

    def engine(self, seed: int = 0, speculation: Mapping[str, Any] | bool | None = None,
               num_blocks: int | None = None, block_order: Sequence[int] | None = None) -> Engine:
        """A continuous-batching engine over this model's serving graphs (runtime/engine.py); `seed` seeds the
        draws of requests added without their own. A bundle with verify graphs speculates (runtime/speculative.py):
        `speculation` False serves without, a dict ({"length", "draft", "fused"}) must match the bundle's.
        A bundle built with kv_layout = "block" gets a BlockEngine (runtime/block_engine.py): `num_blocks`, when
        given, must be the compiled block count; `block_order` the order free blocks are handed out (tests)."""
        from neuronbuild.runtime.block_engine import BlockEngine, check_num_blocks
        from neuronbuild.runtime.speculative import speculative_engine

        check_num_blocks(self, num_blocks)
        if self.block_layout is not None:
            return BlockEngine(self, seed, block_order=block_order)

        return speculative_engine(self, seed, speculation)

    def check_ids(self, rows: Sequence[Sequence[int]], pad_token_id: int) -> None:
        """Every token id (and the pad id) within [0, vocab_size): a ValueError naming the input, never a kernel's
        out-of-range read (an abort of the serving process)."""
        top = self.vocab_size
        for i, r in enumerate(rows):
            for j, t in enumerate(r):
                if t < 0 or (top is not None and t >= top):
                    raise ValueError(f"input_ids[{i}][{j}] = {t} is not a token id of {self.label} "
                                     f"(0 <= id < vocab_size {top if top is not None else '?'})")
        if pad_token_id < 0 or (top is not None and pad_token_id >= top):
            raise ValueError(f"pad_token_id {pad_token_id} is not a token id of {self.label} (vocab_size {top})")

    def _generate_serving(self, rows: list[list[int]], max_new_tokens: int, eos_token_id: int | None,
                          pad_token_id: int) -> torch.Tensor:
        """generate() on continuous-batching graphs: every prompt a greedy request of one engine; a row that ended
        (eos) is padded, the width is the longest row's."""
        eng = self.engine()
        rids = [eng.add(r, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id) for r in rows]
        out = eng.run()
        width = max(len(out[rid]) for rid in rids)
        new = torch.full((len(rows), width), pad_token_id, dtype=torch.int64)
        for i, rid in enumerate(rids):
            new[i, : len(out[rid])] = torch.tensor(out[rid], dtype=torch.int64)
        return new

    # -- generation ----------------------------------------------------------------------------------------------

    def generate(self, input_ids: torch.Tensor | Sequence[Sequence[int]], max_new_tokens: int = 16,
                 attention_mask: torch.Tensor | None = None, eos_token_id: int | None | str = "config",
                 pad_token_id: int | None = None) -> torch.Tensor:
        """Greedy decoding, as transformers' generate(do_sample=False): returns the (left-padded) prompts followed by
        the new tokens, int64 [batch, prompt width + new]. input_ids: a tensor or numpy array (with attention_mask:
        1 = token, 0 = padding, either side) or a list of token lists (ragged). After `eos_token_id` a row gets
        pad_token_id; generation stops early when every row has ended. Both default to the model config's (eos_token_id="config";
        pass None for no end token), as transformers' generate does."""
        if eos_token_id == "config":
            eos_token_id = self.eos_token_id
        if eos_token_id is not None and not isinstance(eos_token_id, int):
            raise ValueError(f"eos_token_id must be an int, None or 'config', got {eos_token_id!r}")
        if pad_token_id is None:
            pad_token_id = self.pad_token_id
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        input_ids = from_numpy(input_ids, "input_ids", self.label)  # numpy arrays as tensors, lists as they are
        if attention_mask is not None:
            attention_mask = from_numpy(attention_mask, "attention_mask", self.label)
        if isinstance(input_ids, torch.Tensor):
            if input_ids.dim() != 2:
                raise ValueError(f"input_ids must be [batch, seq], got {list(input_ids.shape)}")
            if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
                raise ValueError(f"input_ids must hold integer token ids, got {input_ids.dtype}")
            ids = input_ids.to(torch.int64)
            mask = torch.ones_like(ids) if attention_mask is None else attention_mask.to(torch.int64)
            if mask.shape != ids.shape:
                raise ValueError(f"attention_mask {list(mask.shape)} does not match input_ids {list(ids.shape)}")
            rows = [ids[i][mask[i] != 0].tolist() for i in range(ids.shape[0])]
        else:
            rows = [[_token_id(t) for t in r] for r in input_ids]
        if not rows or any(not r for r in rows):
            raise ValueError("every prompt needs at least one token")
        self.check_ids(rows, int(pad_token_id))
        # the prompts as given, or ragged lists left-padded to the longest
        prefix = ids if isinstance(input_ids, torch.Tensor) else \
            left_padded(rows, len(rows), max(map(len, rows)), pad_token_id)[0].long()
        if self.serving:
            return torch.cat([prefix, self._generate_serving(rows, max_new_tokens, eos_token_id, pad_token_id)], 1)
        batch, longest = len(rows), max(len(r) for r in rows)
        ctx_name = self.pick(CONTEXT, self.context_buckets, {"batch": batch, "seq": longest})
        tok_name = self.pick(TOKEN, self.token_buckets, {"batch": batch})
        cb, seq = self.context_buckets[ctx_name]["batch"], self.context_buckets[ctx_name]["seq"]
        tb = self.token_buckets[tok_name]["batch"]
        if seq + max_new_tokens - 1 > self.max_seq:
            raise NoBucketFits(f"{self.label}: context bucket seq={seq} + {max_new_tokens} new tokens need "
                               f"{seq + max_new_tokens - 1} cache slots; the KV cache holds max_seq={self.max_seq}")
        ctx_fn, tok_fn = self._fn(self._context, ctx_name), self._fn(self._token, tok_name)

        # Prefill: prompts left-padded to the bucket's seq; dummy rows attend to their own pad tokens.
        ids, mask, _positions = left_padded(rows, cb, seq, pad_token_id)
        ids, mask = ids.long(), mask.long()
        with torch.inference_mode():
            out = self.named(CONTEXT, ctx_fn(ids, mask))
            kv = self._resize_batch(out["kv"], tb)  # declared state: the token graph's own output from now on
            nxt = out["logits"][:batch].argmax(-1)
            cache_mask = torch.zeros((tb, self.max_seq), dtype=torch.int64)
            cache_mask[:, :seq] = 1
            cache_mask[:batch, :seq] = mask[:batch]
            position = torch.full((tb, 1), seq, dtype=torch.int64)
            position[:batch, 0] = mask[:batch].sum(-1)
            step_ids = torch.full((tb, 1), pad_token_id, dtype=torch.int64)
            done = torch.zeros(batch, dtype=torch.bool)
            new: list[torch.Tensor] = []
            for t in range(max_new_tokens):
                if eos_token_id is not None:
                    nxt = torch.where(done, torch.full_like(nxt, pad_token_id), nxt)
                    done |= nxt == eos_token_id
                new.append(nxt)
                if t == max_new_tokens - 1 or bool(done.all()):
                    break
                slot = seq + t
                cache_mask[:, slot] = 1
                step_ids[:batch, 0] = nxt
                out = self.named(TOKEN, tok_fn(step_ids, position, cache_mask, torch.tensor([slot]), kv))
                kv = out["kv"]  # fed back as is: the output aliasing the `kv` input
                nxt = out["logits"][:batch].argmax(-1)
                position += 1
        return torch.cat([prefix, torch.stack(new, 1)], dim=1)
