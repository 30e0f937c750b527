"""FX graph passes implied by compiler options (auto_cast), applied to a GraphModule and re-exported."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx

from neuronbuild.toolchains.errors import ToolchainError
from neuronbuild.toolchains.trace import strip_unstable_meta
from neuronbuild.vocabulary import AUTO_CAST

aten = torch.ops.aten


# Matmul-family ops whose tensor inputs are cast to bf16 under auto_cast=matmult (the ATen and core-ATen spellings).
MATMUL_OPS: frozenset[Any] = frozenset(
    {
        aten.mm.default,
        aten.bmm.default,
        aten.addmm.default,
        aten.baddbmm.default,
        aten.linear.default,
        aten.matmul.default,
    }
)
# auto_cast=all additionally covers convolutions. Elementwise ops, reductions and softmax stay in their original
# dtype: casting them would only add converts on CPU, and it keeps the numerics of norms/softmax sane.
ALL_EXTRA_OPS: frozenset[Any] = frozenset(
    {
        aten.convolution.default,
        aten.conv1d.default,
        aten.conv2d.default,
        aten.conv3d.default,
    }
)
_CASTABLE = (torch.float32, torch.float16, torch.float64)


def _node_dtype(node: Any) -> torch.dtype | None:
    if not isinstance(node, fx.Node):
        return None
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


def auto_cast_pass(gm: fx.GraphModule, mode: str) -> int:
    """Cast the float inputs of targeted ops to bfloat16 and their result back; returns how many ops were cast."""
    if mode not in AUTO_CAST:
        raise ToolchainError(f"auto_cast must be one of {', '.join(AUTO_CAST)}, got {mode!r}")
    if mode == "none":
        return 0
    targets = MATMUL_OPS | (ALL_EXTRA_OPS if mode == "all" else frozenset())
    graph = gm.graph
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in targets:
            continue
        out_dtype = _node_dtype(node)
        if out_dtype not in _CASTABLE:
            continue
        new_args = []
        for arg in node.args:
            if _node_dtype(arg) in _CASTABLE:
                with graph.inserting_before(node):
                    arg = graph.call_function(aten._to_copy.default, (arg,), {"dtype": torch.bfloat16})
            new_args.append(arg)
        node.args = tuple(new_args)
        with graph.inserting_after(node):
            back = graph.call_function(aten._to_copy.default, (node,), {"dtype": out_dtype})
        node.replace_all_uses_with(back, delete_user_cb=lambda user, back=back: user is not back)
        count += 1
    if count:
        graph.lint()
        gm.recompile()
    return count


def apply_passes(
    ep: torch.export.ExportedProgram,
    options: Mapping[str, Any],
    args: Sequence[torch.Tensor],
) -> torch.export.ExportedProgram:
    """Apply the passes `options` imply; re-exports (with `args` as example inputs) only when something changed."""
    mode = str(options.get("auto_cast", "none") or "none")
    if mode == "none":
        return ep
    gm = ep.module()
    if not isinstance(gm, fx.GraphModule):
        raise ToolchainError("program does not unlift to a GraphModule")
    if auto_cast_pass(gm, mode) == 0:
        return ep
    with torch.no_grad():
        out = torch.export.export(gm, tuple(args), strict=False)
    strip_unstable_meta(out)
    return out
