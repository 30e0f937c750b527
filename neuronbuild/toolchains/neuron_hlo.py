"""Lowers a torch.export program to the XLA HLO module neuronx-cc consumes (torchax -> jax -> HloModuleProto).

The module's entry takes the program's state (parameters, buffers, lifted constants: never constants inside the module)
as its leading parameters, then the user inputs, and returns a tuple. Bytes depend only on the graph and the lowering
options: no debug locations, the per-process module id removed (checked across runs, processes and paths)."""

from __future__ import annotations

import collections
import json
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.export.graph_signature import InputKind, OutputKind

from neuronbuild.runtime import hlo_proto as neuron_hlo_proto
from neuronbuild.toolchains import neuron_complex
from neuronbuild.toolchains.errors import ToolchainError
from neuronbuild.toolchains.neuron_complex import involves_complex
from neuronbuild.toolchains.passes import ALL_EXTRA_OPS, MATMUL_OPS
from neuronbuild.toolchains.tp_ops import collective

HLO_FILE = "model.hlo.pb"
PARAMS_FILE = "params.json"
PARAMS_FORMAT = 1
AUTO_CAST_TYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Ops that only assert facts about tensors (dtype/shape checks a cast leaves behind, `.to()` / `.float()` on torch
# 2.13): they compute nothing, so they lower to nothing.
_ASSERTION_OPS = frozenset({
    "aten._assert_tensor_metadata.default", "aten._assert_scalar.default", "aten._assert_async.default",
    "aten._assert_async.msg", "aten.sym_constrain_range.default", "aten.sym_constrain_range_for_size.default",
    "aten._functional_assert_async.msg", "aten._functional_assert_scalar.default",
})
_CASTABLE = (torch.float32, torch.float16, torch.float64)
# Dtypes a Neuron graph may hold (int64 is computed as int32, as Neuron frameworks do).
NEURON_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int16,
                           torch.int8, torch.uint8, torch.bool,
                           # fp8 weights (toolchains/quantize.py): XLA f8e4m3fn / f8e5m2 parameters; the compile's
                           # environment then carries XLA_HANDLE_SPECIAL_SCALAR=1 (neuron_steps.FP8_ENV)
                           torch.float8_e4m3fn, torch.float8_e5m2})
_STATE_KINDS = {InputKind.PARAMETER: "parameter", InputKind.BUFFER: "buffer", InputKind.CONSTANT_TENSOR: "constant"}


class LoweringError(ToolchainError):
    """An op or graph feature the HLO lowering cannot express; the message names the op and its source line."""


@dataclass(frozen=True)
class HloParameter:
    """One entry parameter: its position, the program's name for it and its shape/dtype in the module."""

    index: int
    name: str
    kind: str  # "parameter" | "buffer" | "constant" | "input"
    shape: tuple[int, ...]
    dtype: str  # the module's element type (numpy-style name): int64 program values are int32 here
    source_dtype: str  # the dtype in the torch program


@dataclass(frozen=True)
class HloOutput:
    index: int
    shape: tuple[int, ...]
    dtype: str  # the module's element type
    source_dtype: str  # the dtype the torch program returns


