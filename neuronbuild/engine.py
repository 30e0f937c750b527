"""The incremental engine: values computed per key and memoised with the keys they read, revisions, one validity walk,
early cutoff and cycle detection (Skyframe's evaluator; Salsa's and Buck2 DICE's revisions and equality contract).

A **key** is any hashable value. How the engine computes one is its type's **function** (Skyframe's SkyFunction):
`functions[type(key)]` when registered, else the key itself; either way an object with
- `compute(key, ctx)` (or `key.compute(ctx)` for a key carrying its own function): the value; every other key it
  reads it asks through `ctx.get(other)`, which records the dependency (and the revision of the value it saw);
- `equal(old, new)`: **the equality contract: when it says True, every computation that read `old` would compute
  the same value from `new`** (so a recomputed value equal to the old one keeps the old revision: early cutoff);
- optionally `volatile` (the value reads the outside world and is recomputed, once per revision, whenever asked;
  equal values still cut off), `unchanged(key, node)` (the outside inputs a node read, e.g. a file's digest,
  are still those it read; checked once per revision before its dependencies) and `keep_equal` (a recomputed value
  equal to the old one is dropped and the old object kept, with whatever was derived from it and cached on it).

A **node** holds a key's value, the keys it read in order with the `changed_at` each had then, its own `changed_at`
(the revision its value last changed) and `verified_at` (the last revision it was known current in). `advance()`
starts a revision; nothing is recomputed eagerly. The **validity walk** (iterative, so chains of any length are
fine) decides whether a node is current: its own inputs unchanged and each dependency current with the `changed_at`
it saw (a leaf, a node that read no key, e.g. a package load: its own inputs alone, without the walk's stack). `get`
recomputes a stale dependency during the walk (Salsa's deep verification: an equal value keeps its revision, so what
read it stays valid); `valid` recomputes nothing (only volatile keys) and reports a node with a stale dependency as
stale, for callers whose computations have ordered side effects (the planner replays a valid node's events in order
and recomputes the rest in the order a fresh analysis would). A key asked for while it is being computed is a cycle:
`CycleError`, naming the keys around it.

A **projection key** (`Projection`) holds a value derived from nodes that its own module reuses in part, where the
generic all-or-nothing reuse of a key would recompute all of it after any edit (docs/server.md): `keep` / `kept`, no
dependencies, dropped with the rest by `clear()`. A projection may hold the nodes it was made from (current then); its
one staleness rule is the engine's: `replaced(nodes)`, true once any of them has been replaced since (a store of its
key, even of an equal value, or `clear()`: `Node.replaced`, the revision it was replaced in). The declared ones: the
planner's segments and groups (analysis_nodes.SEGMENTS, GROUPS), the wall-time schedule, the plan report's rows and
matrix layouts (plan_report.SCHEDULE, REPORT, LAYOUTS), loading's graph check (target_graph.GRAPH_CHECK)."""

from __future__ import annotations

import operator
from collections.abc import Hashable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Protocol

__all__ = ["CycleError", "Engine", "KeyFunction", "Node", "Projection"]


class KeyFunction(Protocol):
    """How the engine computes the keys of one type (the key itself, for keys carrying their own `compute`)."""

    def compute(self, key: Any, ctx: Engine) -> Any: ...

    def equal(self, old: Any, new: Any) -> bool: ...


class CycleError(Exception):
    """A key asked for (directly or not) by its own computation; `cycle` holds the keys from it back to it."""

    def __init__(self, cycle: tuple[Hashable, ...]) -> None:
        super().__init__("dependency cycle: " + " -> ".join(map(str, cycle)))
        self.cycle = cycle


class Projection:
    """A projection key (see the module's docstring): named, compared by identity."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Projection({self.name!r})"


class Node:
    """A key's memoised value and what it read: (key, changed_at seen) in the order read; `replaced`: 0 while it is
    its key's node, then the revision it stopped being (its key stored again, or the engine cleared)."""

    __slots__ = ("changed_at", "deps", "replaced", "value", "verified_at")

    def __init__(self, value: Any, deps: tuple[tuple[Hashable, int], ...], changed_at: int, verified_at: int) -> None:
        self.value = value
        self.deps = deps
        self.changed_at = changed_at
        self.verified_at = verified_at
        self.replaced = 0

    def __repr__(self) -> str:
        return f"Node({self.value!r}, changed_at={self.changed_at}, verified_at={self.verified_at})"


