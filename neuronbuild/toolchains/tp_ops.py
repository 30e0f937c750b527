"""The torch side of tensor parallelism: `neuronbuild::all_reduce(x, tp)`, the one collective a per-rank program holds
(the sum of x over the tp ranks). Tracing sees it as an op of its own; the Neuron lowering turns it into an HLO
all-reduce (neuron_collectives.py). Eager execution of a single rank has no peers: there it is the identity, so a
per-rank module is only ever traced, never run for numbers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

OP_NAME = "neuronbuild::all_reduce"


@torch.library.custom_op(OP_NAME, mutates_args=())
def all_reduce(x: torch.Tensor, tp: int) -> torch.Tensor:
    return x.clone()


@all_reduce.register_fake
def _all_reduce_fake(x: torch.Tensor, tp: int) -> torch.Tensor:
    return torch.empty_like(x)


def is_all_reduce(target: object) -> bool:
    """Whether an FX node target is this op (its overload or packet)."""
    return str(target) in (OP_NAME, f"{OP_NAME}.default", "neuronbuild.all_reduce", "neuronbuild.all_reduce.default")


def shard_rule(full: tuple[int, ...], rank: tuple[int, ...], tp: int) -> tuple[int, int] | None:
    """How a rank's tensor of shape `rank` comes from the whole one of shape `full`: (-1, 1) replicated; (dim, tp)
    split in tp equal blocks along dim (rank r holds block r); (dim, n) with n < tp blocks, each held by tp/n
    consecutive ranks (GQA kv heads replicated when fewer than ranks); None when no such rule exists."""
    full, rank = tuple(full), tuple(rank)
    if full == rank:
        return (-1, 1)
    if len(full) != len(rank):
        return None
    diff = [d for d, (f, r) in enumerate(zip(full, rank, strict=True)) if f != r]
    if len(diff) != 1 or rank[diff[0]] <= 0:
        return None
    d = diff[0]
    f, p = full[d], rank[d]
    if f % p:
        return None
    blocks = f // p
    return (d, blocks) if blocks == tp or (blocks < tp and tp % blocks == 0) else None


def shard(full: torch.Tensor, rank_shape: tuple[int, ...], rank: int, tp: int) -> torch.Tensor:
    """Rank `rank`'s part of `full` (a view; see shard_rule)."""
    rule = shard_rule(tuple(full.shape), tuple(rank_shape), tp)
    if rule is None:
        raise ValueError(f"a tensor of shape {list(full.shape)} cannot be sharded into {list(rank_shape)} over "
                         f"{tp} ranks")
    dim, blocks = rule
    if dim < 0:
        return full
    return full.narrow(dim, (rank * blocks // tp) * rank_shape[dim], rank_shape[dim])


def apply_plan(module: torch.nn.Module, mode: Any, plan: Mapping[str, int], tp: int) -> None:
    """Make `module` (whole, with fake parameters of `mode`) one rank's module of a declared sharding plan: each
    parameter whose name matches a pattern (fnmatch) gets 1/tp of its size along the pattern's dim; an nn.Linear
    weight split along dim 1 (row-parallel: it reads this rank's slice of its input) is followed by an all-reduce of
    its output, its bias added once. Raises ValueError for a pattern matching nothing, patterns disagreeing on a
    parameter, or a dim the parameter lacks or tp does not divide."""
    import fnmatch

    used: set[str] = set()
    for name, param in list(module.named_parameters()):
        matching = [pat for pat in plan if fnmatch.fnmatchcase(name, pat)]
        used.update(matching)
        dims = {int(plan[pat]) for pat in matching}
        if not dims:
            continue
        if len(dims) > 1:
            raise ValueError(f"tp_plan: patterns give parameter {name} different dims ({sorted(dims)})")
        dim = dims.pop()
        shape = list(param.shape)
        if dim >= len(shape) or shape[dim] % tp:
            raise ValueError(f"tp_plan: parameter {name} {shape} cannot be split in {tp} along dim {dim}")
        shape[dim] //= tp
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        with mode:
            made = torch.empty(shape, dtype=param.dtype)
        owner._parameters[attr] = torch.nn.Parameter(made, requires_grad=param.requires_grad)
        if dim == 1 and attr == "weight" and isinstance(owner, torch.nn.Linear):
            if owner.bias is not None and any(fnmatch.fnmatchcase(f"{owner_name}.bias", p) for p in plan):
                raise ValueError(f"tp_plan: {owner_name} is row-parallel (weight dim 1): its bias is added once, "
                                 "after the all-reduce, and cannot be split")
            owner.register_forward_hook(_row_parallel_hook(tp))
    unused = [p for p in plan if p not in used]
    if unused:
        raise ValueError(f"tp_plan: pattern {unused[0]!r} matches no parameter of the model")


def _row_parallel_hook(tp: int) -> Any:
    def hook(m: torch.nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
        bias = getattr(m, "bias", None)
        if bias is None:
            return all_reduce(out, tp)  # type: ignore[no-any-return]
        return all_reduce(out - bias, tp) + bias  # type: ignore[no-any-return]

    return hook
