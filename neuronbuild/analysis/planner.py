"""Turns a TargetGraph into an ActionGraph by asking each requested target's rule kind (neuronbuild.plugins) for its
analysis: kinds return providers and register actions here; one trace per (model, graph, bucket) is shared by all.

Analysis runs on the generic engine (neuronbuild/engine.py; `AnalysisMemo` holds it): one node per target (key: its
Label) holding its provider and what it did, in order (providers it asked for, actions it added, compile targets and
bundles it registered), and what it read: its Target value and the files it digested (checked by the node function's
`unchanged`) and, recorded by the engine, the revision of every node it asked for. A node is replayed only when the
engine finds it valid; an analysis run again with an equal result keeps its revision (early cutoff). Batch commands run the same engine starting empty, the build server keeps it between commands: so the
server's plan is the one a fresh process makes, by construction."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import networkx as nx

from neuronbuild import FORMAT_VERSION, digests, plugins
from neuronbuild.analysis.actions import (
    TRACE,
    TRACE_OUTPUT,
    WEIGHTS,
    Action,
    Bucket,
    DepInput,
    FileInput,
    make_action,
    trace_weights,
)
from neuronbuild.analysis.plan_settings import PlanSettings
from neuronbuild.analysis.providers import BundleInfo, CompileTarget, ModelInfo
from neuronbuild.analysis.toolchain_api import CompileRequest, Toolchain
from neuronbuild.engine import Engine, Node
from neuronbuild.errors import UserInputError
from neuronbuild.loading.labels import Label
from neuronbuild.loading.target_graph import TargetGraph
from neuronbuild.loading.targets import Target

__all__ = ["ActionGraph", "AnalysisContext", "AnalysisMemo", "CompileTarget", "plan"]


def _volatile(kind: str) -> bool:
    """Whether the kind's analysis reads the machine (its rule kind's `volatile`, e.g. a target record resolving
    isa = "native"): never memoised, its provider is computed afresh by every plan and compared with what memoised
    dependants saw."""
    return bool(getattr(plugins.rules().get(kind), "volatile", False))


@dataclass(frozen=True)
class ActionGraph:
    """Every action needed for the requested targets; edges run from producer to consumer.

    A plain value: the actions (by fingerprint, in the order analysis added them), the compile targets and bundles.
    What is derived from them (the networkx digraph, the consumers of each action, the topological order) is made on
    first use and kept with the value; the planner's hot paths use the plain `consumers` map and `Action.deps`."""

    actions: Mapping[str, Action] = field(hash=False)
    given_graph: nx.DiGraph | None = field(default=None, hash=False, compare=False, repr=False)
    compiles: tuple[CompileTarget, ...] = ()
    bundles: Mapping[Label, BundleInfo] = field(default_factory=dict, hash=False, compare=False)
    # The analysis engine knows the registration order is topological (every root's segment is: _Segment.closed).
    registered_topologically: bool = field(default=False, hash=False, compare=False, repr=False)

    @cached_property
    def graph(self) -> nx.DiGraph:
        """The producer -> consumer digraph (networkx, public API): for queries, explain and the scheduler."""
        return self.given_graph if self.given_graph is not None else action_digraph(self.actions)

    @cached_property
    def consumers(self) -> Mapping[str, tuple[str, ...]]:
        """{fingerprint: the distinct actions reading its outputs, in action order}; a dependency never registered
        is a key too (the digraph's nodes)."""
        return self._adjacency[1]

    @cached_property
    def inputs(self) -> Mapping[str, tuple[str, ...]]:
        """{fingerprint: the distinct actions whose outputs it reads} (the digraph's predecessors)."""
        return self._adjacency[0]

    @cached_property
    def _adjacency(self) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]]]:
        ins: dict[str, tuple[str, ...]] = {}
        out: dict[str, list[str]] = {fp: [] for fp in self.actions}
        get = out.get
        for fp, a in self.actions.items():
            dep_inputs = a.dep_inputs
            if not dep_inputs:
                ins[fp] = ()
                continue
            deps = ins[fp] = tuple(dict.fromkeys(map(_ACTION_OF, dep_inputs))) if len(dep_inputs) > 1 else \
                (dep_inputs[0].action,)
            for d in deps:
                lst = get(d)
                if lst is None:
                    lst = out[d] = []
                    ins[d] = ()
                lst.append(fp)
        return ins, {fp: tuple(c) for fp, c in out.items()}

    def topological(self) -> list[Action]:
        return list(self.topological_seq())

    def topological_seq(self) -> tuple[Action, ...]:
        """The actions in topological order (made once per graph): the order analysis registered them in, which is
        one whenever every action's dependencies were registered before it (analysis makes a consumer from its
        inputs' actions, so this is the rule); else the smallest ready fingerprint first."""
        return self._ordered[0]

    def order_fingerprints(self) -> list[str]:
        """The fingerprints of topological(), in its order."""
        return self._ordered[1]

    @cached_property
    def _ordered(self) -> tuple[tuple[Action, ...], list[str]]:
        actions = self.actions
        if self.registered_topologically:
            return tuple(actions.values()), list(actions)
        seen: set[str] = set()
        add, covers = seen.add, seen.issuperset
        for fp, a in actions.items():  # (one pass, a set operation each: the registration order is topological?)
            deps = a.deps
            if deps and not covers(deps):
                return self._kahn()
            add(fp)
        return tuple(actions.values()), list(actions)

    def _kahn(self) -> tuple[tuple[Action, ...], list[str]]:
        """Kahn's algorithm taking the smallest ready fingerprint first (networkx's lexicographical_topological_sort
        order, over `consumers`): for action sets whose registration order is not topological (a dependency
        registered after its consumer, or never registered: then a KeyError; a cycle: NetworkXUnfeasible)."""
        import heapq

        cons = self.consumers
        actions = self.actions
        waiting: dict[str, int] = {}  # (one-input actions are ready once it is)
        ready: list[str] = []
        for fp, deps in self.inputs.items():  # (never-registered dependencies too: no inputs)
            k = len(deps)
            if not k:
                ready.append(fp)
            elif k > 1:
                waiting[fp] = k
        heapq.heapify(ready)
        pop, push = heapq.heappop, heapq.heappush
        fps: list[str] = []
        take = fps.append
        while ready:
            n = pop(ready)
            take(n)
            for s in cons[n]:
                left = waiting.get(s)
                if left is None:
                    push(ready, s)
                elif left > 1:
                    waiting[s] = left - 1
                else:
                    del waiting[s]
                    push(ready, s)
        if len(fps) != len(cons):
            raise nx.NetworkXUnfeasible("the action graph has a cycle")
        return tuple(map(actions.__getitem__, fps)), fps

    def trace_of(self, fp: str) -> Action:
        """Provenance: the trace action an action's outputs derive from (itself for a trace)."""
        a = self.actions[fp]
        while a.kind != TRACE:
            a = self.actions[a.deps[0]]
        return a

    def weights_of(self, fp: str, ships: tuple[DepInput, ...] | None = None) -> Action | None:
        """The model's weights action an action's outputs bind (itself for one), or None (a trace, a Lower).
        `ships`: what the compile target asking ships beside `fp` (CompileTarget.ships_of), else the action's."""
        for s in self.actions[fp].ships if ships is None else ships:  # (a compile ships its model's weights)
            w = self.actions.get(s.action)
            if w is not None and w.kind == WEIGHTS:
                return w
        for d in self.closure(fp):
            a = self.actions.get(d)
            if a is not None and a.kind == WEIGHTS:
                return a
        return None

    def model_of(self, fp: str, ships: tuple[DepInput, ...] | None = None) -> dict[str, Any]:
        """The model record an action's outputs come from: its trace's (the graph's entry, inputs, outputs) with the
        checkpoint the weights action read (weights, weights_prefix), as `validate` rebuilds the eager model.
        `ships`: as weights_of."""
        rec = dict(self.trace_of(fp).model)
        w = self.weights_of(fp, ships)
        if w is not None:
            wrec = w.record.get("model") or {}
            rec.update({k: wrec[k] for k in ("weights", "weights_prefix") if k in wrec})
        return rec

    def closure(self, fp: str, ships: tuple[DepInput, ...] | None = None) -> set[str]:
        """The action and every action it depends on (nx.ancestors' set and `fp`, over `Action.deps`: a build asks
        this of each of its 1,000s of compiles, where networkx's dispatch costs more than the walk). `ships`: what
        the compile target asking ships beside `fp` (CompileTarget.ships_of), counted with it."""
        actions = self.actions
        if fp not in actions:
            raise nx.NetworkXError(f"The node {fp} is not in the digraph.")
        out = {fp}
        stack = [fp]
        for s in ships or ():
            if s.action not in out:
                out.add(s.action)
                stack.append(s.action)
        while stack:
            a = actions.get(stack.pop())
            if a is None:
                continue
            for d in a.deps:
                if d not in out:
                    out.add(d)
                    stack.append(d)
            for s in a.ships:  # (what reaches users with its outputs is part of what it is made of)
                if s.action not in out:
                    out.add(s.action)
                    stack.append(s.action)
        return out

    def shipped_outputs(self, fp: str, lookup: Callable[[str], Any],
                        ships: tuple[DepInput, ...] | None = None) -> dict[str, Any] | None:
        """{name: output ref} of what action `fp`'s outputs are to users (an output target's bucket, a bundle's
        graph): its cached result's outputs plus the outputs it ships (a compile's model weights, from the weights
        action's result: `ships`, the compile target's own (CompileTarget.ships_of), else `Action.ships`); None when
        any of those results is not cached."""
        res = lookup(fp)
        if res is None:
            return None
        ships = self.actions[fp].ships if ships is None else ships
        if not ships:
            return dict(res.outputs)
        out = dict(res.outputs)
        for s in ships:
            other = lookup(s.action)
            if other is None or s.output not in other.outputs:
                return None
            out[s.path] = other.outputs[s.output]
        return out

    @property
    def toolchains(self) -> tuple[str, ...]:
        """Names of the toolchains the compile targets use, in first-use order."""
        return tuple(dict.fromkeys(ct.toolchain for ct in self.compiles))


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
        self.ctx: AnalysisContext | None = None

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
        ctx = self.ctx
        assert ctx is not None
        t = ctx.graph.targets.get(key.label)
        if t is None or not ctx.is_volatile(t.kind):
            return _GONE
        n = len(ctx.actions)
        frames, ctx._frames = ctx._frames, []  # (nothing it asks for is an event of an analysis running)
        try:
            p = plugins.rule(t.kind).analyze(ctx, t)
        finally:
            ctx._frames = frames
        if len(ctx.actions) != n:
            ctx._volatile_actions = True
        return p


