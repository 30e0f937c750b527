"""What a rule kind's analysis sees (`AnalysisContext`): targets, settings, other targets' providers and where to add
actions, compile targets and bundles; the core's trace and weights actions (one trace per model, graph and bucket,
shared by all); and the replay of memoised nodes (analysis/analysis_nodes.py) the engine finds current."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from neuronbuild import FORMAT_VERSION, digests
from neuronbuild.analysis.analysis_nodes import (
    _GONE,
    AnalysisMemo,
    _Fresh,
    _Group,
    _Memo,
    _Segment,
    _versions,
    _volatile,
)
from neuronbuild.analysis.providers import BundleInfo, CompileTarget, ModelInfo
from neuronbuild.analysis.tensor_parallel import TP_OPS, builtin_digest, for_degree
from neuronbuild.engine import Node
from neuronbuild.loading.labels import Label
from neuronbuild.loading.target_graph import TargetGraph
from neuronbuild.loading.targets import Target
from neuronbuild.plugin_api import registry as plugins
from neuronbuild.plugin_api.actions import (
    CORE_STEPS,
    PROVIDER,
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
from neuronbuild.plugin_api.toolchain import CompileRequest, PlanSettings, Toolchain


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


class PlannedBucket(list):  # type: ignore[type-arg]
    """AnalysisContext.plan_bucket's answer: the bucket's registered actions (a list, the primary one last) and what
    the primary action ships for this request (`ships`)."""

    def __init__(self, actions: list[Action], ships: tuple[DepInput, ...]) -> None:
        super().__init__(actions)
        self.ships = ships


class AnalysisContext:
    """What a rule kind's analysis sees: targets, settings, other targets' providers, and where to add actions."""

    def __init__(self, graph: TargetGraph, settings: PlanSettings, memo: AnalysisMemo) -> None:
        self.graph = graph
        self.settings = settings
        self.common: dict[str, Any] = {"env": settings.env_record()} if settings.action_env else {}
        self.actions: dict[str, Action] = {}  # (the graph's edges are made once at the end: action_digraph)
        self.compiles: list[CompileTarget] = _Compiles(self)
        self.bundles: dict[Label, BundleInfo] = _Bundles(self)
        self._providers: dict[Label, Any] = {}
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

    def analyse_volatile(self, label: Label) -> Any:
        """A volatile target's provider, analysed afresh (the engine's _Fresh nodes; _GONE: the target is gone or no
        longer volatile); nothing it asks for is an event of an analysis running."""
        t = self.graph.targets.get(label)
        if t is None or not self.is_volatile(t.kind):
            return _GONE
        n = len(self.actions)
        frames, self._frames = self._frames, []
        try:
            p = plugins.rule(t.kind).analyze(self, t)
        finally:
            self._frames = frames
        if len(self.actions) != n:
            self._volatile_actions = True
        return p

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

    def _current(self, held: _Segment | _Group) -> bool:
        """Whether every node a segment or group holds is current: none replaced since it was made (the engine's rule
        for projections), none whose own inputs changed (the engine function's `unchanged`, over every target node at
        once, on first need), each volatile provider it saw at the revision seen (computed once per plan)."""
        if self._bad is None:
            self._bad = self.memo.nodes_fn.stale_ids(self.engine.nodes)
        if not self._bad.isdisjoint(held.ids) or self.engine.replaced(held.memos):
            return False
        fresh = self.engine.fresh
        return all((node := fresh(key)) is not None and node.changed_at == seen for key, seen in held.volatile)

    def use_segment(self, seg: _Segment) -> bool:
        """Provide its root from a segment if that is valid and the root is not provided yet; whether it was."""
        if seg.labels[0] in self._providers or not self._current(seg):
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
        self.memo.reused += len(new)
        return True

    def use_group(self, group: _Group) -> bool:
        """Provide the roots of `group` (_Group) in one step if it is valid and every node provided so far came from
        a segment or group: this adds what providing each root from its segment would (the nodes provided already,
        shared with earlier roots, and their events left out; an action added already keeping its place and
        object); whether it did."""
        if not self._current(group):
            return False
        memo, ids = self.memo, group.ids
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
        rec = for_degree(_without_weights(model.record), tp_degree)  # (a sharding plan changes only sharded traces)
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
                "inputs": rec["inputs"], "outputs": rec.get("outputs") or [], "bucket": bucket.as_dict(),
                PROVIDER: CORE_STEPS, "step": TRACE}
        if tp_degree > 1:
            record["tp_degree"] = spec["tp_degree"] = tp_degree
        return self.add(make_action(TRACE, model.label, bucket, record, spec, files=_source_files(model),
                                    outputs=(TRACE_OUTPUT,)))

    def plan_bucket(self, tc: Toolchain, req: CompileRequest) -> PlannedBucket:
        """The actions toolchain `tc` plans for one bucket (`req`: a CompileRequest), registered, with the model's
        weights action first when one of them binds it (a toolchain on shapes alone adds none); the last one is the
        bucket's primary action. Its `ships`: what that primary action ships for this request (its model's weights):
        the registered action may be another model's with an identical graph (the same fingerprint: a compile never
        reads weights), holding that model's in `Action.ships`."""
        planned = tc.plan(req)
        w = req.weights
        if w is not None and any(d.action == w.fingerprint for a in planned for d in (*a.dep_inputs, *a.ships)):
            self.add(w)
        return PlannedBucket([self.add(a) for a in planned], planned[-1].ships if planned else ())

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
        rec = for_degree({k: v for k, v in model.record.items() if k not in _GRAPH_KEYS}, tp_degree)
        if tp_degree > 1:  # the rank shards are cut by tp_ops (fused parts, replicated kv heads, ...): its code
            rec["builtin"] = dict(rec.get("builtin") or {}) | {TP_OPS: builtin_digest(TP_OPS)}  # is in the record
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
                | ({"tp_plan": rec["tp_plan"]} if rec.get("tp_plan") else {}), PROVIDER: CORE_STEPS, "step": WEIGHTS}
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
