"""The neuron_compile rule: a model compiled for every bucket for one target with one option set."""

from __future__ import annotations

from collections.abc import Mapping

from neuronbuild import plugins
from neuronbuild.analysis.actions import Bucket
from neuronbuild.analysis.planner import AnalysisContext
from neuronbuild.analysis.providers import BucketsInfo, CompileTarget, ModelInfo, PlatformInfo
from neuronbuild.analysis.toolchain_api import CompileRequest
from neuronbuild.errors import UserInputError
from neuronbuild.kinds.base import RuleKind
from neuronbuild.kinds.options import effective
from neuronbuild.loading.schema import FLOAT, LABEL, LABEL_LIST, NAME, TAGS, Attr, RuleSchema
from neuronbuild.loading.target_graph import locate
from neuronbuild.loading.targets import Target

SCHEMA = RuleSchema(
    "neuron_compile",
    "Compile a model for every bucket, for one target, with one option set.",
    (
        NAME,
        Attr("model", LABEL, "The neuron_model to compile.", required=True, kinds=("neuron_model",)),
        Attr("buckets", LABEL_LIST, "neuron_buckets targets; their shapes are unioned.", required=True,
             kinds=("neuron_buckets",)),
        Attr("target", LABEL, "The neuron_target compiled for.", required=True, kinds=("neuron_target",)),
        Attr("options", LABEL, "A compiler_options target (default: no options).", kinds=("compiler_options",)),
        Attr("tolerance", FLOAT, "Max abs error against eager accepted by `neuronbuild validate`.", default=1e-4),
        Attr("timeout", FLOAT, "Seconds each action of this target may run (trace, lowering, compile); overrides "
             "--action-timeout (0: the flag's value). Not fingerprinted.", default=0.0),
        TAGS,
    ),
)


def buckets_of(ctx: AnalysisContext, t: Target, model: ModelInfo) -> list[Bucket]:
    """The union of the buckets' shapes, each checked against the dimensions the model's inputs use (linear time)."""
    out: dict[Bucket, None] = {}
    needed = set(model.dims)
    for lbl in t.attrs["buckets"]:
        info: BucketsInfo = ctx.provider(lbl)
        for s in info.shapes:
            if s.keys() != needed:
                missing = [d for d in model.dims if d not in s]
                extra = [d for d in s if d not in needed]
                what = (f"has no size for dimension '{missing[0]}' used by the inputs of {model.label}" if missing
                        else f"has dimension '{extra[0]}', which no input of {model.label} uses")
                raise UserInputError(f"bucket {dict(s)} {what}", locate(ctx.graph, t))
            out.setdefault(Bucket(tuple((d, s[d]) for d in model.dims)), None)
    return list(out)


def analyze(ctx: AnalysisContext, t: Target) -> CompileTarget:
    model: ModelInfo = ctx.provider(t.attrs["model"])
    plat: PlatformInfo = ctx.provider(t.attrs["target"])
    opts_label = t.attrs.get("options")
    opts = effective(ctx.provider(opts_label) if opts_label is not None else None)
    tc = plugins.toolchain(plat.toolchain)
    entries: list[tuple[Bucket, str]] = []
    inputs: Mapping[str, object] = dict(model.record["inputs"])  # ordered: the record holds [name, spec] pairs
    for bucket in buckets_of(ctx, t, model):
        trace = ctx.trace(model, bucket)
        req = CompileRequest(t.label, plat.platform, plat.target, opts, bucket, inputs, trace, ctx.settings, ctx.common)
        primary = None
        for action in tc.plan(req):
            primary = ctx.add(action)
        assert primary is not None, f"toolchain {tc.name} planned no action"
        entries.append((bucket, primary.fingerprint))
    ct = CompileTarget(t.label, model.label, plat.platform, tc.name, plat.target, plat.description, opts,
                       tuple(entries), float(t.attrs["tolerance"]), tc.artifact_format)
    ctx.compiles.append(ct)
    return ct


KIND = RuleKind(SCHEMA, analyze, plans_actions=True)
