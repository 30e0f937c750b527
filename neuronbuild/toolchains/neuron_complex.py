"""Complex arithmetic lowered as real pairs, so a Neuron graph holds no complex dtype (Neuron has none).

Models written with complex numbers (Llama 4's RoPE: `torch.polar`, `view_as_complex`, a complex multiply,
`view_as_real`) trace to ATen ops on complex64 tensors. The HLO lowering (neuron_hlo.py) hands every node that reads
or makes a complex tensor to `call`, which computes it on a `Pair`: a real jax array whose last dimension of size 2
holds (real, imaginary). Shape ops move their dims past that last one; `view_as_complex` / `view_as_real` are the
identity on the array. Only the ops below are known; any other op on a complex tensor is a LoweringError naming the
op and the model's source line. A complex program input or output is refused (a graph's interface is real)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Pair:
    """A complex tensor as a real jax array [..., 2] (real, imaginary)."""

    arr: Any

    @property
    def rank(self) -> int:  # the complex tensor's rank
        return int(self.arr.ndim) - 1


def involves_complex(node: torch.fx.Node) -> bool:
    """Whether an FX node makes a complex tensor or reads one."""
    def is_complex(v: Any) -> bool:
        return isinstance(v, torch.Tensor) and v.dtype.is_complex

    val = node.meta.get("val")
    if any(is_complex(v) for v in (val if isinstance(val, list | tuple) else [val])):
        return True
    return any(is_complex(a.meta.get("val")) for a in node.all_input_nodes)


def _jnp() -> Any:
    import jax.numpy as jnp

    return jnp


def _parts(x: Any) -> tuple[Any, Any]:
    """(real, imaginary) of a Pair, a real array or a Python number (imaginary 0 for real ones)."""
    jnp = _jnp()
    if isinstance(x, Pair):
        return x.arr[..., 0], x.arr[..., 1]
    if isinstance(x, complex):
        return x.real, x.imag
    return x, jnp.zeros_like(x) if hasattr(x, "shape") else 0.0


def _pair(re: Any, im: Any) -> Pair:
    jnp = _jnp()
    re, im = jnp.broadcast_arrays(jnp.asarray(re), jnp.asarray(im))
    return Pair(jnp.stack([re, im], axis=-1))


def _dim(d: int, rank: int) -> int:
    """A complex tensor's dim (possibly negative) as an index into its pair array (the pair dim stays last)."""
    return d + rank if d < 0 else d


def _mul(a: Any, b: Any) -> Pair:
    if not isinstance(a, Pair):
        a, b = b, a
    if not isinstance(b, Pair) and not isinstance(b, complex):  # complex x real: scale both parts
        r = b[..., None] if hasattr(b, "shape") and getattr(b, "ndim", 0) > 0 else b
        return Pair(a.arr * r)
    ar, ai = _parts(a)
    br, bi = _parts(b)
    return _pair(ar * br - ai * bi, ar * bi + ai * br)


def _div(a: Any, b: Any) -> Pair:
    br, bi = _parts(b)
    den = br * br + bi * bi
    ar, ai = _parts(a)
    return _pair((ar * br + ai * bi) / den, (ai * br - ar * bi) / den)


def _add(a: Any, b: Any, alpha: Any = 1, sign: int = 1) -> Pair:
    ar, ai = _parts(a)
    br, bi = _parts(b)
    return _pair(ar + sign * alpha * br, ai + sign * alpha * bi)


def _view(x: Pair, shape: Sequence[int]) -> Pair:
    return Pair(x.arr.reshape(*[int(s) for s in shape], 2))


def _slice(x: Pair, dim: int = 0, start: Any = None, end: Any = None, step: int = 1) -> Pair:
    d = _dim(int(dim), x.rank)
    idx = [slice(None)] * x.arr.ndim
    idx[d] = slice(start, end, step)
    return Pair(x.arr[tuple(idx)])


def _select(x: Pair, dim: int, index: int) -> Pair:
    d = _dim(int(dim), x.rank)
    idx: list[Any] = [slice(None)] * x.arr.ndim
    idx[d] = int(index)
    return Pair(x.arr[tuple(idx)])


def _permute(x: Pair, dims: Sequence[int]) -> Pair:
    jnp = _jnp()
    return Pair(jnp.transpose(x.arr, [_dim(int(d), x.rank) for d in dims] + [x.rank]))


def _transpose(x: Pair, a: int, b: int) -> Pair:
    jnp = _jnp()
    return Pair(jnp.swapaxes(x.arr, _dim(int(a), x.rank), _dim(int(b), x.rank)))


def _expand(x: Pair, shape: Sequence[int], implicit: bool = False) -> Pair:  # noqa: ARG001
    jnp = _jnp()
    lead = len(shape) - x.rank
    full = [int(s) if int(s) != -1 else int(x.arr.shape[i - lead]) for i, s in enumerate(shape)]
    return Pair(jnp.broadcast_to(x.arr, (*full, 2)))