@dataclass(frozen=True)
class LoweredModule:
    """A lowered program: the serialized module and the manifest of its signature."""

    proto: bytes
    parameters: tuple[HloParameter, ...]
    outputs: tuple[HloOutput, ...]
    ops: tuple[tuple[str, int], ...]  # aten op histogram of the lowered graph, sorted
    auto_cast: str
    auto_cast_type: str
    cast_ops: int  # how many ops auto_cast cast

    def params_json(self, tp: Mapping[str, Any] | None = None) -> bytes:
        """params.json: every entry parameter (index, name, kind, shape, dtype) and output, in order, one per line;
        for a tensor-parallel module, `tp`: its degree, the inputs/outputs held per rank (name -> dim along which
        ranks concatenate) and the collectives' form."""
        params = [{"index": p.index, "name": p.name, "kind": p.kind, "shape": list(p.shape), "dtype": p.dtype,
                   "source_dtype": p.source_dtype} for p in self.parameters]
        outputs = [{"index": o.index, "shape": list(o.shape), "dtype": o.dtype, "source_dtype": o.source_dtype}
                   for o in self.outputs]

        def rows(items: list[dict[str, Any]]) -> str:
            return "[\n" + ",\n".join("    " + json.dumps(i, sort_keys=True) for i in items) + "\n  ]" if items else "[]"

        head: dict[str, Any] = {"format": PARAMS_FORMAT, "auto_cast": self.auto_cast,
                                "auto_cast_type": self.auto_cast_type}
        if tp:
            head["tp"] = dict(tp)
        body = "".join(f"  {json.dumps(k)}: {json.dumps(v)},\n" for k, v in sorted(head.items()))
        return f"{{\n{body}  \"parameters\": {rows(params)},\n  \"outputs\": {rows(outputs)}\n}}\n".encode()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_FRAME_RE = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')


def source_line(node: torch.fx.Node) -> str:
    """The model source line a traced node came from ("models/m.py:12 in forward: x = x.to(...)"), or ""."""
    trace = node.meta.get("stack_trace") or ""
    frames = _FRAME_RE.findall(trace)
    if not frames:
        return ""
    path, line, func, code = frames[-1]
    return f"{path}:{line} in {func}: {code.strip()}"


def _where(node: torch.fx.Node) -> str:
    loc = source_line(node)
    return f" (from {loc})" if loc else " (no source line recorded for this node)"


def _op_name(target: Any) -> str:
    return str(target) if isinstance(target, torch._ops.OpOverload | torch._ops.OpOverloadPacket) else getattr(
        target, "__name__", str(target))


def _lowering(registry: Any, target: Any) -> Callable[..., Any] | None:
    op = registry.all_aten_ops.get(target)
    if op is None and isinstance(target, torch._ops.OpOverload):
        op = registry.all_aten_ops.get(target.overloadpacket)
    if op is None or not op.is_jax_function or op.needs_env:
        return None
    return op.func  # type: ignore[no-any-return]


