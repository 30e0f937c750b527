"""The torch side of tensor parallelism: the collectives a per-rank program holds, `neuronbuild::all_reduce(x, tp)`
(the sum of x over the tp ranks) and `neuronbuild::all_gather(x, tp)` (the ranks' x joined along the last dim, rank
order), the vocabulary-parallel embedding and how a rank's weights come from the whole ones. Tracing sees each
collective as an op of its own; the Neuron lowering turns it into an HLO all-reduce / all-gather
(neuron_collectives.py). Eager execution of a single rank has no peers (all_reduce is the identity, all_gather
repeats x), so a per-rank module is only ever traced, never run for numbers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

OP_NAME = "neuronbuild::all_reduce"
GATHER_OP_NAME = "neuronbuild::all_gather"
# A per-rank program's rank id: a non-persistent int32[1] buffer of the vocabulary-parallel embedding, which the
# shards give each rank its own value of (rank r: [r]), as NxD Inference's SPMDRank does (no replica-id op needed).
RANK_BUFFER = "nb_tp_rank"


@torch.library.custom_op(OP_NAME, mutates_args=())
def all_reduce(x: torch.Tensor, tp: int) -> torch.Tensor:
    return x.clone()


@all_reduce.register_fake
def _all_reduce_fake(x: torch.Tensor, tp: int) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op(GATHER_OP_NAME, mutates_args=())
def all_gather(x: torch.Tensor, tp: int) -> torch.Tensor:
    return torch.cat([x] * tp, dim=-1)


@all_gather.register_fake
def _all_gather_fake(x: torch.Tensor, tp: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] * tp))


def collective(target: object) -> str | None:
    """Which collective an FX node target is ("all_reduce", "all_gather"; its overload or packet), else None."""
    name = str(target).replace("neuronbuild.", "neuronbuild::").removesuffix(".default")
    return {OP_NAME: "all_reduce", GATHER_OP_NAME: "all_gather"}.get(name)


def is_all_reduce(target: object) -> bool:
    """Whether an FX node target is the all-reduce op (its overload or packet)."""
    return collective(target) == "all_reduce"


def is_rank_buffer(name: str) -> bool:
    """Whether a program's state name is its rank id (RANK_BUFFER), whose value differs per rank."""
    return name.rpartition(".")[2] == RANK_BUFFER


def rank_value(rank: int) -> torch.Tensor:
    """The rank id buffer's value on rank `rank`."""
    return torch.tensor([rank], dtype=torch.int32)


