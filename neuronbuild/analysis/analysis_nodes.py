"""The analysis engine's nodes (the engine is neuronbuild/engine.py): one per analysed target (key: its Label, value:
`_Memo`: its provider and what it did, in order, and the files it digested), one per volatile provider (`_Fresh`),
the plan's action graph (`_PlanKey`, kept when equal), and the build server's projections: per requested root its
segment, per slice of roots its group (their whole analysis reused in one step). `AnalysisMemo` holds them between
plans (the build server) or for one plan (batch). The kinds' API that computes target nodes: analysis_context.py."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from neuronbuild import digests
from neuronbuild.analysis.action_graph import ActionGraph
from neuronbuild.analysis.providers import BundleInfo, CompileTarget
from neuronbuild.engine import Engine, Node, Projection
from neuronbuild.loading.labels import Label
from neuronbuild.loading.targets import Target
from neuronbuild.plugin_api import registry as plugins
from neuronbuild.plugin_api.actions import Action
from neuronbuild.plugin_api.toolchain import PlanSettings

if TYPE_CHECKING:
    from neuronbuild.loading.target_graph import TargetGraph


class _Running(Protocol):
    """The plan running (analysis_context.AnalysisContext, which imports this module): what the nodes read of it."""

    graph: TargetGraph

    def analyse_volatile(self, label: Any) -> Any:
        """A volatile target's provider, analysed afresh (_GONE: the target is gone or no longer volatile)."""
        ...


def _volatile(kind: str) -> bool:
    """Whether the kind's analysis reads the machine (its rule kind's `volatile`, e.g. a target record resolving
    isa = "native"): never memoised, its provider is computed afresh by every plan and compared with what memoised
    dependants saw."""
    return bool(getattr(plugins.rules().get(kind), "volatile", False))

@dataclass(frozen=True)
class _Memo:
    """The value of a target's node in the analysis engine (engine.py; the node keeps what it asked for and
    its revisions): the target's analysis, what it read outside the engine and what it did, in order."""

    target: Target
    provider: Any
    events: tuple[tuple[Any, ...], ...]  # ("dep", label, provider) | ("add", action) | ("compile", ct) | ("bundle", ...)
    files: tuple[tuple[str, str], ...]  # (path, digest) of every file its own analysis digested


@dataclass(frozen=True)
class _Fresh:
    """The engine key of a volatile target's provider (its kind's `volatile`: never memoised across plans, computed
    again once per plan when asked; an equal provider keeps its revision, so what read it stays valid)."""

    label: Label


_GONE = object()  # a _Fresh key whose target is gone or no longer volatile


@dataclass(frozen=True)
class _PlanKey:
    """The engine key of the plan's ActionGraph (AnalysisMemo.action_graph): stored once per plan, an equal graph
    keeps the previous object (`keep_equal`), with what was derived from it (order, consumers, digraph)."""

    keep_equal = True

    @staticmethod
    def equal(last: ActionGraph, new: ActionGraph) -> bool:
        """Equal actions (by fingerprint, in order: fingerprints are content addresses), compile targets and
        bundles."""
        return len(last.actions) == len(new.actions) and list(last.actions) == list(new.actions) and \
            len(last.compiles) == len(new.compiles) and all(map(_same_value, last.compiles, new.compiles)) and \
            list(last.bundles) == list(new.bundles) and \
            _same_value(list(last.bundles.values()), list(new.bundles.values()))


_PLAN = _PlanKey()


class _TargetNodes:
    """The engine's function for target nodes (keys: Label) and volatile providers (keys: _Fresh), bound to the plan
    running (`ctx`). Target nodes are computed by AnalysisContext._analyse (an analysis records its events in order);
    the engine decides their validity and cutoff: a node is current when its Target value and the files it digested
    are unchanged (`unchanged`) and every node it asked for is current with the revision it saw."""

    def __init__(self) -> None:
        self.ctx: _Running | None = None

    @staticmethod
    def equal(old: Any, new: Any) -> bool:
        """A target's analysis again with an equal provider and the same events (actions by fingerprint)."""
        if isinstance(old, _Memo):
            return isinstance(new, _Memo) and _same_value(old.provider, new.provider) and \
                _same_events(old.events, new.events)
        return old is not _GONE and new is not _GONE and _same_value(old, new)

    def unchanged(self, label: Any, node: Node) -> bool:
        """A target node's own inputs: its Target value (Target equality leaves attrs out: compared too) and the
        digest of every file its analysis digested (through the stat-keyed digest cache)."""
        assert self.ctx is not None
        m = node.value
        t = self.ctx.graph.targets.get(label)
        if t is not m.target and (t is None or not (m.target == t and m.target.attrs == t.attrs)):
            return False
        return not m.files or _files_same(m.files)

    def stale_ids(self, nodes: Mapping[Any, Node]) -> set[int]:
        """id() of the target nodes whose own inputs changed: `unchanged` over every node at once (one loop: at
        100,000 graphs this is a third of a warm re-plan's analysis)."""
        assert self.ctx is not None
        get = self.ctx.graph.targets.get
        bad: set[int] = set()
        for lbl, n in nodes.items():
            m = n.value
            if type(m) is not _Memo:
                continue
            t = get(lbl)
            if t is not m.target and (t is None or not (m.target == t and m.target.attrs == t.attrs)) or \
                    m.files and not _files_same(m.files):
                bad.add(id(n))
        return bad


