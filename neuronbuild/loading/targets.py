"""Target and Package values produced by the loading phase."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from neuronbuild.loading.labels import Label


@dataclass(frozen=True)
class Target:
    """One rule instance: its label, rule kind and validated attributes (treat attrs as read-only)."""

    label: Label
    kind: str
    attrs: Mapping[str, Any] = field(hash=False, compare=False)
    build_file: str = ""  # workspace-relative path of the BUILD file
    index: int = 0  # the n-th rule call while evaluating that BUILD file (used to find its call site on error)

    def __getitem__(self, name: str) -> Any:
        return self.attrs[name]

    @property
    def tags(self) -> tuple[str, ...]:
        return tuple(self.attrs.get("tags") or ())

    @cached_property
    def label_deps(self) -> list[tuple[str, Label]]:
        """(attribute, label) for every rule-target reference (source files excluded); made once per object (the
        build server's load cache hands out the same Target from one command to the next)."""
        from neuronbuild.loading.schema import RULES, label_values

        return [(a.name, lbl) for a in RULES[self.kind].attrs
                if a.kinds and "file" not in a.kinds and self.attrs.get(a.name) is not None
                for lbl in label_values(self.attrs[a.name])]


@dataclass(frozen=True)
class PackageSummary:
    """What loading asks of a package as a whole (Package.summary): its targets by label, the ones a whole-package
    pattern selects (not tagged manual), and what target_graph's selection warnings ask of them."""

    by_label: dict[Label, Target]
    selected_labels: tuple[Label, ...]
    manual_buildable: Target | None  # the first buildable target tagged manual
    any_buildable_selected: bool
    selected_kinds: frozenset[str]
    no_buckets: tuple[Target, ...]  # selected buildable targets with buckets = []


@dataclass(frozen=True)
class Package:
    """A loaded BUILD file: its targets and every file that went into evaluating it."""

    name: str
    build_file: str
    targets: tuple[Target, ...]
    files: tuple[str, ...]  # workspace-relative (or @neuronbuild//...) paths of the BUILD file and loaded .bzl files

    @cached_property
    def summary(self) -> PackageSummary:
        """Made once per object (the build server's load cache hands out an unchanged package as the same object)."""
        from neuronbuild.plugin_api import registry as plugins

        buildable = {k: bool(plugins.rule(k).plans_actions) for k in {t.kind for t in self.targets}}
        selected = [t for t in self.targets if "manual" not in t.tags]
        return PackageSummary(
            {t.label: t for t in self.targets}, tuple(t.label for t in selected),
            next((t for t in self.targets if buildable[t.kind] and "manual" in t.tags), None),
            any(buildable[t.kind] for t in selected), frozenset(t.kind for t in selected),
            tuple(t for t in selected if buildable[t.kind] and "buckets" in t.attrs and not t.attrs["buckets"]))
