"""The incremental engine (engine.py) on fake keys, as Bazel's evaluator tests do: what a new revision
recomputes after an input changes, early cutoff, diamonds, dynamic dependencies, cycles, failures, deep chains."""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest

from neuronbuild.engine import CycleError, Engine, Node, Projection

WORLD: dict[str, Any] = {}  # the fake outside world the volatile keys read
RUNS: Counter[Any] = Counter()  # computations per key


@dataclass(frozen=True)
class Cell:
    """A value of the outside world: volatile (read again in every revision that asks for it)."""

    name: str
    volatile = True

    def compute(self, ctx: Engine) -> Any:
        RUNS[self] += 1
        return WORLD[self.name]


@dataclass(frozen=True)
class Sum:
    names: tuple[Any, ...]

    def compute(self, ctx: Engine) -> Any:
        RUNS[self] += 1
        return sum(ctx.get(k) for k in self.names)


@dataclass(frozen=True)
class Parity:
    of: Any

    def compute(self, ctx: Engine) -> Any:
        RUNS[self] += 1
        return ctx.get(self.of) % 2


@dataclass(frozen=True)
class Pick:
    """Reads `cond`, then only the branch it names (dependencies are the keys read this time)."""

    cond: Any
    then: Any
    other: Any

    def compute(self, ctx: Engine) -> Any:
        RUNS[self] += 1
        return ctx.get(self.then if ctx.get(self.cond) else self.other)


@dataclass(frozen=True)
class Chain:
    n: int

    def compute(self, ctx: Engine) -> Any:
        RUNS[self] += 1
        return ctx.get(Cell("base") if self.n == 0 else Chain(self.n - 1)) + 1


@dataclass(frozen=True)
class Loop:
    """Reads `Loop(next)`: a cycle when the world links them in a ring."""

    name: str

    def compute(self, ctx: Engine) -> Any:
        RUNS[self] += 1
        nxt = WORLD.get("loop:" + self.name)
        return 0 if nxt is None else ctx.get(Loop(nxt)) + 1


@dataclass(frozen=True)
class Fails:
    def compute(self, ctx: Engine) -> Any:
        RUNS[self] += 1
        if ctx.get(Cell("fail")):
            raise ValueError("bad input")
        return "ok"


@dataclass(frozen=True)
class FileLike:
    """A key whose own outside input (a 'digest' it read) is checked by `unchanged` instead of by a volatile key."""

    name: str
    checks = Counter[str]()

    def compute(self, ctx: Engine) -> Any:
        RUNS[self] += 1
        return ("content", WORLD[self.name])

    def unchanged(self, node: Node) -> bool:
        FileLike.checks[self.name] += 1
        return bool(node.value == ("content", WORLD[self.name]))


@pytest.fixture(autouse=True)
def _fresh_world() -> None:
    WORLD.clear()
    RUNS.clear()
    FileLike.checks.clear()


def _runs() -> dict[Any, int]:
    out = dict(RUNS)
    RUNS.clear()
    return out


def test_a_new_revision_with_nothing_changed_reads_the_world_again_and_recomputes_nothing_else() -> None:
    WORLD.update(a=1, b=2)
    e = Engine()
    total = Sum((Cell("a"), Cell("b")))
    assert e.get(total) == 3
    assert _runs() == {total: 1, Cell("a"): 1, Cell("b"): 1}
    assert e.get(total) == 3 and _runs() == {}  # (same revision: nothing verified again)
    e.advance()
    assert e.get(total) == 3
    assert _runs() == {Cell("a"): 1, Cell("b"): 1}


def test_an_input_change_recomputes_exactly_the_keys_that_read_it() -> None:
    WORLD.update(a=1, b=2, c=3)
    e = Engine()
    ab, bc = Sum((Cell("a"), Cell("b"))), Sum((Cell("b"), Cell("c")))
    top = Sum((ab, bc))
    assert e.get(top) == 8
    _runs()
    WORLD["a"] = 10
    e.advance()
    assert e.get(top) == 17
    assert _runs() == {Cell("a"): 1, Cell("b"): 1, Cell("c"): 1, ab: 1, top: 1}  # bc was not recomputed
    assert e.nodes[bc].changed_at < e.revision == e.nodes[top].changed_at


