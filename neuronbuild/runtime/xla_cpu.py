"""Runs a Neuron graph's exact model.hlo.pb on XLA:CPU (jaxlib) with its weights and inputs: numerics without a device.

Used by `neuronbuild validate` and by the runtime's explicit emulation mode (`emulate="xla-cpu"`); never counted as a
Neuron execution. Relies on private jaxlib APIs, hence the pinned jax/jaxlib versions (the `neuron` extra)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from neuronbuild import jsondata
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


# Host devices XLA:CPU is started with when this module starts it: enough for any tensor-parallel degree a graph
# is built with here (a jax already started elsewhere keeps its count: XlaCpuError says what to set).
HOST_DEVICES = 64


def cpu_devices(n: int) -> list[Any]:
    """n XLA:CPU devices of this process (XLA starts with HOST_DEVICES of them unless already started)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized() and "xla_force_host_platform_device_count" not in \
            os.environ.get("XLA_FLAGS", ""):
        jax.config.update("jax_num_cpu_devices", max(n, HOST_DEVICES))
    devices = list(xla_bridge.get_backend("cpu").local_devices())
    if len(devices) < n:
        raise XlaCpuError(f"a tp_degree {n} graph needs {n} XLA:CPU devices, this process has {len(devices)} (set "
                          f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before jax starts)")
    return devices[:n]


def read_tp(data: bytes | str) -> dict[str, Any]:
    """params.json's tensor-parallel entry ({} for a one-device module)."""
    try:
        tp = jsondata.loads(data).get("tp") or {}
    except (ValueError, AttributeError) as exc:
        raise XlaCpuError(f"params.json is malformed: {exc}") from None
    return dict(tp) if isinstance(tp, dict) else {}


def read_params(data: bytes | str) -> tuple[list[ParamSpec], list[dict[str, Any]]]:
    """params.json -> (parameters in order, outputs)."""
    try:
        doc = jsondata.loads(data)
        params = [ParamSpec(int(p["index"]), str(p["name"]), str(p["kind"]), tuple(int(d) for d in p["shape"]),
                            str(p["dtype"]), str(p.get("source_dtype", p["dtype"]))) for p in doc["parameters"]]
        outputs = [dict(o) for o in doc.get("outputs", [])]
    except (ValueError, KeyError, TypeError) as exc:
        raise XlaCpuError(f"params.json is malformed: {exc}") from None
    if [p.index for p in params] != list(range(len(params))):
        raise XlaCpuError("params.json: parameter indexes are not 0..n-1 in order")
    return params, outputs


def as_dtype(t: torch.Tensor, want: torch.dtype) -> torch.Tensor:
    """`t` in the module parameter's dtype `want`: int64 ids narrowed to int32 only when every value fits (ValueError
    otherwise)."""
    if t.dtype != want:
        if t.dtype in (torch.int64, torch.uint64) and want == torch.int32 and t.numel():
            lo, hi = int(t.min()), int(t.max())
            if lo < -(2**31) or hi >= 2**31:
                raise ValueError(f"value {hi if hi >= 2**31 else lo} does not fit the module's int32 parameter")
        t = t.to(want)
    return t


def _to_numpy(t: torch.Tensor, dtype: str) -> np.ndarray:
    import ml_dtypes

    t = t.detach().cpu().contiguous()
    if dtype == "bfloat16":
        return t.to(torch.bfloat16).view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if dtype in ("float8_e4m3fn", "float8_e5m2"):  # fp8 weights (numpy has no fp8: ml_dtypes' of the same bits)
        return t.to(getattr(torch, dtype)).view(torch.uint8).numpy().view(getattr(ml_dtypes, dtype))
    try:
        return as_dtype(t, getattr(torch, dtype)).numpy()
    except ValueError as exc:
        raise XlaCpuError(str(exc)) from None


