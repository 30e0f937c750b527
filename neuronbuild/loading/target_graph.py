"""Expands target patterns, loads the packages they need (transitively) and checks references, kinds and cycles."""

from __future__ import annotations

import difflib
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from neuronbuild import streams
from neuronbuild.engine import Node, Projection
from neuronbuild.errors import Location, UserInputError
from neuronbuild.loading.labels import Label, LabelError, TargetPattern, parse_pattern
from neuronbuild.loading.load_cache import LoadCache
from neuronbuild.loading.loader import Loader
from neuronbuild.loading.schema import RULES
from neuronbuild.loading.starlark_adapter import run_on_starlark_thread
from neuronbuild.loading.targets import Package, PackageSummary, Target
from neuronbuild.plugin_api import registry as plugins


def _buildable(t: Target) -> bool:
    """Whether a build makes something for this target (its rule kind plans actions); a pattern selecting no such
    target builds nothing, and says so."""
    return bool(plugins.rule(t.kind).plans_actions)


def _buildable_kinds() -> list[str]:
    return sorted(k for k, r in plugins.rules().items() if r.plans_actions)


def _stderr(msg: str) -> None:
    print(msg, file=streams.err(), flush=True)


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


def _whole_package_warnings(pat: TargetPattern, whole: list[PackageSummary]) -> list[str]:
    """_selection_warnings for a pattern selecting whole packages, from their summaries (the same warnings)."""
    if not any(sm.by_label for sm in whole):
        raise UserInputError(f"pattern '{pat}' matches no targets (its BUILD files declare none)")
    if not any(sm.any_buildable_selected for sm in whole):
        manual = next((sm.manual_buildable for sm in whole if sm.manual_buildable is not None), None)
        if manual is not None:
            return [f"warning: pattern '{pat}' builds nothing: its buildable targets are all tagged manual (name "
                    f"them to build them, e.g. {manual.label})"]
        kinds = sorted(frozenset().union(*(sm.selected_kinds for sm in whole)))
        return [f"warning: pattern '{pat}' selects nothing buildable (only {', '.join(kinds)}; outputs come from "
                f"{' and '.join(_buildable_kinds())} targets)"]
    return [f"warning: {t.label} has no buckets (buckets = []): it builds nothing" for sm in whole
            for t in sm.no_buckets]