def _check_supported(gm: torch.fx.GraphModule, registry: Any) -> None:
    unsupported: dict[str, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op in ("call_module", "call_method"):
            unsupported.setdefault(f"{node.op} {node.target}", node)
        if node.op != "call_function":
            continue
        target = node.target
        if target is operator.getitem or str(target) in _ASSERTION_OPS or collective(target):
            continue
        if involves_complex(node):  # computed on real pairs (neuron_complex.py), whatever torchax has
            if not neuron_complex.known(target):
                raise LoweringError(f"cannot lower {_op_name(target)} on a complex tensor to HLO: Neuron has no "
                                    f"complex dtype and this op has no real-pair rewrite{_where(node)}")
            continue
        if not isinstance(target, torch._ops.OpOverload) or _lowering(registry, target) is None:
            unsupported.setdefault(_op_name(target), node)
    if unsupported:
        first, node = next(iter(unsupported.items()))
        more = f" (and {len(unsupported) - 1} more: {', '.join(list(unsupported)[1:6])})" if len(unsupported) > 1 else ""
        raise LoweringError(f"cannot lower {first} to HLO: no Neuron lowering for this op{_where(node)}{more}")


def _check_dtypes(gm: torch.fx.GraphModule) -> None:
    """Every tensor a Neuron dtype; complex64 only inside the program (lowered as float32 pairs: neuron_complex)."""
    outputs = {a for n in gm.graph.nodes if n.op == "output" for a in n.all_input_nodes}
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        inner = node.op == "call_function" and node not in outputs
        for item in val if isinstance(val, list | tuple) else [val]:
            if inner and isinstance(item, torch.Tensor) and item.dtype == torch.complex64:
                continue
            if isinstance(item, torch.Tensor) and item.dtype not in NEURON_DTYPES:
                what = f"input {node.name!r}" if node.op == "placeholder" else _op_name(node.target)
                raise LoweringError(f"{what} produces {_dtype_name(item.dtype)}, which Neuron does not support "
                                    f"(use float32, bfloat16 or float16){_where(node)}")


def _lower_graph(ep: torch.export.ExportedProgram, registry: Any, cast_targets: frozenset[Any],
                 cast_dtype: Any) -> tuple[Callable[..., Any], list[int]]:
    """A jax-traceable function of (state..., inputs...) -> tuple of outputs; the list counts auto-cast ops."""
    import jax.numpy as jnp
    from torchax.ops import mappings

    gm = ep.graph_module
    cast_count = [0]

    class Lowerer(torch.fx.Interpreter):
        current: torch.fx.Node | None = None

        def run_node(self, n: torch.fx.Node) -> Any:
            self.current = n
            try:
                return super().run_node(n)
            except LoweringError:
                raise
            except Exception as exc:  # a lowering rule rejected this node's arguments
                detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise LoweringError(f"cannot lower {_op_name(n.target)} to HLO: {detail}{_where(n)}") from None

        def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
            if target is operator.getitem:
                return super().call_function(target, args, kwargs)
            if str(target) in _ASSERTION_OPS:
                return None
            if self.current is not None and involves_complex(self.current):
                return neuron_complex.call(target, args, kwargs, self.current)
            kind = collective(target)
            if kind:  # a tensor-parallel program's collective: its form is neuron_collectives'
                from neuronbuild.toolchains import neuron_collectives

                return getattr(neuron_collectives, kind)(args[0], int(args[1]))
            impl = _lowering(registry, target)
            assert impl is not None and self.current is not None  # checked up front
            val = self.current.meta.get("val")
            if target in cast_targets and isinstance(val, torch.Tensor) and val.dtype in _CASTABLE:
                cast_count[0] += 1

                def cast(a: Any) -> Any:
                    is_float = hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating)
                    return a.astype(cast_dtype) if is_float else a

                out = impl(*[cast(a) for a in args], **kwargs)
                return out.astype(mappings.t2j_dtype(val.dtype))
            return impl(*args, **kwargs)

    def model(*flat: Any) -> tuple[Any, ...]:
        out = Lowerer(gm).run(*flat, enable_io_processing=False)
        return tuple(out)

    return model, cast_count


def _check_signature(ep: torch.export.ExportedProgram) -> None:
    sig = ep.graph_signature
    kinds = [s.kind for s in sig.input_specs]
    user = [i for i, k in enumerate(kinds) if k == InputKind.USER_INPUT]
    if user and user != list(range(len(kinds) - len(user), len(kinds))):
        raise LoweringError("the program's user inputs do not all follow its parameters and buffers")
    for s in sig.input_specs:
        if s.kind not in _STATE_KINDS and s.kind != InputKind.USER_INPUT:
            raise LoweringError(f"cannot lower a program input of kind {s.kind.name} ({s.arg}) to HLO")
    for s in sig.output_specs:
        if s.kind == OutputKind.BUFFER_MUTATION:
            raise LoweringError(f"the model updates buffer {s.target!r} in forward(); a Neuron graph cannot keep "
                                "state between calls: pass it as an input and return the new value")
        if s.kind == OutputKind.USER_INPUT_MUTATION:
            raise LoweringError(f"the model writes into its input {s.target!r} in place; return the new value instead")
        if s.kind != OutputKind.USER_OUTPUT:
            raise LoweringError(f"cannot lower a program output of kind {s.kind.name} to HLO")