@dataclass(frozen=True)
class _Segment:
    """A requested root's whole analysis as one node of the engine: every memoised node of its closure (label and
    the `_Memo` it was made from, in the order a fresh analysis provides them), the volatile targets it asked for
    with the providers seen, every action its closure adds (in the order a fresh analysis adds them first), and the
    compile targets and bundles each node registers. It is valid exactly when each of those nodes still has the
    same `_Memo` and its own inputs (Target value, files) are unchanged and each volatile provider is equal: then
    each node is valid by the engine's rule, and providing the root adds what the segment holds, in its order."""

    labels: tuple[Label, ...]
    memos: tuple[Node, ...]  # (engine nodes, values _Memo)
    ids: frozenset[int]  # id() of each of `memos` (held here, so not reused): checked without hashing labels
    volatile: tuple[tuple[_Fresh, int], ...]  # (key, the changed_at seen)
    actions: dict[str, Action]
    events: tuple[tuple[int, tuple[Any, ...]], ...]  # (id of the node's _Memo, ("compile", ct) | ("bundle", ...))
    closed: bool  # every action's dependencies come before it in `actions` (its order is topological)


@dataclass(frozen=True)
class _Group:
    """Consecutive requested roots (at most GROUP_ROOTS, the same slice of the plan's roots every time) provided from
    their segments as one node of the engine: what providing them in order from their segments adds, starting from
    nothing provided (the nodes with their providers, the actions in order, the compile targets and bundles), made
    from those segments. It reads exactly what they read, so it is valid exactly when each of them is: each node is
    still current (`ids`) and each volatile provider is equal. A re-plan provides a valid group in one step when none
    of its nodes or actions is provided yet; else root by root from the segments, as before."""

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

    def __init__(self, segments: bool = True) -> None:
        self.nodes_fn = _TargetNodes()
        self.fresh_fn = _FreshNodes()
        self.engine = Engine({Label: self.nodes_fn, _Fresh: self.fresh_fn})
        self.engine.on_store = self._stored
        # Per requested root: its segment (_Segment), made after each plan when `segments` (the build server: a batch
        # command's engine is used once, so it makes none).
        self.keep_segments = segments
        self.segments: dict[Label, _Segment] = {}
        # Per slice of GROUP_ROOTS requested roots (by its index): the group made from their segments (_Group)
        self.groups: dict[int, _Group] = {}
        # id() of every _Memo replaced since the segments were made (a segment holding one is stale; segments hold
        # their nodes, so such an id is not reused while a segment could ask)
        self.retired: set[int] = set()
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
            self.segments.clear()
            self.groups.clear()
            self.retired.clear()
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

    def _stored(self, key: Any, old: Node | None, new: Node) -> None:
        if old is not None and type(key) is Label:
            self.retired.add(id(old))  # (a segment holding it is stale)

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