def test_an_equal_recomputed_value_keeps_its_revision_and_its_dependants_are_not_recomputed() -> None:
    WORLD.update(x=2, y=1)
    e = Engine()
    px = Parity(Cell("x"))
    top = Sum((px, Cell("y")))
    assert e.get(top) == 1
    before = e.nodes[px].changed_at
    _runs()
    WORLD["x"] = 4  # another value, the same parity: cut off at px
    e.advance()
    assert e.get(top) == 1
    assert _runs() == {Cell("x"): 1, Cell("y"): 1, px: 1}
    assert e.nodes[px].changed_at == before and e.cutoffs == 2  # (px, and Cell("y") read again equal)
    WORLD["x"] = 5
    e.advance()
    assert e.get(top) == 2
    assert _runs() == {Cell("x"): 1, Cell("y"): 1, px: 1, top: 1}


def test_a_diamond_computes_its_shared_key_once_per_revision() -> None:
    WORLD.update(a=1)
    e = Engine()
    shared = Sum((Cell("a"),))
    left, right = Sum((shared,)), Parity(shared)
    top = Sum((left, right))
    assert e.get(top) == 2
    assert _runs() == {Cell("a"): 1, shared: 1, left: 1, right: 1, top: 1}
    WORLD["a"] = 2
    e.advance()
    assert e.get(top) == 2
    assert _runs() == {Cell("a"): 1, shared: 1, left: 1, right: 1, top: 1}


def test_dependencies_are_the_keys_read_the_last_time() -> None:
    WORLD.update(cond=True, a=1, b=2)
    e = Engine()
    pick = Pick(Cell("cond"), Cell("a"), Cell("b"))
    assert e.get(pick) == 1
    _runs()
    WORLD["b"] = 20  # not read by the last computation: no reason to recompute
    e.advance()
    assert e.get(pick) == 1 and pick not in _runs()
    WORLD["cond"] = False
    e.advance()
    assert e.get(pick) == 20 and _runs()[pick] == 1
    WORLD["a"] = 100  # no longer read
    e.advance()
    assert e.get(pick) == 20 and pick not in _runs()


def test_valid_recomputes_nothing_but_volatile_keys_and_finds_stale_what_reads_a_changed_key() -> None:
    WORLD.update(a=1, b=2)
    e = Engine()
    ab = Sum((Cell("a"), Cell("b")))
    top = Parity(ab)
    e.get(top)
    _runs()
    e.advance()
    assert e.valid(top) and _runs() == {Cell("a"): 1, Cell("b"): 1}
    WORLD["b"] = 4
    e.advance()
    assert not e.valid(top) and not e.valid(ab)
    assert _runs() == {Cell("a"): 1, Cell("b"): 1}  # (volatile keys only: ab is not recomputed)
    assert not e.valid(Sum((Cell("zz"),)))  # never computed: no node
    assert e.get(top) == 1 and _runs() == {ab: 1, top: 1}  # (the cells were read in this revision already)


def test_a_cycle_is_refused_naming_its_keys_and_the_engine_recovers_once_it_is_broken() -> None:
    WORLD.update({"loop:a": "b", "loop:b": "c", "loop:c": "a"})
    e = Engine()
    with pytest.raises(CycleError) as err:
        e.get(Loop("a"))
    assert err.value.cycle == (Loop("a"), Loop("b"), Loop("c"), Loop("a"))
    assert "Loop(name='a') -> Loop(name='b')" in str(err.value)
    assert not e._running and not e._frames  # nothing left half-running
    del WORLD["loop:c"]
    e.advance()
    assert e.get(Loop("a")) == 2


def test_a_stored_cycle_left_by_changed_values_is_recomputed_not_refused() -> None:
    WORLD.update({"loop:a": "b"})
    e = Engine()
    assert e.get(Loop("a")) == 1  # a reads b
    e.advance()
    WORLD.update({"loop:a": None, "loop:b": "a"})
    e.nodes[Loop("b")] = Node(0, ((Loop("a"), e.nodes[Loop("a")].changed_at),), 1, 1)  # (b's node reads a, a's b)
    assert e.get(Loop("b")) == 1  # recomputed: a no longer reads b
    assert e.get(Loop("a")) == 0