def _files_same(files: tuple[tuple[str, str], ...]) -> bool:
    for path, digest in files:
        try:
            if digests.digest_file(path) != digest:
                return False
        except OSError:
            return False
    return True


class _FreshNodes(_TargetNodes):
    volatile = True

    def compute(self, key: _Fresh, engine: Engine) -> Any:
        assert self.ctx is not None
        return self.ctx.analyse_volatile(key.label)


@dataclass(frozen=True)
class _Segment:
    """A requested root's whole analysis (an entry of the projection SEGMENTS): every memoised node of its closure
    (label and the engine node it was made from, in the order a fresh analysis provides them), the volatile targets
    it asked for with the revisions seen, every action its closure adds (in the order a fresh analysis adds them
    first), and the compile targets and bundles each node registers. It is valid exactly when none of those nodes was
    replaced since (`Engine.replaced`), their own inputs (Target value, files) are unchanged and each volatile
    provider is at the revision seen: then each node is valid by the engine's rule, and providing the root adds what
    the segment holds, in its order."""

    labels: tuple[Label, ...]
    memos: tuple[Node, ...]  # (engine nodes, values _Memo)
    ids: frozenset[int]  # id() of each of `memos` (held here, so not reused): checked without hashing labels
    volatile: tuple[tuple[_Fresh, int], ...]  # (key, the changed_at seen)
    actions: dict[str, Action]
    events: tuple[tuple[int, tuple[Any, ...]], ...]  # (id of the node's _Memo, ("compile", ct) | ("bundle", ...))
    closed: bool  # every action's dependencies come before it in `actions` (its order is topological)


@dataclass(frozen=True)
class _Group:
    """Consecutive requested roots (at most GROUP_ROOTS, the same slice of the plan's roots every time; an entry of
    the projection GROUPS): what providing them in order from their segments adds, starting from nothing provided
    (the nodes with their providers, the actions in order, the compile targets and bundles). It reads exactly what
    those segments read, so it is valid exactly when each of them is. A re-plan provides a valid group in one step,
    leaving out what is provided already (as providing each root from its segment would)."""

    roots: tuple[Label, ...]
    memos: tuple[Node, ...]  # the nodes, in the order provided (held, so their ids are not reused)
    ids: frozenset[int]
    volatile: tuple[tuple[_Fresh, int], ...]  # (one per volatile target and revision seen)
    providers: dict[Label, Any]  # (in the order of `memos`)
    actions: dict[str, Action]
    events: tuple[tuple[int, tuple[Any, ...]], ...]  # (id of the node's _Memo, ("compile", ct) | ("bundle", ...))
    compiles: tuple[CompileTarget, ...]  # (the events' compile targets, and bundles, in order)
    bundles: tuple[tuple[Label, BundleInfo], ...]
    event_ids: frozenset[int]  # the ids and labels of the nodes with events
    event_labels: frozenset[Label]
    closed: bool


GROUP_ROOTS = 64
SEGMENTS = Projection("segments")  # (the server's, engine.py) {requested root: _Segment}
GROUPS = Projection("groups")  # {index of a slice's first root: _Group, or None}


def _make_group(roots: tuple[Label, ...], segments: Mapping[Label, _Segment]) -> _Group | None:
    """The group of `roots` from their current segments (None when one has none): what providing each root in turn
    from its segment adds (AnalysisContext.use_segment), starting from nothing provided."""
    segs = [segments.get(r) for r in roots]
    labels: dict[Label, Any] = {}
    memos: list[Node] = []
    ids: set[int] = set()
    volatile: dict[tuple[_Fresh, int], None] = {}
    actions: dict[str, Action] = {}
    events: list[tuple[int, tuple[Any, ...]]] = []
    closed = True
    for root, seg in zip(roots, segs, strict=True):
        if seg is None:
            return None
        closed = closed and seg.closed
        volatile.update(dict.fromkeys(seg.volatile))
        if root in labels:  # (provided by an earlier root of the group: a plan adds nothing for it)
            continue
        every = ids.isdisjoint(seg.ids)
        fresh = {id(m) for m in seg.memos if id(m) not in ids}
        for fp, a in seg.actions.items():
            if fp not in actions:
                actions[fp] = a
        events.extend(e for e in seg.events if every or e[0] in fresh)
        for lbl, m in zip(seg.labels, seg.memos, strict=True):
            if every or id(m) in fresh:
                labels[lbl] = m.value.provider
                memos.append(m)
        ids |= seg.ids
    event_ids = frozenset(mid for mid, _ev in events)
    return _Group(roots, tuple(memos), frozenset(ids), tuple(volatile), labels, actions, tuple(events),
                  tuple(ev[1] for _mid, ev in events if ev[0] == "compile"),
                  tuple((ev[1], ev[2]) for _mid, ev in events if ev[0] != "compile"), event_ids,
                  frozenset(lbl for lbl, m in zip(labels, memos, strict=True) if id(m) in event_ids), closed)


