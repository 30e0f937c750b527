"""The neuron_compile rule: a model compiled for every bucket for one target with one option set."""

from __future__ import annotations

from collections.abc import Mapping

from neuronbuild.analysis import tensor_parallel
from neuronbuild.analysis.analysis_context import AnalysisContext
from neuronbuild.analysis.providers import BucketsInfo, CompileTarget, ModelInfo, PlatformInfo
from neuronbuild.errors import UserInputError
from neuronbuild.kinds.model import fused_draft, graphs_only
from neuronbuild.kinds.options import merged_options
from neuronbuild.loading.labels import Label
from neuronbuild.loading.schema import FLOAT, GRAPH_LABEL, GRAPH_LABELS, INT, LABEL, NAME, TAGS
from neuronbuild.loading.target_graph import locate
from neuronbuild.loading.targets import Target
from neuronbuild.plugin_api import registry as plugins
from neuronbuild.plugin_api.actions import Bucket, DepInput
from neuronbuild.plugin_api.rules import Attr, RuleKind, RuleSchema
from neuronbuild.plugin_api.toolchain import CompileRequest, toolchain_options

DRAFT_PREFIX = "draft."  # a fused speculation graph's draft weights file and names (runtime/layout.py DRAFT_PREFIX)

SCHEMA = RuleSchema(
    "neuron_compile",
    "Compile a model for every bucket, for one target, with one option set.",
    (
        NAME,
        Attr("model", LABEL, "The neuron_model to compile.", required=True, kinds=("neuron_model",)),
        Attr("buckets", GRAPH_LABELS, "neuron_buckets targets; their shapes are unioned. For a model with graph "
             "families, a plain list sizes every graph, a dict {graph: [labels]} each graph on its own.",
             required=True, kinds=("neuron_buckets",)),
        Attr("target", LABEL, "The neuron_target compiled for.", required=True, kinds=("neuron_target",)),
        Attr("options", GRAPH_LABEL, "A compiler_options target (default: no options), or {graph: label} per graph "
             "family (e.g. context at -O1, token at -O2).", kinds=("compiler_options",)),
        Attr("tp_degree", INT, "Tensor-parallel degree: each graph becomes one SPMD program for tp_degree NeuronCores "
             "with one weights shard per rank (hf_causal_lm models of the families in docs/neuron.md, neuron_model with a tp_plan; a degree the platform accepts).",
             default=1),
        Attr("tolerance", FLOAT, "Max abs error against eager accepted by `neuronbuild validate`.", default=1e-4),
        Attr("timeout", FLOAT, "Seconds each action of this target may run (trace, lowering, compile); overrides "
             "--action-timeout (0: the flag's value). Not fingerprinted.", default=0.0),
        TAGS,
    ),
)


def buckets_of(ctx: AnalysisContext, t: Target, model: ModelInfo, labels: tuple[Label, ...] | None = None,
               graph: str = "") -> list[Bucket]:
    """The union of the buckets' shapes, each checked against the dimensions the model's inputs use (linear time)."""
    out: dict[Bucket, None] = {}
    needed = set(model.dims)
    of = f" (graph '{graph}')" if graph else ""
    for lbl in (t.attrs["buckets"] if labels is None else labels):
        info: BucketsInfo = ctx.provider(lbl)
        for s in info.shapes:
            if s.keys() != needed:
                missing = [d for d in model.dims if d not in s]
                extra = [d for d in s if d not in needed]
                what = (f"has no size for dimension '{missing[0]}' used by the inputs of {model.label}{of}" if missing
                        else f"has dimension '{extra[0]}', which no input of {model.label}{of} uses")
                raise UserInputError(f"bucket {dict(s)} {what}", locate(ctx.graph, t))
            out.setdefault(Bucket(tuple((d, s[d]) for d in model.dims), graph), None)
    return list(out)


def _per_graph(ctx: AnalysisContext, t: Target, attr: str, names: list[str]) -> None:
    """A dict-valued attribute must name graph families of the model."""
    v = t.attrs.get(attr)
    if not isinstance(v, dict):
        return
    if not names:
        raise UserInputError(f"attribute '{attr}' is a dict of graph families, but {t.attrs['model']} declares no "
                             f"`graphs`", locate(ctx.graph, t))
    for g in v:
        if g not in names:
            raise UserInputError(f"attribute '{attr}': {t.attrs['model']} has no graph '{g}' (graphs: "
                                 f"{', '.join(names)})", locate(ctx.graph, t))