def _cat(xs: Sequence[Any], dim: int = 0) -> Pair:
    jnp = _jnp()
    pairs = [x if isinstance(x, Pair) else _pair(*_parts(x)) for x in xs]
    return Pair(jnp.concatenate([p.arr for p in pairs], axis=_dim(int(dim), pairs[0].rank)))


def _sum(x: Pair, dims: Sequence[int] | None = None, keepdim: bool = False, dtype: Any = None) -> Pair:
    jnp = _jnp()
    axes = tuple(range(x.rank)) if not dims else tuple(_dim(int(d), x.rank) for d in dims)
    return Pair(jnp.sum(x.arr, axis=axes, keepdims=keepdim))


def _index(x: Pair, indices: Sequence[Any]) -> Pair:
    return Pair(x.arr[tuple(slice(None) if i is None else i for i in indices)])


def _to_copy(x: Any, node: torch.fx.Node) -> Any:
    """A dtype change: complex to complex keeps the pair (in the new part dtype), complex to real keeps the real part
    (as torch does), real to complex makes a zero imaginary part."""
    from torchax.ops import mappings

    val = node.meta["val"]
    if val.dtype.is_complex:
        part = mappings.t2j_dtype(val.dtype.to_real())
        if isinstance(x, Pair):
            return Pair(x.arr.astype(part))
        return _pair(_jnp().asarray(x).astype(part), _jnp().zeros(x.shape, part))
    re, _im = _parts(x)
    return re.astype(mappings.t2j_dtype(val.dtype))


def _exp(x: Pair) -> Pair:
    jnp = _jnp()
    re, im = _parts(x)
    m = jnp.exp(re)
    return _pair(m * jnp.cos(im), m * jnp.sin(im))


# ATen overload -> fn(args..., **kwargs) on Pairs / arrays / numbers. `node` is passed to those that read the result's
# metadata (its dtype).
_RULES: dict[str, Callable[..., Any]] = {
    "view_as_complex.default": lambda x: Pair(x),
    "view_as_real.default": lambda x: x.arr,
    "polar.default": lambda r, theta: _pair(r * _jnp().cos(theta), r * _jnp().sin(theta)),
    "complex.default": lambda re, im: _pair(re, im),
    "real.default": lambda x: _parts(x)[0],
    "imag.default": lambda x: _parts(x)[1],
    "mul.Tensor": _mul,
    "mul.Scalar": _mul,
    "div.Tensor": _div,
    "add.Tensor": lambda a, b, alpha=1: _add(a, b, alpha),
    "sub.Tensor": lambda a, b, alpha=1: _add(a, b, alpha, -1),
    "neg.default": lambda x: Pair(-x.arr),
    "conj.default": lambda x: _pair(_parts(x)[0], -_parts(x)[1]),
    "_conj.default": lambda x: _pair(_parts(x)[0], -_parts(x)[1]),
    "conj_physical.default": lambda x: _pair(_parts(x)[0], -_parts(x)[1]),
    "abs.default": lambda x: _jnp().sqrt(_parts(x)[0] ** 2 + _parts(x)[1] ** 2),
    "angle.default": lambda x: _jnp().arctan2(_parts(x)[1], _parts(x)[0]),
    "exp.default": _exp,
    "view.default": _view,
    "_unsafe_view.default": _view,
    "reshape.default": _view,
    "unsqueeze.default": lambda x, d: Pair(_jnp().expand_dims(x.arr, _dim(int(d), x.rank + 1))),
    "squeeze.dim": lambda x, d: Pair(_jnp().squeeze(x.arr, _dim(int(d), x.rank))),
    "squeeze.dims": lambda x, ds: Pair(_jnp().squeeze(x.arr, tuple(_dim(int(d), x.rank) for d in ds))),
    "slice.Tensor": _slice,
    "select.int": _select,
    "permute.default": _permute,
    "transpose.int": _transpose,
    "expand.default": _expand,
    "cat.default": _cat,
    "sum.dim_IntList": _sum,
    "index.Tensor": _index,
    "clone.default": lambda x, memory_format=None: x,
    "alias.default": lambda x: x,
    "contiguous.default": lambda x, memory_format=None: x,
}


def call(target: Any, args: Sequence[Any], kwargs: dict[str, Any], node: torch.fx.Node) -> Any:
    """The value of `node` (an op reading or making complex tensors, `known`) from its arguments (Pairs for complex
    ones)."""
    name = str(target).removeprefix("aten.")
    if name == "_to_copy.default":
        return _to_copy(args[0], node)
    rule = _RULES[name]
    kwargs = {k: v for k, v in kwargs.items() if k not in ("memory_format",)}
    return rule(*args, **kwargs)


def known(target: Any) -> bool:
    """Whether `call` rewrites this op."""
    name = str(target).removeprefix("aten.")
    return name == "_to_copy.default" or name in _RULES
