"""Turns a TargetGraph into an ActionGraph by asking each requested target's rule kind (neuronbuild.plugins) for its
analysis: kinds return providers and register actions here; one trace per (model, graph, bucket) is shared by all.

With an `AnalysisMemo` (kept by the build server between commands) each target's analysis is memoised: its provider
and what it did, in order (providers it asked for, actions it added, compile targets and bundles it registered), keyed
by exactly what it read: its Target value, the files it digested (re-checked by stat-keyed digest), the memoised
analyses of the targets it asked for (recursively), and the plan-wide environment (settings and the versions every
toolchain it used reports now). A memoised target is replayed, so the plan is the one a fresh analysis makes."""

from __future__ import annotations

import json
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import networkx as nx

from neuronbuild import FORMAT_VERSION, digests, plugins
from neuronbuild.analysis.actions import TRACE, TRACE_OUTPUT, TRACE_WEIGHTS, Action, Bucket, make_action
from neuronbuild.analysis.plan_settings import PlanSettings
from neuronbuild.analysis.providers import BundleInfo, CompileTarget, ModelInfo
from neuronbuild.loading.labels import Label
from neuronbuild.loading.target_graph import TargetGraph
from neuronbuild.loading.targets import Target

__all__ = ["ActionGraph", "AnalysisContext", "AnalysisMemo", "CompileTarget", "plan"]

# Kinds whose analysis reads the machine (cpu `isa = "native"` resolves to this host's level): never memoised, their
# providers are computed afresh by every plan and compared with what memoised dependants saw.
VOLATILE_KINDS = frozenset({"neuron_target"})