def _fused_draft_weights(ctx: AnalysisContext, t: Target, graph: ModelInfo, tp: int) -> tuple[DepInput, ...]:
    """What a fused speculation graph ships beside the target's weights: its draft model's weights file (the draft's
    own weights action, shared with the draft's compiles), as `draft.constants.safetensors`; the runtime binds its
    tensors under "draft." (the graph's draft submodule). () for every other graph."""
    draft = fused_draft(graph.record)
    if draft is None:
        return ()
    if tp > 1:
        raise UserInputError(f"{t.label}: fused speculation (graph '{graph.record.get('graph')}') with tp_degree > 1 "
                             "is not supported yet (use fused = False)", locate(ctx.graph, t, "tp_degree"))
    info: ModelInfo = ctx.provider(draft)
    if graphs_only(info.record):
        raise UserInputError(f"{t.label}: the fused speculation graph binds the weights of its draft {draft}, which "
                             "declares graphs only (no checkpoint)", locate(ctx.graph, t))
    weights = ctx.add(ctx.weights(info, 1))
    return tuple(DepInput(weights.fingerprint, out, DRAFT_PREFIX + out) for out in weights.outputs)


def analyze(ctx: AnalysisContext, t: Target) -> CompileTarget:
    model: ModelInfo = ctx.provider(t.attrs["model"])
    plat: PlatformInfo = ctx.provider(t.attrs["target"])
    names = [n for n, _g in model.graphs]
    _per_graph(ctx, t, "buckets", names)
    _per_graph(ctx, t, "options", names)
    opts_attr = t.attrs.get("options")

    tc = plugins.toolchain(plat.toolchain)
    known = {key.name for key in tc.option_keys}
    ignored: dict[str, None] = {}  # options set that the toolchain does not read (they change none of its graphs)
    warned: dict[str, None] = {}

    def options_for(graph: str) -> Mapping[str, object]:
        """The options this toolchain reads (its declared keys and defaults): only those reach its fingerprints."""
        lbl = opts_attr.get(graph) if isinstance(opts_attr, dict) else opts_attr
        merged = merged_options(ctx.provider(lbl) if lbl is not None else None)
        ignored.update(dict.fromkeys(k for k in merged if k not in known))
        read = toolchain_options(tc, merged)
        warned.update(dict.fromkeys(tc.option_warnings(read)))
        return read

    tp = int(t.attrs["tp_degree"])
    if tp < 1:
        raise UserInputError(f"attribute 'tp_degree' must be a positive int (the NeuronCores each graph spans), got {tp}",
                             locate(ctx.graph, t, "tp_degree"))
    weights = None  # the model's one weights action (made once the checks below have passed)
    entries: list[tuple[Bucket, str]] = []
    shipped: list[tuple[DepInput, ...]] = []  # per bucket: what this target ships beside it (CompileTarget.ships)
    buckets_attr = t.attrs["buckets"]
    families = list(model.graphs) or [("", model)]
    graph_options: dict[str, Mapping[str, object]] = {}
    for gname, ginfo in families:
        labels = buckets_attr.get(gname, ()) if isinstance(buckets_attr, dict) else buckets_attr
        opts = options_for(gname)
        if gname:
            graph_options[gname] = opts
        problem = tensor_parallel.check(ginfo.record, plat.platform, tp, tc.tp_degrees.get(plat.platform, (1,)))
        if problem:
            raise UserInputError(f"{t.label}: {problem}", locate(ctx.graph, t))
        traced = ginfo
        if tp > 1:  # one rank's program: its KV cache holds its heads
            traced = ModelInfo(ginfo.label, tensor_parallel.per_rank_record(ginfo.record, tp), ginfo.files, ginfo.dims)
        inputs: Mapping[str, object] = dict(traced.record["inputs"])  # ordered: the record holds [name, spec] pairs
        draft_ships = _fused_draft_weights(ctx, t, ginfo, tp) if labels else ()
        for bucket in buckets_of(ctx, t, ginfo, labels, gname):
            trace = ctx.trace(traced, bucket, tp)
            if weights is None and not graphs_only(model.record):  # (graphs only: no weights action, none shipped)
                weights = ctx.weights(model, tp)
            req = CompileRequest(t.label, plat.platform, plat.target, opts, bucket, inputs, trace, ctx.settings,
                                 ctx.common, weights)
            try:
                planned = ctx.plan_bucket(tc, req)
            except UserInputError as e:  # (a toolchain's plan refusing the options: at this target's call)
                if e.location is not None:
                    raise
                raise UserInputError(e.message, locate(ctx.graph, t)) from None
            assert planned, f"toolchain {tc.name} planned no action"
            entries.append((bucket, planned[-1].fingerprint))
            shipped.append(tuple(planned.ships) + draft_ships)
    first = next(iter(graph_options.values()), None)
    ct = CompileTarget(t.label, model.label, plat.platform, tc.name, plat.target, plat.description,
                       first if first is not None else options_for(""), tuple(entries), float(t.attrs["tolerance"]),
                       tc.artifact_format, graph_options, tuple(ignored),
                       tuple(warned), tuple(shipped))
    ctx.compiles.append(ct)
    return ct


KIND = RuleKind(SCHEMA, analyze, plans_actions=True)
