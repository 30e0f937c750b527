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


# A per-rank module's fused parameters: {state name: (dim, ((whole length, rank length), ...)[, ep])}: along `dim` the
# whole tensor is the concatenation of these parts (q|k|v, gate|up), each split over the ranks on its own (as
# shard_rule splits a tensor: tp blocks, or fewer blocks replicated, e.g. GQA kv heads), and the rank's tensor is the
# concatenation of its blocks of each part. With `ep` > 1 (experts on an EP x TP grid: hf_causal_lm's moe_ep_degree
# x moe_tp_degree, ep_coordinates), dim 0 is the experts': rank r holds block r // (tp/ep) of ep blocks of them and
# its parts are split over the tp/ep ranks of its group (coordinate r % (tp/ep)). Set by the toolchain that builds
# the rank's module (hf_causal_lm); read by the weights action (model_import.rank_values) and the checkpoint check
# (weights.check_against).
FUSED_ATTR = "nb_tp_fused"
Fused = Mapping[str, tuple[Any, ...]]


def fused_params(module: torch.nn.Module) -> Fused:
    """The fused parameters a per-rank module declares (FUSED_ATTR), or none."""
    return dict(getattr(module, FUSED_ATTR, None) or {})


def fused_whole_shape(rank_shape: tuple[int, ...], dim: int, parts: tuple[tuple[int, int], ...],
                      ep: int = 1) -> tuple[int, ...]:
    """The whole tensor's shape of a fused parameter."""
    shape = (*rank_shape[:dim], sum(w for w, _r in parts), *rank_shape[dim + 1:])
    return (shape[0] * ep, *shape[1:])


def ep_coordinates(rank: int, tp: int, ep: int) -> tuple[int, int]:
    """Rank `rank`'s (expert-parallel group, rank inside it) on an EP x TP grid of tp ranks in ep groups, as NxD's
    `initialize_model_parallel(tensor_model_parallel_size = tp/ep, expert_model_parallel_size = ep)` lays it out:
    each group's tp/ep ranks consecutive (the TP dimension contiguous), so rank r is in group r // (tp/ep) at
    r % (tp/ep). Group g holds experts [g*E/ep, (g+1)*E/ep)."""
    moe_tp = tp // ep
    return rank // moe_tp, rank % moe_tp


def fused_shard(full: torch.Tensor, rank_shape: tuple[int, ...], rank: int, tp: int, dim: int,
                parts: tuple[tuple[int, int], ...], ep: int = 1) -> torch.Tensor:
    """Rank `rank`'s part of a fused parameter: its block of each part along dim, concatenated (with `ep` > 1: of its
    expert-parallel group's block of experts, split over the group's ranks)."""
    if ep > 1:
        group, rank = ep_coordinates(rank, tp, ep)
        full, tp = full.narrow(0, group * rank_shape[0], rank_shape[0]), tp // ep
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


# -- transformers families (hf_causal_lm): one rank's model -----------------------------------------------------------
# hf_causal_lm.hf_model builds one rank's model from `per_rank_hf` (the config) and `shard_hf_model` (what the config
# cannot say). Two ways, by family:
# - config-driven (llama and every family whose attention reads `head_dim` from its config): the rank's config holds
#   heads/tp, kv heads/tp (or 1, replicated), the MLP's and experts' widths /tp; transformers then builds the rank's
#   layers at their per-rank shapes;
# - module-patched (PATCHED: falcon, bloom, gpt_bigcode, gpt2, whose attention derives head_dim from hidden_size/heads):
#   the whole model's config, then each attention's head counts and its q|k|v and output projections are cut to the
#   rank's (GPT-2's Conv1D layers hold their weights transposed, [in, out]: the same cuts on the other dim).
# Row-parallel layers (ROW_PARALLEL: attention's output projection, the MLP's down projection, experts) are followed
# by an all-reduce, their bias added once, after it.
PATCHED = ("falcon", "bloom", "gpt_bigcode", "gpt2")
# MLP widths split over the ranks, by config key (an expert's and a shared expert's too; Llama 4's dense layers')
WIDTH_KEYS = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size", "intermediate_size_mlp",
              "ffn_hidden_size", "n_inner")