class _Recorder:
    __slots__ = ("events",)

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []


class _Compiles(list):  # type: ignore[type-arg]
    """ctx.compiles: appends are recorded into the analysis frame that makes them."""

    def __init__(self, ctx: AnalysisContext) -> None:
        super().__init__()
        self._ctx = ctx

    def append(self, ct: CompileTarget) -> None:
        super().append(ct)
        self._ctx._event(("compile", ct))


class _Bundles(dict):  # type: ignore[type-arg]
    def __init__(self, ctx: AnalysisContext) -> None:
        super().__init__()
        self._ctx = ctx

    def __setitem__(self, key: Label, value: BundleInfo) -> None:
        super().__setitem__(key, value)
        self._ctx._event(("bundle", key, value))


class AnalysisContext:
    """What a rule kind's analysis sees: targets, settings, other targets' providers, and where to add actions."""

    def __init__(self, graph: TargetGraph, settings: PlanSettings, memo: AnalysisMemo | None = None) -> None:
        self.graph = graph
        self.settings = settings
        self.common: dict[str, Any] = {"env": settings.env_record()} if settings.action_env else {}
        self.actions: dict[str, Action] = {}  # (the graph's edges are made once at the end: action_digraph)
        self.compiles: list[CompileTarget] = _Compiles(self)
        self.bundles: dict[Label, BundleInfo] = _Bundles(self)
        self._providers: dict[Label, Any] = {}
        if memo is None:
            memo = AnalysisMemo(segments=False)
            memo.begin(settings)
        self.memo = memo
        self.engine = memo.engine
        memo.nodes_fn.ctx = memo.fresh_fn.ctx = self
        self._frames: list[_Recorder] = []
        self._kinds_volatile: dict[str, bool] = {}
        self._traces: dict[tuple[int, Bucket, int], tuple[ModelInfo, Action]] = {}
        self._weights: dict[tuple[int, int], tuple[ModelInfo, Action]] = {}
        self._bad: set[int] | None = None  # id() of memoised nodes whose own inputs changed (made on first need)
        self._from_segments: set[int] = set()  # id() of the nodes provided from segments
        self._all_from_segments = True  # (no node provided otherwise yet: a node is provided iff its id is above)
        self._volatile_actions = False  # a volatile analysis added actions: no segments this plan

    def target(self, label: Label) -> Target:
        return self.graph.targets[label]

    def is_volatile(self, kind: str) -> bool:
        v = self._kinds_volatile.get(kind)
        if v is None:
            v = self._kinds_volatile[kind] = _volatile(kind)
        return v

    def _event(self, ev: tuple[Any, ...]) -> None:
        if self._frames:
            self._frames[-1].events.append(ev)

    def provider(self, label: Label) -> Any:
        """The provider of `label` (its kind's analysis runs once per plan; a memoised one is replayed when the
        engine finds its node current)."""
        p = self._providers.get(label, _MISSING)
        if p is _MISSING:
            self._all_from_segments = False
            if self.is_volatile(self.graph.targets[label].kind):
                p = self.provider_fresh(label)
            elif self.engine.valid(label):
                p = self._replay(self.engine.nodes[label])
                self.memo.reused += 1
            else:
                p = self._analyse(label)
            self._providers[label] = p
        if self._frames:  # (_event inlined: 150,000 calls in a replay, where nothing records)
            self._frames[-1].events.append(("dep", label, p))
            key = _Fresh(label) if self.is_volatile(self.graph.targets[label].kind) else label
            self.engine.observe(key, self.engine.nodes[key])
        return p

    def _analyse(self, label: Label) -> Any:
        """Analyse `label` as its node's computation: what it asks for are its dependencies, its events and digested
        files its value; stored in the engine (an equal result keeps its revision: early cutoff)."""
        t = self.graph.targets[label]
        memo = self.memo
        frame = _Recorder()
        self._frames.append(frame)
        try:
            with self.engine.computing(label) as deps, digests.recording() as files:
                p = plugins.rule(t.kind).analyze(self, t)
        finally:
            self._frames.pop()
        memo.analysed += 1
        events = tuple(frame.events)
        self.engine.store(label, _Memo(t, p, events, tuple(files)), tuple(deps))
        for ev in events:
            if ev[0] == "compile":
                key = (ev[1].toolchain, ev[1].platform)
                if key not in memo.env:
                    v = _versions(*key, self.settings)
                    if v is not None:
                        memo.env[key] = v
        return p

    def provider_fresh(self, label: Label) -> Any:
        """The provider of a volatile target (computed once per plan, never memoised across plans)."""
        if label not in self._providers:
            self._providers[label] = self.engine.fresh(_Fresh(label)).value  # type: ignore[union-attr]
        return self._providers[label]

    def _fresh_same(self, volatile: tuple[tuple[_Fresh, int], ...]) -> bool:
        """Whether each volatile provider a segment or group saw still has the revision it saw (computed once per
        plan; an equal provider keeps its revision)."""
        fresh = self.engine.fresh
        for key, seen in volatile:
            node = fresh(key)
            if node is None or node.changed_at != seen:
                return False
        return True

    def _surface_bad(self) -> set[int]:
        """id() of the memoised nodes whose own inputs changed: their Target value (or the target is gone) or a file
        their analysis digested (the engine function's `unchanged`, over every target node at once)."""
        return self.memo.nodes_fn.stale_ids(self.engine.nodes)

    def use_segment(self, root: Label) -> bool:
        """Provide `root` from its segment (_Segment) if that is valid; whether it was."""
        memo = self.memo
        seg = memo.segments.get(root) if memo is not None else None
        if seg is None or root in self._providers:
            return False
        assert memo is not None
        if self._bad is None:
            self._bad = self._surface_bad()
        if not self._bad.isdisjoint(seg.ids) or not memo.retired.isdisjoint(seg.ids):
            return False  # (a node whose inputs changed, or replaced since: not every node is the current valid one)
        if seg.volatile and not self._fresh_same(seg.volatile):
            return False
        providers, done = self._providers, self._from_segments
        if done.isdisjoint(seg.ids) and self._all_from_segments:
            new = list(zip(seg.labels, seg.memos, strict=True))  # (the common case: a root of its own package)
        elif self._all_from_segments:  # (provided so far only from segments: a node is provided iff its _Memo is)
            new = [(lbl, m) for lbl, m in zip(seg.labels, seg.memos, strict=True) if id(m) not in done]
        else:
            new = [(lbl, m) for lbl, m in zip(seg.labels, seg.memos, strict=True)
                   if id(m) not in done and lbl not in providers]
        actions = self.actions
        if actions.keys().isdisjoint(seg.actions):
            actions.update(seg.actions)
        else:  # an action added already keeps its place and its object (its label: the first target to add it)
            for fp, a in seg.actions.items():
                if fp not in actions:
                    actions[fp] = a
        if seg.events:
            every = len(new) == len(seg.memos)
            fresh = set() if every else {id(m) for _lbl, m in new}
            for mid, ev in seg.events:
                if every or mid in fresh:
                    if ev[0] == "compile":
                        list.append(self.compiles, ev[1])
                    else:
                        dict.__setitem__(self.bundles, ev[1], ev[2])
        for lbl, m in new:
            providers[lbl] = m.value.provider
        done |= seg.ids
        memo.reused += len(new)
        return True

    def use_group(self, group: _Group) -> bool:
        """Provide the roots of `group` (_Group) in one step if it is valid and every node provided so far came from
        a segment or group: this adds what providing each root from its segment would (the nodes provided already,
        shared with earlier roots, and their events left out; an action added already keeping its place and
        object); whether it did."""
        memo = self.memo
        assert memo is not None
        if self._bad is None:
            self._bad = self._surface_bad()
        ids = group.ids
        if not self._bad.isdisjoint(ids) or not memo.retired.isdisjoint(ids):
            return False
        if group.volatile and not self._fresh_same(group.volatile):
            return False
        actions, done, providers = self.actions, self._from_segments, self._providers
        # (shared: e.g. the traces of a package whose roots two slices split)
        kept = {fp: actions[fp] for fp in actions.keys() & group.actions.keys()}
        actions.update(group.actions)  # (new keys in the group's order; a key added already keeps its place...)
        if kept:
            actions.update(kept)  # (... and its object)
        # The events (compile targets, bundles) of the nodes not provided yet: a node provided already, from a segment
        # (its id is in `done`) or otherwise (its label), has added its own (as use_segment)
        if done.isdisjoint(group.event_ids) and \
                (self._all_from_segments or providers.keys().isdisjoint(group.event_labels)):
            list.extend(self.compiles, group.compiles)  # (the common case)
            dict.update(self.bundles, group.bundles)
        else:
            skip = {id(m) for (lbl, _p), m in zip(group.providers.items(), group.memos, strict=True)
                    if id(m) in done or lbl in providers}
            for mid, ev in group.events:
                if mid not in skip:
                    if ev[0] == "compile":
                        list.append(self.compiles, ev[1])
                    else:
                        dict.__setitem__(self.bundles, ev[1], ev[2])
        # A node provided already has the provider of the group's node (the same _Memo, else the group is not valid):
        # writing it again changes nothing
        memo.reused += len(ids) - len(done & ids)
        providers.update(group.providers)
        done |= ids
        memo.grouped += len(group.roots)
        return True

    def make_segment(self, root: Label) -> _Segment | None:
        """The segment of `root` from the memo's current nodes (after a plan that provided it), as a fresh analysis
        would provide it: each node's events in order, a dependency's expanded where it is first asked for."""
        assert self.memo is not None
        entries, targets = self.memo.entries, self.graph.targets
        m = entries.get(root)
        if m is None:
            return None
        labels: list[Label] = [root]
        memos: list[Node] = [m]
        volatile: list[tuple[_Fresh, int]] = []
        actions: dict[str, Action] = {}
        events: list[tuple[int, tuple[Any, ...]]] = []
        seen = {root}
        closed = True
        stack = [(root, iter(m.value.events))]
        while stack:
            lbl, it = stack[-1]
            for ev in it:
                kind = ev[0]
                if kind == "add":
                    a = ev[1]
                    if a.fingerprint not in actions:
                        if closed and a.dep_inputs and not all(d in actions for d in a.deps):
                            closed = False
                        actions[a.fingerprint] = a
                elif kind == "dep":
                    d = ev[1]
                    if d in seen:
                        continue
                    seen.add(d)
                    t = targets.get(d)
                    if t is not None and self.is_volatile(t.kind):
                        fresh = entries.get(_Fresh(d))
                        if fresh is None:
                            return None
                        volatile.append((_Fresh(d), fresh.changed_at))
                        continue
                    dm = entries.get(d)
                    if dm is None:
                        return None
                    labels.append(d)
                    memos.append(dm)
                    stack.append((d, iter(dm.value.events)))
                    break
                else:
                    events.append((id(entries[lbl]), ev))
            else:
                stack.pop()
        return _Segment(tuple(labels), tuple(memos), frozenset(map(id, memos)), tuple(volatile), actions,
                        tuple(events), closed)

    def _replay(self, m: Node) -> Any:
        """Redo what the memoised analysis did, in its order (its own events only; dependencies replay theirs)."""
        frames, self._frames = self._frames, []  # nothing replayed is an event of the analysis asking for it
        actions = self.actions
        try:
            for ev in m.value.events:
                kind = ev[0]
                if kind == "add":
                    a = ev[1]
                    if a.fingerprint not in actions:  # (add() inlined: 300,000 of these at monorepo scale)
                        actions[a.fingerprint] = a
                elif kind == "dep":
                    self.provider(ev[1])
                elif kind == "compile":
                    list.append(self.compiles, ev[1])
                else:
                    dict.__setitem__(self.bundles, ev[1], ev[2])
        finally:
            self._frames = frames
        return m.value.provider

    def add(self, action: Action) -> Action:
        """Register an action (once per fingerprint) with edges from the actions it reads outputs of."""
        if self._frames:
            self._frames[-1].events.append(("add", action))
        known = self.actions.get(action.fingerprint)
        if known is None:
            known = self.actions[action.fingerprint] = action
        return known

    def trace(self, model: ModelInfo, bucket: Bucket, tp_degree: int = 1) -> Action:
        """The trace of `model` at `bucket`: one per (model, bucket, tp_degree), shared by every compile that needs
        it. tp_degree > 1 traces one rank's program (every rank runs the same one) and writes one weights shard per
        rank; tp_degree 1 leaves the record as it was (fingerprints of untouched graphs unchanged)."""
        key = (id(model), bucket, tp_degree)
        known = self._traces.get(key)
        if known is not None and known[0] is model:  # (the model info is held, so its id is not reused)
            return self.add(known[1])
        action = self._make_trace(model, bucket, tp_degree)
        self._traces[key] = (model, action)
        return action

    def _make_trace(self, model: ModelInfo, bucket: Bucket, tp_degree: int = 1) -> Action:
        rec = _without_weights(model.record)
        if tp_degree <= 1 and "tp_plan" in rec:  # a sharding plan changes only sharded traces
            rec = {k: v for k, v in rec.items() if k != "tp_plan"}
        record = {
            "format": FORMAT_VERSION,
            "action": TRACE,
            "model": rec,
            "bucket": bucket.as_dict(),
            # + the third-party distributions the model imports (what-if versions applied like torch's)
            "toolchain": self.settings.trace_toolchain() | self.settings.override(dict(rec.get("imports") or {})),
            "program": "shapes-3",  # program.pt2 only: no weight values, no weight files read (the weights action's)
        } | self.common
        spec = {"model": {k: rec[k] for k in ("package", "entry", "config", "seed")}
                | {"srcs": list(rec["srcs"]), "libraries": sorted(rec.get("deps") or {})}
                | ({"tp_plan": rec["tp_plan"]} if rec.get("tp_plan") else {}),
                "inputs": rec["inputs"], "outputs": rec.get("outputs") or [], "bucket": bucket.as_dict()}
        if tp_degree > 1:
            record["tp_degree"] = spec["tp_degree"] = tp_degree
        return self.add(make_action(TRACE, model.label, bucket, record, spec, files=_source_files(model),
                                    outputs=(TRACE_OUTPUT,)))

    def plan_bucket(self, tc: Toolchain, req: CompileRequest) -> tuple[list[Action], tuple[DepInput, ...]]:
        """The actions toolchain `tc` plans for one bucket (`req`: a CompileRequest), registered, with the model's
        weights action first when one of them binds it (a toolchain on shapes alone adds none); the last one is the
        bucket's primary action. And what that primary action ships for this request (its model's weights): the
        registered action may be another model's with an identical graph (the same fingerprint: a compile never
        reads weights), holding that model's in `Action.ships`."""
        planned = tc.plan(req)
        w = req.weights
        if w is not None and any(d.action == w.fingerprint for a in planned for d in (*a.dep_inputs, *a.ships)):
            self.add(w)
        return [self.add(a) for a in planned], (planned[-1].ships if planned else ())

    def weights(self, model: ModelInfo, tp_degree: int = 1) -> Action:
        """The weights action of `model` (the model itself, not one of its graph families: they share its weights):
        one per (model, dtype, layout), shared by every graph, bucket and target that binds its weights. It streams
        the checkpoint into `constants.safetensors` (or one shard per rank at tp_degree > 1) in the dtypes the
        module holds. Its record: the checkpoint's digests (+ prefix), what decides the module's state names, dtypes
        and shapes (sources, entry, config with its dtype, seed, libraries, imported distributions) and the layout
        (tp_degree and tp_plan when sharded); no bucket, input or output spec and no option, so changing those never
        re-runs it. Made here, not added: the caller adds it when a planned step reads it."""
        key = (id(model), tp_degree)
        known = self._weights.get(key)
        if known is not None and known[0] is model:
            return known[1]
        rec = {k: v for k, v in model.record.items() if k not in _GRAPH_KEYS}
        if tp_degree <= 1:
            rec.pop("tp_plan", None)
        record = {
            "format": FORMAT_VERSION,
            "action": WEIGHTS,
            "model": rec,
            "toolchain": self.settings.trace_toolchain() | self.settings.override(dict(rec.get("imports") or {})),
            "layout": "state-1",  # parameters and persistent buffers by FQN, tied ones once (an alias)
        } | self.common
        spec: dict[str, Any] = {"model": {k: rec[k] for k in ("package", "entry", "config", "seed")}
                | {"srcs": list(rec["srcs"]), "weights": rec.get("weights"),
                   "weights_prefix": rec.get("weights_prefix", ""), "libraries": sorted(rec.get("deps") or {})}
                | ({"tp_plan": rec["tp_plan"]} if rec.get("tp_plan") else {})}
        if tp_degree > 1:
            record["tp_degree"] = spec["tp_degree"] = tp_degree
        action = make_action(WEIGHTS, model.label, Bucket(()), record, spec, files=model.files,
                             outputs=trace_weights(tp_degree))
        self._weights[key] = (model, action)
        return action  # (added by the compile whose steps bind it: AnalysisContext.add)


