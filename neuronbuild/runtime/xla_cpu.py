"""Runs a Neuron graph's exact model.hlo.pb on XLA:CPU (jaxlib) with its weights and inputs: numerics without a device.

Used by `neuronbuild validate` and by the runtime's explicit emulation mode (`emulate="xla-cpu"`); never counted as a
Neuron execution. Relies on private jaxlib APIs, hence the pinned jax/jaxlib versions (the `neuron` extra)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from neuronbuild.runtime.hlo_proto import ProtoError, parse_hlo_module


class XlaCpuError(Exception):
    """The module, its manifest or the values fed to it are unusable; the message is one line."""


@dataclass(frozen=True)
class ParamSpec:
    index: int
    name: str
    kind: str
    shape: tuple[int, ...]
    dtype: str
    source_dtype: str


def read_params(data: bytes | str) -> tuple[list[ParamSpec], list[dict[str, Any]]]:
    """params.json -> (parameters in order, outputs)."""
    try:
        doc = json.loads(data)
        params = [ParamSpec(int(p["index"]), str(p["name"]), str(p["kind"]), tuple(int(d) for d in p["shape"]),
                            str(p["dtype"]), str(p.get("source_dtype", p["dtype"]))) for p in doc["parameters"]]
        outputs = [dict(o) for o in doc.get("outputs", [])]
    except (ValueError, KeyError, TypeError) as exc:
        raise XlaCpuError(f"params.json is malformed: {exc}") from None
    if [p.index for p in params] != list(range(len(params))):
        raise XlaCpuError("params.json: parameter indexes are not 0..n-1 in order")
    return params, outputs


def _to_numpy(t: torch.Tensor, dtype: str) -> np.ndarray:
    import ml_dtypes

    t = t.detach().cpu().contiguous()
    if dtype == "bfloat16":
        return t.to(torch.bfloat16).view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    want = getattr(torch, dtype)
    if t.dtype != want:
        if t.dtype in (torch.int64, torch.uint64) and want == torch.int32 and t.numel():
            lo, hi = int(t.min()), int(t.max())
            if lo < -(2**31) or hi >= 2**31:
                raise XlaCpuError(f"value {hi if hi >= 2**31 else lo} does not fit the module's int32 parameter")
        t = t.to(want)
    return t.numpy()


def _to_torch(a: Any, source_dtype: str | None) -> torch.Tensor:
    arr = np.asarray(a)
    if arr.dtype.name == "bfloat16":
        out = torch.from_numpy(arr.view(np.int16).copy()).view(torch.bfloat16)
    else:
        out = torch.from_numpy(arr.copy())
    if source_dtype and hasattr(torch, source_dtype) and out.dtype != getattr(torch, source_dtype):
        out = out.to(getattr(torch, source_dtype))
    return out


class XlaCpuModule:
    """One compiled module: call with the user inputs (torch tensors) after bind() supplied the state."""

    def __init__(self, proto: bytes, params_json: bytes | str, *, source: str = "model.hlo.pb") -> None:
        try:
            summary = parse_hlo_module(proto)
        except ProtoError as exc:
            raise XlaCpuError(f"{source} is not an HLO module: {exc}") from None
        self.params, self.outputs = read_params(params_json)
        if len(summary.parameters) != len(self.params):
            raise XlaCpuError(f"{source} takes {len(summary.parameters)} parameters, params.json lists "
                              f"{len(self.params)}")
        for p, shape in zip(self.params, summary.parameters, strict=True):
            if p.shape != shape.dims or p.dtype != shape.dtype:
                raise XlaCpuError(f"params.json says parameter {p.index} ({p.name}) is {p.dtype}{list(p.shape)}, "
                                  f"{source} says {shape}")
        self.summary = summary
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        import jax
        from jax._src import xla_bridge
        from jax._src.lib import _jax
        from jax._src.lib import xla_client as xc

        self._jax = jax
        backend = xla_bridge.get_backend("cpu")
        self._device = backend.local_devices()[0]
        computation = xc.XlaComputation(proto)
        mlir = _jax.mlir.xla_computation_to_mlir_module(computation)
        self._exe = backend.compile_and_load(mlir, xc.DeviceList((self._device,)), xc.CompileOptions())
        self._state: list[Any] = []

    @property
    def state_names(self) -> list[str]:
        return [p.name for p in self.params if p.kind != "input"]

    @property
    def input_params(self) -> list[ParamSpec]:
        return [p for p in self.params if p.kind == "input"]

    def bind(self, weights: Mapping[str, torch.Tensor]) -> XlaCpuModule:
        """Supply the leading (state) parameters by name, transferred once; missing or mis-shaped ones fail."""
        state = []
        missing = [n for n in self.state_names if n not in weights]
        if missing:
            raise XlaCpuError(f"weights lack {len(missing)} tensor(s) the module takes: {', '.join(missing[:5])}")
        for p in self.params:
            if p.kind == "input":
                continue
            t = weights[p.name]
            if tuple(t.shape) != p.shape:
                raise XlaCpuError(f"weight {p.name} has shape {list(t.shape)}, the module takes {list(p.shape)}")
            state.append(self._jax.device_put(_to_numpy(t, p.dtype), self._device))
        self._state = state
        return self

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        specs = self.input_params
        if len(self._state) != len(self.params) - len(specs):
            raise XlaCpuError("call bind(weights) before running the module")
        if len(inputs) != len(specs):
            raise XlaCpuError(f"the module takes {len(specs)} input(s), got {len(inputs)}")
        args = list(self._state)
        for p, t in zip(specs, inputs, strict=True):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != p.shape:
                got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise XlaCpuError(f"input {p.name} must have shape {list(p.shape)}, got {got}")
            args.append(self._jax.device_put(_to_numpy(t, p.dtype), self._device))
        results = self._exe.execute(args)
        sources: Sequence[str | None] = [o.get("source_dtype") for o in self.outputs] or [None] * len(results)
        return tuple(_to_torch(r, s) for r, s in zip(results, sources, strict=False))


def load(hlo: Path, params: Path) -> XlaCpuModule:
    """Compile the module at `hlo` (manifest at `params`) for XLA:CPU."""
    try:
        proto, manifest = Path(hlo).read_bytes(), Path(params).read_bytes()
    except OSError as exc:
        raise XlaCpuError(f"cannot read {exc.filename}: {exc.strerror}") from None
    return XlaCpuModule(proto, manifest, source=Path(hlo).name)


def load_graph(hlo: Path, params: Path, weights: Mapping[str, torch.Tensor]) -> Any:
    """A Neuron graph as a callable on XLA:CPU: takes the user inputs, returns the single output or a tuple."""
    module = load(hlo, params).bind(weights)

    def run(*args: torch.Tensor) -> Any:
        out = module(*args)
        return out[0] if len(out) == 1 else out

    return run
