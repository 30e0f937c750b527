"""Numerical validation: a built graph's artifact against the eager model on seeded inputs (max abs / rel error)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuronbuild import jsondata


@dataclass(frozen=True)
class Comparison:
    """Errors of one graph against eager: max |out - ref| and that divided by max |ref|."""

    max_abs: float
    max_rel: float
    shape: tuple[int, ...]
    error: str = ""  # set when running either side failed (e.g. an input value out of the model's range)


def value_config(model_spec: Mapping[str, Any], workspace: Path) -> dict[str, Any]:
    """The keys that size random integer inputs: the model's `config`, over the top-level keys of any declared
    `config.json` data file (HF models read theirs from there)."""

    merged: dict[str, Any] = {}
    for path in sorted(model_spec.get("data") or {}):
        if not str(path).endswith("config.json"):
            continue
        try:
            data = jsondata.loads((Path(workspace) / path).read_bytes()[: 1 << 20])
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            merged.update({k: v for k, v in data.items() if isinstance(v, int) and not isinstance(v, bool)})
    return merged | dict(model_spec.get("config") or {})


def eager_model(model_spec: Mapping[str, Any], workspace: Path) -> Callable[..., Any]:
    """The eager model a trace record describes, built from the workspace's sources and weights."""
    from neuronbuild.toolchains.model_import import build_eager_model

    return build_eager_model(dict(model_spec), workspace)


def compare(fn: Callable[..., Any], model: Callable[..., Any], inputs: Any, bucket: Mapping[str, int],
            config: Mapping[str, Any], seed: int, ranges: Mapping[str, Any] | None = None) -> Comparison:
    """Run both on the same seeded inputs; every output tensor (flattened by name, as traced) is compared."""
    import torch

    from neuronbuild.toolchains.model_import import example_inputs
    from neuronbuild.toolchains.outputs import flatten

    args = example_inputs(inputs, dict(bucket), seed=seed, config=dict(config), ranges=ranges)
    try:
        with torch.no_grad():
            ref = [t for _n, t in flatten(model(*args))]
            out = [t for _n, t in flatten(fn(*args))]
    except Exception as exc:  # noqa: BLE001 - reported as this graph's result, with how to fix the usual cause
        first = (str(exc).strip().splitlines() or [""])[0]
        hint = " (integer inputs out of range? set the model's input_ranges)" if isinstance(exc, IndexError) else ""
        return Comparison(float("inf"), float("inf"), (), f"{type(exc).__name__}: {first}{hint}")
    if len(ref) != len(out) or any(tuple(r.shape) != tuple(o.shape) for r, o in zip(ref, out, strict=False)):
        return Comparison(float("inf"), float("inf"), tuple(int(o.numel()) for o in out))
    ref_t = torch.cat([t.reshape(-1).float() for t in ref]) if ref else torch.zeros(0)
    out_t = torch.cat([t.reshape(-1).float() for t in out]) if out else torch.zeros(0)
    max_abs = float((out_t - ref_t).abs().max()) if ref_t.numel() else 0.0
    scale = float(ref_t.abs().max()) if ref_t.numel() else 0.0
    return Comparison(max_abs, max_abs / scale if scale > 0 else max_abs, tuple(ref_t.shape))


# -- hf_causal_lm: the reference is transformers' own model (same config, same weights) ---------------------------

HF_ENTRY = "neuronbuild.toolchains.hf_causal_lm:"


def is_hf_causal_lm(model_spec: Mapping[str, Any]) -> bool:
    from neuronbuild.toolchains.validate_block import BLOCK_ENTRY  # (kv_layout = "block": its own graph module)

    return str(model_spec.get("entry") or "").startswith((HF_ENTRY, BLOCK_ENTRY))


def unquantized(model_spec: Mapping[str, Any]) -> dict[str, Any] | None:
    """A quantized hf_causal_lm's spec without its quantization and fp8 KV cache (the float model validate reports
    the quantization error against), or None for a model that has neither."""
    config = dict(model_spec.get("config") or {})
    weights, kv = config.pop("quantization", None), config.pop("kv_cache_dtype", None)
    if not is_hf_causal_lm(model_spec) or (weights is None and kv is None):
        return None
    return {**model_spec, "config": config}