def test_a_failed_computation_stores_nothing_and_is_tried_again() -> None:
    WORLD.update(fail=False)
    e = Engine()
    assert e.get(Fails()) == "ok"
    WORLD["fail"] = True
    e.advance()
    with pytest.raises(ValueError):
        e.get(Fails())
    assert e.nodes[Fails()].value == "ok" and not e._running  # the old node is still there, not verified
    assert not e.valid(Fails())
    WORLD["fail"] = False
    e.advance()
    _runs()
    assert e.get(Fails()) == "ok" and _runs() == {Cell("fail"): 1, Fails(): 1}


def test_a_nodes_own_inputs_are_checked_once_per_revision_before_its_dependencies() -> None:
    WORLD.update(f="x", a=1)
    e = Engine()
    top = Sum((Parity(Cell("a")),))
    f = FileLike("f")
    e.get(f)
    e.get(top)
    _runs()
    for _ in range(2):
        e.advance()
        assert e.get(f) == ("content", "x") and e.valid(f)
    assert FileLike.checks["f"] == 2 and f not in _runs()
    WORLD["f"] = "y"
    e.advance()
    assert not e.valid(f) and e.get(f) == ("content", "y") and _runs()[f] == 1


def test_a_chain_deeper_than_the_recursion_limit_is_verified_and_cut_off_without_recursion() -> None:
    depth = sys.getrecursionlimit() * 2
    WORLD.update(base=0)
    e = Engine()
    for n in range(depth):  # (built bottom up: each computation reads a node made already)
        e.get(Chain(n))
    top = Chain(depth - 1)
    assert e.get(top) == depth
    e.advance()
    assert e.valid(top)  # an iterative walk over `depth` nodes
    _runs()
    WORLD["base"] = 1
    e.advance()
    assert not e.valid(top)
    assert e.get(top) == depth + 1  # recomputed bottom up by the walk, each reading a node verified already
    runs = _runs()
    assert runs[Chain(0)] == runs[top] == 1 and len(runs) == depth + 1  # (each link once, and the base cell)


def test_functions_registered_by_key_type_compute_plain_keys() -> None:
    class Double:
        @staticmethod
        def compute(key: int, ctx: Engine) -> int:
            return 2 * key if key < 1 else ctx.get(key - 1) + 2

        @staticmethod
        def equal(old: int, new: int) -> bool:
            return old == new

    e = Engine({int: Double()})
    assert e.get(3) == 6
    assert list(e.nodes) == [0, 1, 2, 3] and e.computed == 4  # (stored in the order their computations ended)
    assert e.nodes[3].deps == ((2, 1),)
    with pytest.raises(KeyError):
        e.get("no function")


@dataclass(frozen=True)
class Rounded:
    """Keeps the old value object when the new one is equal (`keep_equal`), as the planner's action graph node does."""

    of: Any
    keep_equal = True

    def compute(self, ctx: Engine) -> Any:
        return [round(ctx.get(self.of))]


def test_an_equal_value_of_a_keep_equal_key_is_the_old_object() -> None:
    WORLD.update(x=1.2)
    e = Engine()
    first = e.get(Rounded(Cell("x")))
    WORLD["x"] = 0.9
    e.advance()
    assert e.get(Rounded(Cell("x"))) is first  # (a plain key stores the new, equal object)
    assert e.get(Sum((Cell("x"),))) == 0.9
    WORLD["x"] = 2.2
    e.advance()
    assert e.get(Rounded(Cell("x"))) == [2]


HELD = Projection("nodes held")  # (as the planner's segments and groups hold the target nodes they were made from)