# A graph family's own record keys (a weights action is the model's: its graphs share it).
_GRAPH_KEYS = ("graph", "inputs", "outputs", "aliases", "whole_inputs", "tp")


def _weight_paths(record: Mapping[str, Any]) -> set[str]:
    w = record.get("weights") or {}
    return {str(p) for p, _d in w.get("shards") or ()} | ({str(w["path"])} if w.get("path") else set())


def _without_weights(record: Mapping[str, Any]) -> dict[str, Any]:
    """A model record as a trace sees it: the checkpoint is the weights action's (a trace works on shapes only, so
    weight values, and which files hold them, do not enter its fingerprint)."""
    return {k: v for k, v in record.items() if k not in ("weights", "weights_prefix")}


def _source_files(model: ModelInfo) -> tuple[FileInput, ...]:
    """The model's declared files but its weight files (a trace's sandbox holds no checkpoint)."""
    paths = _weight_paths(model.record)
    return tuple(f for f in model.files if f.path not in paths) if paths else model.files


_MISSING = object()
_ACTION_OF = operator.attrgetter("action")


def plan(graph: TargetGraph, settings: PlanSettings | None = None, memo: AnalysisMemo | None = None,
         errors: list[UserInputError] | None = None) -> ActionGraph:
    """Analyse every requested target whose kind plans actions (compiles; bundles and the compiles they ship).

    `errors` (--keep-going): a requested target whose analysis fails (bad input: UserInputError) is appended there and
    left out of the plan, with everything its analysis added (a target depending on it fails with it); the others are
    planned as without it. None: the first analysis error is raised.

    `settings` adds declared --action-env values (to every record, when any), toolchain configuration (e.g. the
    neuronx-cc version) and toolchain overrides (what-if plans for explain and upgrade-impact).

    `memo`: the analysis engine's state (the build server keeps one per workspace and settings); None starts it empty
    (batch mode). Either way the same engine runs, so the plan is the one a fresh process makes."""
    settings = settings or PlanSettings()
    if memo is None:
        memo = AnalysisMemo(segments=False)
    memo.begin(settings)
    ctx = AnalysisContext(graph, settings, memo)
    segments = memo.segments if memo.keep_segments else None
    plans_actions = {kind: bool(r.plans_actions) for kind, r in plugins.rules().items()}
    targets = graph.targets
    roots = [lbl for lbl in graph.requested if plans_actions[targets[lbl].kind]]
    made: list[Label] = []
    provide = ctx.provider if errors is None else functools.partial(_provide_or_drop, ctx, errors)
    if segments is None:
        for lbl in roots:
            provide(lbl)
        return memo.action_graph(ctx.actions, tuple(ctx.compiles), dict(ctx.bundles))
    groups = memo.groups
    regroup: list[int] = []  # (slices provided otherwise: their groups are made afresh)
    closed = True  # (every root provided from a closed segment or group so far)
    for start in range(0, len(roots), GROUP_ROOTS):
        chunk = roots[start:start + GROUP_ROOTS]
        g = groups.get(start)
        if g is not None and g.roots == tuple(chunk) and ctx.use_group(g):
            closed = closed and g.closed
            continue
        regroup.append(start)
        for lbl in chunk:
            if not ctx.use_segment(lbl):
                if provide(lbl) is _DROPPED:
                    segments.pop(lbl, None)  # (no segment: a group made over this slice is none either)
                else:
                    made.append(lbl)
    topological = False
    if ctx._volatile_actions:  # (a volatile analysis added actions: they are in no segment)
        segments.clear()
        groups.clear()
    else:
        for lbl in made:
            seg = ctx.make_segment(lbl)
            if seg is None:
                segments.pop(lbl, None)
            else:
                segments[lbl] = seg
        if len(segments) > 2 * len(memo.entries) + 1000:  # (roots gone: keep the memory bounded)
            for lbl in [k for k in segments if k not in memo.entries]:
                del segments[lbl]
        if len(memo.retired) > 100_000:  # (forgetting them needs every segment gone that could hold one)
            segments.clear()
            groups.clear()
            memo.retired.clear()
        for start in regroup:
            g = _make_group(tuple(roots[start:start + GROUP_ROOTS]), segments)
            if g is None:
                groups.pop(start, None)
            else:
                groups[start] = g
            closed = closed and g is not None and g.closed
        for start in [k for k in groups if k >= len(roots)]:  # (fewer roots than before)
            del groups[start]
        # Providing the roots in order adds each one's segment's actions not yet added, in its order: the
        # registration order is topological when every segment's is (a group's is when its segments' are).
        topological = closed
    return memo.action_graph(ctx.actions, tuple(ctx.compiles), dict(ctx.bundles), topological)


