"""What a rule kind is (the plug-in API's rule half): its attribute schema (`RuleSchema` of `Attr`s, each of an
`AttrType`) plus its analysis (`RuleKind`). The attribute types themselves (STRING, LABEL, ...) and rule-call
validation are loading's (loading/schema.py)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol


class AttrError(ValueError):
    """An attribute value that does not fit the schema; the message is user-facing."""


@dataclass(frozen=True)
class AttrType:
    """A named attribute type with its checker (raises AttrError, returns the normalised value)."""

    name: str
    check: Callable[[str, Any, str], Any]  # (attr name, value, current package) -> normalised value


@dataclass(frozen=True)
class Attr:
    """One attribute of a rule kind."""

    name: str
    type: AttrType
    doc: str
    required: bool = False
    default: Any = None
    choices: tuple[Any, ...] = ()
    kinds: tuple[str, ...] = ()  # for label attributes: the rule kinds allowed ("file" = a source file)
    own_package: bool = False  # for label attributes: every label must be in the target's own package (loader.py)


@dataclass(frozen=True)
class RuleSchema:
    """A rule kind: its attributes and a one-line description."""

    kind: str
    doc: str
    attrs: tuple[Attr, ...]
    check: Callable[[Mapping[str, Any]], None] | None = field(default=None, compare=False)

    @functools.cached_property
    def attr_names(self) -> frozenset[str]:
        """Its attributes' names (made once: the load cache validates 35,000 targets at 100,000 graphs)."""
        return frozenset(a.name for a in self.attrs)

    @functools.cached_property
    def own_package_attrs(self) -> tuple[str, ...]:
        """Its label attributes whose labels must be in the target's own package (Attr.own_package)."""
        return tuple(a.name for a in self.attrs if a.own_package)

    def attr(self, name: str) -> Attr | None:
        for a in self.attrs:
            if a.name == name:
                return a
        return None


class Rule(Protocol):
    """A registered rule kind (plugin_api/registry.register_rule): its schema and its analysis. `RuleKind` is the
    plain one; a kind whose schema is made from the registered toolchains' (neuron_target, compiler_options) is a
    class of its own. `plans_actions`, `stands_for` and `volatile` are optional (RuleDefaults)."""

    @property
    def name(self) -> str: ...

    @property
    def schema(self) -> RuleSchema: ...

    @property
    def analyze(self) -> Callable[[Any, Any], Any]:
        """(ctx: analysis/analysis_context.AnalysisContext, target: loading/targets.Target) -> its provider."""
        ...

    @property
    def plans_actions(self) -> bool: ...

    @property
    def stands_for(self) -> tuple[str, ...]: ...

    @property
    def volatile(self) -> bool: ...


class RuleDefaults:
    """What a rule kind is unless it says otherwise: analysed when a dependant asks (not when requested), standing for
    no other kind, not reading the machine."""

    plans_actions = False
    stands_for: tuple[str, ...] = ()
    volatile = False


RULE_REQUIRED = ("name", "schema", "analyze")


@dataclass(frozen=True)
class RuleKind:
    """A registered rule kind. `analyze(ctx, target)` returns the target's provider (analysis/providers.py) and may
    add actions through ctx (analysis/analysis_context.AnalysisContext); `plans_actions` kinds are analysed when
    requested."""

    schema: RuleSchema
    analyze: Callable[[Any, Any], Any] = field(compare=False)
    plans_actions: bool = False
    stands_for: tuple[str, ...] = ()  # kinds whose place its targets may take in label attributes (same provider)
    # Its analysis reads the machine (e.g. a target record resolving isa = "native"): never memoised, its provider is
    # computed afresh by every plan and compared with what memoised dependants saw (analysis/analysis_nodes.py).
    volatile: bool = False

    @property
    def name(self) -> str:
        return self.schema.kind
