"""The neuron_target rule: the platform compiled for, served by the toolchain registered for it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from neuronbuild import plugins
from neuronbuild.analysis.planner import AnalysisContext
from neuronbuild.analysis.providers import PlatformInfo
from neuronbuild.errors import UserInputError
from neuronbuild.kinds.base import RuleKind
from neuronbuild.loading.schema import NAME, STRING, TAGS, Attr, AttrError, RuleSchema
from neuronbuild.loading.target_graph import locate
from neuronbuild.loading.targets import Target
from neuronbuild.vocabulary import CPU_ISAS, CPU_PLATFORM


def _check(a: Mapping[str, Any]) -> None:
    known = plugins.platforms()
    if a["platform"] not in known:
        raise AttrError(f"attribute 'platform' must be one of {', '.join(repr(p) for p in known)}, "
                        f"got {a['platform']!r}")
    if a.get("isa") is not None and a["platform"] != CPU_PLATFORM:
        raise AttrError(f"attribute 'isa' applies to platform 'cpu' only, not '{a['platform']}'")


SCHEMA = RuleSchema(
    "neuron_target",
    "The platform compiled for: a Neuron platform (trn1, trn2, trn3, inf2), 'cpu' with an ISA, or a plug-in's.",
    (
        NAME,
        Attr("platform", STRING, "A platform some registered toolchain serves (Neuron platforms, 'cpu').",
             required=True),
        Attr("isa", STRING, "cpu only: 'native' (this machine's level, resolved) or an x86-64 level.", choices=CPU_ISAS),
        TAGS,
    ),
    _check,
)


def analyze(ctx: AnalysisContext, t: Target) -> PlatformInfo:
    platform = t.attrs["platform"]
    try:
        tc = plugins.toolchain_for(platform)
    except UserInputError as e:
        raise UserInputError(str(e), locate(ctx.graph, t)) from None
    record = tc.target_record(platform, t.attrs)
    return PlatformInfo(platform, tc.name, record, tc.describe_target(record))


KIND = RuleKind(SCHEMA, analyze)