class AnalysisMemo:
    """The analysis engine's state: an `Engine` (engine.py) with one node per analysed target (key: its
    Label, value: `_Memo`) and per volatile target asked for (key: `_Fresh`), kept between plans of one workspace
    with one set of settings by the build server, and made empty for each batch command (the same engine, starting
    empty). Each plan is a revision of it.

    A node is reused only when everything it read is unchanged (the engine's validity walk): its Target value, the
    files it digested (checked by digest through the stat-keyed digest cache), and every node it asked for, which
    must be valid itself and still have the revision (`changed_at`) it had when asked. `env` is what every plan must
    see unchanged to reuse any of it: the settings and, per (toolchain, platform) the memoised analyses used, the
    versions the toolchain reports now (a C++ compiler or neuronx-cc replaced between commands empties the memo)."""

    def __init__(self) -> None:
        self.nodes_fn = _TargetNodes()
        self.fresh_fn = _FreshNodes()
        self.engine = Engine({Label: self.nodes_fn, _Fresh: self.fresh_fn})
        self.env: dict[tuple[str, str], dict[str, str]] = {}
        self.settings_key: str | None = None
        self.trace_toolchain: dict[str, str] = {}
        self.reused = self.analysed = self.grouped = 0  # (this plan's: nodes; roots by groups)

    def begin(self, settings: PlanSettings) -> None:
        key = settings_key(settings)
        trace_tc = settings.trace_toolchain()  # (what every trace record holds: Python and torch versions)
        if key != self.settings_key or trace_tc != self.trace_toolchain or \
                any(_versions(tc, platform, settings) != v for (tc, platform), v in self.env.items()):
            self.engine.clear()
            self.env.clear()
        self.settings_key, self.trace_toolchain = key, trace_tc
        self.engine.advance()
        self.reused = self.analysed = self.grouped = 0

    @property
    def entries(self) -> dict[Any, Node]:
        """The engine's nodes: by Label, the memoised targets' (values `_Memo`); by `_Fresh`, volatile providers."""
        return self.engine.nodes

    def memoised_targets(self) -> int:
        return sum(type(k) is Label for k in self.engine.nodes)

    def action_graph(self, actions: dict[str, Action], compiles: tuple[CompileTarget, ...],
                     bundles: dict[Label, BundleInfo], topological: bool = False) -> ActionGraph:
        """The plan's ActionGraph node (key `_PLAN`): a value of its actions, compile targets and bundles. When they
        equal the previous plan's, that value is returned (early cutoff: `_PlanKey.equal`), with what was derived
        from it (order, consumers, digraph)."""
        node = self.engine.store(_PLAN, ActionGraph(actions, None, compiles, bundles, topological), ())
        return node.value  # type: ignore[no-any-return]

    @property
    def last(self) -> ActionGraph | None:
        """The previous plan's action graph (the `_PLAN` node's value)."""
        node = self.engine.nodes.get(_PLAN)
        return None if node is None else node.value  # type: ignore[no-any-return]


def settings_key(settings: PlanSettings) -> str:
    return json.dumps([list(settings.action_env), list(settings.tools), sorted(settings.toolchain_overrides.items())],
                      default=str)


def _versions(tc: str, platform: str, settings: PlanSettings) -> dict[str, str] | None:
    try:
        return dict(plugins.toolchain(tc).versions(platform, settings))
    except Exception:  # noqa: BLE001 - a toolchain gone or failing: the memo is dropped, the plan reports the error
        return None


def _same_value(a: Any, b: Any) -> bool:
    """Equality of two analysis results over every field (providers leave some out of their own `==`)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if dataclasses.is_dataclass(a):
        return all(_same_value(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, tuple | list):
        return len(a) == len(b) and all(map(_same_value, a, b))
    return bool(a == b)


def _same_events(a: tuple[tuple[Any, ...], ...], b: tuple[tuple[Any, ...], ...]) -> bool:
    """Whether two analyses did the same things in the same order (actions by fingerprint)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x[0] != y[0]:
            return False
        if x[0] == "add":
            if x[1].fingerprint != y[1].fingerprint:
                return False
        elif x[0] == "dep":
            if x[1] != y[1]:
                return False
        elif not _same_value(x[1:], y[1:]):
            return False
    return True

