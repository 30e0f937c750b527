"""Scheduling decisions, without torch: in-flight work never exceeds --jobs (claims included), the longest critical path
starts first using recorded durations, and --local-ram holds actions back. The executor here is an in-process test
double that "runs" an action by writing its outputs; the scheduler, cache, claims and history are the real ones."""

from __future__ import annotations

from pathlib import Path

import networkx as nx

from neuronbuild.analysis.actions import COMPILE, TRACE, Action, Bucket, DepInput
from neuronbuild.analysis.planner import ActionGraph
from neuronbuild.cache.action_cache import ActionResult
from neuronbuild.cache.identity_index import IdentityIndex
from neuronbuild.cache.local import LocalCache
from neuronbuild.execution.jobs import Completion, Job, Started
from neuronbuild.execution.scheduler import Scheduler, SchedulerOptions
from neuronbuild.loading.labels import Label


class RecordingExecutor:
    """Completes jobs in start order, one per wait(); records what ran concurrently and claims held."""

    local = True
    name = "test"

    def __init__(self, slots: int, cache: LocalCache, tmp: Path) -> None:
        self.slots = slots
        self.cache = cache
        self.tmp = tmp
        self.queue: list[Job] = []
        self.order: list[str] = []
        self.max_in_flight = 0
        self.max_claims = 0

    def warm(self, n: int) -> None:
        pass

    def _claims_held(self) -> int:
        held = 0
        for lock in (self.cache.locks).glob("*.lock"):
            other = self.cache.try_claim(lock.stem)
            if other is None:
                held += 1
            else:
                other.release()
        return held

    def start(self, job: Job) -> Started:
        self.queue.append(job)
        self.order.append(job.action.label.name)
        self.max_in_flight = max(self.max_in_flight, len(self.queue))
        return Started("w", 0)

    def wait(self, timeout: float | None) -> list[Completion]:
        # flock claims are per open file description: a second try_claim in this process fails while one is held.
        self.max_claims = max(self.max_claims, self._claims_held())
        job = self.queue.pop(0)
        out = self.tmp / job.id.replace("#", "-")
        out.mkdir(parents=True)
        for name in job.action.outputs:
            (out / name).write_text(job.action.fingerprint + name)
        return [Completion(job, True, "w", 0, duration_s=1.0, outputs=out)]

    def finish(self, job: Job) -> None:
        pass

    def cancel(self) -> None:
        self.queue.clear()

    def shutdown(self) -> None:
        pass


def _graph(chains: dict[str, int]) -> ActionGraph:
    """Per name: a trace followed by a chain of `n` compiles (name_c1 -> name_c2 ...)."""
    g = nx.DiGraph()
    actions: dict[str, Action] = {}
    b = Bucket((("batch", 1),))
    for name, n in chains.items():
        prev = Action(f"{name}-t".ljust(64, "0"), TRACE, Label("p", name), b, {}, {}, outputs=("program.pt2",))
        actions[prev.fingerprint] = prev
        g.add_node(prev.fingerprint)
        for i in range(1, n + 1):
            a = Action(f"{name}-c{i}".ljust(64, "0"), COMPILE, Label("p", f"{name}_c{i}"), b, {}, {},
                       dep_inputs=(DepInput(prev.fingerprint, "program.pt2", "program.pt2"),),
                       outputs=("lowered.pt2",), platform="trn2")
            actions[a.fingerprint] = a
            g.add_edge(prev.fingerprint, a.fingerprint)
            prev = a
    return ActionGraph(actions, g, ())


def test_in_flight_and_claims_never_exceed_jobs_and_the_longest_chain_starts_first(tmp_path: Path) -> None:
    cache = LocalCache(tmp_path / "cache")
    ag = _graph({"short": 1, "long": 3, "mid": 2})
    ex = RecordingExecutor(2, cache, tmp_path / "out")
    result = Scheduler(tmp_path, cache, ex, SchedulerOptions()).run(ag)
    assert result.ok and len(result.executed) == 9
    assert ex.max_in_flight == 2 and ex.max_claims <= 2
    assert ex.order[:2] == ["long", "mid"]  # by critical path (estimates: trace 4 s + n compiles x 4 s)


def test_recorded_durations_reorder_work(tmp_path: Path) -> None:
    cache = LocalCache(tmp_path / "cache")
    ag = _graph({"a": 1, "b": 1})
    # "b"'s compile was slow last time (same identity): its trace goes first.
    b_compile = next(a for a in ag.actions.values() if a.label.name == "b_c1")
    a_compile = next(a for a in ag.actions.values() if a.label.name == "a_c1")
    IdentityIndex(cache.root).record(ActionResult("f" * 64, b_compile.identity, {}, {}, 120.0,
                                                  {"peak_rss_mb": 300.0}))
    IdentityIndex(cache.root).record(ActionResult("e" * 64, a_compile.identity, {}, {}, 1.0))
    assert cache.history().latest(b_compile.identity).peak_rss_mb == 300.0
    ex = RecordingExecutor(1, cache, tmp_path / "out")
    Scheduler(tmp_path, cache, ex, SchedulerOptions()).run(ag)
    assert ex.order[0] == "b"
    assert cache.history().latest(b_compile.identity).duration_s == 1.0  # this run's measurement


def test_local_ram_cap_holds_actions_back(tmp_path: Path) -> None:
    cache = LocalCache(tmp_path / "cache")
    ag = _graph({"a": 0, "b": 0, "c": 0})  # three independent traces, estimated 800 MB each
    ex = RecordingExecutor(3, cache, tmp_path / "out")
    Scheduler(tmp_path, cache, ex, SchedulerOptions(local_ram_mb=1700)).run(ag)
    assert ex.max_in_flight == 2
    ex = RecordingExecutor(3, LocalCache(tmp_path / "c2"), tmp_path / "out2")
    Scheduler(tmp_path, ex.cache, ex, SchedulerOptions(local_ram_mb=100)).run(_graph({"a": 0, "b": 0}))
    assert ex.max_in_flight == 1  # one action always runs, even above the cap