ROW_PARALLEL = (".self_attn.o_proj", ".mlp.down_proj", ".shared_expert.down_proj", ".shared_experts.down_proj",
                ".feed_forward.down_proj", ".feed_forward.shared_expert.down_proj",
                ".self_attn.dense", ".mlp.fc2",  # phi
                ".mlp.c_proj", ".attn.c_proj",  # starcoder2, gpt_bigcode, gpt2 (a Conv1D)
                ".self_attention.dense", ".mlp.dense_4h_to_h")  # falcon, bloom
EXPERTS = (".mlp.experts", ".feed_forward.experts")  # experts' intermediate width split: partial sums, all-reduced


def per_rank_hf(model_type: str, hf: dict[str, Any], tp: int) -> dict[str, Any]:
    """One rank's HF config (see above). The embedding and lm_head hold the rank's block of the vocabulary padded to
    a multiple of tp (vocab_parallel); norms are replicated."""
    out = dict(hf)
    hidden = int(hf.get("hidden_size") or hf.get("n_embd") or 0)
    if model_type == "falcon":
        out["ffn_hidden_size"] = int(hf.get("ffn_hidden_size") or 4 * hidden) // tp
    elif model_type in ("gpt_bigcode", "gpt2"):
        out["n_inner"] = int(hf.get("n_inner") or 4 * hidden) // tp
    if model_type not in PATCHED:
        heads = int(hf["num_attention_heads"])
        kv = int(hf.get("num_key_value_heads") or heads)
        if not hf.get("kv_lora_rank"):  # (latent attention's head_dim is its rotary width: the config's own)
            out["head_dim"] = int(hf.get("head_dim") or hidden // heads)
        out["num_attention_heads"] = heads // tp
        out["num_key_value_heads"] = max(1, kv // tp)
        for key in WIDTH_KEYS:
            if hf.get(key):
                out[key] = int(hf[key]) // tp
    out["vocab_size"] = vocab_rows(int(hf["vocab_size"]), tp)
    out["pad_token_id"] = None  # (the embedding's padding_idx: a global id, and only init and gradients use it)
    return out


def shard_hf_model(model: torch.nn.Module, model_type: str, hf: Mapping[str, Any], tp: int,
                   moe_ep_degree: int = 1) -> None:
    """Make `model` (built from per_rank_hf's config) one rank's model: the patched families' attention cut to the
    rank's heads, whole-width q/k norms (OLMoE) made tensor-parallel, the experts on an EP x TP grid with
    `moe_ep_degree` > 1 (hf_causal_lm's; moe_tp_degree = tp / it: _expert_parallel), all-reduces after the
    row-parallel layers, biases of width-split experts added by one rank of each expert-parallel group, the
    vocabulary-parallel embedding and lm_head, and the fused parameters declared (FUSED_ATTR) for the weights action.
    ValueError for what no rule covers."""
    if tp % moe_ep_degree:
        raise ValueError(f"moe_ep_degree {moe_ep_degree} does not divide tp_degree {tp}")
    if model_type in PATCHED:
        _patch_attention(model, model_type, hf, tp)
    _tp_qk_norms(model, hf, tp)
    experts = _expert_parallel(model, hf, tp, moe_ep_degree) if moe_ep_degree > 1 else {}
    _row_parallel(model, tp, tp // moe_ep_degree)
    vocab_parallel(model, tp, int(hf.get("vocab_size") or 0))
    declare_fused(model, model_type, hf, tp, experts)


# The experts' own attributes set by expert parallelism: the whole model's expert count (the routing's width) and the
# ranks of an expert-parallel group (MOE_TP_ATTR: which block of experts rank r holds, r // it, and which rank of the
# group adds a down bias); read by hf_causal_lm's dense experts with the rank id buffer.
EP_EXPERTS_ATTR = "nb_ep_experts"
MOE_TP_ATTR = "nb_moe_tp"


def _expert_parallel(model: torch.nn.Module, hf: Mapping[str, Any], tp: int, ep: int) -> dict[str, tuple[Any, ...]]:
    """Expert parallelism as NxD Inference's moe_ep_degree x moe_tp_degree = tp: the ranks form ep groups of
    moe_tp = tp/ep consecutive ranks (ep_coordinates); each experts module (transformers' experts interface:
    [experts, ...] parameters) holds its group's block of experts (experts/ep of them, group g: [g*E/ep, (g+1)*E/ep)),
    each expert's intermediate width split over the group's ranks as the width split does over all of them
    (column-parallel gate/up, fused gate|up part by part, row-parallel down; moe_tp 1: whole experts); its routing
    weights those experts' columns of the whole routing (the router is replicated). Its output, the rank's share of
    every token, is all-reduced over every rank as the width-split experts' partial sums are. Returns the experts'
    parameters as fused declarations with the grid (FUSED_ATTR), for the weights action."""
    import copy

    moe_tp = tp // ep
    fused: dict[str, tuple[Any, ...]] = {}
    for name, m in list(model.named_modules()):
        if not name.endswith(EXPERTS):
            continue
        if not isinstance(getattr(m, "down_proj", None), torch.nn.Parameter):
            raise ValueError(f"{name}: {type(m).__name__} does not hold its experts as [experts, ...] parameters: "
                             "expert parallelism is not supported for it")
        built = []
        for split in (1, moe_tp):  # the experts at their whole width, and at a rank's of its group
            cfg = copy.copy(m.config if hasattr(m, "config") else model.config)  # type: ignore[union-attr]
            for key in WIDTH_KEYS:  # (per_rank_hf divided them by tp)
                if hf.get(key):
                    setattr(cfg, key, int(hf[key]) // split)
            with torch.device("meta"):
                built.append(type(m)(cfg))
        whole, part = built
        experts = int(whole.down_proj.shape[0])
        if experts % ep:
            raise ValueError(f"{name}: {experts} experts cannot be split by expert over {ep} groups")
        concatenated = bool(getattr(m, "is_concatenated", True))  # (gpt-oss: interleaved gate/up pairs)
        for pname, p in list(whole.named_parameters(recurse=False)):
            held = m._parameters[pname]
            assert held is not None
            shape = (experts // ep, *part._parameters[pname].shape[1:])  # type: ignore[union-attr]
            m._parameters[pname] = torch.nn.Parameter(torch.empty(shape, dtype=held.dtype, device=held.device),
                                                      requires_grad=False)
            fused[f"{name}.{pname}"] = _expert_split(tuple(p.shape), shape, concatenated and "gate_up" in pname, ep)
        for attr in ("intermediate_dim", "intermediate_size", "expert_dim"):
            if hasattr(part, attr):
                setattr(m, attr, getattr(part, attr))
        setattr(m, "num_experts", experts // ep)  # noqa: B010
        setattr(m, EP_EXPERTS_ATTR, experts)
        setattr(m, MOE_TP_ATTR, moe_tp)
        m.register_buffer(RANK_BUFFER, torch.zeros(1, dtype=torch.int32), persistent=False)
    return fused


def _expert_split(whole: tuple[int, ...], rank: tuple[int, ...], gate_up: bool, ep: int) -> tuple[Any, ...]:
    """The fused declaration (FUSED_ATTR, with the grid) of one expert parameter: its width dim (the one besides the
    experts' that differs; gate|up concatenated: two parts) split over the group's ranks, or none (a down bias)."""
    dims = [d for d in range(1, len(whole)) if whole[d] != rank[d]]
    if not dims:
        return (len(whole) - 1, ((whole[-1], whole[-1]),), ep)
    d = dims[0]
    if gate_up:
        return (d, ((whole[d] // 2, rank[d] // 2),) * 2, ep)
    return (d, ((whole[d], rank[d]),), ep)


def _is_conv1d(layer: Any) -> bool:
    """transformers' Conv1D (GPT-2): a linear layer whose weight is [in, out] (nx, nf), computing x @ W + b."""
    from transformers.pytorch_utils import Conv1D

    return isinstance(layer, Conv1D)


def _resize(linear: Any, dim: int, size: int) -> None:
    """Give an nn.Linear (or a Conv1D, its weight transposed) `size` output (dim 0) or input (dim 1) features: new
    (valueless) parameters of the rank's shapes, in the same dtype and device (the weights action fills them)."""
    conv = _is_conv1d(linear)
    weight = linear.weight
    shape = list(weight.shape)
    shape[1 - dim if conv else dim] = size
    linear.weight = torch.nn.Parameter(torch.empty(shape, dtype=weight.dtype, device=weight.device),
                                       requires_grad=False)
    if dim == 0:
        setattr(linear, "nf" if conv else "out_features", size)
        if linear.bias is not None:
            bias = linear.bias
            linear.bias = torch.nn.Parameter(torch.empty(size, dtype=bias.dtype, device=bias.device),
                                             requires_grad=False)
    else:
        setattr(linear, "nx" if conv else "in_features", size)


def _patch_attention(model: torch.nn.Module, model_type: str, hf: Mapping[str, Any], tp: int) -> None:
    """Falcon, BLOOM, GPT-BigCode, GPT-2: each attention's heads cut to the rank's (head_dim kept), its fused q|k|v cut
    to the rank's heads (per-head interleaved [q k v] per head, or Falcon's new decoder architecture's kv groups
    [q.. k v] per group with kv heads dividing by tp: a plain block of heads or groups; multi-query [q... | k | v],
    one group: the query heads split, the one k and v replicated, declared fused; GPT-2's [q | k | v]: each part split
    by head, declared fused) and its output projection's input to theirs; ALiBi slopes (BLOOM's, Falcon's) are the
    whole model's, each rank taking its heads' (its rank id)."""
    for name, m in model.named_modules():
        cls = type(m).__name__
        if cls.endswith("MLP") and model_type == "bloom":
            _resize(m.dense_h_to_4h, 0, m.dense_h_to_4h.out_features // tp)
            _resize(m.dense_4h_to_h, 1, m.dense_4h_to_h.in_features // tp)
        if not cls.endswith("Attention"):
            continue
        heads, head_dim = int(m.num_heads), int(m.head_dim)
        m.num_heads = heads // tp
        rank_q = heads // tp * head_dim
        if model_type == "falcon":
            if m.new_decoder_architecture:  # [q.. k v] per kv group; k and v broadcast to the group's query heads
                kv_r = max(1, int(m.num_kv_heads) // tp)
                m.num_kv_heads = kv_r
                qkv_out = rank_q + 2 * kv_r * head_dim
            else:
                m.num_kv_heads = 1 if m.multi_query else heads // tp
                qkv_out = rank_q + 2 * head_dim if m.multi_query else 3 * rank_q
            qkv, dense = m.query_key_value, m.dense
        elif model_type == "bloom":
            qkv, dense, qkv_out = m.query_key_value, m.dense, 3 * rank_q
        else:  # gpt_bigcode, gpt2
            if getattr(m, "is_cross_attention", False):
                raise ValueError(f"{name}: cross-attention is not supported at tp_degree > 1")
            m.embed_dim = m.split_size = rank_q
            multi_query = bool(getattr(m, "multi_query", False))
            qkv_out = rank_q + 2 * head_dim if multi_query else 3 * rank_q
            if model_type == "gpt_bigcode":
                m.kv_heads = 1 if multi_query else heads // tp
                m.kv_dim = m.kv_heads * head_dim
                m.num_key_value_groups = m.num_heads // m.kv_heads
            qkv, dense = m.c_attn, m.c_proj
        _resize(qkv, 0, qkv_out)
        _resize(dense, 1, rank_q)
    if model_type == "bloom":
        _bloom_alibi(model, tp)
    if model_type == "falcon" and hf.get("alibi"):
        _falcon_alibi(model, tp)


def _falcon_alibi(model: torch.nn.Module, tp: int) -> None:
    """Falcon's ALiBi for the rank's heads: FalconModel builds the bias (and the 4-D mask it is merged into) for every
    head of the whole model, as transformers does; each attention takes its rank's block of heads of both, by the
    rank id (a buffer of the FalconModel, as the embedding's)."""
    base: Any = model.transformer
    base.register_buffer(RANK_BUFFER, torch.zeros(1, dtype=torch.int32), persistent=False)
    heads = int(base.num_heads)

    def take_heads(m: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        alibi, mask = kwargs.get("alibi"), kwargs.get("attention_mask")
        if alibi is None:
            return args, kwargs
        per = int(m.num_heads)  # type: ignore[arg-type]
        index = getattr(base, RANK_BUFFER).to(torch.int64) * per + torch.arange(per, device=alibi.device)
        if alibi.dim() == 4:  # [batch, heads, 1, kv] (FalconModel's, once merged into a 4-D mask)
            kwargs["alibi"] = alibi.index_select(1, index)
        else:  # [batch * heads, 1, kv]
            batch = alibi.shape[0] // heads
            whole = alibi.view(batch, heads, *alibi.shape[1:])
            kwargs["alibi"] = whole.index_select(1, index).reshape(batch * per, *alibi.shape[1:])
        if mask is not None and mask.dim() == 4 and mask.shape[1] == heads:  # [batch, heads, q, kv]: ALiBi merged in
            kwargs["attention_mask"] = mask.index_select(1, index)
        return args, kwargs

    for _name, m in model.named_modules():
        if type(m).__name__.endswith("Attention"):
            m.register_forward_pre_hook(take_heads, with_kwargs=True)


def _bloom_alibi(model: torch.nn.Module, tp: int) -> None:
    """BLOOM's ALiBi bias for the rank's heads: the whole model's tensor (its slopes depend on the head count and the
    head's index), the rank's block of heads taken by its rank id (a buffer, as the embedding's)."""
    base: Any = model.transformer  # BloomModel: builds the bias from its num_heads (the whole model's)
    base.register_buffer(RANK_BUFFER, torch.zeros(1, dtype=torch.int32), persistent=False)
    whole_build = base.build_alibi_tensor
    heads = int(base.num_heads)

    def build_alibi_tensor(attention_mask: torch.Tensor, num_heads: int, dtype: torch.dtype) -> torch.Tensor:
        alibi = whole_build(attention_mask, num_heads, dtype)  # [batch * heads, 1, seq]
        batch = attention_mask.shape[0]
        per = heads // tp
        index = getattr(base, RANK_BUFFER).to(torch.int64) * per + torch.arange(per, device=alibi.device)
        alibi = alibi.view(batch, heads, 1, alibi.shape[-1]).index_select(1, index)
        return alibi.reshape(batch * per, 1, alibi.shape[-1])

    base.build_alibi_tensor = build_alibi_tensor


class TPRMSNorm(torch.nn.Module):
    """One rank's part of an RMSNorm over a width split across the ranks (OLMoE's q and k norms span every head): the
    sum of squares all-reduced (each block counted once: divided by the ranks holding it) over the whole width."""

    weight: torch.nn.Parameter

    def __init__(self, weight: torch.nn.Parameter, eps: float, width: int, copies: int, tp: int) -> None:
        super().__init__()
        self.weight = weight
        self.variance_epsilon, self.width, self.copies, self.tp = eps, width, copies, tp

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        x = hidden_states.to(torch.float32)
        squares = all_reduce(x.pow(2).sum(-1, keepdim=True), self.tp)
        variance = squares / (self.copies * self.width)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * x.to(dtype)  # type: ignore[no-any-return]


def _tp_qk_norms(model: torch.nn.Module, hf: Mapping[str, Any], tp: int) -> None:
    """Whole-width q/k RMSNorms (over all heads, before the heads are split: OLMoE's, OLMo-2's) as TPRMSNorm over the
    rank's heads. Per-head norms (Qwen3's, of head_dim) are replicated as they are."""
    heads = int(hf.get("num_attention_heads") or 0)
    kv = int(hf.get("num_key_value_heads") or heads)
    for _name, m in model.named_modules():
        q_norm, q_proj = getattr(m, "q_norm", None), getattr(m, "q_proj", None)
        if q_norm is None or q_proj is None or not isinstance(q_proj, torch.nn.Linear):
            continue
        head_dim = int(getattr(m, "head_dim", 0) or 0)
        weight = getattr(q_norm, "weight", None)
        if weight is None or weight.dim() != 1 or weight.shape[0] == head_dim:
            continue  # per head: replicated
        for attr, proj, blocks in (("q_norm", q_proj, tp), ("k_norm", m.k_proj, min(kv, tp))):
            norm = getattr(m, attr)
            eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
            rank = int(proj.out_features)
            w = norm.weight
            made = torch.nn.Parameter(torch.empty(rank, dtype=w.dtype, device=w.device), requires_grad=False)
            setattr(m, attr, TPRMSNorm(made, eps, rank * blocks, tp // blocks, tp))


def _row_parallel_linear(cls: type) -> type:
    """A row-parallel nn.Linear (or Conv1D: x @ W, its weight [in, out]) with a bias: the partial products
    all-reduced, the bias added once."""
    from transformers.pytorch_utils import Conv1D

    conv = issubclass(cls, Conv1D)

    def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        if conv:
            part = (x.reshape(-1, x.shape[-1]) @ self.weight).view(*x.shape[:-1], self.nf)
        else:
            part = torch.nn.functional.linear(x, self.weight)
        return all_reduce(part, self.nb_tp) + self.bias  # type: ignore[no-any-return]

    return type(f"RowParallel{cls.__name__}", (cls,), {"forward": forward})


class _RankMaskedDownBias:
    """Width-split experts whose down projection has a bias (gpt-oss): each rank's experts output a partial sum over
    its slice of the intermediate width, all-reduced; the bias is added by the first rank of each expert-parallel
    group only (its value times rank % MOE_TP_ATTR == 0; without expert parallelism, rank 0), so the sum holds it
    once. The parameter keeps its name (the checkpoint's)."""

    @property
    def down_proj_bias(self) -> torch.Tensor:
        bias = self._parameters["down_proj_bias"]  # type: ignore[attr-defined]
        rank = getattr(self, RANK_BUFFER)
        return bias * (rank % getattr(self, MOE_TP_ATTR) == 0).to(bias.dtype)  # type: ignore[no-any-return]


def _row_parallel(model: torch.nn.Module, tp: int, moe_tp: int) -> None:
    """An all-reduce after every row-parallel layer (ROW_PARALLEL linears, EXPERTS modules), the bias added once
    (experts split by width over `moe_tp` ranks: by one rank of each group of them)."""
    def reduce(_m: torch.nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
        return all_reduce(out, tp)  # type: ignore[no-any-return]

    for name, m in list(model.named_modules()):
        if name.endswith(EXPERTS):
            if getattr(m, "has_bias", False) and moe_tp > 1:  # (moe_tp 1: whole experts, each bias on one rank)
                cls = type(m)
                m.__class__ = type(f"RankMasked{cls.__name__}", (_RankMaskedDownBias, cls), {})
                setattr(m, MOE_TP_ATTR, moe_tp)
                m.register_buffer(RANK_BUFFER, torch.zeros(1, dtype=torch.int32), persistent=False)
            m.register_forward_hook(reduce)
        elif name.endswith(ROW_PARALLEL):
            if getattr(m, "bias", None) is None:
                m.register_forward_hook(reduce)
            elif isinstance(m, torch.nn.Linear) or _is_conv1d(m):
                m.__class__ = _row_parallel_linear(type(m))
                setattr(m, "nb_tp", tp)  # noqa: B010
            else:
                raise ValueError(f"{name}: a row-parallel {type(m).__name__} with a bias is not supported for "
                                 "tensor parallelism")


def vocab_parallel(model: torch.nn.Module, tp: int, vocab: int) -> None:
    """Vocabulary-parallel embedding and lm_head (Megatron, as NxD Inference): each rank's embedding looks up its
    block of ids, zeros elsewhere, all-reduced (VocabParallelEmbedding); its lm_head is column-parallel over the same
    blocks (a bias too: Phi's), its logits all-gathered and the padding cut, so the graph outputs the whole model's
    logits. A tied lm_head is the embedding's own weight: one shard serves both."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()  # type: ignore[operator]
    if head is None:
        raise ValueError("tensor parallelism: the model has no lm_head")
    make_vocab_parallel(embed, tp)
    gather_vocab(head, tp, vocab)


def declare_fused(model: torch.nn.Module, model_type: str, hf: Mapping[str, Any], tp: int,
                  experts: Mapping[str, tuple[Any, ...]] | None = None) -> None:
    """Declare one rank's fused column-parallel parameters (FUSED_ATTR) for the weights action: Phi-3's q|k|v (q heads
    split, kv heads split or replicated), multi-query q|k|v (Falcon's, GPT-BigCode's: k and v replicated; Falcon's
    new decoder architecture with one kv group), GPT-2's Conv1D [in, q | k | v] (along dim 1; its bias dim 0), gate|up
    projections, dense ([2 x intermediate, hidden]) or experts' ([experts, 2 x intermediate, hidden], or transposed
    [experts, hidden, 2 x intermediate]): each part split on its own. Interleaved ones (per-head [q k v] of BLOOM and
    multi-head Falcon; gpt-oss's gate/up pairs) need none: a rank's block of the whole is its part. `experts`:
    the expert-parallel experts' parameters, declared with their grid by _expert_parallel."""
    heads = int(hf.get("num_attention_heads") or hf.get("n_head") or 0)
    kv = int(hf.get("num_key_value_heads") or heads)
    hidden = int(hf.get("hidden_size") or hf.get("n_embd") or 0)
    head_dim = int(hf.get("head_dim") or (hidden // max(heads, 1)))
    modules = dict(model.named_modules())
    fused: dict[str, tuple[Any, ...]] = dict(experts or {})
    for name, p in model.named_parameters():
        owner = modules.get(name.rpartition(".")[0])
        if name.endswith(".self_attn.qkv_proj.weight"):
            kv_rank = max(1, kv // tp)
            fused[name] = (0, ((heads * head_dim, heads // tp * head_dim), (kv * head_dim, kv_rank * head_dim),
                               (kv * head_dim, kv_rank * head_dim)))
        elif name.endswith((".query_key_value.weight", ".query_key_value.bias", ".c_attn.weight", ".c_attn.bias")):
            attn = modules.get(name.rsplit(".", 2)[0])
            if _is_conv1d(owner):  # GPT-2: [in, q | k | v], each part split by head
                rank_q = heads // tp * head_dim
                fused[name] = (p.dim() - 1, ((heads * head_dim, rank_q),) * 3)
            elif _one_kv_group(attn, hf):
                fused[name] = (0, ((heads * head_dim, heads // tp * head_dim), (head_dim, head_dim),
                                   (head_dim, head_dim)))
        elif name.endswith(".mlp.gate_up_proj.weight"):
            half = p.shape[0] // 2
            fused[name] = (0, ((half * tp, half), (half * tp, half)))
        elif name.endswith(".experts.gate_up_proj") or name.endswith(".experts.gate_up_proj_bias"):
            if not getattr(owner, "is_concatenated", True) or name in fused:
                continue  # interleaved gate/up pairs (gpt-oss): a contiguous block holds whole pairs
            transposed = getattr(owner, "is_transposed", type(owner).__name__ == "Llama4TextExperts")
            dim = p.dim() - 1 if (transposed or name.endswith("_bias")) else p.dim() - 2
            half = p.shape[dim] // 2
            fused[name] = (dim, ((half * tp, half), (half * tp, half)))
    setattr(model, FUSED_ATTR, fused)


def _one_kv_group(attn: Any, hf: Mapping[str, Any]) -> bool:
    """Whether a fused q|k|v is [q heads | k | v] (one k and v head: replicated on every rank): multi-query Falcon
    and GPT-BigCode, Falcon's new decoder architecture with one kv group. Its other kv groups ([q.. k v] per group,
    kv heads divisible by tp) and per-head interleaved layouts are split as a plain block."""
    if getattr(attn, "new_decoder_architecture", False):
        return int(hf.get("num_kv_heads") or 0) == 1
    return bool(getattr(attn, "multi_query", False))
