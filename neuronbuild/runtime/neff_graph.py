"""One Neuron graph's NEFF loaded through libnrt (runtime/libnrt.py) and called like any runtime graph: torch tensors in,
torch tensors out. No compiler, torch-neuronx or jax is needed.

Loading (all or nothing): one model per rank (`nrt_load` on NeuronCore 0 for one rank; `nrt_load_collectives` with
device id r of N on NeuronCore r for tensor parallelism: ranks take the first N NeuronCores libnrt makes visible,
i.e. NEURON_RT_VISIBLE_CORES or the host's); its I/O table (`nrt_get_model_tensor_info`: `input<i>` is HLO parameter
i, `output<j>` output j, the names frameworks give NEFF tensors) checked against params.json and the manifest (name,
direction, bytes, dtype, shape: a difference is an error naming the graph and tensor); the weights written once into
device tensors per NeuronCore, shared by every graph (bucket) that binds the same weight tensor; one device tensor per
user input and output, and the input/output tensor sets. A failing call unloads and frees what this load made so far
and raises the NrtError naming the call and its status.

Device-resident outputs: an output is read back to a torch tensor the caller gets, and the runtime remembers which
device tensor it came from. When that same torch tensor object, unmodified (its version counter unchanged) and its
device tensor not overwritten since, is passed back as an input (the KV cache: context graph -> token graph -> token
graph ...), the device tensor is bound as is (no host-to-device copy), and an output the graph declares as updating
that input (`aliases`, e.g. kv -> kv) is written into the same device tensor. Nothing changes for the caller."""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from neuronbuild.runtime.libnrt import DTYPES, USAGE_INPUT, USAGE_OUTPUT, NrtError, Session, session
from neuronbuild.runtime.xla_cpu import ParamSpec, RankIO, as_dtype, read_params


class NeffMismatch(RuntimeError):
    """The NEFF's I/O table disagrees with the manifest."""


@dataclass
class _Device:
    """A device tensor this graph owns (its user inputs and outputs): handle, NeuronCore, bytes, write generation."""

    handle: int
    vnc: int
    size: int
    generation: int = 0


@dataclass
class _Resident:
    """What a returned torch tensor was read from: the per-rank device tensors and their generations then."""

    ref: weakref.ref[torch.Tensor]
    version: int
    devices: list[_Device]
    generations: list[int]


_residents: dict[int, _Resident] = {}  # id(torch tensor) -> where it lives on the device
_residents_lock = threading.Lock()


def _resident(t: Any, ranks: int, sizes: list[int]) -> list[_Device] | None:
    if not isinstance(t, torch.Tensor):
        return None
    with _residents_lock:
        r = _residents.get(id(t))
        if r is None or r.ref() is not t or r.version != t._version or len(r.devices) != ranks:
            return None
        if any(d.generation != g for d, g in zip(r.devices, r.generations, strict=True)):
            return None
        if [d.size for d in r.devices] != sizes or [d.vnc for d in r.devices] != list(range(ranks)):
            return None
        return list(r.devices)


def _remember(t: torch.Tensor, devices: list[_Device]) -> None:
    key = id(t)

    def forget(_: object, key: int = key) -> None:
        with _residents_lock:
            r = _residents.get(key)
            if r is not None and r.ref() is None:
                del _residents[key]

    with _residents_lock:
        _residents[key] = _Resident(weakref.ref(t, forget), t._version, devices, [d.generation for d in devices])


def _dtype(name: str) -> torch.dtype:
    return torch.bool if name == "bool" else getattr(torch, name)  # type: ignore[no-any-return]


def _host_bytes(t: torch.Tensor, p: ParamSpec, what: str) -> torch.Tensor:
    """`t` as the module's parameter takes it: its dtype, contiguous, on the CPU (int64 ids narrowed to int32 only
    when every value fits)."""
    try:
        return as_dtype(t.detach().cpu(), _dtype(p.dtype)).contiguous()
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None


def _nbytes(shape: Sequence[int], dtype: str) -> int:
    return math.prod(shape) * torch.empty((), dtype=_dtype(dtype)).element_size()