# The error a graph computing in a 16-bit float dtype is allowed on top of the target's `tolerance`, relative to the
# largest reference logit: 8 units in the last place of bfloat16 (2^-8 each), of float16 (2^-11 each). The compiled
# graph and transformers' eager model round differently (fused kernels keep float32 intermediates), one last place per
# op at worst; tokens are compared exactly all the same (validate --generate).
LOW_PRECISION_REL = {"bfloat16": 2.0 ** -5, "float16": 2.0 ** -8}


def hf_dtype(model_spec: Mapping[str, Any]) -> str:
    """The dtype an hf_causal_lm computes in (its config's), float32 for any other model."""
    if not is_hf_causal_lm(model_spec):
        return "float32"
    from neuronbuild.toolchains.hf_causal_lm import model_dtype

    return str(model_dtype(dict((model_spec.get("config") or {}).get("hf") or {}))).removeprefix("torch.")


def accepted_error(tolerance: float, dtype: str, cmp: Comparison) -> float:
    """The max abs error accepted for one comparison: the target's `tolerance`, or for a bfloat16 / float16 model
    LOW_PRECISION_REL of the largest reference value when that is larger."""
    rel = LOW_PRECISION_REL.get(dtype)
    if rel is None or not cmp.max_rel or cmp.max_rel == float("inf"):
        return tolerance
    scale = cmp.max_abs / cmp.max_rel if cmp.max_abs else 0.0
    return max(tolerance, rel * scale)


def reference_model(config: Mapping[str, Any]) -> Any:
    """transformers' model of an hf_causal_lm config (hf_causal_lm.hf_model: random weights, in eval mode) computing
    its mixture-of-experts layers with transformers' eager experts. transformers picks its `grouped_mm` experts by
    default, whose CPU kernel refuses an expert whose intermediate rows are not a multiple of 16 bytes (e.g. an
    expert width of 6 in float32: "RuntimeError: strides should be multiple of 16 bytes"); the eager experts (each
    expert hit, its own linear layers) compute the same for any width, in every family whose experts go through
    transformers' experts interface. A model without experts is unchanged. The graphs themselves trace neuronbuild's
    dense experts (hf_causal_lm.EXPERTS), not these."""
    from neuronbuild.toolchains import hf_causal_lm

    model: Any = hf_causal_lm.hf_model(dict(config)).eval()
    model.set_experts_implementation("eager")
    return model


