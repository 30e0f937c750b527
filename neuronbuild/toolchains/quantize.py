"""Weight-only quantization (hf_causal_lm's `quantization`): the documented formulas (symmetric float32 scales; int8,
fp8 e4m3 in Neuron's +-240 range, fp8 e5m2; per tensor, per output channel or blockwise along the input dim), the
dequantising linear layer the graphs hold, and the checkpoint view through which the weights action streams
quantized weights and their scales, tensor by tensor (docs/quantization.md).

Storage: int8 as torch.int8; float8_e4m3 as torch.float8_e4m3fn (safetensors F8_E4M3): values are kept within
+-240, where the OCP e4m3fn and the IEEE-style e4m3 Neuron computes in share every bit pattern, so the stored bytes
mean the same on the device; float8_e5m2 as torch.float8_e5m2 (IEEE-style on both sides)."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from neuronbuild.toolchains.errors import ToolchainError
from neuronbuild.toolchains.weights import Checkpoint

# quantization dtype -> (the torch dtype weights are stored and traced in, the largest magnitude a scale maps to)
QDTYPES: dict[str, tuple[torch.dtype, float]] = {
    "int8": (torch.int8, 127.0),
    "float8_e4m3": (torch.float8_e4m3fn, 240.0),  # Neuron's e4m3 saturates at +-240 (not e4m3fn's +-448)
    "float8_e5m2": (torch.float8_e5m2, 57344.0),
}
E4M3_NEURON_MAX = 240.0
KV_CACHE_DTYPES = {"float8_e4m3": torch.float8_e4m3fn}


@dataclass(frozen=True)
class QuantSpec:
    """One model's quantization: dtype, scheme, block_size (blockwise only), modules_to_not_convert (patterns)."""

    dtype: str
    scheme: str
    block_size: int = 0
    modules_to_not_convert: tuple[str, ...] = ()

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> QuantSpec:
        """The config's `quantization` dict; ValueError naming the bad field (analysis/quantization.py's rules)."""
        from neuronbuild.analysis.quantization import normalize

        q = normalize(raw)
        return cls(str(q["dtype"]), str(q["scheme"]), int(q.get("block_size") or 0),
                   tuple(q.get("modules_to_not_convert") or ()))

    @property
    def torch_dtype(self) -> torch.dtype:
        return QDTYPES[self.dtype][0]

    @property
    def qmax(self) -> float:
        return QDTYPES[self.dtype][1]

    def scale_shape(self, out_features: int, in_features: int, name: str = "") -> tuple[int, ...]:
        """per_tensor [1]; per_channel [out, 1]; blockwise [out, in / block_size]."""
        if self.scheme == "per_tensor":
            return (1,)
        if self.scheme == "per_channel":
            return (out_features, 1)
        if in_features % self.block_size:
            raise ValueError(f"quantization: {name or 'a layer'}'s input width {in_features} is not a multiple of "
                             f"block_size {self.block_size}")
        return (out_features, in_features // self.block_size)

    def converts(self, module_name: str) -> bool:
        """False when a modules_to_not_convert pattern matches the module: a glob (*, ?, [) against its whole name,
        else a run of whole name components ("layers.0.mlp" matches "model.layers.0.mlp.up_proj", not layers.01)."""
        for pat in self.modules_to_not_convert:
            if any(c in pat for c in "*?["):
                if fnmatch.fnmatchcase(module_name, pat):
                    return False
            elif f".{pat}." in f".{module_name}.":
                return False
        return True


def spec_of(config: Mapping[str, Any] | None) -> QuantSpec | None:
    """The model config's quantization (rules/llm.bzl puts it in the config), or None."""
    raw = (config or {}).get("quantization")
    return None if raw is None else QuantSpec.parse(raw)


def kv_cache_dtype(config: Mapping[str, Any]) -> torch.dtype | None:
    """The KV cache's storage dtype when the config's `kv_cache_dtype` names an fp8 one (None: the model dtype).
    Direct casts, as NxD Inference's kv_cache_quant: keys and values are cast to fp8 as written and back to the model
    dtype as attention reads them (context and token graphs alike)."""
    name = config.get("kv_cache_dtype")
    if name is None:
        return None
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {name!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name]


def rounding_cache(config: Any, dtype: torch.dtype) -> Any:
    """A transformers DynamicCache whose keys and values are cast to `dtype` and back as they are stored: the
    reference an fp8 KV cache is validated against."""
    from transformers import DynamicCache

    class RoundingCache(DynamicCache):
        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
                   *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            return super().update(key_states.to(dtype).to(key_states.dtype),
                                  value_states.to(dtype).to(value_states.dtype), layer_idx, *args, **kwargs)

    return RoundingCache(config=config)


# Rows are worked on in chunks of about this many elements, on the calling thread only (_one_thread): whole-tensor
# float32 temporaries, and memory torch's intra-op threads free into their own malloc arenas, kept the quantizing
# weights action of a Llama-3.2-1B shape at 0.6-0.9 GB above the plain one's (measured, 2026-12-07); chunked on one
# thread it stays within ~0.1 GB of it, and the results are the same bits (max and division are exact per element).
_CHUNK = 1 << 20


@contextmanager
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _row_chunks(rows: int, width: int) -> Iterator[tuple[int, int]]:
    step = max(1, _CHUNK // max(1, width))
    for first in range(0, rows, step):
        yield first, min(rows, first + step)


def compute_scale(w: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """float32 scales of the weight w [out, in] (its values in float32): amax / qmax over the tensor, each row, or
    each row's blocks of block_size input columns; a group whose amax is 0 gets scale 1 (its values quantize to 0)."""
    out, inp = w.shape
    g = spec.scale_shape(out, inp)[1] if spec.scheme == "blockwise" else 1  # groups per row
    amax = torch.empty((out, g), dtype=torch.float32)
    for a, b in _row_chunks(out, inp):
        amax[a:b] = w[a:b].float().reshape(b - a, g, inp // g).abs().amax(dim=2)
    if spec.scheme == "per_tensor":
        amax = amax.amax().reshape(1)
    scale = amax / torch.tensor(spec.qmax, dtype=torch.float32)
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def _expanded(scale: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """A scale broadcast to the weight's shape (blockwise: each scale over its block of columns)."""
    if scale.dim() == 2 and scale.shape[1] not in (1, shape[1]):
        return scale.repeat_interleave(shape[1] // scale.shape[1], dim=1)
    return scale


def quantize(w: torch.Tensor, spec: QuantSpec, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) of the weight w [out, in]: q = w / scale in float32, then int8: round half to even, clamped to
    [-127, 127]; fp8: cast with round to nearest even (|w / scale| <= qmax, so never beyond the format's range).
    `scale`: w's rows' scales when given (a block of rows of a tensor quantized whole)."""
    if scale is None:
        scale = compute_scale(w, spec)
    out, inp = w.shape
    q = torch.empty((out, inp), dtype=spec.torch_dtype)
    for a, b in _row_chunks(out, inp):
        rows = scale if scale.shape[0] == 1 and scale.dim() == 1 else scale[a:b]
        x = w[a:b].float() / _expanded(rows, (b - a, inp))
        if spec.dtype == "int8":
            q[a:b] = torch.round(x).clamp_(-127, 127).to(torch.int8)
        else:
            q[a:b] = x.clamp_(-spec.qmax, spec.qmax).to(spec.torch_dtype)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight the graph multiplies by: q converted to `dtype` (exact) times the scale in `dtype`."""
    return q.to(dtype) * _expanded(scale.to(dtype), q.shape)


class QuantLinear(nn.Module):
    """A Linear whose weight is stored quantized: parameters `weight` (int8 / fp8 [out, in]) and `scale` (float32;
    NxD Inference's `<module>.scale` layout), `bias` (model dtype) when the layer had one. forward dequantises
    (q * scale in the model dtype) before the matmul, so the exported program holds the quantized parameters."""

    def __init__(self, linear: nn.Linear, spec: QuantSpec, name: str = "") -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.compute_dtype = linear.weight.dtype
        self.weight = nn.Parameter(torch.empty((self.out_features, self.in_features), dtype=spec.torch_dtype),
                                   requires_grad=False)
        self.scale = nn.Parameter(torch.ones(spec.scale_shape(self.out_features, self.in_features, name),
                                             dtype=torch.float32), requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = dequantize(self.weight, self.scale, self.compute_dtype)
        return nn.functional.linear(x, w, self.bias)


def quantize_linears(model: nn.Module, config: Mapping[str, Any], every_linear: bool = False) -> list[str]:
    """Replace the model's quantized Linear layers by QuantLinear (before tensor-parallel hooks are attached):
    every nn.Linear inside a decoder layer (the classes transformers lists in `_no_split_modules`), except those
    modules_to_not_convert matches. Embeddings, norms and lm_head are never converted. `every_linear` (a plain
    neuron_model: no decoder layer classes): every nn.Linear of the module, but those modules_to_not_convert matches.
    Returns the names replaced; ValueError when a pattern of modules_to_not_convert matches no quantizable Linear,
    or a layer cannot be split in blocks."""
    spec = spec_of(config)
    if spec is None:
        return []
    if every_linear:
        candidates = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        if not candidates:
            raise ValueError(f"quantization: {type(model).__name__} has no nn.Linear layer to quantize")
    else:
        layer_classes = set(getattr(model, "_no_split_modules", None) or ())
        inside: list[str] = [n + "." for n, m in model.named_modules() if type(m).__name__ in layer_classes]
        if not inside:
            raise ValueError(f"quantization: {type(model).__name__} lists no decoder layer class (_no_split_modules)")
        candidates = [(n, m) for n, m in model.named_modules()
                      if isinstance(m, nn.Linear) and any(n.startswith(p) for p in inside)]
    for pat in spec.modules_to_not_convert:
        probe = QuantSpec(spec.dtype, spec.scheme, spec.block_size, (pat,))
        if all(probe.converts(n) for n, _m in candidates):
            raise ValueError(f"quantization: modules_to_not_convert pattern {pat!r} matches no quantizable layer")
    done = []
    for name, lin in candidates:
        if not spec.converts(name):
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, attr, QuantLinear(lin, spec, name))  # type: ignore[arg-type]
        done.append(name)
    return done


def quantized_modules(state: Mapping[str, torch.dtype]) -> set[str]:
    """The quantized modules of a state ({name: dtype}): those with a quantized `weight` and a `scale`."""
    qdt = {dt for dt, _m in QDTYPES.values()}
    return {n[:-6] for n in state if n.endswith(".scale") and state.get(n[:-6] + ".weight") in qdt}


class QuantizedCheckpoint:
    """A Checkpoint as the quantized module's state: each quantized module's `weight` (its quantized values) and
    `scale`, computed from the checkpoint's float weight tensor by tensor (the scale is kept, small; the weight is
    quantized again when asked for), or read as they are from a pre-quantized checkpoint (`<module>.scale` beside
    an int8 / fp8 `weight`), whose fp8 e4m3 values beyond Neuron's +-240 are a ToolchainError naming the tensor and
    its largest magnitude. Other tensors pass through. Same reading interface as Checkpoint."""

    def __init__(self, base: Checkpoint, spec: QuantSpec, modules: set[str]) -> None:
        self.base, self.spec, self.label = base, spec, base.label
        self.modules = modules
        self.index = dict(base.index)
        self._scales: dict[str, torch.Tensor] = {}
        self.prequantized: set[str] = set()
        for m in sorted(modules):
            wname = m + ".weight"
            if wname not in base.index:
                continue  # check_against names it as missing
            path, key, dtype, shape = base.index[wname]
            if m + ".scale" in base.index:
                if dtype != spec.torch_dtype:
                    raise ToolchainError(f"weights {self.label}: tensor {key} is {dtype} but has a scale; the model is "
                                         f"quantized to {spec.dtype} ({spec.torch_dtype})")
                self.prequantized.add(m)
                continue
            if dtype is None or not dtype.is_floating_point or dtype.itemsize == 1:
                raise ToolchainError(f"weights {self.label}: tensor {key} ({dtype}) has no {m}.scale: a pre-quantized "
                                     "weight needs its scale; a float one is quantized by neuronbuild")
            try:
                scale_shape = spec.scale_shape(shape[0], shape[1], m) if len(shape) == 2 else None
            except ValueError as exc:
                raise ToolchainError(str(exc)) from None
            if scale_shape is None:
                raise ToolchainError(f"weights {self.label}: tensor {key} {list(shape)} is not a 2-D linear weight")
            self.index[m + ".scale"] = (path, key + ":scale", torch.float32, scale_shape)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.index[name][3]

    def _module(self, name: str) -> tuple[str, str] | None:
        m, _, leaf = name.rpartition(".")
        if m in self.modules and leaf in ("weight", "scale"):
            return m, leaf
        return None

    def _scale(self, m: str) -> torch.Tensor:
        if m not in self._scales:
            with _one_thread():
                self._scales[m] = compute_scale(self.base.tensor(m + ".weight"), self.spec)
        return self._scales[m]

    def _quantized(self, name: str, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        with _one_thread():
            q, _s = quantize(w, self.spec, scale)
        return q

    def _checked_range(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if self.spec.dtype == "float8_e4m3" and t.numel():
            amax = float(t.float().abs().amax())
            if not amax <= E4M3_NEURON_MAX:  # (NaN too)
                key = self.base.index[name][1]
                raise ToolchainError(f"weights {self.label}: fp8 e4m3 tensor {key} holds values up to {amax:g}, "
                                     f"beyond Neuron's +-{E4M3_NEURON_MAX:g} (they would be NaN on the device): "
                                     "rescale the checkpoint (weight / k, scale * k)")
        return t

    def tensor(self, name: str) -> torch.Tensor:
        found = self._module(name)
        if found is None:
            return self.base.tensor(name)
        m, leaf = found
        if m in self.prequantized:
            t = self.base.tensor(name)
            return self._checked_range(name, t) if leaf == "weight" else t
        if leaf == "scale":
            return self._scale(m)
        return self._quantized(name, self.base.tensor(name), self._scale(m))

    def rows(self, name: str, first: int, count: int) -> torch.Tensor:
        found = self._module(name)
        if found is None or found[0] in self.prequantized:
            t = self.base.rows(name, first, count)
            return self._checked_range(name, t) if found is not None and found[1] == "weight" else t
        m, leaf = found
        scale = self._scale(m)  # (the whole tensor's, computed once: per_tensor's amax spans every row)
        if first < 0 or count < 0 or first + count > self.shape(name)[0]:
            raise ToolchainError(f"weights {self.label}: rows [{first}, {first + count}) are not in tensor {name}")
        rows = scale if self.spec.scheme == "per_tensor" else scale[first:first + count]
        if leaf == "scale":
            return rows.clone()
        return self._quantized(name, self.base.rows(name, first, count), rows)  # only the rank's rows read

    def pieces(self, name: str, dtype: torch.dtype, max_bytes: int = 64 << 20) -> Iterator[torch.Tensor]:
        found = self._module(name)
        if found is None or (found[0] in self.prequantized and found[1] == "scale"):
            yield from self.base.pieces(name, dtype, max_bytes)
            return
        yield self.tensor(name).to(dtype).reshape(-1)


def open_checkpoint(model: Mapping[str, Any], paths: list[Path], label: str,
                    state: Mapping[str, torch.dtype]) -> Checkpoint | QuantizedCheckpoint:
    """The model's weight files as the module's state reads them: quantized when its config asks for it (`state`:
    the module's {name: dtype}, which says which modules hold quantized weights)."""
    ckpt = Checkpoint(paths, label, str(model.get("weights_prefix") or ""))
    try:
        spec = spec_of(model.get("config"))
    except ValueError as exc:
        raise ToolchainError(str(exc)) from None
    if spec is None:
        return ckpt
    return QuantizedCheckpoint(ckpt, spec, quantized_modules(state))