class _SelfFunction:
    """The function of a key type carrying its own: `key.compute(ctx)`, and the class's `equal(old, new)` (a
    staticmethod; default ==), `volatile` and `unchanged(node)` when it has them."""

    def __init__(self, cls: type) -> None:
        self.volatile = bool(getattr(cls, "volatile", False))
        self.keep_equal = bool(getattr(cls, "keep_equal", False))
        self.equal = getattr(cls, "equal", _equal)
        if hasattr(cls, "unchanged"):
            self.unchanged = _own_unchanged

    @staticmethod
    def compute(key: Any, ctx: Engine) -> Any:
        return key.compute(ctx)


def _equal(old: Any, new: Any) -> bool:
    return bool(old == new)


def _own_unchanged(key: Any, node: Node) -> bool:
    return bool(key.unchanged(node))


class Engine:
    """The memo of one set of functions: nodes by key, the current revision, the computations running."""

    def __init__(self, functions: Mapping[type, Any] | None = None) -> None:
        self.functions: dict[type, Any] = dict(functions or {})
        self.nodes: dict[Hashable, Node] = {}
        self.revision = 1
        self._stale: set[Hashable] = set()  # (this revision: nodes found stale by `valid`, not recomputed)
        self._frames: list[tuple[Hashable, list[tuple[Hashable, int]]]] = []  # computations running, innermost last
        self._running: set[Hashable] = set()
        self._checks: dict[type, Any] = {}  # per key type: its function's `unchanged` (_always: none), None if volatile
        self.computed = self.cutoffs = 0  # (counters since the last advance())

    def function(self, key: Hashable) -> Any:
        fn = self.functions.get(type(key))
        if fn is None and (hasattr(key, "compute") or hasattr(key, "equal")):  # (a key only stored has no compute)
            fn = self.functions[type(key)] = _SelfFunction(type(key))
        return fn

    def _check(self, key: Hashable) -> Any:
        """The `unchanged` of `key`'s function (_always: it has none), None when it is volatile (looked up once)."""
        try:
            return self._checks[type(key)]
        except KeyError:
            fn = self.function(key)
            check = self._checks[type(key)] = None if getattr(fn, "volatile", False) else \
                getattr(fn, "unchanged", _always)
            return check

    def advance(self) -> None:
        """Start a new revision: every node is to be verified again before it is used."""
        self.revision += 1
        self._stale.clear()
        self.computed = self.cutoffs = 0

    def clear(self) -> None:
        """Forget every node, projections too (a changed input the nodes do not record, e.g. the settings)."""
        for node in self.nodes.values():
            node.replaced = self.revision
        self.nodes.clear()
        self._stale.clear()

    # --- reading -------------------------------------------------------------------------------------------------
    def get(self, key: Hashable) -> Any:
        """The current value of `key` (verified, or recomputed), recorded as read by the running computation."""
        node = self.fresh(key, recompute=True)
        assert node is not None
        self.observe(key, node)
        return node.value

    def observe(self, key: Hashable, node: Node) -> None:
        """Record that the running computation (if any) read `key`'s current node."""
        if self._frames:
            self._frames[-1][1].append((key, node.changed_at))

    def valid(self, key: Hashable) -> bool:
        """Whether `key` has a node that is current, recomputing nothing but volatile keys."""
        return self.fresh(key, recompute=False) is not None

    def fresh(self, key: Hashable, recompute: bool = True) -> Node | None:
        """The node of `key`, made current: the validity walk, with its dependencies' stale nodes recomputed
        (`recompute`) or, without, None for `key` when it or any node it depends on is stale."""
        nodes, rev = self.nodes, self.revision
        node = nodes.get(key)
        if node is not None and node.verified_at == rev:
            return node
        stale = self._stale
        if not recompute and key in stale:
            return None
        if node is not None and not node.deps:  # (a leaf, e.g. a package load: only its own inputs to check)
            check = self._check(key)
            if check is not None:
                if check(key, node):
                    node.verified_at = rev
                    return node
                if not recompute:
                    stale.add(key)
                    return None
            return self.compute(key)
        # Depth first over [key, node, index of the next dependency to check (-1: its own inputs first)]
        stack: list[tuple[Hashable, Node | None, int]] = [(key, node, -1)]
        on_stack = {key}
        checks = self._check
        while stack:
            k, n, i = stack[-1]
            check = checks(k)
            volatile = check is None
            ok = n is not None and not volatile
            if n is not None and ok and i < 0:
                ok = check(k, n)
                i = 0
            if ok:
                assert n is not None
                deps = n.deps
                pushed = False
                while i < len(deps):
                    dk, seen = deps[i]
                    dn = nodes.get(dk)
                    if dn is not None and dn.verified_at == rev:
                        if dn.changed_at != seen:
                            ok = False
                            break
                        i += 1
                        continue
                    if dk in on_stack or (not recompute and dk in stale):
                        ok = False  # (a stored cycle, left by values that changed since: recomputing decides)
                        break
                    stack[-1] = (k, n, i)
                    stack.append((dk, dn, -1))
                    on_stack.add(dk)
                    pushed = True
                    break
                if pushed:
                    continue
            stack.pop()
            on_stack.discard(k)
            if ok:
                assert n is not None
                n.verified_at = rev
            elif recompute or volatile:
                self.compute(k)
            else:
                stale.add(k)
                stale.update(s[0] for s in stack)  # (everything waiting on it is stale too)
                return None
        return nodes[key]

    def kept(self, key: Projection) -> Any:
        """The value kept under a projection key (None: none)."""
        node = self.nodes.get(key)
        return None if node is None else node.value

    def keep(self, key: Projection, value: Any) -> None:
        """Keep `value` under a projection key (None: forget it)."""
        if value is None:
            self.nodes.pop(key, None)
        else:
            self.nodes[key] = Node(value, (), self.revision, self.revision)

    @staticmethod
    def replaced(nodes: Iterable[Node]) -> bool:
        """Whether any of `nodes` (held by a projection made when they were current) has been replaced since."""
        return any(map(_REPLACED, nodes))

    # --- computing -----------------------------------------------------------------------------------------------
    def compute(self, key: Hashable) -> Node:
        """Compute `key` now (whatever its node says), store its node and return it; a value equal to the old one
        keeps the old `changed_at` (early cutoff)."""
        if key in self._running:
            keys = [f[0] for f in self._frames]
            raise CycleError((*keys[keys.index(key):], key))
        fn = self.function(key)
        if fn is None:
            raise KeyError(f"no function computes keys of type {type(key).__name__}")
        deps: list[tuple[Hashable, int]] = []
        self._frames.append((key, deps))
        self._running.add(key)
        try:
            value = fn.compute(key, self)
        finally:
            self._frames.pop()
            self._running.discard(key)
        return self.store(key, value, tuple(deps), fn)

    def store(self, key: Hashable, value: Any, deps: tuple[tuple[Hashable, int], ...], fn: Any = None) -> Node:
        """Store a node for `key` computed outside `compute` (with the dependencies it read): early cutoff applies."""
        rev = self.revision
        old = self.nodes.get(key)
        changed_at = rev
        fn = fn or self.function(key)
        if old is not None and fn.equal(old.value, value):
            changed_at = old.changed_at
            self.cutoffs += 1
            if getattr(fn, "keep_equal", False):
                value = old.value
        node = self.nodes[key] = Node(value, deps, changed_at, rev)
        if old is not None:
            old.replaced = rev
        self._stale.discard(key)
        self.computed += 1
        return node

    @contextmanager
    def computing(self, key: Hashable) -> Iterator[list[tuple[Hashable, int]]]:
        """The frame of a computation run by the caller (who then `store`s its value): reads meanwhile are its
        dependencies (yielded), and asking for `key` itself is a cycle."""
        if key in self._running:
            keys = [f[0] for f in self._frames]
            raise CycleError((*keys[keys.index(key):], key))
        deps: list[tuple[Hashable, int]] = []
        self._frames.append((key, deps))
        self._running.add(key)
        try:
            yield deps
        finally:
            self._frames.pop()
            self._running.discard(key)


def _always(_key: Any, _node: Node) -> bool:
    return True


_REPLACED = operator.attrgetter("replaced")
