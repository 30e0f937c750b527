"""Model outputs as named tensors: any output pytree (tensor, tuple, list, dict, HF ModelOutput, KV caches, nested)
flattened at trace time, and which output dims follow which bucket dims."""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch

from neuronbuild.toolchains.errors import ToolchainError

SINGLE = "output"  # the name of a model's output when it returns one bare tensor


def _join(prefix: str, key: object) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def flatten(obj: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) leaves in a stable order; names are the pytree paths ('logits', 'past_key_values.0.keys').

    None leaves are dropped (HF outputs leave unused fields None); any other non-tensor leaf is an error."""
    if obj is None:
        return []
    if isinstance(obj, torch.Tensor):
        return [(prefix or SINGLE, obj)]
    if isinstance(obj, Mapping):  # dict, OrderedDict, HF ModelOutput (an OrderedDict of its non-None fields)
        return [x for k, v in obj.items() for x in flatten(v, _join(prefix, k))]
    if isinstance(obj, (tuple, list)):
        return [x for i, v in enumerate(obj) for x in flatten(v, _join(prefix, i))]
    layers = getattr(obj, "layers", None)
    if isinstance(layers, (list, tuple)) and all(hasattr(layer, "keys") and hasattr(layer, "values")
                                                  for layer in layers):
        # transformers' Cache (DynamicCache, StaticCache, ...): one (keys, values) pair per layer.
        out: list[tuple[str, torch.Tensor]] = []
        for i, layer in enumerate(layers):
            for part in ("keys", "values"):
                v = getattr(layer, part)
                out += flatten(v if not callable(v) else None, _join(prefix, f"{i}.{part}"))
        return out
    if hasattr(obj, "key_cache") and hasattr(obj, "value_cache"):  # older transformers caches
        return flatten({"key_cache": obj.key_cache, "value_cache": obj.value_cache}, prefix)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [x for f in dataclasses.fields(obj) for x in flatten(getattr(obj, f.name), _join(prefix, f.name))]
    what = prefix or "the model's output"
    raise ToolchainError(f"output '{what}' is a {type(obj).__name__}, not a tensor (or a tuple/list/dict/"
                         f"ModelOutput/cache of tensors); return tensors from forward()")


class FlatForward:
    """Makes `module` return its outputs flattened (a bare tensor stays a tensor, anything else becomes a tuple of
    tensors in `flatten` order), so exported programs hold no model-package types; `names` are the last call's.

    The instance's forward is replaced, not wrapped in another module, so parameter names stay the model's own."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.names: list[str] = []
        self.single = False
        original = module.forward

        def forward(_self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            named = flatten(out)
            self.names = [n for n, _t in named]
            self.single = isinstance(out, torch.Tensor)
            if self.single:
                return out
            if not named:
                raise ToolchainError("the model returns no tensors")
            return tuple(t for _n, t in named)

        forward.__signature__ = _signature(original)  # type: ignore[attr-defined]  # export reads argument names
        module.forward = types.MethodType(forward, module)  # type: ignore[method-assign]

    def undo(self) -> None:
        self.module.__dict__.pop("forward", None)


def _signature(fn: Callable[..., Any]) -> Any:
    import inspect

    sig = inspect.signature(fn)
    return sig.replace(parameters=[inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
                                   *sig.parameters.values()])


def output_names(out: Any) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of an eager model's raw output (the same names and order as the traced program's)."""
    return flatten(out)


def describe(named: list[tuple[str, torch.Tensor]], follows: list[list[str | None]]) -> list[dict[str, Any]]:
    """The outputs as trace metadata (and manifests) record them."""
    return [{"name": n, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "follows": f}
            for (n, t), f in zip(named, follows, strict=True)]


def declared_follows(declared: list[Any], named: list[tuple[str, torch.Tensor]], bucket: Mapping[str, int]
                     ) -> tuple[list[str], list[list[str | None]]]:
    """Names and followed bucket dims from the model's `outputs` attribute, checked against the traced outputs."""
    if len(declared) != len(named):
        got = ", ".join(n for n, _t in named)
        raise ToolchainError(f"attribute 'outputs' declares {len(declared)} output(s), the model returns "
                             f"{len(named)} tensor(s) ({got})")
    names: list[str] = []
    follows: list[list[str | None]] = []
    for (name, spec), (path, t) in zip(declared, named, strict=True):
        dims = list(spec.get("dims", ()))
        if len(dims) != t.dim():
            raise ToolchainError(f"output '{name}' ({path}) is declared with {len(dims)} dims {dims}, the model "
                                 f"returns shape {list(t.shape)}")
        dtype = str(spec.get("dtype", ""))
        if dtype and str(t.dtype).removeprefix("torch.") != dtype:
            raise ToolchainError(f"output '{name}' ({path}) is declared {dtype}, the model returns {t.dtype}")
        row: list[str | None] = []
        for j, d in enumerate(dims):
            want = bucket.get(d) if isinstance(d, str) else d
            if want is not None and int(t.shape[j]) != int(want):
                raise ToolchainError(f"output '{name}' ({path}) dim {j} is declared {d!r} = {want}, the model "
                                     f"returns {int(t.shape[j])}")
            row.append(d if isinstance(d, str) and d in bucket else None)
        names.append(str(name))
        follows.append(row)
    return names, follows


def inferred_follows(run: Callable[[Mapping[str, int]], list[tuple[str, torch.Tensor]]],
                     named: list[tuple[str, torch.Tensor]], bucket: Mapping[str, int]) -> list[list[str | None]]:
    """Which output dims follow which bucket dim, by running the model at a second size of each bucket dim and
    comparing shapes: an output dim follows `d` when it equals d's size at both sizes and no other change moves it.

    Never guessed from equal sizes at one shape (BERT's pooler_output [batch, hidden] with seq == hidden). A bucket
    dim the model accepts at no other size (a feature width sized by buckets) is followed by no output dim."""
    follows: list[list[str | None]] = [[None] * t.dim() for _n, t in named]
    moved: list[list[bool]] = [[False] * t.dim() for _n, t in named]
    for d, size in bucket.items():
        alt = None
        for other in ((size - 1, size + 1) if size > 1 else (size + 1,)):
            try:
                alt = run({**bucket, d: other})
                break
            except Exception:  # noqa: BLE001, S112 - the model rejects this size: try the other one
                continue
        if alt is None:
            continue
        if [n for n, _t in alt] != [n for n, _t in named]:
            raise ToolchainError(f"the model's outputs change with '{d}' ({d}={size} vs {other}); declare them "
                                 f"with the model's `outputs` attribute")
        for i, ((_n, t), (_m, u)) in enumerate(zip(named, alt, strict=True)):
            if t.dim() != u.dim():
                raise ToolchainError(f"output '{_n}' changes rank with '{d}'; declare `outputs`")
            for j in range(t.dim()):
                a, b = int(t.shape[j]), int(u.shape[j])
                if a == b:
                    continue
                if a == size and b == other and follows[i][j] is None and not moved[i][j]:
                    follows[i][j] = d
                else:
                    follows[i][j] = None
                moved[i][j] = True
    return follows
