"""The plan's fast paths at monorepo scale against the straightforward code they replace: the action graph is the graph
add_node/add_edge per registration makes (same nodes, edges and orders), the wall-time estimate is the greedy list
schedule, and the plan matrix text renders every cell as it did row by row."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import networkx as nx
import pytest
from helpers import REPO

from neuronbuild.analysis.estimate import Estimate, wall_time
from neuronbuild.analysis.plan_report import BUILD, CACHED, UNNEEDED, PlanReport

sys.path.insert(0, str(REPO / "benchmarks"))
import gen_monorepo  # noqa: E402


@pytest.fixture(scope="module")
def action_graph(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from neuronbuild.analysis.planner import plan
    from neuronbuild.loading.target_graph import load_targets

    ws = tmp_path_factory.mktemp("ws")
    gen_monorepo.generate(ws, 24, 3, 3)
    return plan(load_targets(ws, ["//..."]))


def test_the_action_graph_is_the_graph_networkx_makes_per_registration(action_graph: Any) -> None:
    ag = action_graph
    ref = nx.DiGraph()
    for fp, a in ag.actions.items():
        ref.add_node(fp)
        for dep in a.deps:
            ref.add_edge(dep, fp)
    g = ag.graph
    assert list(g.nodes) == list(ref.nodes) == list(ag.actions)
    assert list(g.edges) == list(ref.edges) and len(g.edges) > len(g.nodes) / 2
    assert all(list(g.predecessors(n)) == list(ref.predecessors(n)) and
               list(g.successors(n)) == list(ref.successors(n)) for n in ref)
    order = [a.fingerprint for a in ag.topological()]
    assert order == list(ag.actions)  # analysis registers each action after its inputs': that order is topological
    place = {fp: i for i, fp in enumerate(order)}
    assert all(place[u] < place[v] for u, v in ref.edges)
    g.add_edge("x", "y")  # still an ordinary graph: networkx's own updates keep both directions
    assert list(g.predecessors("y")) == ["x"] and g.in_degree("y") == 1


def _random_dag(rng: random.Random, least: int, most: int, fan_in: tuple[int, ...]) -> tuple[nx.DiGraph, list[str]]:
    """A random DAG of `least`..`most` fingerprint-named actions, each depending on rng.choice(fan_in) earlier ones,
    and its lexicographical topological order."""
    g = nx.DiGraph()
    names = [f"{rng.getrandbits(64):016x}" for _ in range(rng.randint(least, most))]
    for k, fp in enumerate(names):
        g.add_node(fp)
        for dep in rng.sample(names[:k], min(k, rng.choice(fan_in))):
            g.add_edge(dep, fp)
    return g, list(nx.lexicographical_topological_sort(g))


def _greedy(graph: nx.DiGraph, todo: list[Any], seconds: dict[str, float], jobs: int) -> float:
    """The schedule as it was first written: each action on the first worker free, after its needed deps."""
    need = {a.fingerprint for a in todo}
    finish: dict[str, float] = {}
    workers = [0.0] * max(1, jobs)
    for a in todo:
        ready = max((finish[d] for d in graph.predecessors(a.fingerprint) if d in need), default=0.0)
        i = min(range(len(workers)), key=workers.__getitem__)
        start = max(ready, workers[i])
        finish[a.fingerprint] = workers[i] = start + seconds.get(a.fingerprint, 0.0)
    return max(finish.values(), default=0.0)


def test_the_wall_time_estimate_is_the_greedy_list_schedule(action_graph: Any) -> None:
    ag = action_graph
    order = ag.topological()
    rng = random.Random(7)
    for trial in range(12):
        todo = [a for a in order if rng.random() < 0.8]
        # whole seconds make ties (two workers free at once, two deps finishing together) common
        seconds = {a.fingerprint: float(rng.randint(0, 3)) if trial % 2 else rng.random() * 10 for a in todo}
        for jobs in (1, 2, 3, 8):
            assert wall_time(ag.graph, todo, seconds, jobs) == _greedy(ag.graph, todo, seconds, jobs)
            report = PlanReport(ag, tuple(todo), frozenset(), {fp: Estimate(s, "own") for fp, s in seconds.items()},
                                jobs)
            assert report.wall_s == _greedy(ag.graph, todo, seconds, jobs)


def test_the_wall_time_estimate_is_the_greedy_list_schedule_on_random_graphs() -> None:
    """Random DAGs with actions of several dependencies, dependencies not to run, ties, and durations the fast
    loop leaves to the reference (negative, infinite: the greedy schedule's answer all the same)."""
    rng = random.Random(11)
    for trial in range(60):
        g, order = _random_dag(rng, 1, 120, (0, 1, 1, 1, 2, 3))
        todo = [_Act(fp) for fp in order if rng.random() < 0.85]
        seconds = {a.fingerprint: float(rng.randint(0, 3)) if trial % 2 else rng.random() * 10 for a in todo}
        if trial % 10 == 9 and todo:
            seconds[rng.choice(todo).fingerprint] = rng.choice((-1.0, -0.5, float("inf")))
        for jobs in (1, 2, 3, 8):
            got, want = wall_time(g, todo, seconds, jobs), _greedy(g, todo, seconds, jobs)
            assert got == want, (trial, jobs)


def test_a_wall_time_schedule_resumed_from_the_previous_plans_equals_a_full_one(monkeypatch: Any) -> None:
    """The build server keeps the last schedule (estimate.Schedule) and resumes it where the actions, their order and
    seconds are unchanged: after random edits (an action's seconds, actions inserted, removed, the workers) the figure
    equals the greedy schedule's and a fresh full run's, exactly."""
    from neuronbuild.analysis import estimate

    monkeypatch.setattr(estimate, "CHECK", 4)  # (resume points every 4 actions: small graphs resume often)
    rng = random.Random(23)
    resumed = 0
    for trial in range(40):
        g, order = _random_dag(rng, 1, 80, (0, 1, 1, 2))
        prior = None
        todo = [fp for fp in order if rng.random() < 0.9]
        seconds = {fp: float(rng.randint(0, 3)) if trial % 2 else rng.random() * 10 for fp in order}
        jobs = rng.choice((1, 2, 3))
        for _edit in range(6):
            deps = [list(g.predecessors(fp)) for fp in todo]
            secs = [seconds[fp] for fp in todo]
            wall, prior = estimate.schedule_from(prior, todo, deps, secs, jobs)
            want = _greedy(g, [_Act(fp) for fp in todo], seconds, jobs)
            assert wall == want == estimate.schedule(todo, deps, secs, jobs), (trial, _edit)
            what = rng.choice(("seconds", "drop", "add", "jobs", "none"))
            if what == "seconds" and todo:
                seconds[rng.choice(todo)] = float(rng.randint(0, 5))
            elif what == "drop" and todo:
                todo.remove(rng.choice(todo))
            elif what == "add":
                todo = [fp for fp in order if fp in todo or rng.random() < 0.2]
            elif what == "jobs":
                jobs = rng.choice((1, 2, 3))
            resumed += estimate._resume(prior, todo, [seconds[fp] for fp in todo], jobs) > 0
    assert resumed > 40  # (resuming happens: not a full run every time)


def test_a_schedule_resumed_after_the_last_kept_point_of_a_plan_that_ended_there_equals_a_full_one(
        monkeypatch: Any) -> None:
    """A plan of exactly 2 * CHECK actions keeps its schedule's points before actions 0 and CHECK; the next plan adds
    actions after them: resumed from the last kept point (not from the end, whose state is not kept), its figure is
    a full run's."""
    from neuronbuild.analysis import estimate

    monkeypatch.setattr(estimate, "CHECK", 4)
    fps = [f"a{i}" for i in range(10)]
    deps: list[list[str]] = [[] for _ in fps]
    for jobs in (1, 2, 3):
        _wall, prior = estimate.schedule_from(None, fps[:8], deps[:8], [1.0] * 8, jobs)
        for same in (None, (8, 0)):
            wall, _node = estimate.schedule_from(prior, fps, deps, [1.0] * 10, jobs, same=same)
            assert wall == estimate.schedule(fps, deps, [1.0] * 10, jobs), (jobs, same)


def test_a_wall_time_schedule_taken_over_where_it_converges_equals_a_full_one(monkeypatch: Any) -> None:
    """An edit that renames actions (their fingerprints and every consumer's change, as content addresses do),
    changes their seconds, or takes one action out of the plan and another in, keeping as many: the kept schedule is resumed up to the edit and taken over again from
    where it converges (the same workers' state, nothing after reading a finish that differs); every action's finish,
    the figure and the kept points equal a fresh full run's, exactly, after each edit."""
    from neuronbuild.analysis import estimate

    monkeypatch.setattr(estimate, "CHECK", 2)
    rng = random.Random(29)
    converged = 0
    for trial in range(300):
        g, order = _random_dag(rng, 5, 40, (0, 1, 1, 2))
        todo = [fp for fp in order if rng.random() < 0.9]
        seconds = {fp: float(rng.randint(1, 3)) if trial % 3 else rng.random() * 10 for fp in order}
        jobs = rng.choice((1, 2, 2, 3))
        prior = None
        for _edit in range(8):
            deps = [list(g.predecessors(fp)) for fp in todo]
            secs = [seconds[fp] for fp in todo]
            was = prior
            if was is not None and rng.random() < 0.5:  # (told where the lists are the prior's, as a report does)
                n = min(len(todo), len(was.fps))
                h = next((i for i in range(n) if (todo[i], secs[i]) != (was.fps[i], was.seconds[i])), n)
                t = next((i for i in range(n - h) if (todo[-1 - i], secs[-1 - i]) != (was.fps[-1 - i],
                                                                                   was.seconds[-1 - i])), n - h)
                wall, prior = estimate.schedule_from(was, todo, deps, secs, jobs, same=(h, t))
            else:
                wall, prior = estimate.schedule_from(was, todo, deps, secs, jobs)
            _full_wall, full = estimate.schedule_from(None, todo, deps, secs, jobs)
            # (taken over: the last finish is the prior node's own object, not one placed now)
            converged += was is not None and len(todo) > 4 and prior.ends[-1] is was.ends[-1] and \
                was.fps[-1] == todo[-1] and _edit > 0
            assert wall == _greedy(g, [_Act(fp) for fp in todo], seconds, jobs), (trial, _edit)
            assert (prior.ends, prior.states) == (full.ends, full.states), (trial, _edit)
            what = rng.choice(("rename", "rename", "resize", "seconds", "swap"))
            victim = rng.choice(todo)
            out = [fp for fp in g if fp not in todo]
            if what == "swap" and out and len(todo) > 1:  # (one action leaves the plan, e.g. cached, another joins)
                joins = rng.choice(out)
                todo = [fp for fp in nx.lexicographical_topological_sort(g)
                        if fp == joins or (fp in todo and fp != victim)]
            elif what == "swap":
                pass
            elif what != "seconds":  # (the action and everything reading it, transitively: new fingerprints)
                renamed = {fp: f"{rng.getrandbits(64):016x}" for fp in (victim, *nx.descendants(g, victim))}
                g = nx.relabel_nodes(g, renamed)
                seconds.update({new: seconds[old] for old, new in renamed.items()})
                todo = [renamed.get(fp, fp) for fp in todo]
                if what == "resize":  # (a renamed action taking longer or shorter: later finishes move)
                    seconds[renamed[victim]] = float(rng.randint(1, 3))
            else:
                seconds[victim] = float(rng.randint(1, 3))
    assert converged > 60  # (taking over happens: not a run to the end every time)


class _Act:
    def __init__(self, fingerprint: str) -> None:
        self.fingerprint = fingerprint


def _reference_lines(r: PlanReport) -> list[str]:
    """The plan matrix rendered row by row, each cell computed from the report's status() and estimates."""
    out: list[str] = []
    for ct in r.ag.compiles:
        opts = " ".join(f"{k}={','.join(v) if isinstance(v, list) else v}" for k, v in ct.options.items()
                        if v not in (None, []))
        out.append(f"{ct.label}  {ct.description}  {opts}".rstrip())
        width = max([len("bucket"), *(len(str(b)) for b, _fp in ct.buckets)])
        out.append(f"  {'bucket':<{width}}  {'trace':<7} {'compile':<7} est.")
        for bucket, fp in ct.buckets:
            trace_fp = r.ag.trace_of(fp).fingerprint
            te, ce = r.estimates.get(trace_fp), r.estimates.get(fp)
            if te is None and ce is None:
                shown = "-"
            else:
                est = sum((e.seconds or 0.0) for e in (te, ce) if e is not None)
                unknown = any(e is not None and not e.recorded for e in (te, ce))
                shown = f"~{est:.1f} s" if unknown else f"{est:.1f} s"
            out.append(f"  {str(bucket):<{width}}  {r.status(trace_fp):<7} {r.status(fp):<7} {shown}")
    return out


def test_the_plan_matrix_renders_each_cell_as_row_by_row(action_graph: Any) -> None:
    ag = action_graph
    order = ag.topological()
    rng = random.Random(3)
    shared = [Estimate(4.0, "default", recorded=False), Estimate(2.5, "class mean")]  # shared, as the estimator's
    seen: set[str] = set()
    for _ in range(6):
        cached = frozenset(a.fingerprint for a in order if rng.random() < 0.3)
        todo = tuple(a for a in order if a.fingerprint not in cached and rng.random() < 0.8)
        estimates = {a.fingerprint: rng.choice(shared) if rng.random() < 0.5 else
                     Estimate(round(rng.random() * 9, 2), "own", recorded=rng.random() < 0.7) for a in todo}
        r = PlanReport(ag, todo, cached, estimates, 2)
        lines = r.lines()
        assert lines[:-1] == _reference_lines(r)
        seen |= {c for ln in lines[:-1] for c in (BUILD, CACHED, UNNEEDED) if f" {c} " in ln}
    assert seen == {BUILD, CACHED, UNNEEDED}  # (the draws cover every kind of cell; which draw does depends on the
    # order of the generated graph's fingerprints, which any change to an action record moves)


def test_a_missing_dependency_becomes_a_node_as_add_edge_makes_it(tmp_path: Path) -> None:
    from neuronbuild.analysis.action_graph import action_digraph
    from neuronbuild.loading.labels import Label
    from neuronbuild.plugin_api.actions import Action, Bucket, DepInput

    def act(fp: str, *deps: str) -> Action:
        return Action(fp, "compile", Label("p", "t"), Bucket(()), {}, {},
                      dep_inputs=tuple(DepInput(d, "o", "o") for d in deps))

    actions = {a.fingerprint: a for a in (act("b"), act("c", "zz", "b", "b"), act("a", "c"))}
    ref = nx.DiGraph()
    for fp, a in actions.items():
        ref.add_node(fp)
        for d in a.deps:
            ref.add_edge(d, fp)
    g = action_digraph(actions)
    assert list(g.nodes) == list(ref.nodes) == ["b", "c", "zz", "a"]
    assert list(g.edges) == list(ref.edges)


def test_a_cycle_in_the_action_graph_is_refused() -> None:
    from neuronbuild.analysis.action_graph import ActionGraph, action_digraph
    from neuronbuild.loading.labels import Label
    from neuronbuild.plugin_api.actions import Action, Bucket, DepInput

    def act(fp: str, *deps: str) -> Action:
        return Action(fp, "compile", Label("p", "t"), Bucket(()), {}, {},
                      dep_inputs=tuple(DepInput(d, "o", "o") for d in deps))

    for actions in ({"a": act("a", "c"), "b": act("b", "a"), "c": act("c", "b", "r"), "r": act("r")},
                    {"s": act("s", "s"), "r": act("r")}):
        with pytest.raises(nx.NetworkXUnfeasible):
            ActionGraph(actions, action_digraph(actions)).topological()
    ok = {"r": act("r"), "a": act("a", "r"), "b": act("b", "a", "r")}
    assert [a.fingerprint for a in ActionGraph(ok, action_digraph(ok)).topological()] == ["r", "a", "b"]


def test_an_action_registered_before_its_input_is_ordered_after_it_smallest_ready_first() -> None:
    """Registration order is the topological order only when it is one; otherwise Kahn's, smallest ready first
    (networkx's lexicographical_topological_sort)."""
    from neuronbuild.analysis.action_graph import ActionGraph, action_digraph
    from neuronbuild.loading.labels import Label
    from neuronbuild.plugin_api.actions import Action, Bucket, DepInput

    def act(fp: str, *deps: str) -> Action:
        return Action(fp, "compile", Label("p", "t"), Bucket(()), {}, {},
                      dep_inputs=tuple(DepInput(d, "o", "o") for d in deps))

    late = {"z": act("z", "m"), "m": act("m"), "c": act("c"), "a": act("a", "c", "m")}
    ag = ActionGraph(late, action_digraph(late))
    assert [a.fingerprint for a in ag.topological()] == list(nx.lexicographical_topological_sort(ag.graph)) == \
        ["c", "m", "a", "z"]


def test_the_neuron_toolchain_shares_one_lower_action_per_distinct_lowering(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Lower actions a plan shares between compiles (toolchains/neuron.py `_lowers`) against one made per
    compile, as before: the same actions (fingerprints, records, specs, labels, edges) in the same order; and with
    other settings (an action env) no Lower of the first plan is reused."""
    from neuronbuild.analysis.planner import plan
    from neuronbuild.loading.target_graph import load_targets
    from neuronbuild.plugin_api.toolchain import PlanSettings
    from neuronbuild.toolchains.neuron import LOWER, NeuronToolchain

    gen_monorepo.generate(tmp_path, 24, 3, 3)
    graph = load_targets(tmp_path, ["//..."])

    def summary(ag: Any) -> list[Any]:
        return [(fp, a.kind, str(a.label), a.bucket, dict(a.record), dict(a.spec), a.deps) for fp, a in ag.actions.items()]

    shared = plan(graph)
    lowers = [a for a in shared.actions.values() if a.kind == LOWER]
    made = []
    orig = NeuronToolchain._lowers
    monkeypatch.setattr(NeuronToolchain, "_lowers", lambda self, req: made.append(1) or {})  # one per compile
    separate = plan(graph)
    assert summary(shared) == summary(separate) and len(lowers) > 0
    assert len(made) > len(lowers)  # (compiles of several platforms share a Lower)
    monkeypatch.setattr(NeuronToolchain, "_lowers", orig)
    env = plan(graph, PlanSettings(action_env=(("FOO", "1"),)))
    assert not {fp for fp, a in env.actions.items() if a.kind == LOWER} & {a.fingerprint for a in lowers}


def test_loadings_path_checks_answer_as_pathlib_did(tmp_path: Path) -> None:
    """Loader.find_packages (string paths) and check_source_file (real paths through per-directory real paths)
    against the pathlib code they replace, over a tree with symlinked directories and files inside and outside the
    workspace, chains of links, a dangling link, a directory where a file is expected and a nested workspace."""
    import os

    from neuronbuild.loading.labels import Label
    from neuronbuild.loading.loader import Loader
    from neuronbuild.plugin_api.rules import AttrError
    from neuronbuild.workspace import BUILD_FILE, MARKER

    ws, outside = tmp_path / "ws", tmp_path / "outside"
    for d in ("a/b", "a/c", "real", ".hidden", "nested/x", "deep/er/est"):
        (ws / d).mkdir(parents=True)
        (ws / d / BUILD_FILE).write_text("")
    (ws / MARKER).write_text("")
    (ws / "nested" / MARKER).write_text("")
    outside.mkdir()
    (outside / "o.py").write_text("")
    (ws / "real" / "f.py").write_text("")
    (ws / "deep" / "er" / "est" / "g.py").write_text("")
    os.symlink(ws / "real", ws / "a" / "linkdir")  # a directory link inside the workspace
    os.symlink(outside, ws / "a" / "outdir")  # ... and one pointing outside
    os.symlink(ws / "real" / "f.py", ws / "a" / "b" / "in.py")
    os.symlink(outside / "o.py", ws / "a" / "b" / "out.py")
    os.symlink(ws / "a" / "b" / "in.py", ws / "a" / "c" / "chain.py")  # a link to a link
    os.symlink(ws / "a" / "b" / "out.py", ws / "a" / "c" / "chain_out.py")
    os.symlink(ws / "missing.py", ws / "a" / "c" / "dangling.py")
    (ws / "a" / "c" / "dir.py").mkdir()

    def old_check(loader: Loader, label: Label) -> str:
        path = loader.root / label.package / label.name
        if not path.is_file():
            return "missing"
        try:
            path.resolve().relative_to(loader.root.resolve())
        except ValueError:
            return "outside"
        return "ok"

    def new_check(loader: Loader, label: Label) -> str:
        try:
            loader.check_source_file(label, "srcs")
        except AttrError as e:
            return "missing" if "does not exist" in str(e) else "outside" if "outside" in str(e) else str(e)
        return "ok"

    labels = [Label("a/b", n) for n in ("in.py", "out.py", "none.py")] + \
        [Label("a/c", n) for n in ("chain.py", "chain_out.py", "dangling.py", "dir.py")] + \
        [Label("a", "linkdir/f.py"), Label("a", "outdir/o.py"), Label("real", "f.py"), Label("deep", "er/est/g.py"),
         Label("deep/er/est", "g.py"), Label("", "real/f.py")]
    for root in (ws, tmp_path / "wslink"):
        if root != ws:
            os.symlink(ws, root)  # the workspace itself reached through a link
        loader = Loader(root)
        got = [new_check(loader, lbl) for lbl in labels + labels]  # (twice: the kept directories' real paths)
        assert got == [old_check(Loader(root), lbl) for lbl in labels + labels]
        assert set(got) == {"ok", "missing", "outside"}
        want = sorted(p.parent.relative_to(root).as_posix() for p in root.rglob(BUILD_FILE)
                      if not any(part.startswith(".") for part in p.relative_to(root).parts)
                      and "nested" not in p.parts and p.is_file())
        assert loader.find_packages() == want and "a/b" in want
        assert loader.find_packages("deep") == ["deep/er/est"]


def test_a_plans_probe_from_shard_listings_finds_exactly_the_records_there_and_the_next_pass_sees_new_ones(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from neuronbuild.cache.action_cache import ActionCache
    from neuronbuild.cache.local import LocalCache

    cache = LocalCache(tmp_path / "cache")
    monkeypatch.setattr(ActionCache, "LISTING_AFTER", 0)  # every pass through the shard listings
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "o").write_bytes(b"x")
    fps = [f"{i:02x}{i:062x}" for i in range(40)]
    for fp in fps[::3]:
        cache.store_outputs(fp, f"compile {fp[:4]}", {}, tmp_path / "out", ["o"], 1.0, {})
    assert cache.peek_many(fps) == set(fps[::3]) == {fp for fp in fps if cache.peek(fp)}
    cache.store_outputs(fps[1], "compile new", {}, tmp_path / "out", ["o"], 1.0, {})
    assert cache.peek_many(fps) == {*fps[::3], fps[1]}  # a new pass lists again: the record written since is found
    cache.blobs.evict(cache.lookup(fps[0]).outputs["o"].digest)  # type: ignore[union-attr]
    cache._complete.clear()
    assert cache.peek_many(fps) == set()  # (every entry shares the blob: listed records are peeked whole)


def test_an_equal_re_plan_returns_the_previous_action_graph_and_a_changed_one_a_new_value(tmp_path: Path) -> None:
    from neuronbuild.analysis.analysis_nodes import AnalysisMemo
    from neuronbuild.analysis.planner import plan
    from neuronbuild.loading.target_graph import load_targets

    ws = tmp_path / "ws"
    gen_monorepo.generate(ws, 8, 2, 2)
    memo = AnalysisMemo()
    first = plan(load_targets(ws, ["//..."]), memo=memo)
    assert plan(load_targets(ws, ["//..."]), memo=memo) is first
    build = next(p for p in sorted(ws.rglob("BUILD")) if '"batch"' in p.read_text())
    build.write_text(build.read_text().replace('"batch": [', '"batch": [77, ', 1))
    changed = plan(load_targets(ws, ["//..."]), memo=memo)
    assert changed is not first and set(changed.actions) != set(first.actions)
    assert list(changed.actions) == list(plan(load_targets(ws, ["//..."])).actions)  # = a fresh engine's
    assert [a.fingerprint for a in changed.topological()] == list(changed.actions)


def test_a_plans_recorded_states_are_the_dict_they_stand_for(action_graph: Any) -> None:
    """A plan's invocation record gets {fingerprint: to_build | cached} as a mapping made into a dict only when asked
    by key (a large plan's record only counts its values): the same keys, values and counts as the dict."""
    from collections import Counter

    from neuronbuild.commands.common import _PlannedStates
    from neuronbuild.report.states import CACHED as R_CACHED
    from neuronbuild.report.states import TO_BUILD

    order = action_graph.topological()
    todo, cached = order[: len(order) // 3], [a.fingerprint for a in order[len(order) // 3:]]
    want = dict.fromkeys([a.fingerprint for a in todo], TO_BUILD) | dict.fromkeys(cached, R_CACHED)
    assert Counter(_PlannedStates(todo, cached).values()) == Counter(want.values())
    assert list(_PlannedStates(todo, cached).values()) == list(want.values())
    planned = _PlannedStates(todo, cached)
    assert dict(planned) == want and len(planned) == len(want)
    assert planned.get(cached[0]) == R_CACHED and planned.get(todo[0].fingerprint) == TO_BUILD
    assert planned.get("0" * 64, "none") == "none"


def test_a_kept_engine_after_an_analysis_error_and_its_fix_plans_what_a_fresh_one_plans(tmp_path: Path) -> None:
    """An analysis error half-way through a plan (a bucket set with a dimension no input uses) leaves the kept engine
    (neuronbuild/engine.py under planner.AnalysisMemo) consistent: nothing half-running, and once the edit is fixed
    the re-plan equals a fresh engine's, reusing the nodes the error did not touch."""
    from neuronbuild.analysis.analysis_nodes import AnalysisMemo
    from neuronbuild.analysis.planner import plan
    from neuronbuild.errors import UserInputError
    from neuronbuild.loading.target_graph import load_targets

    ws = tmp_path / "ws"
    gen_monorepo.generate(ws, 8, 2, 2)  # 2 packages
    memo = AnalysisMemo()
    plan(load_targets(ws, ["//..."]), memo=memo)
    build = ws / gen_monorepo.package_name(1) / "BUILD"
    good = build.read_text()
    build.write_text(good.replace(f'"feat": [{gen_monorepo.FEAT}]', f'"feat": [{gen_monorepo.FEAT}], "zz": [1]', 1))
    with pytest.raises(UserInputError, match="'zz', which no input"):
        plan(load_targets(ws, ["//..."]), memo=memo)
    assert not memo.engine._running and not memo.engine._frames
    build.write_text(good.replace('"batch": [', '"batch": [77, ', 1))
    again = plan(load_targets(ws, ["//..."]), memo=memo)
    fresh = plan(load_targets(ws, ["//..."]))
    assert list(again.actions) == list(fresh.actions) and again.compiles == fresh.compiles
    assert memo.reused > 0 and memo.analysed == 3  # (package 1's bucket set and its two compiles)
