"""The neuron_target rule: the platform compiled for, served by the toolchain registered for it.

Its attributes besides `platform` are not named here: each toolchain declares the target attributes it reads
(`target_attrs`, e.g. the cpu toolchain's `isa`), and one applies only to the platforms of the toolchain declaring it."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from neuronbuild.analysis.analysis_context import AnalysisContext
from neuronbuild.analysis.providers import PlatformInfo
from neuronbuild.errors import UserInputError
from neuronbuild.loading.schema import NAME, STRING, TAGS
from neuronbuild.loading.target_graph import locate
from neuronbuild.loading.targets import Target
from neuronbuild.plugin_api import registry as plugins
from neuronbuild.plugin_api.rules import Attr, AttrError, RuleSchema

KIND_NAME = "neuron_target"


def _owners() -> dict[str, tuple[Attr, list[str]]]:
    """Target attribute name -> (its declaration, the platforms whose toolchains declare it)."""
    out: dict[str, tuple[Attr, list[str]]] = {}
    for tc in plugins.toolchains().values():
        for a in tc.target_attrs:
            out.setdefault(a.name, (a, []))[1].extend(tc.platforms)
    return out


def _check(a: Mapping[str, Any]) -> None:
    known = plugins.platforms()
    if a["platform"] not in known:
        raise AttrError(f"attribute 'platform' must be one of {', '.join(repr(p) for p in known)}, "
                        f"got {a['platform']!r}")
    for name, (_attr, platforms) in _owners().items():
        if a.get(name) is not None and a["platform"] not in platforms:
            raise AttrError(f"attribute '{name}' applies to platform {' or '.join(repr(p) for p in platforms)} "
                            f"only, not '{a['platform']}'")


@functools.cache  # one schema per set of registered declarations
def _schema(attrs: tuple[Attr, ...]) -> RuleSchema:
    return RuleSchema(
        KIND_NAME,
        "The platform compiled for: a platform some registered toolchain serves (built in: the Neuron platforms "
        "trn1, trn2, trn3, inf2, and 'cpu' with an ISA), with the attributes its toolchain declares.",
        (
            NAME,
            Attr("platform", STRING, "A platform some registered toolchain serves (Neuron platforms, 'cpu').",
                 required=True),
            *attrs,
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


@dataclass(frozen=True)
class TargetKind:
    """The neuron_target rule kind, its schema made from the registered toolchains' target attributes when first read
    (toolchains register after the built-in kinds)."""

    analyze: Any = field(default=analyze, compare=False)
    plans_actions: bool = False
    stands_for: tuple[str, ...] = ()
    volatile: bool = True  # a toolchain's target record may read the machine (cpu resolves isa = "native")
    name: str = KIND_NAME

    @property
    def schema(self) -> RuleSchema:
        attrs = tuple(a for a, _platforms in _owners().values())
        return _schema(attrs)


KIND = TargetKind()
