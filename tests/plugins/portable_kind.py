"""An out-of-tree rule kind in one module (tests/test_plugin_release.py): `portable_compile(name, model, buckets)`
compiles a model for the out-of-tree "cpu-portable" toolchain without a neuron_target or options. It stands for
neuron_compile (it returns the same provider, a CompileTarget), so bundles ship it and validate checks it.
Registration is this module's name in $NEURONBUILD_PLUGINS."""

from __future__ import annotations

from neuronbuild import plugins
from neuronbuild.analysis.analysis_context import AnalysisContext
from neuronbuild.analysis.providers import CompileTarget, ModelInfo
from neuronbuild.kinds.compile import buckets_of
from neuronbuild.loading.schema import LABEL, LABEL_LIST, NAME, TAGS
from neuronbuild.loading.targets import Target
from neuronbuild.plugin_api.rules import Attr, RuleKind, RuleSchema
from neuronbuild.plugin_api.toolchain import CompileRequest, toolchain_options

PLATFORM = "cpu-portable"

SCHEMA = RuleSchema(
    "portable_compile",
    "Compile a model for every bucket for the portable x86-64 baseline (default options).",
    (
        NAME,
        Attr("model", LABEL, "The neuron_model to compile.", required=True, kinds=("neuron_model",)),
        Attr("buckets", LABEL_LIST, "neuron_buckets targets; their shapes are unioned.", required=True,
             kinds=("neuron_buckets",)),
        TAGS,
    ),
)


def analyze(ctx: AnalysisContext, t: Target) -> CompileTarget:
    model: ModelInfo = ctx.provider(t.attrs["model"])
    tc = plugins.toolchain_for(PLATFORM)
    record = tc.target_record(PLATFORM, {})
    options = toolchain_options(tc, {})
    inputs = dict(model.record["inputs"])
    entries = []
    for bucket in buckets_of(ctx, t, model):
        req = CompileRequest(t.label, PLATFORM, record, options, bucket, inputs, ctx.trace(model, bucket),
                             ctx.settings, ctx.common, ctx.weights(model))
        actions = ctx.plan_bucket(tc, req)
        entries.append((bucket, actions[-1].fingerprint))
    ct = CompileTarget(t.label, model.label, PLATFORM, tc.name, record, tc.describe_target(record), options,
                       tuple(entries), 1e-4, tc.artifact_format)
    ctx.compiles.append(ct)
    return ct


KIND = plugins.register_rule(RuleKind(SCHEMA, analyze, plans_actions=True, stands_for=("neuron_compile",)))
