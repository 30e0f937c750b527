"""Expands target patterns, loads the packages they need (transitively) and checks references, kinds and cycles."""

from __future__ import annotations

import difflib
import operator
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from neuronbuild import plugins
from neuronbuild.errors import Location, UserInputError
from neuronbuild.loading.labels import Label, LabelError, TargetPattern, parse_pattern
from neuronbuild.loading.loader import Loader
from neuronbuild.loading.schema import RULES, label_values
from neuronbuild.loading.starlark_adapter import run_on_starlark_thread
from neuronbuild.loading.targets import Package, Target

if TYPE_CHECKING:
    from neuronbuild.loading.load_cache import LoadCache



def _buildable(t: Target) -> bool:
    """Whether a build makes something for this target (its rule kind plans actions); a pattern selecting no such
    target builds nothing, and says so."""
    return bool(plugins.rule(t.kind).plans_actions)


def _buildable_kinds() -> list[str]:
    return sorted(k for k, r in plugins.rules().items() if r.plans_actions)


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _did_you_mean(word: str, candidates: Sequence[str]) -> str:
    near = difflib.get_close_matches(word, list(candidates), n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(near)}?" if near else ""


def _target_hint(name: str, cwd_package: str, get_package: Callable[[str], Package | None]) -> str:
    """For `pkg/word` that is no package but names (or nearly names) targets of `pkg`: `; did you mean :word?` (a
    bare word is a package to patterns, as in Bazel: `build cnn_cpu` in vision/ means //vision/cnn_cpu)."""
    parent, _, word = name.rpartition("/")
    try:
        pkg = get_package(parent) if word else None
    except UserInputError:
        return ""  # (a broken parent BUILD file: the pattern's own error is the one to report)
    if pkg is None:
        return ""
    names = [t.label.name for t in pkg.targets]
    near = [word] if word in names else difflib.get_close_matches(word, names, n=3, cutoff=0.6)
    if not near:
        return ""
    return f"; did you mean {' or '.join((':' if parent == cwd_package else f'//{parent}:') + n for n in near)}?"


@dataclass(frozen=True)
class TargetGraph:
    """The loaded targets: every target reachable from the requested ones, and the requested labels in order."""

    root: Path
    targets: Mapping[Label, Target] = field(hash=False)
    packages: Mapping[str, Package] = field(hash=False)
    requested: tuple[Label, ...] = ()

    def label_deps(self, target: Target) -> list[tuple[str, Label]]:
        """(attribute, label) for every rule-target reference of `target` (source files excluded); kept in the
        (frozen) Target, which the build server's load cache hands out unchanged from one command to the next."""
        known = target.__dict__.get("_label_deps")
        if known is not None:
            return known  # type: ignore[no-any-return]
        out: list[tuple[str, Label]] = []
        for a in RULES[target.kind].attrs:
            if a.kinds and "file" not in a.kinds and target.attrs.get(a.name) is not None:
                for lbl in label_values(target.attrs[a.name]):
                    out.append((a.name, lbl))
        target.__dict__["_label_deps"] = out
        return out


def load_targets(root: Path, patterns: Sequence[str], cwd_package: str = "",
                 load_cache: LoadCache | None = None, warn: Callable[[str], None] | None = _stderr) -> TargetGraph:
    """Load everything `patterns` need. Runs the Starlark work on the dedicated Starlark thread.

    With a `load_cache`, packages whose BUILD and .bzl files are unchanged are not evaluated again. A pattern that
    matches no target at all is an error; one that selects nothing buildable (only manual targets, only options or
    models, a compile with `buckets = []`) is a warning passed to `warn` (stderr by default). With warn=None neither
    check is made (query and gc load patterns as sets of targets, where an empty selection is a valid answer)."""
    parsed: list[TargetPattern] = []
    for p in patterns:
        try:
            parsed.append(parse_pattern(p, cwd_package))
        except LabelError as e:
            raise UserInputError(f"bad target pattern '{p}': {e}") from None
    graph, warnings = run_on_starlark_thread(_load, root, parsed, load_cache, warn is not None, cwd_package)
    if warn is not None:
        for w in warnings:
            warn(w)
    return graph


def _selection_warnings(pat: TargetPattern, matched: list[Target], selected: list[Target]) -> list[str]:
    if not matched:
        raise UserInputError(f"pattern '{pat}' matches no targets (its BUILD files declare none)")
    manual = [t for t in matched if _buildable(t) and "manual" in t.tags]
    if manual and not any(_buildable(t) for t in selected):
        return [f"warning: pattern '{pat}' builds nothing: its buildable targets are all tagged manual (name them to "
                f"build them, e.g. {manual[0].label})"]
    if not any(_buildable(t) for t in selected):
        kinds = sorted({t.kind for t in selected})
        return [f"warning: pattern '{pat}' selects nothing buildable (only {', '.join(kinds)}; outputs come from "
                f"{' and '.join(_buildable_kinds())} targets)"]
    return [f"warning: {t.label} has no buckets (buckets = []): it builds nothing" for t in selected
            if _buildable(t) and "buckets" in t.attrs and not t.attrs["buckets"]]


