"""The torch side of tensor parallelism: `neuronbuild::all_reduce(x, tp)`, the one collective a per-rank program holds
(the sum of x over the tp ranks). Tracing sees it as an op of its own; the Neuron lowering turns it into an HLO
all-reduce (neuron_collectives.py). Eager execution of a single rank has no peers: there it is the identity, so a
per-rank module is only ever traced, never run for numbers."""

from __future__ import annotations

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