def _load(root: Path, patterns: list[TargetPattern], load_cache: LoadCache | None = None, check: bool = True,
          cwd_package: str = "") -> tuple[TargetGraph, list[str]]:
    loader = Loader(root)
    packages: dict[str, Package] = {}
    engine = load_cache.engine if load_cache is not None else None
    if load_cache is not None:
        load_cache.begin(loader)

    def get_package(name: str) -> Package | None:
        if name not in packages:
            if not loader.has_package(name):
                return None
            packages[name] = load_cache.package(name) if load_cache is not None else loader.load_package(name)
        return packages[name]

    requested: list[Label] = []
    warnings: list[str] = []
    for pat in patterns:
        if pat.recursive:
            names = loader.find_packages(pat.package, load_cache.listing if load_cache is not None else None)
            if not names and not (root / pat.package).is_dir():
                raise UserInputError(f"no such package '{pat.package}' (pattern '{pat}')"
                                     + _did_you_mean(f"//{pat.package}/...",
                                                     [f"//{n}/..." for n in loader.find_packages("")]))
        else:
            names = [pat.package]
        matched: list[Target] = []
        selected: list[Target] = []
        whole: list[PackageSummary] = []  # (pat.name is None: each package's summary, in order)
        for name in names:
            pkg = get_package(name)
            if pkg is None:
                raise UserInputError(f"no such package '{name}': no BUILD file in {name or 'the workspace root'}"
                                     + (_target_hint(name, cwd_package, get_package) or _did_you_mean(
                                         f"//{name}", [f"//{n}" for n in loader.find_packages("")])))
            if pat.name is None:
                whole.append(pkg.summary)
            else:
                found = [t for t in pkg.targets if t.label.name == pat.name]
                if not found:
                    raise UserInputError(f"no such target '//{name}:{pat.name}': {pkg.build_file} does not declare it"
                                         + _did_you_mean(f"//{name}:{pat.name}",
                                                         [str(t.label) for t in pkg.targets]))
                matched.extend(found)
                selected.extend(found)
        if pat.name is None:
            if check:
                warnings += _whole_package_warnings(pat, whole)
            for sm in whole:
                requested.extend(sm.selected_labels)
        else:
            if check:
                warnings += _selection_warnings(pat, matched, selected)
            requested.extend(t.label for t in selected)
    if len(patterns) > 1 or patterns[0].name is not None:  # (one whole-package pattern names each target once)
        requested = list(dict.fromkeys(requested))

    targets: dict[Label, Target] = {}
    for pkg in packages.values():
        targets.update(pkg.summary.by_label)  # (a dict's update reuses its stored hashes)
    graph = TargetGraph(root, targets, packages, tuple(requested))
    # Transitive closure with reference and kind checks (skipped for the targets of a package the last accepted load
    # checked, when its node and those of every package it refers to are current and not replaced since:
    # CheckedGraph.unchanged).
    prev: CheckedGraph | None = engine.kept(GRAPH_CHECK) if engine is not None else None
    stable: dict[str, bool] = {}
    todo = list(requested)
    seen: set[Label] = set()
    deps_of: dict[Label, list[tuple[str, Label]]] = {}
    while todo:
        lbl = todo.pop()
        if lbl in seen:
            continue
        seen.add(lbl)
        t = targets[lbl]
        deps_of[lbl] = label_deps = t.label_deps  # (made once per Target object)
        if prev is not None:
            ok = stable.get(lbl.package)
            if ok is None:
                ok = stable[lbl.package] = prev.unchanged(lbl.package, engine.revision)  # type: ignore[union-attr]
            if ok:  # (these checks passed in prev against the same targets: they pass again)
                todo.extend(map(_DEP_LABEL, label_deps))
                continue
        for attr, dep in label_deps:
            schema_attr = RULES[t.kind].attr(attr)
            assert schema_attr is not None
            if dep.repo:
                raise UserInputError(f"attribute '{attr}': '{dep}' must be a target in this workspace",
                                     loader.locate(t, attr))
            if dep not in targets:
                pkg = get_package(dep.package)
                if pkg is not None:
                    for other in pkg.targets:
                        targets[other.label] = other
            if dep not in targets:
                where = "no BUILD file" if not loader.has_package(dep.package) else "not declared there"
                pkg = get_package(dep.package) if where != "no BUILD file" else None
                near = difflib.get_close_matches(dep.name, [o.label.name for o in pkg.targets] if pkg else [], n=1)
                if near:
                    where += f"; did you mean '{':' if dep.package == lbl.package else f'//{dep.package}:'}{near[0]}'?"
                raise UserInputError(f"attribute '{attr}' of '{lbl}' refers to '{dep}', which does not exist "
                                     f"({where})", loader.locate(t, attr))
            kind = targets[dep].kind
            if not plugins.kind_fits(kind, schema_attr.kinds):
                raise UserInputError(f"attribute '{attr}' of '{lbl}' must be a {' or '.join(schema_attr.kinds)} "
                                     f"target, but '{dep}' is a {kind}", loader.locate(t, attr))
            todo.append(dep)
    if engine is None:
        _check_cycles(graph, seen, loader, deps_of)
    else:
        assert load_cache is not None
        engine.keep(GRAPH_CHECK, _check_acyclic(graph, seen, loader, deps_of, prev, load_cache.loaded,
                                                engine.revision)
                    .completed(stable, packages))
    return graph, warnings


_DEP_LABEL = operator.itemgetter(1)


GRAPH_CHECK = Projection("graph check")  # (a kept session's loading engine: the last accepted CheckedGraph)


def _current(node: Node | None, rev: int) -> bool:
    """Whether a package node a check holds is the one this load (revision `rev`) verified, not replaced since."""
    return node is not None and node.verified_at == rev and not node.replaced