def _load(root: Path, patterns: list[TargetPattern], load_cache: LoadCache | None = None, check: bool = True,
          cwd_package: str = "") -> tuple[TargetGraph, list[str]]:
    loader = Loader(root)
    packages: dict[str, Package] = {}

    def get_package(name: str) -> Package | None:
        if name not in packages:
            if not loader.has_package(name):
                return None
            cached = load_cache.get(loader, name) if load_cache is not None else None
            if cached is None:
                started = time.time_ns()
                cached = loader.load_package(name)
                if load_cache is not None:
                    load_cache.put(loader, cached, started)
            packages[name] = cached
        return packages[name]

    requested: list[Label] = []
    warnings: list[str] = []
    for pat in patterns:
        if pat.recursive:
            names = loader.find_packages(pat.package, load_cache.dirs if load_cache is not None else None)
            if not names and not (root / pat.package).is_dir():
                raise UserInputError(f"no such package '{pat.package}' (pattern '{pat}')"
                                     + _did_you_mean(f"//{pat.package}/...",
                                                     [f"//{n}/..." for n in loader.find_packages("")]))
        else:
            names = [pat.package]
        matched: list[Target] = []
        selected: list[Target] = []
        for name in names:
            pkg = get_package(name)
            if pkg is None:
                raise UserInputError(f"no such package '{name}': no BUILD file in {name or 'the workspace root'}"
                                     + (_target_hint(name, cwd_package, get_package) or _did_you_mean(
                                         f"//{name}", [f"//{n}" for n in loader.find_packages("")])))
            if pat.name is None:
                matched.extend(pkg.targets)
                selected.extend(t for t in pkg.targets if "manual" not in t.tags)
            else:
                found = [t for t in pkg.targets if t.label.name == pat.name]
                if not found:
                    raise UserInputError(f"no such target '//{name}:{pat.name}': {pkg.build_file} does not declare it"
                                         + _did_you_mean(f"//{name}:{pat.name}",
                                                         [str(t.label) for t in pkg.targets]))
                matched.extend(found)
                selected.extend(found)
        if check:
            warnings += _selection_warnings(pat, matched, selected)
        requested.extend(t.label for t in selected)
    requested = list(dict.fromkeys(requested))

    targets: dict[Label, Target] = {}
    for pkg in packages.values():
        for t in pkg.targets:
            targets[t.label] = t
    graph = TargetGraph(root, targets, packages, tuple(requested))
    # Transitive closure with reference and kind checks.
    todo = list(requested)
    seen: set[Label] = set()
    deps_of: dict[Label, list[tuple[str, Label]]] = {}
    while todo:
        lbl = todo.pop()
        if lbl in seen:
            continue
        seen.add(lbl)
        t = targets[lbl]
        deps_of[lbl] = label_deps = graph.label_deps(t)
        for attr, dep in label_deps:
            schema_attr = RULES[t.kind].attr(attr)
            assert schema_attr is not None
            if dep.repo:
                raise UserInputError(f"attribute '{attr}': '{dep}' must be a target in this workspace",
                                     loader.locate(t))
            if dep not in targets:
                pkg = get_package(dep.package)
                if pkg is not None:
                    for other in pkg.targets:
                        targets[other.label] = other
            if dep not in targets:
                where = "no BUILD file" if not loader.has_package(dep.package) else "not declared there"
                raise UserInputError(f"attribute '{attr}' of '{lbl}' refers to '{dep}', which does not exist "
                                     f"({where})", loader.locate(t))
            kind = targets[dep].kind
            if not plugins.kind_fits(kind, schema_attr.kinds):
                raise UserInputError(f"attribute '{attr}' of '{lbl}' must be a {' or '.join(schema_attr.kinds)} "
                                     f"target, but '{dep}' is a {kind}", loader.locate(t))
            todo.append(dep)
    _check_cycles(graph, seen, loader, deps_of)
    return graph, warnings


MAX_DEPS_DEPTH = 256  # longest dependency chain accepted (compiler_options deps merge recursively)


_LABEL_ORDER = operator.attrgetter("package", "name", "repo")  # Label's own order, compared in C


def _check_cycles(graph: TargetGraph, labels: set[Label], loader: Loader,
                  deps_of: Mapping[Label, list[tuple[str, Label]]] | None = None) -> int:
    """Iterative depth-first search: cycles and over-long chains are one located error, never a RecursionError.
    Returns the number of targets on the longest dependency chain."""
    known = deps_of or {}

    def deps(lbl: Label) -> list[tuple[str, Label]]:
        d = known.get(lbl)
        return d if d is not None else graph.label_deps(graph.targets[lbl])

    state: dict[Label, int] = {}
    height: dict[Label, int] = {}  # longest chain starting at a checked target (counted in targets)
    for root in sorted(labels, key=_LABEL_ORDER):
        if root in state:
            continue
        stack: list[Label] = [root]
        iters = [iter(deps(root))]
        state[root] = 1
        while iters:
            pair = next(iters[-1], None)  # ((attribute, label): no generator made per step)
            dep = pair[1] if pair is not None else None
            if dep is None:
                lbl = stack.pop()
                state[lbl] = 2
                height[lbl] = 1 + max((height[d] for _a, d in deps(lbl)), default=0)
                iters.pop()
                continue
            if state.get(dep) == 1:
                cycle = [*stack[stack.index(dep):], dep]
                raise UserInputError("dependency cycle: " + " -> ".join(str(c) for c in cycle),
                                     loader.locate(graph.targets[dep]))
            if state.get(dep) is None:
                if len(stack) >= MAX_DEPS_DEPTH:
                    raise UserInputError(f"dependency chain longer than {MAX_DEPS_DEPTH} targets (from {root} to "
                                         f"{dep})", loader.locate(graph.targets[dep]))
                state[dep] = 1
                stack.append(dep)
                iters.append(iter(deps(dep)))
    return max(height.values(), default=0)


def locate(graph: TargetGraph, target: Target) -> Location:
    """Call site of a target's rule call (re-evaluates its BUILD file; only used on error paths)."""
    return run_on_starlark_thread(lambda: Loader(graph.root).locate(target))