def _to_torch(a: Any, source_dtype: str | None) -> torch.Tensor:
    arr = np.asarray(a)
    if arr.dtype.name == "bfloat16":
        out = torch.from_numpy(arr.view(np.int16).copy()).view(torch.bfloat16)
    elif arr.dtype.name in ("float8_e4m3fn", "float8_e5m2"):  # an fp8 KV cache: torch reads its bits
        out = torch.from_numpy(arr.view(np.uint8).copy()).view(getattr(torch, arr.dtype.name))
    else:
        out = torch.from_numpy(arr.copy())
    if source_dtype and hasattr(torch, source_dtype) and out.dtype != getattr(torch, source_dtype):
        out = out.to(getattr(torch, source_dtype))
    return out


class RankIO:
    """How a module's ranks hold its user inputs and outputs (params.json's "tp" entry; XlaCpuModule's and
    neff_graph.NeffGraph's): callers hold them whole; along its rank dim, rank r takes block r*blocks//tp of `blocks`
    (several ranks share one when there are fewer blocks than ranks); any other input is the same on every rank."""

    def _read_ranks(self, params_json: bytes | str) -> None:
        tp = read_tp(params_json)
        self.tp = int(tp.get("degree") or 1)
        self.rank_dims = {str(k): int(v) for k, v in dict(tp.get("rank_dims") or {}).items()}
        self.output_rank_dims = {int(k): int(v) for k, v in dict(tp.get("output_rank_dims") or {}).items()}
        self.blocks = int(tp.get("blocks") or self.tp)  # distinct shards of a per-rank input/output (<= tp)

    def _rank_inputs(self, p: ParamSpec, t: Any, error: Callable[[str], Exception]) -> list[torch.Tensor]:
        """Input `t` as each rank takes it; error(message) is raised when `t` does not have the (whole) shape."""
        dim = self.rank_dims.get(p.name) if self.tp > 1 else None
        want = list(p.shape)
        if dim is not None:
            want[dim] *= self.blocks
        if not isinstance(t, torch.Tensor) or list(t.shape) != want:
            raise error(f"input {p.name} must have shape {want}, got "
                        f"{list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if dim is None:
            return [t] * self.tp
        return [t.narrow(dim, (r * self.blocks // self.tp) * p.shape[dim], p.shape[dim]) for r in range(self.tp)]


class XlaCpuModule(RankIO):
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
        self._read_ranks(params_json)
        self._devices = cpu_devices(self.tp)
        import jax
        from jax._src import xla_bridge
        from jax._src.lib import _jax
        from jax._src.lib import xla_client as xc

        self._jax = jax
        backend = xla_bridge.get_backend("cpu")
        self._device = self._devices[0]
        computation = xc.XlaComputation(proto)
        mlir = _jax.mlir.xla_computation_to_mlir_module(computation)
        options = xc.CompileOptions()
        if self.tp > 1:  # one program on tp devices as replicas (the collectives' form: neuron_collectives.py)
            import numpy as np

            options.num_replicas = self.tp
            options.num_partitions = 1
            options.device_assignment = xc.DeviceAssignment.create(np.arange(self.tp).reshape(self.tp, 1))
            mesh = jax.sharding.Mesh(np.array(self._devices), ("tp",))
            self._sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("tp"))
            self._replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        self._exe = backend.compile_and_load(mlir, xc.DeviceList(tuple(self._devices)), options)
        self._state: list[Any] = []

    @property
    def state_names(self) -> list[str]:
        return [p.name for p in self.params if p.kind != "input"]

    @property
    def input_params(self) -> list[ParamSpec]:
        return [p for p in self.params if p.kind == "input"]

    def bind(self, weights: Mapping[str, torch.Tensor] | Sequence[Mapping[str, torch.Tensor]]) -> XlaCpuModule:
        """Supply the leading (state) parameters by name, transferred once; missing or mis-shaped ones fail. A
        tensor-parallel module takes one mapping per rank (that rank's shard)."""
        per_rank = [weights] if isinstance(weights, Mapping) else list(weights)
        if len(per_rank) != self.tp:
            raise XlaCpuError(f"the module runs on {self.tp} rank(s), got weights for {len(per_rank)}")
        state = []
        for rank, w in enumerate(per_rank):
            missing = [n for n in self.state_names if n not in w]
            if missing:
                raise XlaCpuError(f"weights{f' of rank {rank}' if self.tp > 1 else ''} lack {len(missing)} tensor(s) "
                                  f"the module takes: {', '.join(missing[:5])}")
        for p in self.params:
            if p.kind == "input":
                continue
            bufs = []
            for rank, w in enumerate(per_rank):
                t = w[p.name]
                if tuple(t.shape) != p.shape:
                    raise XlaCpuError(f"weight {p.name} has shape {list(t.shape)}, the module takes {list(p.shape)}")
                bufs.append(self._jax.device_put(_to_numpy(t, p.dtype), self._devices[rank]))
            state.append(self._put(bufs, p.shape))
        self._state = state
        return self

    def _put(self, bufs: list[Any], shape: tuple[int, ...]) -> Any:
        """One argument: its buffer, or (tensor-parallel) one buffer per device as one array over the devices."""
        if self.tp == 1:
            return bufs[0]
        if not shape:  # a scalar (e.g. Gemma's embedding scale): one copy per device, as a replicated array
            return self._jax.make_array_from_single_device_arrays((), self._replicated, bufs)
        return self._jax.make_array_from_single_device_arrays((self.tp * shape[0], *shape[1:]), self._sharding, bufs)

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        specs = self.input_params
        if len(self._state) != len(self.params) - len(specs):
            raise XlaCpuError("call bind(weights) before running the module")
        if len(inputs) != len(specs):
            raise XlaCpuError(f"the module takes {len(specs)} input(s), got {len(inputs)}")
        args = list(self._state)
        for p, t in zip(specs, inputs, strict=True):
            parts = self._rank_inputs(p, t, XlaCpuError)
            args.append(self._put([self._jax.device_put(_to_numpy(x, p.dtype), d)
                                   for x, d in zip(parts, self._devices, strict=True)], p.shape))
        if self.tp == 1:
            results = self._exe.execute(args)
        else:  # per output, one array per rank: held-per-rank ones joined from one rank per block, the rest are
            # identical on every rank (rank 0's)
            per_rank = self._exe.execute_sharded(args).disassemble_into_single_device_arrays()
            results = [np.concatenate([np.asarray(arrays[b * self.tp // self.blocks]) for b in range(self.blocks)],
                                      axis=self.output_rank_dims[i])
                       if i in self.output_rank_dims else arrays[0] for i, arrays in enumerate(per_rank)]
        sources: Sequence[str | None] = [o.get("source_dtype") for o in self.outputs] or [None] * len(results)
        return tuple(_to_torch(r, s) for r, s in zip(results, sources, strict=False))


def load(hlo: Path, params: Path) -> XlaCpuModule:
    """Compile the module at `hlo` (manifest at `params`) for XLA:CPU."""
    try:
        proto, manifest = Path(hlo).read_bytes(), Path(params).read_bytes()
    except OSError as exc:
        raise XlaCpuError(f"cannot read {exc.filename}: {exc.strerror}") from None
    return XlaCpuModule(proto, manifest, source=Path(hlo).name)


def load_graph(hlo: Path, params: Path,
               weights: Mapping[str, torch.Tensor] | Sequence[Mapping[str, torch.Tensor]]) -> Any:
    """A Neuron graph as a callable on XLA:CPU: takes the user inputs, returns the single output or a tuple. A
    tensor-parallel graph takes one weights mapping per rank and runs on that many host devices; its callers see
    whole tensors (inputs and outputs held per rank are concatenated over ranks)."""
    module = load(hlo, params).bind(weights)

    def run(*args: torch.Tensor) -> Any:
        out = module(*args)
        return out[0] if len(out) == 1 else out

    return run