@dataclass(frozen=True)
class CheckedGraph:
    """Loading's graph check, a projection of a kept session's loading engine (GRAPH_CHECK): the targets a load found
    free of cycles and of chains longer than MAX_DEPS_DEPTH (`seen`, from the package nodes in `packages`), and
    `height`, an upper bound of the longest chain among them (exact after a full check). `complete`: per package whose
    every target was in `seen` (so had its references and kinds checked), the packages its targets refer to."""

    packages: Mapping[str, Node] = field(hash=False)
    seen: frozenset[Label] | set[Label] = field(hash=False)
    height: int = 0
    complete: Mapping[str, frozenset[str]] = field(default_factory=dict, hash=False)

    def unchanged(self, name: str, rev: int) -> bool:
        """Whether package `name`'s targets were all checked here, and its node and those of every package they refer
        to are still current in this load (`rev`): then each reference resolves to the same Target, the checks pass
        again."""
        refers = self.complete.get(name)
        nodes = self.packages
        return refers is not None and _current(nodes.get(name), rev) and all(_current(nodes.get(n), rev)
                                                                              for n in refers)

    def completed(self, stable: Mapping[str, bool], packages: Mapping[str, Package]) -> CheckedGraph:
        """This check with `complete` made for its packages (carried over for the `stable` ones)."""
        seen, complete = self.seen, {}
        old = self.complete
        for name, pkg in packages.items():
            if stable.get(name) and name in old:
                complete[name] = old[name]
            elif all(t.label in seen for t in pkg.targets):
                complete[name] = frozenset(dep.package for t in pkg.targets for _a, dep in t.label_deps)
        return CheckedGraph(self.packages, seen, self.height, complete)


def _check_acyclic(graph: TargetGraph, seen: set[Label], loader: Loader, deps_of: Mapping[Label, list[tuple[str, Label]]],
                   prev: CheckedGraph | None, nodes: Mapping[str, Node], rev: int) -> CheckedGraph:
    """_check_cycles over `seen`, re-checking only what changed since `prev` when that proves the same answer.

    A target is unchanged when it was checked in `prev` and its package's node is still current (so the same Target,
    with the same references). A cycle made only of unchanged targets would have been found in `prev`, so every new
    cycle goes through a changed target: a search from the changed ones finds it. A chain is a run of unchanged
    targets (at most prev.height: it was a chain then) followed, from its first changed target on, by at most the
    largest height the search computes: so prev.height + that bounds every chain. Only an accepted graph is decided
    here; anything else (a cycle, a bound above the limit, many changes) is the full check's, whose error a fresh
    process reports too."""
    if prev is not None:
        old = prev.packages
        changed = {t.label for name, pkg in graph.packages.items() if not _current(old.get(name), rev)
                   for t in pkg.targets}
        changed &= seen
        changed |= seen - prev.seen
        if len(changed) * 4 <= len(seen):
            try:
                reach = _check_cycles(graph, changed, loader, deps_of) if changed else 0
            except UserInputError:
                reach = MAX_DEPS_DEPTH + 1
            bound = prev.height + reach
            if bound <= MAX_DEPS_DEPTH:
                return CheckedGraph(dict(nodes), seen, bound, prev.complete)
    return CheckedGraph(dict(nodes), seen, _check_cycles(graph, seen, loader, deps_of),
                        prev.complete if prev is not None else {})


MAX_DEPS_DEPTH = 256  # longest dependency chain accepted (compiler_options deps merge recursively)


_LABEL_ORDER = operator.attrgetter("package", "name", "repo")  # Label's own order, compared in C


def _check_cycles(graph: TargetGraph, labels: set[Label], loader: Loader,
                  deps_of: Mapping[Label, list[tuple[str, Label]]] | None = None) -> int:
    """Iterative depth-first search: cycles and over-long chains are one located error, never a RecursionError.
    Returns the number of targets on the longest dependency chain."""
    known = deps_of or {}

    def deps(lbl: Label) -> list[tuple[str, Label]]:
        d = known.get(lbl)
        return d if d is not None else graph.targets[lbl].label_deps

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


def locate(graph: TargetGraph, target: Target, attr: str | None = None) -> Location:
    """Call site of a target's rule call, or of its attribute `attr` there (re-evaluates its BUILD file; only used on
    error paths)."""
    return run_on_starlark_thread(lambda: Loader(graph.root).locate(target, attr))
