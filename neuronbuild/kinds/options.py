"""The compiler_options rule: a composable option set (deps merge in order, own values win, flags concatenate).

Its option attributes are not named here: they are the union of the option keys the registered toolchains declare
(plugin_api/toolchain.OptionKey), and each compile passes a toolchain only the keys it declared."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from neuronbuild.analysis.analysis_context import AnalysisContext
from neuronbuild.analysis.providers import OptionsInfo
from neuronbuild.loading.schema import LABEL_LIST, NAME, STRING_LIST, TAGS
from neuronbuild.loading.targets import Target
from neuronbuild.plugin_api import registry as plugins
from neuronbuild.plugin_api.rules import Attr, RuleDefaults, RuleSchema
from neuronbuild.plugin_api.toolchain import OptionKey

KIND_NAME = "compiler_options"
LIST_KEYS_CONCATENATE = STRING_LIST  # list-valued options (e.g. flags) concatenate along deps instead of replacing


def option_keys(toolchains: Iterable[Any]) -> dict[str, OptionKey]:
    """Every option key some toolchain reads, by name (the first declaration wins; choices are unioned)."""
    out: dict[str, OptionKey] = {}
    for tc in toolchains:
        for key in tc.option_keys:
            known = out.get(key.name)
            if known is None:
                out[key.name] = key
            elif known.type != key.type:
                raise ValueError(f"option {key.name!r}: toolchain {tc.name!r} declares type {key.type.name}, "
                                 f"another toolchain {known.type.name}")
            elif known.choices is not None:
                extra = tuple(c for c in key.choices or () if c not in known.choices)
                out[key.name] = OptionKey(known.name, known.type, known.doc, known.default,
                                          None if key.choices is None else known.choices + extra)
    return out


@functools.cache  # one schema per set of registered declarations
def _schema(keys: tuple[OptionKey, ...]) -> RuleSchema:
    return RuleSchema(
        KIND_NAME,
        "A composable set of compiler options; deps merge in order and this target's own values win. A toolchain "
        "sees (and fingerprints) only the options it reads.",
        (
            NAME,
            Attr("deps", LABEL_LIST, "Option sets merged first, in order.", default=(), kinds=(KIND_NAME,)),
            *(Attr(k.name, k.type, k.doc, choices=tuple(k.choices or ())) for k in keys),
            TAGS,
        ),
    )


def analyze(ctx: AnalysisContext, t: Target) -> OptionsInfo:
    merged: dict[str, Any] = {}
    lists: dict[str, list[Any]] = {}
    schema = plugins.rule(t.kind).schema
    concat = {a.name for a in schema.attrs if a.type is LIST_KEYS_CONCATENATE and a.name != "tags"}
    own = {a.name: t.attrs[a.name] for a in schema.attrs
           if a.name not in ("name", "deps", "tags") and t.attrs.get(a.name) is not None}
    for d in [*(ctx.provider(dep).merged for dep in t.attrs.get("deps") or ()), own]:  # deps in order, then its own
        for k, v in d.items():
            if k in concat:
                lists.setdefault(k, []).extend(v)
            else:
                merged[k] = v
    for k, v in lists.items():
        if v:
            merged[k] = v
    return OptionsInfo(merged)


def merged_options(info: OptionsInfo | None) -> dict[str, Any]:
    """The options a target set (itself and through deps), before any toolchain picks its keys and defaults."""
    return dict(info.merged) if info is not None else {}


@dataclass(frozen=True)
class OptionsKind(RuleDefaults):
    """The compiler_options rule kind, its schema made from the registered toolchains' option keys when first read
    (toolchains register after the built-in kinds)."""

    analyze: Any = field(default=analyze, compare=False)
    plans_actions: bool = False
    name: str = KIND_NAME

    @property
    def schema(self) -> RuleSchema:
        keys = tuple(option_keys(plugins.toolchains().values()).values())
        return _schema(keys)


KIND = OptionsKind()