_DROPPED = object()


def _provide_or_drop(ctx: AnalysisContext, errors: list[UserInputError], label: Label) -> Any:
    """ctx.provider(label), or, when its analysis is bad input, the error appended to `errors` and whatever that
    analysis registered (actions, compile targets, bundles) removed again: _DROPPED. Providers of the targets it
    analysed successfully on the way (its model, a compile a bundle ships) stay; shared traces and weights actions
    are re-added by the next target that asks for them."""
    actions, compiles, bundles = ctx.actions, ctx.compiles, ctx.bundles
    n_actions, n_compiles, had_bundles = len(actions), len(compiles), set(bundles)
    try:
        return ctx.provider(label)
    except UserInputError as e:
        for fp in list(itertools.islice(actions, n_actions, None)):
            del actions[fp]
        del compiles[n_compiles:]
        for lbl in [b for b in bundles if b not in had_bundles]:
            dict.__delitem__(bundles, lbl)
        if any(str(e) == str(seen) for seen in errors):  # (the error of a target it depends on, said already)
            from neuronbuild.loading.target_graph import locate

            e = UserInputError(f"{label} is not built: a target it depends on failed analysis (above)",
                               locate(ctx.graph, ctx.target(label)))
        errors.append(e)
        return _DROPPED


def action_digraph(actions: Mapping[str, Action]) -> nx.DiGraph:
    """The producer -> consumer graph of `actions` (in their order; a dependency never registered is a node too)."""
    g = nx.DiGraph()
    add_node, add_edge = g.add_node, g.add_edge
    for fp, a in actions.items():
        add_node(fp)
        for dep in a.deps:
            add_edge(dep, fp)
    return g
