"""The neuron_py_library rule: Python sources shared by models across packages (importable from the workspace root)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from neuronbuild.analysis.analysis_context import AnalysisContext
from neuronbuild.digests import digest_file
from neuronbuild.loading.labels import Label
from neuronbuild.loading.schema import LABEL_LIST, NAME, TAGS
from neuronbuild.loading.targets import Target
from neuronbuild.plugin_api.actions import FileInput
from neuronbuild.plugin_api.rules import Attr, AttrError, RuleKind, RuleSchema

KIND_NAME = "neuron_py_library"


@dataclass(frozen=True)
class PyLibraryInfo:
    """A library and its deps: every source by workspace-relative path -> digest, and the files to place."""

    label: Label
    srcs: Mapping[str, str] = field(hash=False, compare=False)
    files: tuple[FileInput, ...] = ()


def check_srcs(a: Mapping[str, Any]) -> None:
    if not a["srcs"]:
        raise AttrError("attribute 'srcs' must list at least one .py file")
    for src in a["srcs"]:
        if not src.name.endswith(".py"):
            raise AttrError(f"attribute 'srcs': '{src}' is not a .py file")


SCHEMA = RuleSchema(
    KIND_NAME,
    "Python sources shared across packages; models (and other libraries) take it in `deps` and import it by its "
    "workspace path (//common:util.py -> `from common import util`).",
    (
        NAME,
        Attr("srcs", LABEL_LIST, "Python sources (files in this package).", required=True, kinds=("file",)),
        Attr("deps", LABEL_LIST, "Other neuron_py_library targets these sources import.", default=(),
             kinds=(KIND_NAME,)),
        TAGS,
    ),
    check_srcs,
)


def collect(ctx: AnalysisContext, deps: tuple[Label, ...]) -> tuple[dict[str, str], tuple[FileInput, ...]]:
    """The sources of `deps` and their deps, by path (sorted) and as files to place in sandboxes."""
    srcs: dict[str, str] = {}
    for dep in deps:
        info: PyLibraryInfo = ctx.provider(dep)
        srcs.update(info.srcs)
    files = tuple(FileInput(p, d) for p, d in sorted(srcs.items()))
    return dict(sorted(srcs.items())), files


def analyze(ctx: AnalysisContext, t: Target) -> PyLibraryInfo:
    srcs = {lbl.path: digest_file(ctx.graph.root / lbl.path) for lbl in t.attrs["srcs"]}
    dep_srcs, _files = collect(ctx, tuple(t.attrs["deps"]))
    srcs.update(dep_srcs)
    return PyLibraryInfo(t.label, dict(sorted(srcs.items())), tuple(FileInput(p, d) for p, d in sorted(srcs.items())))


KIND = RuleKind(SCHEMA, analyze)