class NeffGraph(RankIO):
    """A NEFF loaded on its NeuronCores (one model per rank); call with the user inputs (whole tensors)."""

    def __init__(self, describe: str, neff: bytes, params_json: bytes, outputs: Sequence[Mapping[str, Any]],
                 aliases: Mapping[str, str], weights: Sequence[Mapping[str, torch.Tensor]]) -> None:
        self.describe = describe
        self.params, self.outputs = read_params(params_json)
        self._read_ranks(params_json)
        self.output_names = [str(o.get("name", f"output{j}")) for j, o in enumerate(outputs)]
        if len(self.output_names) != len(self.outputs):
            raise NeffMismatch(f"{describe}: the manifest lists {len(self.output_names)} output(s), params.json "
                               f"{len(self.outputs)}")
        inputs = [p.name for p in self.params if p.kind == "input"]
        self.aliases = {self.output_names.index(o): inputs.index(i) for o, i in aliases.items()
                        if o in self.output_names and i in inputs}
        if len(weights) != self.tp:
            raise RuntimeError(f"{describe}: runs on {self.tp} rank(s), got weights for {len(weights)}")
        self._s: Session = session()
        if self.tp > self._s.cores:
            raise RuntimeError(f"{describe}: tp_degree {self.tp} needs {self.tp} NeuronCores, libnrt makes "
                               f"{self._s.cores} visible (NEURON_RT_VISIBLE_CORES)")
        self._res = _Resources(self._s)
        self.in_sets: list[int] = []
        self.out_sets: list[int] = []
        self.in_dev: list[list[_Device]] = []  # [rank][user input] this graph's own device tensors
        self.out_dev: list[list[_Device]] = []  # [rank][output]
        self._lock = threading.Lock()
        res = self._res
        try:
            for r in range(self.tp):
                res.models.append(self._s.load(neff, r, r, self.tp))
                self._check_io(self._s.tensor_info(res.models[r]))
            for r in range(self.tp):
                self._bind_rank(r, weights[r])
        except BaseException:
            res.release()
            raise
        self._s.own(id(res), res.release)  # released at nrt_close, or when this graph is collected
        weakref.finalize(self, res.release)

    def release(self) -> None:
        """Unload this graph now (it cannot run afterwards)."""
        self._res.release()

    # -- loading -----------------------------------------------------------------------------------------------------
    def _check_io(self, info: list[tuple[str, int, int, int, tuple[int, ...]]]) -> None:
        """The NEFF's tensors against params.json (parameters -> input<i>, outputs -> output<j>)."""
        want: dict[str, tuple[int, str, tuple[int, ...], str]] = {}
        for p in self.params:
            want[f"input{p.index}"] = (USAGE_INPUT, p.dtype, p.shape, f"{p.kind} {p.name}")
        for j, o in enumerate(self.outputs):
            want[f"output{j}"] = (USAGE_OUTPUT, str(o["dtype"]), tuple(int(d) for d in o["shape"]),
                                  f"output {self.output_names[j]}")
        got = {i[0]: i for i in info}
        for name, (usage, dtype, shape, what) in want.items():
            if name not in got:
                raise NeffMismatch(f"{self.describe}: the NEFF has no tensor {name} ({what} in params.json)")
            _, u, size, code, dims = got[name]
            if u != usage:
                raise NeffMismatch(f"{self.describe}: NEFF tensor {name} ({what}) is an "
                                   f"{'output' if u == USAGE_OUTPUT else 'input'} in the NEFF")
            if dims != shape or size != _nbytes(shape, dtype) or DTYPES.get(dtype) != code:
                neff_dtype = next((n for n, c in DTYPES.items() if c == code), f"dtype code {code}")
                raise NeffMismatch(f"{self.describe}: NEFF tensor {name} ({what}) is {neff_dtype}{list(dims)} "
                                   f"({size} bytes) in the NEFF, {dtype}{list(shape)} "
                                   f"({_nbytes(shape, dtype)} bytes) in params.json")
        extra = sorted(set(got) - set(want))
        if extra:
            raise NeffMismatch(f"{self.describe}: the NEFF has tensor(s) params.json does not list: "
                               f"{', '.join(extra[:5])}")

    def _device(self, vnc: int, size: int, name: str) -> _Device:
        d = _Device(self._s.allocate(vnc, size, name), vnc, size)
        self._res.own.append(d)
        return d

    def _bind_rank(self, r: int, weights: Mapping[str, torch.Tensor]) -> None:
        s = self._s
        tin = s.new_set()
        self._res.sets.append(tin)
        tout = s.new_set()
        self._res.sets.append(tout)
        self.in_sets.append(tin)
        self.out_sets.append(tout)
        ins: list[_Device] = []
        for p in self.params:
            name = f"input{p.index}"
            size = _nbytes(p.shape, p.dtype)
            if p.kind == "input":
                d = self._device(r, size, p.name)
                ins.append(d)
                s.bind(tin, name, d.handle)
                continue
            t = weights.get(p.name)
            if t is None:
                raise RuntimeError(f"{self.describe}: the weights{f' of rank {r}' if self.tp > 1 else ''} lack "
                                   f"{p.name}, which the NEFF takes as {name}")
            if tuple(t.shape) != p.shape:
                raise RuntimeError(f"{self.describe}: weight {p.name} has shape {list(t.shape)}, the NEFF takes "
                                   f"{list(p.shape)}")
            key = (id(t), r, p.dtype)

            def fill(handle: int, t: torch.Tensor = t, p: ParamSpec = p, size: int = size) -> None:
                host = _host_bytes(t, p, p.name)
                s.write(handle, host.data_ptr(), size, p.name)

            handle = s.shared(key, r, size, p.name, fill)
            self._res.shared.append((key, t))  # (the tensor kept alive: its id stays its own while shared)
            s.bind(tin, name, handle)
        outs = []
        for j, o in enumerate(self.outputs):
            d = self._device(r, _nbytes([int(x) for x in o["shape"]], str(o["dtype"])), self.output_names[j])
            outs.append(d)
            s.bind(tout, f"output{j}", d.handle)
        self.in_dev.append(ins)
        self.out_dev.append(outs)

    # -- running -----------------------------------------------------------------------------------------------------
    def __call__(self, *inputs: Any) -> Any:
        specs = [p for p in self.params if p.kind == "input"]
        if len(inputs) != len(specs):
            raise TypeError(f"{self.describe}: the graph takes {len(specs)} input(s), got {len(inputs)}")
        with self._lock:
            s = self._s
            bound: dict[int, list[_Device]] = {}  # user input index -> per-rank device tensors bound
            for k, (p, t) in enumerate(zip(specs, inputs, strict=True)):
                own = [self.in_dev[r][k] for r in range(self.tp)]
                resident = _resident(t, self.tp, [d.size for d in own])
                if resident is not None:
                    bound[k] = resident
                    continue
                parts = self._rank_inputs(p, t, lambda msg: ValueError(f"{self.describe}: {msg}"))
                for r, x in enumerate(parts):
                    host = _host_bytes(x, p, p.name)
                    s.write(own[r].handle, host.data_ptr(), own[r].size, p.name)
                bound[k] = own
            out_dev = [[self.out_dev[r][j] for j in range(len(self.outputs))] for r in range(self.tp)]
            for j, k in self.aliases.items():  # an output updating a device-resident input: written in place
                if bound[k][0] is not self.in_dev[0][k] and \
                        all(bound[k][r].size == out_dev[r][j].size for r in range(self.tp)):
                    for r in range(self.tp):
                        out_dev[r][j] = bound[k][r]
            # another graph's device tensors are bound for this execution only: the sets hold this graph's own
            # tensors between calls, so releasing that graph never frees a tensor a live set of this one holds
            borrowed_in = [(k, p) for k, p in enumerate(specs) if bound[k][0] is not self.in_dev[0][k]]
            borrowed_out = [j for j in range(len(self.outputs)) if out_dev[0][j] is not self.out_dev[0][j]]
            try:
                for r in range(self.tp):
                    for k, p in borrowed_in:
                        s.bind(self.in_sets[r], f"input{p.index}", bound[k][r].handle)
                    for j in borrowed_out:
                        s.bind(self.out_sets[r], f"output{j}", out_dev[r][j].handle)
                self._execute()
                with torch.inference_mode(False):  # normal tensors: their version counter shows in-place changes
                    results = [self._read(j, [out_dev[r][j] for r in range(self.tp)])
                               for j in range(len(self.outputs))]
            finally:
                for r in range(self.tp):
                    for k, p in borrowed_in:
                        s.bind(self.in_sets[r], f"input{p.index}", self.in_dev[r][k].handle)
                    for j in borrowed_out:
                        s.bind(self.out_sets[r], f"output{j}", self.out_dev[r][j].handle)
        return results[0] if len(results) == 1 else tuple(results)

    def _read(self, j: int, devices: list[_Device]) -> torch.Tensor:
        """Output j read back (joined over ranks when held per rank), remembered as device-resident."""
        o = self.outputs[j]
        per_rank = []
        for r, d in enumerate(devices):
            d.generation += 1
            host = torch.empty([int(x) for x in o["shape"]], dtype=_dtype(str(o["dtype"])))
            if j in self.output_rank_dims or r == 0:
                self._s.read(d.handle, host.data_ptr(), d.size, self.output_names[j])
            per_rank.append(host)
        if j in self.output_rank_dims:  # held per rank: one rank per block, joined
            out = torch.cat([per_rank[b * self.tp // self.blocks] for b in range(self.blocks)],
                            dim=self.output_rank_dims[j])
        else:
            out = per_rank[0]
        src = o.get("source_dtype")
        if src and hasattr(torch, str(src)) and out.dtype != _dtype(str(src)):
            out = out.to(_dtype(str(src)))
        _remember(out, devices)
        return out

    def _execute(self) -> None:
        s = self._s
        if self.tp == 1:
            status = s.execute(self._res.models[0], self.in_sets[0], self.out_sets[0])
            if status:
                raise NrtError("nrt_execute", status, f"({self.describe})")
            return
        statuses = [0] * self.tp  # every rank of the collectives group executes at once (one thread each)

        def run(r: int) -> None:
            statuses[r] = s.execute(self._res.models[r], self.in_sets[r], self.out_sets[r])

        threads = [threading.Thread(target=run, args=(r,), name=f"nrt-rank{r}") for r in range(1, self.tp)]
        for th in threads:
            th.start()
        run(0)
        for th in threads:
            th.join()
        failed = [(r, st) for r, st in enumerate(statuses) if st]
        if failed:
            r, st = failed[0]
            raise NrtError("nrt_execute", st, f"({self.describe}, rank {r} of {self.tp})")


class _Resources:
    """What one graph holds in libnrt (kept apart from the graph, so the session and a finalizer can release it)."""

    def __init__(self, s: Session) -> None:
        self.s = s
        self.models: list[int] = []
        self.sets: list[int] = []
        self.own: list[_Device] = []
        self.shared: list[Any] = []  # (key, the host tensor it was copied from)

    def release(self) -> None:
        """Destroy the tensor sets, free the tensors, release the shared weights, unload the models: each step
        attempted even when an earlier one failed; the first failure is raised at the end. Idempotent."""
        s = self.s
        self.s.disown(id(self))
        if s.closed:
            return
        for d in self.own:
            d.generation += 1  # torch tensors read from it are no longer device-resident
        first: BaseException | None = None
        steps = ([lambda h=h: s.destroy_set(h) for h in self.sets]
                 + [lambda d=d: s.free(d.handle) for d in self.own]
                 + [lambda k=k: s.release_shared(k[0]) for k in self.shared]
                 + [lambda m=m: s.unload(m) for m in self.models])
        self.sets, self.own, self.shared, self.models = [], [], [], []
        for step in steps:
            try:
                step()
            except BaseException as e:  # noqa: BLE001 - keep releasing, report the first failure
                first = first or e
        if first is not None:
            raise first


def load_neff_graph(describe: str, neff: bytes, params_json: bytes, outputs: Sequence[Mapping[str, Any]],
                    aliases: Mapping[str, str], weights: Sequence[Mapping[str, torch.Tensor]]) -> Any:
    """The graph as a callable (user inputs -> the single output, or a tuple)."""
    return NeffGraph(describe, neff, params_json, outputs, aliases, weights)
