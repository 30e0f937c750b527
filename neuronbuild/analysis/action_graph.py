"""The action graph: the plan's value (every action needed for the requested targets, by fingerprint in the order
analysis added them, the compile targets and bundles) and what is derived from it on first use."""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import networkx as nx

from neuronbuild.analysis.providers import BundleInfo, CompileTarget
from neuronbuild.loading.labels import Label
from neuronbuild.plugin_api.actions import TRACE, WEIGHTS, Action, DepInput


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


_ACTION_OF = operator.attrgetter("action")


def action_digraph(actions: Mapping[str, Action]) -> nx.DiGraph:
    """The producer -> consumer graph of `actions` (in their order; a dependency never registered is a node too)."""
    g = nx.DiGraph()
    add_node, add_edge = g.add_node, g.add_edge
    for fp, a in actions.items():
        add_node(fp)
        for dep in a.deps:
            add_edge(dep, fp)
    return g