def test_a_projection_is_stale_once_a_node_it_holds_is_replaced_after_it_was_made() -> None:
    WORLD.update(a=1, b=2)
    e = Engine()
    left, right = Sum((Cell("a"),)), Sum((Cell("b"),))
    assert e.get(left) == 1 and e.get(right) == 2
    e.keep(HELD, (e.nodes[left], e.nodes[right]))
    for _ in range(2):  # (new revisions, nothing changed: each node verified again, none replaced)
        e.advance()
        assert e.get(left) == 1 and e.get(right) == 2
        assert not e.replaced(e.kept(HELD))
    WORLD["b"] = 5
    e.advance()
    assert e.valid(left) and e.get(right) == 5  # (right's node stored anew)
    assert e.replaced(e.kept(HELD))
    assert not e.replaced(e.kept(HELD)[:1])  # (left's node is still its key's)


def test_a_node_replaced_before_a_projection_was_made_leaves_it_current() -> None:
    WORLD.update(a=1)
    e = Engine()
    key = Sum((Cell("a"),))
    assert e.get(key) == 1
    first = e.nodes[key]
    WORLD["a"] = 2
    e.advance()
    assert e.get(key) == 2 and e.replaced([first])
    e.keep(HELD, (e.nodes[key],))  # (made from the current node, after the replacement)
    e.advance()
    assert e.get(key) == 2 and not e.replaced(e.kept(HELD))


def test_clear_drops_projections_and_marks_every_node_replaced() -> None:
    WORLD.update(a=1)
    e = Engine()
    key = Sum((Cell("a"),))
    e.get(key)
    held = (e.nodes[key],)
    e.keep(HELD, held)
    assert e.kept(HELD) is held
    e.clear()
    assert e.kept(HELD) is None and e.replaced(held)  # (a value holding them outside the engine is stale too)
    e.advance()
    assert e.get(key) == 1 and not e.replaced([e.nodes[key]])


@dataclass(frozen=True)
class Mod:
    """A random graph's key: (the sum of its inputs' values + its own offset) mod 3 (small values: many cutoffs)."""

    n: int
    inputs: tuple[Any, ...] = field(compare=False)  # (keys by n: hashing nested keys would be exponential)

    def compute(self, ctx: Engine) -> Any:
        RUNS[self] += 1
        return (sum(ctx.get(k) for k in self.inputs) + self.n) % 3


def _values(cells: list[Cell], keys: list[Mod]) -> dict[Any, Any]:
    """Every value of a random graph computed without the engine (the oracle; `keys` in topological order)."""
    out: dict[Any, Any] = {c: WORLD[c.name] for c in cells}
    for k in keys:
        out[k] = (sum(out[i] for i in k.inputs) + k.n) % 3
    return out


@pytest.mark.parametrize("seed", range(20))
def test_random_graphs_recompute_exactly_the_keys_whose_inputs_changed_value(seed: int) -> None:
    """A random DAG over 8 cells and 40 keys, 30 revisions of random cell edits: every value equals the oracle's,
    and a key is recomputed in a revision exactly when one of its inputs' values differs from the last revision's
    (with early cutoff, a changed cell whose dependants' values do not change stops there)."""
    import random

    rnd = random.Random(seed)
    cells = [Cell(f"c{i}") for i in range(8)]
    WORLD.update({c.name: rnd.randrange(3) for c in cells})
    keys: list[Mod] = []
    for n in range(40):
        pool: list[Any] = [*cells, *keys]
        keys.append(Mod(n, tuple(rnd.sample(pool, rnd.randint(1, 4)))))
    top = Sum(tuple(keys))
    e = Engine()
    before = _values(cells, keys)
    assert e.get(top) == sum(before[k] for k in keys)
    for _ in range(30):
        for c in rnd.sample(cells, rnd.randint(0, 3)):
            WORLD[c.name] = rnd.randrange(3)
        RUNS.clear()
        e.advance()
        now = _values(cells, keys)
        assert e.get(top) == sum(now[k] for k in keys)
        assert all(e.nodes[k].value == now[k] for k in keys)
        expected = {k for k in keys if any(before[i] != now[i] for i in k.inputs)}
        assert {k for k in keys if RUNS[k]} == expected
        assert all(RUNS[k] <= 1 for k in keys)
        before = now