def vocab_rows(vocab: int, tp: int) -> int:
    """Rows of the vocabulary each rank holds: the vocabulary padded to a multiple of tp, split in tp blocks."""
    return -(-vocab // tp)


class VocabParallelEmbedding(torch.nn.Embedding):
    """One rank's block of a vocabulary-parallel embedding (Megatron, as NxD Inference's ParallelEmbedding): its
    weight holds rows [rank*rows, (rank+1)*rows) of the vocabulary padded to tp*rows; an id outside that range looks
    up zeros, and the all-reduce sums the one rank that holds it with the zeros of the others (exact in any dtype).
    Made from an nn.Embedding by `make_vocab_parallel`, so the weight keeps its name (and any tie)."""

    nb_tp: int

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.shape[0]
        local = ids - getattr(self, RANK_BUFFER).to(ids.dtype) * rows
        inside = (local >= 0) & (local < rows)
        out = torch.nn.functional.embedding(torch.where(inside, local, torch.zeros_like(local)), self.weight)
        out = torch.where(inside.unsqueeze(-1), out, torch.zeros((), dtype=out.dtype))
        return all_reduce(out, self.nb_tp)  # type: ignore[no-any-return]


class ScaledVocabParallelEmbedding(VocabParallelEmbedding):
    """The same for transformers' scaled word embeddings (Gemma's `*ScaledWordEmbedding`: the lookup times its
    `embed_scale` buffer, in the weight's dtype), scaled as they do after the lookup: on each rank's block, before the
    all-reduce (the other ranks' zeros stay zeros, so the sum is the whole model's scaled lookup)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.shape[0]
        local = ids - getattr(self, RANK_BUFFER).to(ids.dtype) * rows
        inside = (local >= 0) & (local < rows)
        out = torch.nn.functional.embedding(torch.where(inside, local, torch.zeros_like(local)), self.weight)
        out = out * self.embed_scale.to(self.weight.dtype)  # type: ignore[operator]
        out = torch.where(inside.unsqueeze(-1), out, torch.zeros((), dtype=out.dtype))
        return all_reduce(out, self.nb_tp)  # type: ignore[no-any-return]


def _is_scaled_embedding(embedding: torch.nn.Module) -> bool:
    """transformers' `*ScaledWordEmbedding`: an nn.Embedding whose forward is the lookup times `embed_scale`."""
    cls = type(embedding)
    return cls.__name__.endswith("ScaledWordEmbedding") and cls.__mro__[1] is torch.nn.Embedding \
        and isinstance(getattr(embedding, "embed_scale", None), torch.Tensor)


def make_vocab_parallel(embedding: torch.nn.Module, tp: int) -> None:
    """Turn one rank's nn.Embedding (of `vocab_rows` rows) into that rank's VocabParallelEmbedding, with its rank id
    buffer (a program input each rank's shard gives its value); a scaled word embedding (Gemma) keeps its scale."""
    if _is_scaled_embedding(embedding):
        embedding.__class__ = ScaledVocabParallelEmbedding
    elif type(embedding) is not torch.nn.Embedding:
        raise ValueError(f"vocabulary-parallel embedding: {type(embedding).__name__} is not a plain nn.Embedding")
    else:
        embedding.__class__ = VocabParallelEmbedding
    setattr(embedding, "nb_tp", tp)  # noqa: B010 - (now a VocabParallelEmbedding's attribute)
    embedding.register_buffer(RANK_BUFFER, torch.zeros(1, dtype=torch.int32), persistent=False)


def gather_vocab(linear: torch.nn.Module, tp: int, vocab: int) -> None:
    """Make one rank's column-parallel lm_head (vocab_rows rows of the padded vocabulary) output the whole logits: its
    output all-gathered over the ranks along the vocabulary, the padding cut off (`vocab` columns)."""
    def hook(_m: torch.nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
        return all_gather(out, tp)[..., :vocab]  # type: ignore[no-any-return]

    linear.register_forward_hook(hook)


def shard_rule(full: tuple[int, ...], rank: tuple[int, ...], tp: int) -> tuple[int, int] | None:
    """How a rank's tensor of shape `rank` comes from the whole one of shape `full`: (-1, 1) replicated; (dim, tp)
    split in tp equal blocks along dim (rank r holds block r; when tp blocks of that size overrun the dim, as a
    vocabulary padded to a multiple of tp does, the overrun is zeros); (dim, n) with n < tp blocks, each held by tp/n
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
    blocks = 0 if f % p else f // p
    if blocks == tp or (0 < blocks < tp and tp % blocks == 0):
        return (d, blocks)
    return (d, tp) if vocab_rows(f, tp) == p else None  # padded to tp * p (a vocabulary of at least tp rows)


def block(full: tuple[int, ...], rank_shape: tuple[int, ...], rank: int, tp: int) -> tuple[int, int, int]:
    """Where rank `rank`'s part of a tensor of shape `full` lies: (dim, start, held), `held` <= rank_shape[dim]
    indices of `dim` from `start` (fewer at a padded end; the rest are zeros); (-1, 0, 0) when replicated.
    ValueError when the shapes admit no split (see shard_rule)."""
    rule = shard_rule(tuple(full), tuple(rank_shape), tp)
    if rule is None:
        raise ValueError(f"a tensor of shape {list(full)} cannot be sharded into {list(rank_shape)} over {tp} ranks")
    dim, blocks = rule
    if dim < 0:
        return -1, 0, 0
    size = rank_shape[dim]
    start = (rank * blocks // tp) * size
    return dim, start, max(0, min(size, full[dim] - start))


def padded(part: torch.Tensor, rank_shape: tuple[int, ...], dim: int) -> torch.Tensor:
    """`part` (a block's held indices along dim) as the rank's shape: zeros past it (the padded end of a vocabulary:
    looked up by no id, cut from the logits)."""
    if tuple(part.shape) == tuple(rank_shape):
        return part
    out = part.new_zeros(rank_shape)
    out.narrow(dim, 0, part.shape[dim]).copy_(part)
    return out


def shard(full: torch.Tensor, rank_shape: tuple[int, ...], rank: int, tp: int) -> torch.Tensor:
    """Rank `rank`'s part of `full` (a view unless padded; see shard_rule)."""
    dim, start, held = block(tuple(full.shape), tuple(rank_shape), rank, tp)
    return full if dim < 0 else padded(full.narrow(dim, start, held), tuple(rank_shape), dim)


# A per-rank module's fused parameters: {state name: (dim, ((whole length, rank length), ...))}: along `dim` the
# whole tensor is the concatenation of these parts (q|k|v, gate|up), each split over the ranks on its own (as
# shard_rule splits a tensor: tp blocks, or fewer blocks replicated, e.g. GQA kv heads), and the rank's tensor is the
# concatenation of its blocks of each part. Set by the toolchain that builds the rank's module (hf_causal_lm);
# read by the weights action (model_import.rank_values) and the checkpoint check (weights.check_against).
FUSED_ATTR = "nb_tp_fused"
Fused = Mapping[str, tuple[int, tuple[tuple[int, int], ...]]]


def fused_params(module: torch.nn.Module) -> Fused:
    """The fused parameters a per-rank module declares (FUSED_ATTR), or none."""
    return dict(getattr(module, FUSED_ATTR, None) or {})


def fused_whole_shape(rank_shape: tuple[int, ...], dim: int, parts: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    """The whole tensor's shape of a fused parameter."""
    return (*rank_shape[:dim], sum(w for w, _r in parts), *rank_shape[dim + 1:])


def fused_shard(full: torch.Tensor, rank_shape: tuple[int, ...], rank: int, tp: int, dim: int,
                parts: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """Rank `rank`'s part of a fused parameter: its block of each part along dim, concatenated."""
    out, start = [], 0
    for whole, held in parts:
        piece = full.narrow(dim, start, whole)
        shape = (*rank_shape[:dim], held, *rank_shape[dim + 1:])
        out.append(shard(piece, shape, rank, tp))
        start += whole
    return torch.cat(out, dim=dim)


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
