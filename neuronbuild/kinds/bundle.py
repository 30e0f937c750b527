"""The neuron_bundle rule: a deployable release archive of compile targets (built by packaging/bundle.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from neuronbuild.analysis.planner import AnalysisContext
from neuronbuild.analysis.providers import BundleInfo
from neuronbuild.kinds.base import RuleKind
from neuronbuild.loading.schema import LABEL_LIST, NAME, STRING, TAGS, Attr, AttrError, RuleSchema
from neuronbuild.loading.targets import Target


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
        Attr("compression", STRING, "Archive compression: 'zstd' (<name>.tar.zst) or 'gzip' (<name>.tar.gz).",
             default="zstd", choices=("zstd", "gzip")),
        TAGS,
    ),
    _check,
)


def analyze(ctx: AnalysisContext, t: Target) -> BundleInfo:
    for src in t.attrs["srcs"]:
        ctx.provider(src)
    info = BundleInfo(tuple(t.attrs["srcs"]), str(t.attrs["compression"]))
    ctx.bundles[t.label] = info
    return info


KIND = RuleKind(SCHEMA, analyze, plans_actions=True)