def lower_program(ep: torch.export.ExportedProgram, options: Mapping[str, Any] | None = None) -> LoweredModule:
    """Lower `ep` (any ATen program: core-ATen decomposition happens here) to a byte-stable HloModuleProto.

    options: auto_cast ("none" | "matmult" | "all") and auto_cast_type ("bf16" | "fp16"): matmul-family ops (and
    convolutions under "all") take their float operands in that type and cast the result back, in the module itself.
    Only shapes are traced: the weights' values never enter the module."""
    options = options or {}
    auto_cast = str(options.get("auto_cast") or "none")
    if auto_cast not in ("none", "matmult", "all"):
        raise ToolchainError(f"auto_cast must be one of none, matmult, all, got {auto_cast!r}")
    cast_type = str(options.get("auto_cast_type") or "bf16")
    if cast_type not in AUTO_CAST_TYPES:
        raise ToolchainError(f"auto_cast_type must be one of {', '.join(AUTO_CAST_TYPES)} for the HLO lowering, "
                             f"got {cast_type!r}")
    from neuronbuild.toolchains.neuron_torchax import import_torchax

    registry, decompositions = import_torchax()
    import jax
    from jax._src.lib import _jax
    from torchax.ops import mappings

    _check_signature(ep)
    # One pass to core ATen plus torchax's own decompositions (two passes cost twice: each re-traces the program).
    table = torch.export.default_decompositions()
    table.update(decompositions.DECOMPOSITIONS)
    ep = ep.run_decompositions(table)
    _check_signature(ep)
    gm = ep.graph_module
    _check_supported(gm, registry)
    _check_dtypes(gm)

    cast_targets: frozenset[Any] = frozenset()
    if auto_cast != "none":
        cast_targets = MATMUL_OPS | (ALL_EXTRA_OPS if auto_cast == "all" else frozenset())
    fn, cast_count = _lower_graph(ep, registry, cast_targets, mappings.t2j_dtype(AUTO_CAST_TYPES[cast_type]))

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    specs = ep.graph_signature.input_specs
    avals, params = [], []
    for i, (node, spec) in enumerate(zip(placeholders, specs, strict=True)):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise LoweringError(f"program input {node.name!r} is not a tensor ({type(val).__name__}); only static "
                                "tensor inputs can be lowered")
        try:
            jdtype = mappings.t2j_dtype(val.dtype)
        except Exception:
            raise LoweringError(f"program input {node.name!r} has dtype {_dtype_name(val.dtype)}, which the HLO "
                                "lowering does not support") from None
        avals.append(jax.ShapeDtypeStruct(tuple(int(d) for d in val.shape), jdtype))
        kind = _STATE_KINDS.get(spec.kind, "input")
        name = str(spec.target) if kind != "input" else node.name
        params.append((i, name, kind, _dtype_name(val.dtype)))

    lowered = jax.jit(fn, keep_unused=True).lower(*avals)
    text = lowered.compiler_ir("stablehlo").operation.get_asm(enable_debug_info=False)  # type: ignore[union-attr]
    computation = _jax.mlir.mlir_module_to_xla_computation(text, use_tuple_args=False, return_tuple=True)
    proto = neuron_hlo_proto.strip_module_id(computation.as_serialized_hlo_module_proto())
    summary = neuron_hlo_proto.parse_hlo_module(proto)
    if summary.result.dtype != "tuple" or len(summary.parameters) != len(params):
        raise LoweringError(f"internal: lowered module has signature {summary.parameters} -> {summary.result}")
    parameters = tuple(
        HloParameter(i, name, kind, shape.dims, shape.dtype, src)
        for (i, name, kind, src), shape in zip(params, summary.parameters, strict=True)
    )
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    out_vals = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in out_node.args[0]]
    if len(out_vals) != len(summary.result.elements) or not all(isinstance(v, torch.Tensor) for v in out_vals):
        raise LoweringError("the model must return tensors only (a tensor or a tuple/list of tensors)")
    outputs = tuple(HloOutput(i, s.dims, s.dtype, _dtype_name(v.dtype))
                    for i, (s, v) in enumerate(zip(summary.result.elements, out_vals, strict=True))
                    if isinstance(v, torch.Tensor))
    hist: collections.Counter[str] = collections.Counter(
        _op_name(n.target) for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem)
    return LoweredModule(proto, parameters, outputs, tuple(sorted(hist.items())), auto_cast, cast_type, cast_count[0])