@dataclass(frozen=True)
class ActionGraph:
    """Every action needed for the requested targets; edges run from producer to consumer."""

    actions: Mapping[str, Action] = field(hash=False)
    graph: nx.DiGraph = field(hash=False, compare=False)
    compiles: tuple[CompileTarget, ...] = ()
    bundles: Mapping[Label, BundleInfo] = field(default_factory=dict, hash=False, compare=False)

    def topological(self) -> list[Action]:
        return list(self.topological_seq())

    def topological_seq(self) -> tuple[Action, ...]:
        """topological() as the graph keeps it (no copy)."""
        order = self.__dict__.get("_order")  # computed once per graph (frozen: kept in __dict__ directly)
        if order is None:
            prev = self.__dict__.pop("_prev", None)  # (the build server: the previous plan's actions and order)
            if prev is not None:
                order = self._patched(*prev)
                if order is not None:
                    self.__dict__["_patched_from"] = prev[0]
            if order is None:
                order = self._topological()
            self.__dict__["_order"] = order
        return order  # type: ignore[no-any-return]

    def order_fingerprints(self) -> list[str]:
        """The fingerprints of topological(), in its order."""
        fps = self.__dict__.get("_order_fps")
        if fps is None:
            fps = self.__dict__["_order_fps"] = list(map(_FINGERPRINT, self.topological()))
        return fps  # type: ignore[no-any-return]

    def _patched(self, old_actions: Mapping[str, Action], old_order: tuple[Action, ...],
                 old_fps: list[str], old_inserted: list[int] | None = None) -> tuple[Action, ...] | None:
        """The order `_topological` gives, patched from the order of a previous graph `old_actions` (the build
        server's previous plan) when only a few actions were added or removed; None when it cannot be (then the full
        order is made). A fingerprint is the digest of a record holding every input of the action, its dependencies'
        fingerprints included, so an action kept by fingerprint has the same dependencies: the kept actions U are
        closed under dependencies in both graphs, and the smallest-first order restricted to such a set is that set's
        own smallest-first order, i.e. the previous order filtered to U. The added actions D are merged into it as
        Kahn's algorithm takes them: whenever the smallest ready D is smaller than U's next one (which is always
        ready), D goes first. Sets `_diff` = (added, removed) for incremental.needed_actions. The kept actions in
        the order are the previous graph's objects (the same fingerprint: the same action). `old_inserted`: where
        the previous order placed the actions its own patch added (an edit loop removes what the last edit added:
        then the removed ones are found there, not by a pass over the previous order)."""
        import heapq
        from bisect import bisect_right
        from itertools import compress

        actions = self.actions
        pred, succ = self.graph._pred, self.graph._succ
        if len(pred) != len(actions):  # nodes that are not actions (a dependency never registered): full order
            return None
        diff = self.__dict__.get("_graph_diff")  # (the graph patched from the same previous plan: its diff)
        if diff is not None and diff[0] is old_actions:
            added, removed = diff[1], diff[2]
        else:
            added = actions.keys() - old_actions.keys()
            removed = old_actions.keys() - actions.keys()
        if len(added) + len(removed) > max(64, len(actions) // 8):
            return None
        waiting: dict[str, int] = {}
        rel: set[str] = set()  # kept actions some added one waits for
        for d in added:
            p = pred[d]
            waiting[d] = len(p)
            rel.update(x for x in p if x not in added)
            if any(s not in added for s in succ[d]):  # a kept action reading an added one: not content-addressed
                return None
            if any(x not in added and actions[x] is not old_actions[x] and actions[x].deps != old_actions[x].deps
                   for x in p):
                return None
        heap = [d for d, k in waiting.items() if k == 0]
        heapq.heapify(heap)
        keep: list[bool] | None = None
        if removed:
            at = [q for q in old_inserted or () if old_fps[q] in removed]
            if len(at) == len(removed):  # (each removed action once in the order: these are all its places)
                keep = [True] * len(old_fps)
                for q in at:
                    keep[q] = False
            else:
                keep = list(map(operator.not_, map(removed.__contains__, old_fps)))  # (one lookup pass for both)
            ufps = list(compress(old_fps, keep))
            useq = list(compress(old_order, keep))
        else:
            ufps, useq = list(old_fps), list(old_order)
        inserted: list[int] = []  # where each added action went in the new order
        rel_at = [k for k, fp in enumerate(ufps) if fp in rel] if rel else []
        bmax = [max(ufps[k:k + _BLOCK]) for k in range(0, len(ufps), _BLOCK)]
        pop, push = heapq.heappop, heapq.heappush
        out: list[Action] = []
        fps: list[str] = []
        i, n, r = 0, len(ufps), 0

        def release(fp: str) -> None:  # (an added action's consumers are added ones; a kept one's may be either)
            for s in succ[fp]:
                k = waiting.get(s)
                if k is not None:
                    waiting[s] = k - 1
                    if k == 1:
                        push(heap, s)

        def take(j: int) -> None:  # the kept actions up to j (excluded)
            nonlocal i, r
            out.extend(useq[i:j])
            fps.extend(ufps[i:j])
            i = j
            while r < len(rel_at) and rel_at[r] < i:
                r += 1

        while i < n or heap:
            if heap:
                h = heap[0]
                stop = rel_at[r] if r < len(rel_at) else n  # (the next kept action an added one waits for)
                j = i
                while j < stop and ufps[j] < h:
                    if j % _BLOCK == 0 and j + _BLOCK <= stop and bmax[j // _BLOCK] < h:
                        j += _BLOCK  # (a whole block below h)
                    else:
                        j += 1
                take(j)
                if j < n and ufps[j] < h:  # a kept action some added one waits for, smaller than h: it goes first
                    take(j + 1)
                    release(ufps[j])
                else:
                    d = pop(heap)
                    inserted.append(len(fps))
                    out.append(actions[d])
                    fps.append(d)
                    release(d)
            else:  # nothing added is ready: the kept order up to (and with) the next kept action an added one waits for
                if r == len(rel_at):
                    take(n)
                else:
                    j = rel_at[r]
                    take(j + 1)
                    release(ufps[j])
        if len(out) != len(actions):  # an added action never ready: a cycle (the full order raises)
            return None
        self.__dict__["_diff"] = (added, removed)
        self.__dict__["_order_fps"] = fps
        # how the order was patched, for order_deps(): the kept actions' mask over the previous order (None: all
        # kept), where the added actions went, and the new places of the kept actions added ones read
        adj = [q - j for j, q in enumerate(inserted)]  # (the kept actions' index before which each insertion sits)
        rel_new = {ufps[k]: k + bisect_right(adj, k) for k in rel_at}
        self.__dict__["_splice"] = (old_fps, keep, inserted, rel_new)
        return tuple(out)

    def order_deps(self) -> tuple[list[int], list[tuple[int, ...]]]:
        """For each action of topological(), in its order, where its dependency is in that order (1-based; 0: none;
        ~k: several, at the places many[k]), and `many`: what the wall-time schedule reads instead of the graph
        (estimate.wall_time_at). Made once per graph; in the build server, patched from the previous plan's as the
        order was (`_patched`): the kept actions' places move by how many actions were removed and added before
        them (a kept action's dependencies are kept), the added actions' are looked up."""
        known = self.__dict__.get("_order_deps")
        if known is None:
            prev = self.__dict__.pop("_prev_deps", None)
            splice = self.__dict__.get("_splice")
            fps = self.order_fingerprints()
            if prev is not None and splice is not None and prev[0] is splice[0]:
                known = _spliced_deps(prev[1], prev[2], splice, fps, self.graph._pred)
            if known is None:
                known = _order_deps(fps, self.graph._pred)
            self.__dict__["_order_deps"] = known
        return known  # type: ignore[no-any-return]

    def _topological(self) -> tuple[Action, ...]:
        """Kahn's algorithm taking the smallest ready fingerprint first: networkx's lexicographical_topological_sort
        order, at a fraction of its cost (computed once per graph)."""
        import heapq

        g = self.graph
        pred, succ, actions = g._pred, g._succ, self.actions
        ready = [n for n, p in pred.items() if not p]
        waiting = {n: len(p) for n, p in pred.items() if len(p) > 1}  # (one-input actions are ready once it is)
        heapq.heapify(ready)
        pop, push = heapq.heappop, heapq.heappush
        fps: list[str] = []
        take = fps.append
        while ready:
            n = pop(ready)
            take(n)
            for s in succ[n]:
                k = waiting.get(s)
                if k is None:
                    push(ready, s)
                elif k > 1:
                    waiting[s] = k - 1
                else:
                    del waiting[s]
                    push(ready, s)
        if len(fps) != len(pred):
            raise nx.NetworkXUnfeasible("the action graph has a cycle")
        self.__dict__["_order_fps"] = fps  # (order_fingerprints(): the order's fingerprints, made here anyway)
        return tuple(map(actions.__getitem__, fps))

    def trace_of(self, fp: str) -> Action:
        """Provenance: the trace action an action's outputs derive from (itself for a trace)."""
        a = self.actions[fp]
        while a.kind != TRACE:
            a = self.actions[a.deps[0]]
        return a

    def closure(self, fp: str) -> set[str]:
        """The action and every action it depends on (nx.ancestors' set and `fp`, over the adjacency dict: a build
        asks this of each of its 1,000s of compiles, where networkx's dispatch costs more than the walk)."""
        pred = self.graph._pred
        if fp not in pred:
            raise nx.NetworkXError(f"The node {fp} is not in the digraph.")
        out = {fp}
        stack = [fp]
        while stack:
            for d in pred[stack.pop()]:
                if d not in out:
                    out.add(d)
                    stack.append(d)
        return out

    @property
    def toolchains(self) -> tuple[str, ...]:
        """Names of the toolchains the compile targets use, in first-use order."""
        return tuple(dict.fromkeys(ct.toolchain for ct in self.compiles))


@dataclass(frozen=True)
class _Memo:
    """One target's memoised analysis: what it read and what it did, in order."""

    target: Target
    provider: Any
    events: tuple[tuple[Any, ...], ...]  # ("dep", label, provider) | ("add", action) | ("compile", ct) | ("bundle", ...)
    files: tuple[tuple[str, str], ...]  # (path, digest) of every file its own analysis digested
    deps: tuple[tuple[Label, Any], ...] = ()  # the ("dep", label, provider) events, in order (checked per plan)


class AnalysisMemo:
    """Per-target analyses kept between plans of one workspace with one set of settings (see the module docstring).
    `env` is what every plan must see unchanged to reuse any of it: the settings and, per (toolchain, platform) the
    memoised analyses used, the versions the toolchain reports now (a C++ compiler or neuronx-cc replaced between
    commands drops the memo)."""

    def __init__(self) -> None:
        self.entries: dict[Label, _Memo] = {}
        self.env: dict[tuple[str, str], dict[str, str]] = {}
        self.settings_key: str | None = None
        self.trace_toolchain: dict[str, str] = {}
        self.reused = self.analysed = 0
        self.last: ActionGraph | None = None  # the previous plan's graph (its order is patched: ActionGraph._patched)
        self.state: _PlanState | None = None  # the previous plan per requested root (plan(): its segments reused)

    def begin(self, settings: PlanSettings) -> None:
        key = settings_key(settings)
        trace_tc = settings.trace_toolchain()  # (what every trace record holds: Python and torch versions)
        if key != self.settings_key or trace_tc != self.trace_toolchain or \
                any(_versions(tc, platform, settings) != v for (tc, platform), v in self.env.items()):
            self.entries.clear()
            self.env.clear()
            self.state = None
        self.settings_key, self.trace_toolchain = key, trace_tc
        self.reused = self.analysed = 0


def settings_key(settings: PlanSettings) -> str:
    cc = settings.neuronx_cc
    return json.dumps([list(settings.action_env), cc.spec() if cc is not None else None,
                       sorted(settings.toolchain_overrides.items())], default=str)


def _versions(tc: str, platform: str, settings: PlanSettings) -> dict[str, str] | None:
    try:
        return dict(plugins.toolchain(tc).versions(platform, settings))
    except Exception:  # noqa: BLE001 - a toolchain gone or failing: the memo is dropped, the plan reports the error
        return None


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
        self.memo = memo
        self._frames: list[_Recorder] = []
        self._valid: dict[Label, bool] = {}
        self._traces: dict[tuple[int, Bucket], tuple[ModelInfo, Action]] = {}

    def target(self, label: Label) -> Target:
        return self.graph.targets[label]

    def _event(self, ev: tuple[Any, ...]) -> None:
        if self._frames:
            self._frames[-1].events.append(ev)

    def provider(self, label: Label) -> Any:
        """The provider of `label` (its kind's analysis runs once per plan)."""
        p = self._providers.get(label, _MISSING)
        if p is _MISSING:
            memo = self.memo
            m = memo.entries.get(label) if memo is not None else None
            if m is not None and self._is_valid(label):
                p = self._replay(m)
                assert memo is not None
                memo.reused += 1
            else:
                p = self._analyse(label)
            self._providers[label] = p
        if self._frames:  # (_event inlined: 150,000 calls in a replay, where nothing records)
            self._frames[-1].events.append(("dep", label, p))
        return p

    def _analyse(self, label: Label) -> Any:
        t = self.graph.targets[label]
        if self.memo is None:
            return plugins.rule(t.kind).analyze(self, t)
        frame = _Recorder()
        self._frames.append(frame)
        try:
            with digests.recording() as files:
                p = plugins.rule(t.kind).analyze(self, t)
        finally:
            self._frames.pop()
        self.memo.analysed += 1
        if t.kind not in VOLATILE_KINDS:
            self.memo.entries[label] = _Memo(t, p, tuple(frame.events), tuple(files),
                                             tuple((ev[1], ev[2]) for ev in frame.events if ev[0] == "dep"))
            for ev in frame.events:
                if ev[0] == "compile":
                    key = (ev[1].toolchain, ev[1].platform)
                    if key not in self.memo.env:
                        v = _versions(*key, self.settings)
                        if v is not None:
                            self.memo.env[key] = v
        self._valid[label] = False  # analysed in this plan: dependants memoised before it are stale
        return p

    def _is_valid(self, label: Label) -> bool:
        """Whether the memoised analysis of `label` is what a fresh analysis would give now (iterative: chains of
        compiler_options deps may be long)."""
        known = self._valid
        if label in known:
            return known[label]
        assert self.memo is not None
        entries = self.memo.entries
        targets = self.graph.targets
        # Depth-first over memoised dependencies; a target is valid when it, its files and all its deps are.
        stack: list[tuple[Label, list[Label]]] = []

        def open_(lbl: Label) -> bool | None:
            """None: pending on deps (pushed); else the verdict."""
            m = entries.get(lbl)
            t = targets.get(lbl)
            if m is None or t is None or not (m.target is t or (m.target == t and m.target.attrs == t.attrs)):
                return False  # (Target equality leaves attrs out: compared here)
            for path, digest in m.files:
                try:
                    if digests.digest_file(path) != digest:
                        return False
                except OSError:
                    return False
            deps: list[Label] = []
            for dep, seen in m.deps:
                dt = targets.get(dep)
                if dt is None:
                    return False
                if dt.kind in VOLATILE_KINDS:
                    if self.provider_fresh(dep) != seen:
                        return False
                elif known.get(dep) is False:
                    return False
                elif dep not in known:
                    deps.append(dep)
            stack.append((lbl, deps))
            return None

        verdict = open_(label)
        if verdict is not None:
            known[label] = verdict
            return verdict
        while stack:
            lbl, deps = stack[-1]
            while deps and deps[-1] in known:
                if not known[deps.pop()]:
                    break
            else:
                if not deps:
                    known[lbl] = True
                    stack.pop()
                    continue
                dep = deps[-1]
                if any(d == dep for d, _ in stack):  # a cycle: loading rejects these; be safe
                    known[dep] = False
                    continue
                v = open_(dep)
                if v is not None:
                    known[dep] = v
                continue
            # a dependency turned out invalid: so is everything on the stack that waits on it
            for s_lbl, _ in stack:
                known[s_lbl] = False
            stack.clear()
        return known[label]

    def provider_fresh(self, label: Label) -> Any:
        """The provider of a volatile target (computed once per plan, never memoised)."""
        if label not in self._providers:
            t = self.graph.targets[label]
            self._providers[label] = plugins.rule(t.kind).analyze(self, t)
        return self._providers[label]

    def _replay(self, m: _Memo) -> Any:
        """Redo what the memoised analysis did, in its order (its own events only; dependencies replay theirs)."""
        frames, self._frames = self._frames, []  # nothing replayed is an event of the analysis asking for it
        actions = self.actions
        try:
            for ev in m.events:
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
        return m.provider

    def add(self, action: Action) -> Action:
        """Register an action (once per fingerprint) with edges from the actions it reads outputs of."""
        if self._frames:
            self._frames[-1].events.append(("add", action))
        known = self.actions.get(action.fingerprint)
        if known is None:
            known = self.actions[action.fingerprint] = action
        return known

    def trace(self, model: ModelInfo, bucket: Bucket) -> Action:
        """The trace of `model` at `bucket`: one per (model, bucket), shared by every compile that needs it."""
        key = (id(model), bucket)
        known = self._traces.get(key)
        if known is not None and known[0] is model:  # (the model info is held, so its id is not reused)
            return self.add(known[1])
        action = self._make_trace(model, bucket)
        self._traces[key] = (model, action)
        return action

    def _make_trace(self, model: ModelInfo, bucket: Bucket) -> Action:
        rec = model.record
        record = {
            "format": FORMAT_VERSION,
            "action": TRACE,
            "model": rec,
            "bucket": bucket.as_dict(),
            # + the third-party distributions the model imports (what-if versions applied like torch's)
            "toolchain": self.settings.trace_toolchain() | self.settings.override(dict(rec.get("imports") or {})),
            "program": "shapes-1",  # program.pt2 without weight values + the streamed constants.safetensors
        } | self.common
        spec = {"model": {k: rec[k] for k in ("package", "entry", "config", "seed")}
                | {"srcs": list(rec["srcs"]), "weights": rec["weights"], "weights_prefix": rec.get("weights_prefix", ""),
                   "libraries": sorted(rec.get("deps") or {})},
                "inputs": rec["inputs"], "outputs": rec.get("outputs") or [], "bucket": bucket.as_dict()}
        return self.add(make_action(TRACE, model.label, bucket, record, spec, files=model.files,
                                    outputs=(TRACE_OUTPUT, TRACE_WEIGHTS)))


_MISSING = object()
_FINGERPRINT = operator.attrgetter("fingerprint")
_BLOCK = 256  # the kept order is scanned for the first fingerprint above the smallest ready added one by blocks


def _order_deps(fps: list[str], pred: Mapping[str, Mapping[str, Any]]) -> tuple[list[int], list[tuple[int, ...]]]:
    """ActionGraph.order_deps() made from the graph: C-level passes (a place per fingerprint, each action's first
    dependency), a loop over the actions with several."""
    from itertools import compress, repeat

    pos: dict[str | None, int] = dict(zip(fps, range(1, len(fps) + 1), strict=True))
    preds = list(map(pred.__getitem__, fps))
    dep: list[int] = list(map(pos.get, map(next, map(iter, preds), repeat(None)), repeat(0)))  # type: ignore[arg-type]
    many: list[tuple[int, ...]] = []
    for i in compress(range(len(fps)), map(operator.lt, repeat(1), map(len, preds))):
        dep[i] = ~len(many)
        many.append(tuple(map(pos.__getitem__, preds[i])))
    return dep, many


def _spliced_deps(dep: list[int], many: list[tuple[int, ...]], splice: tuple[Any, ...], fps: list[str],
                  pred: Mapping[str, Mapping[str, Any]]) -> tuple[list[int], list[tuple[int, ...]]] | None:
    """order_deps() of an order patched from the previous one (`splice`, see ActionGraph._patched) from the previous
    order's `dep` and `many`; None when an added action reads an action whose place is not known (then they are
    made from the graph)."""
    from itertools import compress

    old_fps, keep, inserted, rel_new = splice
    n_old = len(old_fps)
    if len(dep) != n_old or len(many) > n_old // 4 + 1024:  # (too many entries of removed actions: made afresh)
        return None
    if keep is None and not inserted:  # (the same order: the same places; the lists are never changed)
        return (dep, many) if len(fps) == n_old else None
    removed = [] if keep is None else list(compress(range(n_old), map(operator.not_, keep)))
    adj = [q - j for j, q in enumerate(inserted)]
    # shift[p]: how far the action at place p (1-based) of the previous order moved (kept ones only; 0 for removed
    # ones and for "none"), then zeros that the markers ~k of actions with several dependencies index
    shift = [0]
    k = r = c = ri = ci = 0
    while k < n_old:
        if ri < len(removed) and removed[ri] == k:
            shift.append(0)
            ri += 1
            r += 1
            k += 1
            continue
        while ci < len(adj) and adj[ci] <= k - r:
            ci += 1
            c += 1
        end = min(removed[ri] if ri < len(removed) else n_old, adj[ci] + r if ci < len(adj) else n_old)
        shift.extend([c - r] * (end - k))
        k = end
    shift.extend([0] * len(many))
    kept = dep if keep is None else list(compress(dep, keep))
    kept = list(map(operator.add, kept, map(shift.__getitem__, kept)))
    at = shift.__getitem__
    many = [tuple(map(operator.add, t, map(at, t))) for t in many]  # (a removed action's: unused)
    place = dict(rel_new)
    for q in inserted:
        place[fps[q]] = q
    out: list[int] = []
    f = 0
    for j, q in enumerate(inserted):
        out.extend(kept[f:adj[j]])
        f = adj[j]
        ds = pred[fps[q]]
        if not ds:
            out.append(0)
            continue
        try:
            ps = tuple(place[d] + 1 for d in ds)
        except KeyError:
            return None
        if len(ps) == 1:
            out.append(ps[0])
        else:
            out.append(~len(many))
            many.append(ps)
    out.extend(kept[f:])
    if len(out) != len(fps):
        return None
    return out, many


def plan(graph: TargetGraph, settings: PlanSettings | None = None, memo: AnalysisMemo | None = None) -> ActionGraph:
    """Analyse every requested target whose kind plans actions (compiles; bundles and the compiles they ship).

    `settings` adds declared --action-env values (to every record, when any), toolchain configuration (e.g. the
    neuronx-cc version) and toolchain overrides (what-if plans for explain and upgrade-impact).

    With a memo (the build server) that holds the previous plan (`_PlanState`), what
    each requested root's analysis added to the plan is reused as a whole (`_Segment`) when nothing it read changed
    (see `_invalid_labels`) and the targets it reached were provided before it exactly as then; the other roots are
    analysed (or replayed target by target) as without it. The result is the plan a fresh analysis makes."""
    settings = settings or PlanSettings()
    if memo is not None:
        memo.begin(settings)
    ctx = AnalysisContext(graph, settings, memo)
    state = memo.state if memo is not None else None
    invalid: set[Label] | None = None
    roots: list[Label] | None = None
    if state is not None and memo is not None:
        memo.state = None  # (rebuilt below; an exception leaves none)
        if state.raw is not None:
            state = _materialised(state, memo)
        if state is not None and state.root == graph.root:
            invalid, same_kinds = _invalid_labels(ctx, state)
            if same_kinds and state.requested == graph.requested:  # (the same requested targets and kinds: roots)
                roots = state.roots
    if roots is None:
        roots = [lbl for lbl in graph.requested if plugins.rule(graph.targets[lbl].kind).plans_actions]
    if memo is None:
        for lbl in roots:
            ctx.provider(lbl)
    else:
        _plan_segments(ctx, memo, roots, state if invalid is not None else None, invalid or set())
    actions = ctx.actions
    g = None
    last = memo.last if memo is not None else None
    if last is not None:
        hint = ctx.__dict__.pop("_diff_hint", None)
        g = _patched_digraph(actions, last.actions, last.graph,
                             hint[1:] if hint is not None and hint[0] is last.actions else None)
    ag = ActionGraph(actions, g if g is not None else action_digraph(actions), tuple(ctx.compiles), dict(ctx.bundles))
    if g is not None and last is not None:
        ag.__dict__["_graph_diff"] = (last.actions, *g.__dict__.pop("_nb_diff"))
    if memo is not None:
        memo.last = ag
        order = last.__dict__.get("_order") if last is not None else None
        if last is not None and order is not None:  # (only the actions and order: no chain of graphs is kept)
            splice = last.__dict__.get("_splice")
            ag.__dict__["_prev"] = (last.actions, order, last.order_fingerprints(),
                                    splice[2] if splice is not None else None)
            deps = last.__dict__.get("_order_deps")
            if deps is not None:  # (the previous order's, with that order: order_deps() patches them)
                ag.__dict__["_prev_deps"] = (last.order_fingerprints(), *deps)
    return ag


_PROVIDERS = operator.attrgetter("providers")
_ACTIONS = operator.attrgetter("actions")
_COMPILES = operator.attrgetter("compiles")
_FIRST = operator.attrgetter("first")


class _Segment:
    """What one requested root's top-level analysis added to a plan: the targets it provided first (in order; volatile
    ones left out), the already-provided targets it asked for, and the actions, compile targets and bundles it added
    first (in order)."""

    __slots__ = ("first", "touched", "providers", "actions", "compiles", "bundles")

    def __init__(self, first: tuple[Label, ...], touched: frozenset[Label] | None, providers: dict[Label, Any],
                 actions: dict[str, Action], compiles: tuple[CompileTarget, ...],
                 bundles: tuple[tuple[Label, BundleInfo], ...]) -> None:
        self.first, self.touched, self.providers = first, touched, providers
        self.actions, self.compiles, self.bundles = actions, compiles, bundles

    def touched_in(self, entries: Mapping[Label, _Memo], targets: Mapping[Label, Target]) -> frozenset[Label]:
        """`touched`, made when first asked (a segment made by _materialised): from the memoised analyses of the
        targets it provided first, which are those it was made from as long as it is in the plan state (a target
        analysed again makes its segment redone, not reused), and the kinds of the targets they asked for (a kind
        changed with its package: its dependants are analysed again)."""
        t = self.touched
        if t is None:
            t = self.touched = frozenset(
                d for lbl in self.first for d, _p in entries[lbl].deps
                if (dt := targets.get(d)) is None or dt.kind not in VOLATILE_KINDS).difference(self.first)
        return t


@dataclass
class _PlanState:
    """The build server's previous plan of one memo, per requested root (plan() reuses its segments)."""

    root: Any
    requested: tuple[Label, ...]
    packages: Mapping[str, Any]  # the previous graph's packages (an unchanged package is the same object)
    roots: list[Label]  # the requested targets whose kinds plan actions, in order
    segments: list[_Segment | None]  # per root: its segment (None: provided already when the plan reached it)
    files: dict[Label, tuple[tuple[str, str], ...]]  # (path, digest) of the files each provided target's analysis read
    volatile: dict[Label, Any]  # the fresh provider of every volatile target provided
    rdeps: dict[Label, set[Label]]  # target -> the provided targets whose analysis asked for its provider
    owner: dict[Label, _Segment]  # target -> the segment that provided it first
    # a first plan records only where each root's segment starts (positions in the plan's providers, actions,
    # compile targets and bundles, None for a root provided already) and keeps those containers; the segments and
    # the maps above are made from them when the next plan needs them (_materialised)
    raw: tuple[Any, ...] | None = None
    actions: Mapping[str, Action] | None = None  # the plan's actions (its ActionGraph's)


def _invalid_labels(ctx: AnalysisContext, state: _PlanState) -> tuple[set[Label], bool]:
    """Every target of the previous plan whose memoised analysis may not be what a fresh analysis gives now: those of
    the packages that are not the same objects (edited, added, removed), those that read a file whose digest
    changed, those that asked for a volatile target whose fresh provider changed (each volatile target's fresh
    provider is computed here, as `_is_valid` would), and every target that asked for one of these, transitively.
    A superset is safe: the roots reaching one are analysed as without the plan state. Also says whether every
    package declares the same targets of the same kinds as then."""
    graph = ctx.graph
    changed: set[Label] = set()
    old = state.packages
    same_kinds = len(old) == len(graph.packages)
    for name, pkg in graph.packages.items():
        o = old.get(name)
        if o is not pkg:
            changed.update(t.label for t in pkg.targets)
            if o is not None:
                changed.update(t.label for t in o.targets)
                same_kinds = same_kinds and [(t.label, t.kind) for t in o.targets] == \
                    [(t.label, t.kind) for t in pkg.targets]
            else:
                same_kinds = False
    if not same_kinds:
        for name in old.keys() - graph.packages.keys():
            changed.update(t.label for t in old[name].targets)
    for lbl, files in state.files.items():
        try:
            if any(digests.digest_file(path) != digest for path, digest in files):
                changed.add(lbl)
        except OSError:
            changed.add(lbl)
    for lbl, seen in state.volatile.items():
        t = graph.targets.get(lbl)
        if t is None or t.kind not in VOLATILE_KINDS or lbl in changed:
            changed.add(lbl)
            continue
        try:
            fresh = ctx.provider_fresh(lbl)
        except Exception:  # noqa: BLE001 - its dependants are analysed again and report it as a fresh plan does
            changed.add(lbl)
            continue
        if fresh != seen:
            changed.add(lbl)
    invalid = set(changed)
    stack = list(changed)
    rdeps = state.rdeps
    while stack:
        for d in rdeps.get(stack.pop(), ()):
            if d not in invalid:
                invalid.add(d)
                stack.append(d)
    return invalid, same_kinds


def _materialised(state: _PlanState, memo: AnalysisMemo) -> _PlanState | None:
    """The segments and maps of a plan state recorded by a first plan (_PlanState.raw), or None when a provided
    target's memoised analysis is not the one that plan used (then the next plan runs without the state)."""
    assert state.raw is not None
    starts, ends, targets, providers, actions, compiles, bundles = state.raw
    entries = memo.entries
    p_items, a_items, b_items = list(providers.items()), list(actions.items()), list(bundles.items())
    bounds = [b for b in starts if b is not None]
    bounds.append(ends)
    segments: list[_Segment | None] = []
    owner: dict[Label, _Segment] = {}
    files: dict[Label, tuple[tuple[str, str], ...]] = {}
    rdeps: dict[Label, set[Label]] = {}
    volatile: dict[Label, Any] = {}
    vol = {lbl for lbl, t in targets.items() if t.kind in VOLATILE_KINDS}  # (a few: no lookup per provided target)
    k = 0
    for b in starts:
        if b is None:
            segments.append(None)
            continue
        e = bounds[k + 1]
        k += 1
        provided = []
        memos = []
        for lbl, v in p_items[b[0]:e[0]]:
            if lbl in vol:
                volatile[lbl] = v
                continue
            m = entries.get(lbl)
            if m is None or m.provider is not v:
                return None
            provided.append((lbl, v))
            memos.append(m)
        first = tuple(lbl for lbl, _v in provided)
        seg = _Segment(first, None, dict(provided), dict(a_items[b[1]:e[1]]), tuple(compiles[b[2]:e[2]]),
                       tuple(b_items[b[3]:e[3]]))  # (what it asked for: made when first needed, touched_in)
        segments.append(seg)
        for lbl, m in zip(first, memos, strict=True):
            owner[lbl] = seg
            if m.files:
                files[lbl] = m.files
            for d, _p in m.deps:
                s = rdeps.get(d)
                if s is None:
                    rdeps[d] = {lbl}
                else:
                    s.add(lbl)
    return _PlanState(state.root, state.requested, state.packages, state.roots, segments, files, volatile, rdeps,
                      owner, actions=actions)


def _tail(d: dict[Any, Any], n: int) -> list[tuple[Any, Any]]:
    """The last n items of dict `d`, in insertion order (O(n): reversed dict views)."""
    from itertools import islice

    out = list(islice(reversed(d.items()), n))
    out.reverse()
    return out


def _plan_segments(ctx: AnalysisContext, memo: AnalysisMemo, roots: list[Label], state: _PlanState | None,
                   invalid: set[Label]) -> None:
    """plan()'s loop over the requested roots with a memo: reuse each root's segment of the previous plan where
    the analysis would redo exactly it, else provide the root (replayed or analysed per target) and record its
    segment; then keep the new plan state in the memo."""
    providers, actions, compiles, bundles = ctx._providers, ctx.actions, ctx.compiles, ctx.bundles
    targets = ctx.graph.targets
    entries = memo.entries
    if state is None:  # (a first plan: only where each segment starts, see _PlanState.raw)
        starts: list[tuple[int, int, int, int] | None] = []
        for lbl in roots:
            if lbl in providers:
                starts.append(None)
                continue
            starts.append((len(providers), len(actions), len(compiles), len(bundles)))
            ctx.provider(lbl)
        ends = (len(providers), len(actions), len(compiles), len(bundles))
        memo.state = _PlanState(ctx.graph.root, ctx.graph.requested, ctx.graph.packages, roots, [], {}, {}, {}, {},
                                (starts, ends, targets, providers, actions, compiles, bundles), actions)
        return
    from collections import deque
    from itertools import compress, count, repeat

    same_roots = state.roots is roots
    if same_roots:
        old: list[_Segment | None] = state.segments
    else:  # (other roots: each root's segment found by its label)
        by_label = dict(zip(state.roots, state.segments, strict=True))
        old = [by_label.get(lbl) for lbl in roots]
    # the old segments holding an invalid target (by the target each one provided first)
    redo = {id(seg) for seg in map(state.owner.get, invalid) if seg is not None}
    # Which targets are provided differs from the previous plan at the same root only for these (the reused
    # segments provide the same; so a segment whose targets are not among them finds them as it found them then;
    # a root with no segment then was provided already, one with a segment was not)
    diverged: set[Label] = set()
    segments: list[_Segment | None] = []
    redone: list[_Segment] = []
    dropped: list[_Segment] = []  # the previous plan's segments not reused
    volatile_seen: set[Label] = set(state.volatile)
    usable = True
    # Each reused segment's actions are added with one update: they are new to the plan unless an action some
    # re-analysed segment added first is among them (then the update replaced that object). The count tells:
    # every update adding only new fingerprints leaves len(actions) at `expected`; else the actions are made again
    # in order, the first of each fingerprint kept (as one by one)
    expected = len(actions)
    parts: list[Mapping[str, Action]] = [dict(actions)]  # what was added, in order (for _first_wins)
    # With the same roots and nothing diverged, every root up to the next one to redo is reused or was provided
    # already (no segment): such a run is appended as a whole, by C-level passes (what the loop below does per root)
    stops = list(compress(count(), map(redo.__contains__, map(id, old)))) if same_roots else []
    stop = 0
    i, n = 0, len(roots)
    while i < n:
        if same_roots and not diverged:
            while stop < len(stops) and stops[stop] < i:
                stop += 1
            end = stops[stop] if stop < len(stops) else n
            if end > i:
                run = old[i:end]
                live = list(filter(None, run))
                deque(map(providers.update, map(_PROVIDERS, live)), maxlen=0)
                deque(map(actions.update, map(_ACTIONS, live)), maxlen=0)
                expected += sum(map(len, map(_ACTIONS, live)))
                parts.extend(map(_ACTIONS, live))
                deque(map(list.extend, repeat(compiles), map(_COMPILES, live)), maxlen=0)
                for kept in live:
                    for k, v in kept.bundles:
                        dict.__setitem__(bundles, k, v)
                memo.reused += sum(map(len, map(_FIRST, live)))
                segments.extend(run)
                i = end
                continue
        lbl, seg = roots[i], old[i]
        i += 1
        if same_roots and not diverged:
            provided_now = seg is None
        else:
            provided_now = lbl in providers
        if provided_now:
            if seg is not None:
                diverged.symmetric_difference_update(seg.first)
                dropped.append(seg)
            segments.append(None)
            continue
        if seg is not None and id(seg) not in redo and (
                (same_roots and (not diverged or (diverged.isdisjoint(seg.first) and
                                                  diverged.isdisjoint(seg.touched_in(entries, targets)))))
                or (not same_roots and providers.keys().isdisjoint(seg.first) and
                    all(t in providers for t in seg.touched_in(entries, targets)))):
            providers.update(seg.providers)
            actions.update(seg.actions)
            expected += len(seg.actions)
            parts.append(seg.actions)
            if seg.compiles:
                list.extend(compiles, seg.compiles)
            for k, v in seg.bundles:
                dict.__setitem__(bundles, k, v)
            memo.reused += len(seg.first)
            segments.append(seg)
            continue
        if seg is not None:
            dropped.append(seg)
        if len(actions) != expected:  # (before an analysis: it asks for the first action of a fingerprint)
            _first_wins(actions, parts)
        n_p, n_a, n_c, n_b = len(providers), len(actions), len(compiles), len(bundles)
        ctx.provider(lbl)
        added_now = dict(_tail(actions, len(actions) - n_a))  # (an analysis adds only new fingerprints)
        parts.append(added_now)
        expected = len(actions)
        provided = []
        for k, v in _tail(providers, len(providers) - n_p):
            if targets[k].kind in VOLATILE_KINDS:
                volatile_seen.add(k)
            else:
                provided.append((k, v))
        first = tuple(k for k, _v in provided)
        if same_roots:
            diverged.symmetric_difference_update(first)
            if seg is not None:
                diverged.symmetric_difference_update(seg.first)
        if any(k not in entries or entries[k].provider is not v for k, v in provided):
            usable = False  # (an analysis memoised elsewhere, or not at all: no state is kept this time)
            segments.append(None)
            continue
        touched = frozenset(d for k in first for d, _p in entries[k].deps
                            if targets[d].kind not in VOLATILE_KINDS).difference(first)
        seg = _Segment(first, touched, dict(provided), added_now, tuple(compiles[n_c:]),
                       tuple(_tail(bundles, len(bundles) - n_b)))
        segments.append(seg)
        redone.append(seg)
    if len(actions) != expected:
        _first_wins(actions, parts)
    if same_roots:  # (else a root of the previous plan may be gone: its segment is in neither list)
        # every action of the previous plan came from one of its segments, each now reused or dropped, and every
        # action of this plan from a reused or redone one: what changed is among the dropped and redone ones'
        ctx.__dict__["_diff_hint"] = (state.actions, {fp for seg in redone for fp in seg.actions},
                                      {fp for seg in dropped for fp in seg.actions})
    if not usable:
        return
    volatile = {k: providers[k] for k in volatile_seen if k in providers}
    # (stale reverse dependencies and owners only widen the next invalidation)
    files, rdeps, owner = state.files, state.rdeps, state.owner
    if len(files) > len(entries) + 1024 or len(rdeps) > 2 * len(entries) + 1024 or \
            len(owner) > 2 * len(entries) + 1024:  # (too many stale ones: made again from this plan)
        redone = [seg for seg in segments if seg is not None]
        files, rdeps, owner = {}, {}, {}
    for seg in redone:
        for k in seg.first:
            owner[k] = seg
            m = entries[k]
            if m.files:
                files[k] = m.files
            else:
                files.pop(k, None)
            for d, _p in m.deps:
                s = rdeps.get(d)
                if s is None:
                    rdeps[d] = {k}
                else:
                    s.add(k)
    memo.state = _PlanState(ctx.graph.root, ctx.graph.requested, ctx.graph.packages, roots, segments, files,
                            volatile, rdeps, owner, actions=actions)


def _first_wins(actions: dict[str, Action], parts: list[Mapping[str, Action]]) -> None:
    """`actions` made again from what was added to it, in order, keeping the first action of each fingerprint (an
    update with a reused segment's actions replaced one that a re-analysed segment had added first)."""
    fresh: dict[str, Action] = {}
    for part in parts:
        for fp, a in part.items():
            if fp not in fresh:
                fresh[fp] = a
    actions.clear()
    actions.update(fresh)


def action_digraph(actions: Mapping[str, Action]) -> nx.DiGraph:
    """The producer -> consumer graph of `actions` (in their order): the graph `add_node(fp)` then `add_edge(dep, fp)`
    per action in order makes, built directly in networkx's adjacency dicts (a tenth of the cost at 160,000 actions)."""
    g = nx.DiGraph()
    node: dict[str, dict[str, Any]] = {}
    succ: dict[str, dict[str, dict[str, Any]]] = {}
    pred: dict[str, dict[str, dict[str, Any]]] = {}
    for fp, a in actions.items():
        if fp not in node:
            node[fp], succ[fp], pred[fp] = {}, {}, {}
        p = pred[fp]
        for dep in a.deps:
            if dep not in node:  # (a dependency registered after its consumer: add_edge adds it as a node)
                node[dep], succ[dep], pred[dep] = {}, {}, {}
            s = succ[dep]
            if fp not in s:
                s[fp] = p[dep] = {}
    g._node = node
    g._adj = succ  # (networkx's descriptor sets _succ too and resets its cached views)
    g._pred = pred
    return g


def _patched_digraph(actions: Mapping[str, Action], old_actions: Mapping[str, Action], old: nx.DiGraph,
                     hint: tuple[set[str], set[str]] | None = None) -> nx.DiGraph | None:
    """The graph action_digraph(actions) makes, made from the graph of a previous plan `old_actions` (the build
    server) when only a few actions were added or removed: the same nodes and edges, and every node's predecessors
    and successors in a fresh graph's order; the kept actions' adjacency dicts are shared with the old graph (a
    fingerprint fixes an action's dependencies) except where a consumer was added or removed. The nodes are the old
    graph's order without the removed ones, then the added ones (copying the old dicts costs a thirtieth of building
    them in the new actions' order; nothing reads the node order: orders come from the fingerprints and adjacency).
    `hint`: (candidates added, candidates removed) from the plan's segments (a superset of each). None when it
    cannot be (then the graph is built in full)."""
    old_pred, old_succ, old_node = old._pred, old._succ, old._node
    if len(old_pred) != len(old_actions):  # (nodes that are not actions)
        return None
    if hint is not None:
        added = {fp for fp in hint[0] if fp not in old_actions}
        removed = {fp for fp in hint[1] if fp not in actions}
    else:
        added = actions.keys() - old_actions.keys()
        removed = old_actions.keys() - actions.keys()
    if len(added) + len(removed) > max(64, len(actions) // 8):
        return None
    pred, succ, node = old_pred.copy(), old_succ.copy(), old_node.copy()
    for fp in removed:
        if any(c not in removed for c in old_succ[fp]):  # (a kept action reading a removed one: not content-addressed)
            return None
        del pred[fp], succ[fp], node[fp]
    changed: set[str] = set()
    for fp in added:
        node[fp], succ[fp], pred[fp] = {}, {}, {}
    for fp in added:
        p = pred[fp]
        for dep in actions[fp].deps:
            if dep not in pred:
                return None
            if dep not in p:
                p[dep] = {}
                changed.add(dep)
    for fp in removed:
        changed.update(dep for dep in old_actions[fp].deps if dep in pred)
    unsorted: list[tuple[str, list[str]]] = []
    for dep in changed:
        if dep in added:
            consumers = [c for c in added if dep in pred[c]]
        else:
            consumers = [c for c in old_succ[dep] if c not in removed]
            consumers.extend(c for c in added if dep in pred[c])
        if len(consumers) > 1:  # (a fresh graph lists consumers in the actions' order)
            if len(consumers) > 64:
                return None
            unsorted.append((dep, consumers))
        else:
            succ[dep] = {c: pred[c][dep] for c in consumers}
    if unsorted:  # (the places of these few consumers in the actions' order: one pass for all)
        from itertools import compress, count

        want = {c for _dep, consumers in unsorted for c in consumers}
        place = dict(zip(compress(actions, map(want.__contains__, actions)), count(), strict=False))
        for dep, consumers in unsorted:
            consumers.sort(key=place.__getitem__)
            succ[dep] = {c: pred[c][dep] for c in consumers}
    g = nx.DiGraph()
    g._node, g._adj, g._pred = node, succ, pred  # (see action_digraph)
    g.__dict__["_nb_diff"] = (added, removed)  # (taken by plan(): ActionGraph._patched uses it)
    return g
