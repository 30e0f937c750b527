"""Expands target patterns, loads the packages they need (transitively) and checks references, kinds and cycles."""

from __future__ import annotations

import difflib
import operator
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
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
            if t.kind == "neuron_compile" and not t.attrs.get("buckets")]


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

    last = load_cache.last if load_cache is not None else None
    if last is not None and last.root == root and last.patterns == tuple(patterns) and last.check == check:
        assert load_cache is not None
        fast = _reload(loader, patterns, load_cache, last)
        if fast is not None:
            return fast, []
    requested: list[Label] = []
    warnings: list[str] = []
    all_names: list[list[str]] = []
    for pat in patterns:
        if pat.recursive:
            names = loader.find_packages(pat.package, load_cache.dirs if load_cache is not None else None)
            if not names and not (root / pat.package).is_dir():
                raise UserInputError(f"no such package '{pat.package}' (pattern '{pat}')"
                                     + _did_you_mean(f"//{pat.package}/...",
                                                     [f"//{n}/..." for n in loader.find_packages("")]))
        else:
            names = [pat.package]
        all_names.append(names)
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
            if kind not in schema_attr.kinds:
                raise UserInputError(f"attribute '{attr}' of '{lbl}' must be a {' or '.join(schema_attr.kinds)} "
                                     f"target, but '{dep}' is a {kind}", loader.locate(t))
            todo.append(dep)
    checked = load_cache.checked if load_cache is not None else None
    if checked is None or checked.root != root or (bound := _no_new_cycle(graph, seen, deps_of, checked)) is None:
        bound = _check_cycles(graph, seen, loader, deps_of)
    if load_cache is not None:  # (in memory only: the build server's next load checks what changed since this one)
        labels = frozenset(seen)
        load_cache.checked = Checked(root, dict(packages), labels, bound)
        load_cache.last = None
        if not warnings and len(seen) == len(requested):  # (everything reached is requested: see _reload)
            load_cache.last = Last(root, tuple(patterns), check, all_names, graph, labels)
    return graph, warnings


@dataclass(frozen=True)
class Last:
    """The build server's last load of a LoadCache (in memory): its patterns and their packages, and its graph, in
    which every target reached is a requested one and no warning was given."""

    root: Path
    patterns: tuple[TargetPattern, ...]
    check: bool
    names: list[list[str]] = field(hash=False)
    graph: TargetGraph = field(hash=False)
    seen: frozenset[Label] = field(hash=False)


def _reload(loader: Loader, patterns: Sequence[TargetPattern], load_cache: LoadCache, last: Last) -> TargetGraph | None:
    """The build server's re-load when the patterns select the same packages as last time: each package is checked
    (and evaluated again if changed) as a load does, and only the targets of changed packages are checked again
    (references, kinds, new cycles). None when the answer could differ from a full load's in more than that (then the
    full load runs and reports any error): a changed package declares other labels, kinds or manual tags, would
    warn, or refers outside what the last load reached."""
    names = [loader.find_packages(p.package, load_cache.dirs) if p.recursive else [p.package] for p in patterns]
    if names != last.names or not all(names):
        return None
    old = last.graph.packages
    packages: dict[str, Package] = {}
    changed: list[str] = []
    try:
        for name, before in old.items():
            pkg = load_cache.get(loader, name)  # (its BUILD file gone: a miss, then load_package raises)
            if pkg is None:
                started = time.time_ns()
                pkg = loader.load_package(name)
                load_cache.put(loader, pkg, started)
            packages[name] = pkg
            if pkg is not before:
                changed.append(name)
    except UserInputError:
        return None  # (the full load reports it where a batch load would)
    graph = TargetGraph(last.graph.root, last.graph.targets, packages, last.graph.requested)
    seen = last.seen
    deps_of: dict[Label, list[tuple[str, Label]]] = {}
    if changed:
        targets = dict(last.graph.targets)
        for name in changed:
            before_targets, now = old[name].targets, packages[name].targets
            if len(before_targets) != len(now):
                return None
            for o, t in zip(before_targets, now, strict=True):
                if o.label != t.label or o.kind != t.kind or ("manual" in o.tags) != ("manual" in t.tags) or \
                        (t.kind == "neuron_compile" and not t.attrs.get("buckets") and t.label in seen):
                    return None
                targets[t.label] = t
        graph = TargetGraph(last.graph.root, targets, packages, last.graph.requested)
        for name in changed:
            for t in packages[name].targets:
                if t.label not in seen:
                    continue
                label_deps = deps_of[t.label] = graph.label_deps(t)
                for attr, dep in label_deps:
                    schema_attr = RULES[t.kind].attr(attr)
                    if dep.repo or dep not in seen or schema_attr is None or targets[dep].kind not in schema_attr.kinds:
                        return None
    checked = load_cache.checked
    if checked is None or checked.root != last.root or (bound := _no_new_cycle(graph, seen, deps_of, checked)) \
            is None:
        return None
    load_cache.checked = Checked(last.root, dict(packages), seen, bound)
    load_cache.last = Last(last.root, last.patterns, last.check, names, graph, seen)
    return graph


@dataclass(frozen=True)
class Checked:
    """What the last load checked for cycles and chain lengths: its packages (the objects: an unchanged package is
    the same object in the build server's next load), the labels it checked and an upper bound of the number of
    targets on its longest dependency chain."""

    root: Path
    packages: Mapping[str, Package] = field(hash=False)
    labels: frozenset[Label] = field(hash=False)
    longest: int = 0


def _no_new_cycle(graph: TargetGraph, labels: AbstractSet[Label], deps_of: Mapping[Label, list[tuple[str, Label]]],
                  before: Checked) -> int | None:
    """The build server's re-load: when the last load's targets had no cycle and no chain longer than
    MAX_DEPS_DEPTH, a new cycle or a longer chain must pass through a target that changed since (a target of a
    package that is not the same object, or one that was not checked then); so a search from those alone decides.
    Returns the new bound of the longest chain (the old one plus the longest chain starting at a changed target:
    the part of a chain above its first changed target is an old chain), or None when the full check must run
    (a cycle, or a bound reaching MAX_DEPS_DEPTH: it finds and reports them as a batch load does)."""
    old = before.packages
    changed = [t.label for name, pkg in graph.packages.items() if old.get(name) is not pkg
               for t in pkg.targets if t.label in labels]
    changed.extend(labels - before.labels)
    if not changed:
        return before.longest
    targets = graph.targets

    def deps(lbl: Label) -> list[tuple[str, Label]]:
        d = deps_of.get(lbl)
        return d if d is not None else graph.label_deps(targets[lbl])

    height: dict[Label, int] = {}  # longest chain starting at a target (counted in targets); absent: on the stack
    for root in changed:
        if root in height:
            continue
        stack = [root]
        iters = [iter(deps(root))]
        on_stack = {root}
        while iters:
            pair = next(iters[-1], None)  # ((attribute, label): no generator made per step)
            dep = pair[1] if pair is not None else None
            if dep is None:
                lbl = stack.pop()
                iters.pop()
                on_stack.discard(lbl)
                height[lbl] = 1 + max((height[d] for _a, d in deps(lbl)), default=0)
                continue
            if dep in on_stack:
                return None  # a cycle: the full check reports it
            if dep not in height:
                if len(stack) >= MAX_DEPS_DEPTH:
                    return None
                on_stack.add(dep)
                stack.append(dep)
                iters.append(iter(deps(dep)))
    longest = before.longest + max(height[c] for c in changed)
    return longest if longest <= MAX_DEPS_DEPTH else None


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