class HfReference:
    """transformers' model class of an hf_causal_lm built from the same config with the graphs' weights (as
    neuronbuild loads them for the trace; its experts transformers' eager ones: reference_model), plus the wrapper's
    eager context graph (only to fill the token graph's cache input: its errors reach the token logits compared with
    transformers')."""

    def __init__(self, model_spec: Mapping[str, Any], workspace: Path) -> None:
        from neuronbuild.toolchains import hf_causal_lm
        from neuronbuild.toolchains.model_import import build_eager_model

        self.config = dict(model_spec.get("config") or {})
        eager: Any = build_eager_model(dict(model_spec), workspace)
        state = eager.state_dict()
        model = reference_model(self.config)
        model.load_state_dict(state)
        self.model = model
        self.context: Any = hf_causal_lm.context(self.config).eval()
        self.context.load_state_dict(state)
        self.max_seq = int(self.config["max_seq"])
        self.vocab = int(model.config.vocab_size)
        from neuronbuild.toolchains.quantize import kv_cache_dtype

        self.kv_dtype = kv_cache_dtype(self.config)
        self.kv_input: Any = None  # the graphs' KV cache dtype when it is not this model's (HfReference.unquantized)

        # continuous-batching graphs (hf_causal_lm serving_* / sampling_* entries): a cache of lines, rows by seq_ids
        from neuronbuild.toolchains.validate_block import is_block

        self.block = is_block(model_spec)  # kv_layout = "block": block_* entries over a pool of blocks
        entry = str(model_spec.get("entry") or "").rsplit(":", 1)[-1].removeprefix("block_")
        self.serving = entry.startswith(("serving_", "sampling_"))
        self.sampling = entry.startswith("sampling_")
        kv = dict(model_spec.get("whole_inputs") or model_spec.get("inputs") or []).get("kv") or {}
        self.kv_dims = [int(d) for d in kv.get("dims") or []] if self.serving else []
        self.lines_dtype = str(kv.get("dtype") or "float32")

    @classmethod
    def unquantized(cls, model_spec: Mapping[str, Any], workspace: Path) -> HfReference:
        """The reference of a quantized model's float model (`unquantized`), making token cases for its graphs."""
        from neuronbuild.toolchains.quantize import kv_cache_dtype

        plain = unquantized(model_spec)
        if plain is None:
            raise ValueError("internal: the model is not quantized")
        ref = cls(plain, workspace)
        ref.kv_input = kv_cache_dtype(dict(model_spec.get("config") or {}))
        return ref

    def cache(self) -> Any:
        """A fresh transformers cache for one forward or generate: None (transformers' own) unless the KV cache is
        fp8, then one holding what the graphs' cache holds (keys and values cast to fp8 and back)."""
        from neuronbuild.toolchains.quantize import rounding_cache

        return None if self.kv_dtype is None else rounding_cache(self.model.config, self.kv_dtype)

    def prompts(self, gen: Any, batch: int, width: int) -> tuple[Any, Any]:
        """Seeded random prompts left-padded to `width` (row 0 full, the others 1..width tokens), pad id 0."""
        import torch

        ids = torch.randint(0, self.vocab, (batch, width), generator=gen, dtype=torch.int64)
        lengths = [width] + torch.randint(1, width + 1, (max(batch - 1, 0),), generator=gen).tolist()
        mask = torch.zeros((batch, width), dtype=torch.int64)
        for i, n in enumerate(lengths):
            mask[i, width - n:] = 1
        return ids.masked_fill(mask == 0, 0), mask

    @staticmethod
    def positions(mask: Any) -> Any:
        return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # as transformers' generate derives them

    def context_logits(self, ids: Any, mask: Any) -> Any:
        return self.model(input_ids=ids, attention_mask=mask, position_ids=self.positions(mask),
                          past_key_values=self.cache()).logits[:, -1]

    def token_case(self, gen: Any, batch: int, verify: int = 0) -> tuple[tuple[Any, ...], Any]:
        """The token graph's inputs after a prefill of max_seq // 2 slots, and transformers' next logits after its
        own prefill of the same prompts. Continuous-batching graphs: row b's prompt left-aligned in line b (rows
        beyond max_batch write the scratch line: compare_hf leaves them out). `verify` = k + 1: a speculation
        verify graph's inputs (k + 1 tokens per row) and transformers' logits at those k + 1 positions."""
        import torch

        width = max(1, self.max_seq // 2)
        ids, mask = self.prompts(gen, batch, width)
        nxt = torch.randint(0, self.vocab, (batch, verify or 1), generator=gen, dtype=torch.int64)
        kv = self.context(ids, mask)["kv"]
        if self.kv_input is not None:
            kv = kv.to(self.kv_input)
        pos = mask.sum(-1, keepdim=True)
        if self.serving:
            lines = torch.zeros(self.kv_dims, dtype=getattr(torch, self.lines_dtype))
            attend = torch.zeros((batch, self.max_seq), dtype=torch.int32)
            for b in range(min(batch, self.kv_dims[2] - 1)):
                n = int(pos[b, 0])
                lines[:, :, b, :, :n] = kv[:, :, b, :, width - n:width]
                attend[b, : n + 1] = 1
            args: tuple[Any, ...] = (nxt.int(), attend, pos.int(), self.seq_ids(batch), *self.greedy_sampling(batch),
                                     lines)
            if verify:  # positions pos..pos+k; the mask names the slots before them; a draw per position
                sampling = self.greedy_sampling(batch)
                args = (nxt.int(), (torch.arange(self.max_seq)[None, :] < pos).to(torch.int32),
                        (pos + torch.arange(verify)[None, :]).int(), self.seq_ids(batch),
                        *((sampling[0], torch.zeros((batch, verify))) if sampling else ()), lines)
        else:
            cache_mask = torch.zeros((batch, self.max_seq), dtype=torch.int64)
            cache_mask[:, :width] = mask
            cache_mask[:, width] = 1
            args = (nxt, pos, cache_mask, torch.tensor([width], dtype=torch.int64), kv)
        pre = self.model(input_ids=ids, attention_mask=mask, position_ids=self.positions(mask), use_cache=True,
                         past_key_values=self.cache())
        full = torch.cat([mask, torch.ones((batch, verify or 1), dtype=torch.int64)], dim=1)
        out = self.model(input_ids=nxt, attention_mask=full, position_ids=pos + torch.arange(verify or 1)[None, :],
                         past_key_values=pre.past_key_values, use_cache=True).logits
        return args, (out if verify else out[:, -1])


    def lines(self, kv: Any, pos: Any, width: int, dims: list[int], dtype: str) -> Any:
        """A continuous-batching cache of `dims`: row b's left-padded prompt (its pos[b] tokens, from a context
        graph's `kv` over `width` slots) left-aligned in line b (rows beyond the lines: none)."""
        import torch

        lines = torch.zeros(dims, dtype=getattr(torch, dtype))
        for b in range(min(int(pos.shape[0]), dims[2] - 1)):
            n = int(pos[b, 0])
            lines[:, :, b, :, :n] = kv[:, :, b, :, width - n:width].to(lines.dtype)
        return lines

    def fused_case(self, draft: HfReference, gen: Any, batch: int, k: int, draft_dims: list[int], draft_dtype: str,
                   run: Callable[..., Any], names: list[str]) -> tuple[dict[str, Any], Any, Any]:
        """A fused speculation graph (hf_causal_lm speculation fused = True) after both models' prefill of the same
        seeded prompts (n tokens each) and a random last accepted token t at slot n: its outputs, and transformers'
        logits of the target at [t, d_1..d_k] and of the draft at [t, d_1..d_k-1], where d_i are the graph's own
        proposals (the draft's logits decide them: compared, they make the proposals transformers' too)."""
        import torch

        width = max(1, self.max_seq // 2)
        ids, mask = self.prompts(gen, batch, width)
        t = torch.randint(0, self.vocab, (batch, 1), generator=gen, dtype=torch.int64)
        pos = mask.sum(-1, keepdim=True)
        lines = self.lines(self.context(ids, mask)["kv"], pos, width, self.kv_dims, self.lines_dtype)
        draft_lines = self.lines(draft.context(ids, mask)["kv"], pos, width, draft_dims, draft_dtype)
        pair = torch.cat([ids[:, -1:], t], 1)
        sampling = self.greedy_sampling(batch)
        args = (pair.int(), (torch.arange(self.max_seq)[None, :] < pos).to(torch.int32),
                torch.cat([pos - 1, pos], 1).int(), self.seq_ids(batch),
                *((sampling[0], torch.zeros((batch, k + 1)), torch.zeros((batch, k))) if sampling else ()),
                lines, draft_lines)
        out = _named(run(*args), names)
        proposals = out["draft_tokens"].long()

        def after_prompt(model: Any, new: Any) -> Any:
            pre = model(input_ids=ids, attention_mask=mask, position_ids=self.positions(mask), use_cache=True)
            full = torch.cat([mask, torch.ones(new.shape, dtype=torch.int64)], dim=1)
            return model(input_ids=new, attention_mask=full, position_ids=pos + torch.arange(new.shape[1])[None, :],
                         past_key_values=pre.past_key_values, use_cache=True).logits

        want = after_prompt(self.model, torch.cat([t, proposals], 1))
        draft_want = after_prompt(draft.model, torch.cat([t, proposals[:, :-1]], 1))
        return out, want, draft_want

    def seq_ids(self, batch: int) -> Any:
        """Continuous-batching graphs: row b in line b; rows beyond max_batch in the scratch line (-1)."""
        import torch

        return torch.tensor([b if b < self.kv_dims[2] - 1 else -1 for b in range(batch)], dtype=torch.int32)

    def greedy_sampling(self, batch: int) -> tuple[Any, ...]:
        """on_device_sampling graphs' sampling_params and rand: greedy (top_k 1) for every row."""
        import torch

        if not self.sampling:
            return ()
        return torch.tensor([[1.0, 1.0, 0.0]] * batch), torch.zeros(batch)

    def serving_context_case(self, gen: Any, batch: int, seq: int) -> tuple[Any, ...]:
        import torch

        ids, mask = self.prompts(gen, batch, seq)
        return (ids.int(), mask.int(), self.positions(mask).int(), self.seq_ids(batch), *self.greedy_sampling(batch),
                torch.zeros(self.kv_dims, dtype=getattr(torch, self.lines_dtype)))


def _named(out: Any, names: list[str]) -> dict[str, Any]:
    import torch

    tensors = [out] if isinstance(out, torch.Tensor) else list(out.values()) if isinstance(out, dict) else list(out)
    return dict(zip(names, tensors, strict=False))


def compare_hf(fn: Callable[..., Any], ref: HfReference, graph: str, bucket: Mapping[str, int], output_names: list[str],
               seed: int, verify: int = 0, draft: tuple[HfReference, Mapping[str, Any]] | None = None) -> Comparison:
    """An hf_causal_lm graph against transformers: the context graph's last-position logits against a transformers
    forward over the same left-padded prompts; the token graph's logits against transformers' next logits after a
    prefill of the same prompts; a speculation verify graph's (`verify` = k + 1 positions) logits at its positions
    likewise; a fused speculation graph's (`draft`: the draft's reference and its cache spec) target and draft logits
    against transformers' models of both (HfReference.fused_case)."""
    import torch

    gen = torch.Generator().manual_seed(int(seed))
    if graph == "fused" and draft is not None:
        return _compare_fused(fn, ref, draft, int(bucket["batch"]), output_names, verify - 1, gen)
    try:
        with torch.no_grad():
            if ref.block:  # (toolchains/validate_block.py: the pool's blocks shuffled among the rows)
                from neuronbuild.toolchains import validate_block

                batch = int(bucket["batch"])
                args, want = (validate_block.token_case(ref, gen, batch) if graph == "token" else
                              validate_block.prefix_case(ref, gen, batch, int(bucket["seq"]), int(bucket["prefix"]))
                              if graph == "prefix" else validate_block.context_case(ref, gen, batch, int(bucket["seq"])))
            elif graph == "token":
                args, want = ref.token_case(gen, int(bucket["batch"]))
            elif graph == "verify":  # (hf_causal_lm speculation) k + 1 positions per row
                args, want = ref.token_case(gen, int(bucket["batch"]), verify)
            elif ref.serving:
                args = ref.serving_context_case(gen, int(bucket["batch"]), int(bucket["seq"]))
                want = ref.context_logits(args[0].long(), args[1].long())
            else:
                args = ref.prompts(gen, int(bucket["batch"]), int(bucket["seq"]))
                want = ref.context_logits(*args)
            out = _named(fn(*args), output_names)
    except Exception as exc:  # noqa: BLE001 - reported as this graph's result
        first = (str(exc).strip().splitlines() or [""])[0]
        return Comparison(float("inf"), float("inf"), (), f"{type(exc).__name__}: {first}")
    if ref.serving and graph in ("token", "verify"):  # rows in the scratch line (beyond max_batch) hold no prefill
        want = want[: ref.kv_dims[2] - 1]
    if "logits" not in out:  # on_device_sampling without logits: greedy tokens, exactly
        tokens = out["tokens"][: want.shape[0]]
        equal = tokens.tolist() == want.argmax(-1).tolist()
        return Comparison(0.0 if equal else float("inf"), 0.0 if equal else float("inf"), tuple(tokens.shape))
    got = out["logits"][: want.shape[0]]
    if tuple(got.shape) != tuple(want.shape):
        return Comparison(float("inf"), float("inf"), tuple(got.shape))
    max_abs = float((got.float() - want.float()).abs().max())
    scale = float(want.float().abs().max())
    return Comparison(max_abs, max_abs / scale if scale > 0 else max_abs, tuple(want.shape))


def _compare_fused(fn: Callable[..., Any], ref: HfReference, draft: tuple[HfReference, Mapping[str, Any]], batch: int,
                   names: list[str], k: int, gen: Any) -> Comparison:
    import torch

    dref, kv = draft
    try:
        with torch.no_grad():
            out, want, dwant = ref.fused_case(dref, gen, batch, k, [int(d) for d in kv["dims"]], str(kv["dtype"]), fn,
                                              names)
    except Exception as exc:  # noqa: BLE001 - reported as this graph's result
        first = (str(exc).strip().splitlines() or [""])[0]
        return Comparison(float("inf"), float("inf"), (), f"{type(exc).__name__}: {first}")
    rows = min(batch, ref.kv_dims[2] - 1)  # (rows beyond max_batch: the scratch line, no prefill)
    if "logits" not in out:  # on_device_sampling without logits: greedy tokens, exactly
        equal = (out["tokens"][:rows].tolist() == want[:rows].argmax(-1).tolist()
                 and out["draft_tokens"][:rows].tolist() == dwant[:rows].argmax(-1).tolist())
        return Comparison(0.0 if equal else float("inf"), 0.0 if equal else float("inf"), tuple(want.shape))
    got = torch.cat([out["logits"][:rows].reshape(-1), out["draft_logits"][:rows].reshape(-1)]).float()
    ref_t = torch.cat([want[:rows].reshape(-1), dwant[:rows].reshape(-1)]).float()
    if got.shape != ref_t.shape:
        return Comparison(float("inf"), float("inf"), tuple(got.shape))
    max_abs = float((got - ref_t).abs().max())
    scale = float(ref_t.abs().max())
    return Comparison(max_abs, max_abs / scale if scale > 0 else max_abs, tuple(ref_t.shape))


class _Graph:
    def __init__(self, spec: Mapping[str, Any], bucket: Mapping[str, int], name: str, aliases: Mapping[str, str],
                 label: str) -> None:
        # what callers feed: a tensor-parallel graph's inputs whole (as bundle manifests list them)
        self.inputs = {str(n): dict(s) for n, s in spec.get("whole_inputs") or spec["inputs"]}
        self.outputs = [{"name": str(n)} for n, _s in spec.get("outputs") or []]
        self.aliases = dict(aliases)
        self.trace_record = {"model": dict(spec)}
        self.bucket = dict(bucket)
        self._what = f"{label} [{name}]"

    def describe(self) -> str:
        return self._what


class _Family:
    """What runtime.causal_lm.CausalLM reads of a deployed model's graph family, over loaded artifacts."""

    def __init__(self, label: str, graphs: dict[str, tuple[_Graph, Callable[..., Any]]]) -> None:
        self.label = label
        self._graphs = graphs

    @property
    def buckets(self) -> dict[str, dict[str, int]]:
        return {n: dict(g.bucket) for n, (g, _fn) in self._graphs.items()}

    def graph(self, name: str) -> _Graph:
        return self._graphs[name][0]

    def bucket_fn(self, name: str) -> Callable[..., Any]:
        return self._graphs[name][1]


class _Model:
    def __init__(self, label: str, families: dict[str, _Family]) -> None:
        self.label = label
        self.families = list(families)
        self._families = families

    def family(self, name: str) -> _Family:
        return self._families[name]


def verify_width(spec: Mapping[str, Any]) -> int:
    """k + 1 for a speculation verify graph's model spec (hf_causal_lm speculation), else 0."""
    spec_cfg = (spec.get("config") or {}).get("speculation") or {}
    return int(spec_cfg.get("length") or 0) + 1 if spec.get("graph") in ("verify", "fused") and spec_cfg else 0


def generate_cases(label: str, ref: HfReference, graphs: Mapping[str, Mapping[str, tuple[Mapping[str, Any],
                   Mapping[str, int], Callable[..., Any]]]], aliases: Mapping[str, str], new_tokens: int,
                   seed: int, tolerance: float = 0.0) -> list[tuple[str, bool, str]]:
    """Greedy tokens from the compiled graphs, run by the runtime's CausalLM as it serves them, against transformers'
    `generate` on seeded random prompts: batch 1 and (when a bucket holds two rows) a left-padded batch of the
    largest token-bucket batch. `graphs`: family -> bucket name -> (trace spec, bucket, loaded artifact);
    `tolerance`: the logits' accepted max abs error (ties: _against_transformers).
    Returns (case, equal, detail) per case."""
    import torch

    from neuronbuild.runtime.causal_lm import CausalLM

    families = {fam: _Family(label, {n: (_Graph(spec, b, n, aliases if fam == "token" else {}, label), fn)
                                     for n, (spec, b, fn) in by_name.items()})
                for fam, by_name in graphs.items()}
    lm = CausalLM(_Model(label, families), strict=True)
    gen = torch.Generator().manual_seed(int(seed))
    seqs = sorted({b["seq"] for b in lm.context_buckets.values() if b["seq"] + new_tokens - 1 <= ref.max_seq})
    if not seqs:
        return [("generate", False, f"no context bucket leaves room for {new_tokens} new tokens in max_seq "
                                    f"{ref.max_seq}")]
    width = seqs[-1]
    batches = sorted({b["batch"] for b in lm.token_buckets.values()} & {b["batch"] for b in lm.context_buckets.values()})
    cases = [("batch1", 1)] + ([(f"batch{batches[-1]}_padded", batches[-1])] if batches and batches[-1] > 1 else [])
    out = []
    for case, batch in cases:
        ids, mask = ref.prompts(gen, batch, width)
        try:
            with torch.no_grad():
                got = lm.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, eos_token_id=None)[:, -new_tokens:]
                out.append((case, *_against_transformers(ref, ids, mask, got, tolerance)))
        except Exception as exc:  # noqa: BLE001 - reported as this case's result
            first = (str(exc).strip().splitlines() or [""])[0]
            out.append((case, False, f"{type(exc).__name__}: {first}"))
    return out


def _hf_tokens(ref: HfReference, ids: Any, mask: Any, n: int, logits: bool = False) -> tuple[Any, Any]:
    """transformers' greedy `generate` of n tokens after left-padded `ids`: batched as the static graphs run them, or
    (continuous batching) each request on its own; with `logits`, also its logits for the first one ([batch, vocab])."""
    import torch

    width = ids.shape[1]
    # (each request alone: every one of its tokens attended, pad id or not; without a mask generate would take a
    # token equal to the pad id inside a prompt for padding)
    parts = [(r, torch.ones_like(r)) for r in (ids[i:i + 1, width - int(mask[i].sum()):] for i in range(ids.shape[0]))] \
        if ref.serving else [(ids, mask)]
    toks, first = [], []
    for r, m in parts:
        res = ref.model.generate(r, attention_mask=m, max_new_tokens=n, do_sample=False, eos_token_id=None,
                                 pad_token_id=0, past_key_values=ref.cache(), min_new_tokens=n,
                                 return_dict_in_generate=True, output_logits=logits)
        toks.append(res.sequences[:, -n:])
        if logits:
            first.append(res.logits[0])
    return torch.cat(toks), torch.cat(first) if logits else None


def _against_transformers(ref: HfReference, ids: Any, mask: Any, got: Any, tolerance: float) -> tuple[bool, str]:
    """Whether the graphs' greedy tokens `got` ([batch, n]) are transformers' for the same prompts, and how.

    At the first new token where a row differs, transformers' logits there decide: when the graphs' token is one whose
    logit is within what the graphs may round (twice the logits' tolerance, or the dtype's rounding at that
    magnitude) of transformers' top token, the two models differ only by a tie, which is reported and not counted;
    transformers then continues from the graphs' tokens (prompt + the tokens so far: a compiled context bucket could
    not hold a longer prompt) and the rest is compared the same way. Any other difference fails, naming the gap."""
    import torch

    n = got.shape[1]
    want, _ = _hf_tokens(ref, ids, mask, n)
    ties: list[str] = []
    done = 0  # new tokens matched so far (ties included)
    while True:
        diff = (got[:, done:] != want).nonzero().tolist()
        if not diff:
            break
        col = min(c for _r, c in diff)
        rows = sorted({r for r, c in diff if c == col})
        pre = got[:, done:done + col]  # the same tokens in both, for every row up to col
        ext_ids = torch.cat([ids, got[:, :done].to(ids.dtype), pre.to(ids.dtype)], dim=1)
        ext_mask = torch.cat([mask, torch.ones((mask.shape[0], done + col), dtype=mask.dtype)], dim=1)
        _t, logits = _hf_tokens(ref, ext_ids, ext_mask, 1, logits=True)
        for r in rows:
            lg = logits[r].float()
            top2 = torch.topk(lg, 2)
            a, b = int(want[r, col]), int(got[r, done + col])
            gap = float(lg[a] - lg[b])
            rounding = max(2 * tolerance, float(torch.finfo(logits.dtype).eps) * abs(float(lg[a])))
            where = (f"row {r} new token {done + col + 1}: {b}, transformers {a} (its top-2 gap there "
                     f"{float(top2.values[0] - top2.values[1]):.3g}, {b}'s logit {gap:.3g} below the top)")
            if gap > rounding:
                return False, (f"{where}: differs beyond rounding ({rounding:.3g}); {got[r].tolist()} != "
                               f"transformers {torch.cat([got[r, :done + col], want[r, col:]]).tolist()}"
                               + (f"; ties before: {'; '.join(ties)}" if ties else ""))
            ties.append(f"{where}: a tie within rounding ({rounding:.3g})")
        done += col + 1
        if done >= n:
            break
        cont_ids = torch.cat([ids, got[:, :done].to(ids.dtype)], dim=1)
        cont_mask = torch.cat([mask, torch.ones((mask.shape[0], done), dtype=mask.dtype)], dim=1)
        want, _ = _hf_tokens(ref, cont_ids, cont_mask, n - done)
    batch = got.shape[0]
    if not ties:
        return True, f"{n} tokens x {batch} equal"
    return True, (f"{n} tokens x {batch} equal but for {len(ties)} tie{'s' if len(ties) > 1 else ''} "
                  f"(transformers continued from the graphs' token): {'; '.join(ties)}")
