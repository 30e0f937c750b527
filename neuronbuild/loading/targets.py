"""Target and Package values produced by the loading phase."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
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


@dataclass(frozen=True)
class Package:
    """A loaded BUILD file: its targets and every file that went into evaluating it."""

    name: str
    build_file: str
    targets: tuple[Target, ...]
    files: tuple[str, ...]  # workspace-relative (or @neuronbuild//...) paths of the BUILD file and loaded .bzl files
