"""The neuron_bundle rule: a deployable release archive of compile targets (built by packaging/bundle.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from neuronbuild.analysis.analysis_context import AnalysisContext
from neuronbuild.analysis.providers import BundleInfo, CompileTarget, ModelInfo
from neuronbuild.errors import UserInputError
from neuronbuild.kinds.model import graphs_only
from neuronbuild.kinds.weights import WeightsTarget
from neuronbuild.loading.labels import Label
from neuronbuild.loading.schema import LABEL_LIST, NAME, STRING, TAGS
from neuronbuild.loading.target_graph import locate
from neuronbuild.loading.targets import Target
from neuronbuild.plugin_api.rules import Attr, AttrError, RuleKind, RuleSchema


def _check(a: Mapping[str, Any]) -> None:
    if not a["srcs"]:
        raise AttrError("attribute 'srcs' must list at least one neuron_compile target")


SCHEMA = RuleSchema(
    "neuron_bundle",
    "A deployable release archive of compile targets: manifest, artifacts, weights once per model, docs.",
    (
        NAME,
        Attr("srcs", LABEL_LIST, "The neuron_compile targets shipped in the bundle.", required=True,
             kinds=("neuron_compile",)),
        Attr("weights", LABEL_LIST, "model_weights targets shipped as the weights of the compiles in `srcs`: each "
             "compile takes the one of its own model, else the only one listed. Required for compiles built without "
             "weights (a graphs-only model); for the others they replace the model's own weights (a release with new "
             "weights and the same graphs). deploy checks them against the graphs' parameters.", default=(),
             kinds=("model_weights",)),
        Attr("compression", STRING, "Archive compression: 'zstd' (<name>.tar.zst) or 'gzip' (<name>.tar.gz).",
             default="zstd", choices=("zstd", "gzip")),
        TAGS,
    ),
    _check,
)


@dataclass(frozen=True)
class WeightsBundleInfo(BundleInfo):
    """A bundle whose `weights` attribute pairs compiles with model_weights targets (#51)."""

    # (compile label, the model_weights target it ships) per compile that takes one
    weights: tuple[tuple[Label, WeightsTarget], ...] = ()


def analyze(ctx: AnalysisContext, t: Target) -> BundleInfo:
    listed: list[WeightsTarget] = [ctx.provider(lbl) for lbl in t.attrs["weights"]]
    by_model: dict[Label, WeightsTarget] = {}
    for w in listed:
        if w.model in by_model:
            raise UserInputError(f"attribute 'weights': {by_model[w.model].label} and {w.label} are both weights of "
                                 f"{w.model}; list one", locate(ctx.graph, t, "weights"))
        by_model[w.model] = w
    pairs: list[tuple[Label, WeightsTarget]] = []
    for src in t.attrs["srcs"]:
        ct: CompileTarget = ctx.provider(src)
        paired = by_model.get(ct.model) or (listed[0] if len(listed) == 1 else None)
        if paired is not None:
            pairs.append((src, paired))
            continue
        model: ModelInfo = ctx.provider(ct.model)
        if graphs_only(model.record):
            have = f" (it lists {', '.join(str(x.label) for x in listed)})" if listed else ""
            raise UserInputError(f"{src} is built without weights ({ct.model} declares graphs only): list a "
                                 f"model_weights target of {ct.model} in this bundle's `weights`{have}",
                                 locate(ctx.graph, t))
    _check_drafts(ctx, t)
    if pairs:
        info: BundleInfo = WeightsBundleInfo(tuple(t.attrs["srcs"]), str(t.attrs["compression"]), tuple(pairs))
    else:
        info = BundleInfo(tuple(t.attrs["srcs"]), str(t.attrs["compression"]))
    ctx.bundles[t.label] = info
    return info


def _check_drafts(ctx: AnalysisContext, t: Target) -> None:
    """A compile whose verify graphs speculate with a draft model (hf_causal_lm's `speculation`) needs the draft's
    graphs for the same platform beside it: without them the deployed model cannot speculate (the runtime's engine
    would refuse it on the serving host). Refused here, at the bundle's line, instead."""
    cts: list[CompileTarget] = [ctx.provider(src) for src in t.attrs["srcs"]]
    for ct in cts:
        model: ModelInfo = ctx.provider(ct.model)
        compiled = {b.graph for b, _fp in ct.buckets}
        for name, g in model.graphs:
            spec = (g.record.get("config") or {}).get("speculation") if name in compiled else None
            if not isinstance(spec, Mapping) or not isinstance(spec.get("draft"), str):
                continue
            draft = spec["draft"]
            if not any(str(o.model) == draft and o.platform == ct.platform and
                       o.target.get("isa") == ct.target.get("isa") for o in cts):
                raise UserInputError(f"{ct.label} speculates with draft model {draft} ({name} graphs), but this bundle "
                                     f"ships no compile of {draft} for {ct.description or ct.platform}: add one to "
                                     "`srcs`", locate(ctx.graph, t, "srcs"))


KIND = RuleKind(SCHEMA, analyze, plans_actions=True)
