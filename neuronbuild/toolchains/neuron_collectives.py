"""The one place that decides how a collective looks in the HLO a tensor-parallel Neuron graph holds.

Form used: replica-style, as torch-xla (and so NxD Inference) emits them: `all-reduce(x), replica_groups={{0..tp-1}},
to_apply=add` and `all-gather(x), replica_groups={{0..tp-1}}, dimensions={last}`, no channel id, the module run with num_replicas = tp (XLA:CPU here: runtime/xla_cpu.py). Whether
neuronx-cc accepts this form (or wants partition-style `channel_id` + `use_global_device_ids`) is not verified: no
compiler here. Change it here and nowhere else."""

from __future__ import annotations

from typing import Any

FORM = "replica"  # recorded in every Lower record of a tp graph: a change of form re-lowers


def _primitive() -> Any:
    import numpy as np
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import hlo
    from jax.extend.core import Primitive

    prim = Primitive("neuronbuild_all_reduce")
    prim.def_impl(lambda x, *, tp: x)
    prim.def_abstract_eval(lambda x, *, tp: x)

    def lowering(ctx: Any, x: Any, *, tp: int) -> Any:
        aval, = ctx.avals_in
        groups = ir.DenseIntElementsAttr.get(np.arange(tp, dtype=np.int64).reshape(1, tp))  # type: ignore[call-overload]
        op = hlo.AllReduceOp([x.type], [x], replica_groups=groups)
        scalar = ir.RankedTensorType.get([], mlir.dtype_to_ir_type(aval.dtype))
        block = op.regions[0].blocks.append(scalar, scalar)
        with ir.InsertionPoint(block):
            hlo.return_([hlo.add(*block.arguments)])
        return op.results

    mlir.register_lowering(prim, lowering)
    return prim


def _gather_primitive() -> Any:
    import numpy as np
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import hlo
    from jax.extend.core import Primitive

    prim = Primitive("neuronbuild_all_gather")
    prim.def_abstract_eval(lambda x, *, tp: x.update(shape=(*x.shape[:-1], x.shape[-1] * tp)))

    def lowering(ctx: Any, x: Any, *, tp: int) -> Any:
        out, = ctx.avals_out
        groups = ir.DenseIntElementsAttr.get(np.arange(tp, dtype=np.int64).reshape(1, tp))  # type: ignore[call-overload]
        result = ir.RankedTensorType.get(out.shape, mlir.dtype_to_ir_type(out.dtype))
        return hlo.AllGatherOp([result], [x], all_gather_dim=len(out.shape) - 1, replica_groups=groups).results

    mlir.register_lowering(prim, lowering)
    return prim


_PRIMS: dict[str, Any] = {}


def all_reduce(x: Any, tp: int) -> Any:
    """The sum of `x` over the tp ranks, as an HLO all-reduce of this module's form."""
    if "all_reduce" not in _PRIMS:
        _PRIMS["all_reduce"] = _primitive()
    return _PRIMS["all_reduce"].bind(x, tp=int(tp))


def all_gather(x: Any, tp: int) -> Any:
    """The tp ranks' `x` joined along its last dim in rank order, as an HLO all-gather of this module's form."""
    if "all_gather" not in _PRIMS:
        _PRIMS["all_gather"] = _gather_primitive()
    return _PRIMS["all_gather"].bind(x, tp=int(tp))
