"""Scheduling decisions, without torch: in-flight work never exceeds --jobs (claims included), the longest critical path
starts first using recorded durations, and --local-ram holds actions back. The executor here is an in-process test
double that "runs" an action by writing its outputs; the scheduler, cache, claims and history are the real ones."""

from __future__ import annotations

from pathlib import Path

import networkx as nx

from neuronbuild import plugins
from neuronbuild.analysis.action_graph import ActionGraph
from neuronbuild.cache.action_cache import ActionResult
from neuronbuild.cache.identity_index import IdentityIndex
from neuronbuild.cache.local import LocalCache
from neuronbuild.execution import events as ev
from neuronbuild.execution.events import BuildEvent, EventBus
from neuronbuild.execution.jobs import Completion, Job, Started
from neuronbuild.execution.scheduler import Scheduler, SchedulerOptions
from neuronbuild.loading.labels import Label
from neuronbuild.plugin_api.actions import COMPILE, TRACE, WEIGHTS, Action, Bucket, DepInput
from neuronbuild.plugin_api.toolchain import StepDirs


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
        self.kinds: list[str] = []
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
        self.kinds.append(job.action.kind)
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


class WarmingToolchain:
    """A toolchain with a warm-up hook (as the cpu toolchain's precompiled headers): compiles for one isa share it."""

    name = "warmtest"
    platforms = ("warmtest",)
    artifact_format = "warmtest"
    estimate_s = 15.0
    estimate_mb = 100.0
    validate_note = ""
    option_keys = ()
    target_attrs = ()
    warm_up_shared = True
    runtime_loader = ""
    tp_degrees: dict[str, tuple[int, ...]] = {}  # never sharded

    # (the scheduler tests run its actions through a recording executor: nothing plans, runs or loads them)
    def target_record(self, platform: str, attrs: object) -> dict[str, str]:
        return {"platform": platform}

    def describe_target(self, target: dict[str, str]) -> str:
        return target["platform"]

    def versions(self, platform: str, settings: object) -> dict[str, str]:
        return {"x": "1"}

    def plan(self, req: object) -> list[object]:
        raise AssertionError("not planned in these tests")

    def run(self, step: str, spec: object, sandbox: object, out_dir: object) -> dict[str, object]:
        raise AssertionError("not run in these tests")

    def load_artifact(self, files: object) -> object:
        raise AssertionError("not loaded in these tests")

    def notes(self, settings: object) -> list[str]:
        return []

    def warm_up_key(self, spec: dict[str, str]) -> dict[str, str] | None:
        return {"isa": spec["isa"]} if spec.get("step") == COMPILE else None

    def prepare_worker(self) -> None:
        pass

    def step_dirs(self, spec: object) -> StepDirs:
        return StepDirs()

    def host_status(self) -> dict[str, str | None]:
        return {}


plugins.register_toolchain(WarmingToolchain())  # type: ignore[arg-type]


class ProcessWarmingToolchain(WarmingToolchain):
    """A toolchain whose warm-up only fills the worker process (as the Neuron toolchain's jax import)."""

    name = "procwarm"
    platforms = ("procwarm",)
    warm_up_shared = False


plugins.register_toolchain(ProcessWarmingToolchain())  # type: ignore[arg-type]


class Events:
    def __init__(self) -> None:
        self.got: list[BuildEvent] = []

    def on_event(self, e: BuildEvent) -> None:
        self.got.append(e)

    def close(self) -> None:
        pass

    def kinds(self, kind: str) -> list[BuildEvent]:
        return [e for e in self.got if e.kind == kind]


def _warm_graph(isas: list[str], traces: bool = True) -> ActionGraph:
    """Per isa: a trace and a compile of the warming toolchain (or only the compile)."""
    g = nx.DiGraph()
    actions: dict[str, Action] = {}
    b = Bucket((("batch", 1),))
    for isa in isas:
        deps: tuple[DepInput, ...] = ()
        if traces:
            t = Action(f"t-{isa}".ljust(64, "0"), TRACE, Label("p", f"t_{isa}"), b, {}, {}, outputs=("program.pt2",))
            actions[t.fingerprint] = t
            g.add_node(t.fingerprint)
            deps = (DepInput(t.fingerprint, "program.pt2", "program.pt2"),)
        c = Action(f"c-{isa}".ljust(64, "0"), COMPILE, Label("p", f"c_{isa}"), b, {"toolchain": {"x": "1"}},
                   {"toolchain": "warmtest", "step": COMPILE, "isa": isa}, dep_inputs=deps, outputs=("out",),
                   platform="warmtest", target=f"warmtest/{isa}")
        actions[c.fingerprint] = c
        g.add_node(c.fingerprint)
        for d in deps:
            g.add_edge(d.action, c.fingerprint)
    return ActionGraph(actions, g, ())


def test_a_toolchain_warm_up_runs_once_per_key_first_beside_the_traces(tmp_path: Path) -> None:
    cache = LocalCache(tmp_path / "cache")
    ag = _warm_graph(["v4", "v4b"])
    for a in ag.actions.values():  # two compiles with the same key
        if a.kind == COMPILE:
            a.spec["isa"] = "v4"  # type: ignore[index]
    got = Events()
    ex = RecordingExecutor(2, cache, tmp_path / "out")
    result = Scheduler(tmp_path, cache, ex, SchedulerOptions(), EventBus([got])).run(ag)
    assert result.ok and len(result.executed) == 4  # the warm-up is not an action of the build
    assert ex.kinds[0] == "warm_up" and ex.kinds.count("warm_up") == 1 and ex.kinds[1] == TRACE
    assert ex.max_in_flight == 2  # the warm-up holds a worker like any job
    started, finished = got.kinds(ev.WARM_UP_STARTED), got.kinds(ev.WARM_UP_FINISHED)
    assert len(started) == len(finished) == 1 and finished[0].fields["ok"]
    assert started[0].fields["key"] == {"isa": "v4"} and "warmtest/v4" in started[0].fields["description"]
    assert all(e.fields["kind"] != "warm_up" for e in got.kinds(ev.ACTION_FINISHED))


def test_a_warm_up_that_only_fills_its_worker_takes_no_worker_from_the_traces(tmp_path: Path) -> None:
    """Each worker runs such a warm-up itself before its first step that needs it (worker.warm_before): a
    pseudo-action beside the traces would give the other workers nothing."""
    cache = LocalCache(tmp_path / "cache")
    ag = _warm_graph(["v4", "v3"])
    for a in ag.actions.values():
        if a.kind == COMPILE:
            a.spec["toolchain"] = "procwarm"  # type: ignore[index]
    ex = RecordingExecutor(2, cache, tmp_path / "out")
    assert Scheduler(tmp_path, cache, ex, SchedulerOptions()).run(ag).ok
    assert "warm_up" not in ex.kinds and ex.kinds[:2] == [TRACE, TRACE]


def test_warm_ups_one_per_key_and_never_all_workers(tmp_path: Path) -> None:
    cache = LocalCache(tmp_path / "cache")
    ex = RecordingExecutor(3, cache, tmp_path / "out")
    Scheduler(tmp_path, cache, ex, SchedulerOptions()).run(_warm_graph(["v2", "v3", "v4"]))
    assert ex.kinds[:2] == ["warm_up", "warm_up"] and ex.kinds.count("warm_up") == 2  # 3 keys, a worker kept free
    assert ex.max_in_flight == 3


def test_no_warm_up_with_one_worker_or_nothing_to_overlap(tmp_path: Path) -> None:
    cache = LocalCache(tmp_path / "cache")
    ex = RecordingExecutor(1, cache, tmp_path / "out")
    assert Scheduler(tmp_path, cache, ex, SchedulerOptions()).run(_warm_graph(["v4"])).ok
    assert "warm_up" not in ex.kinds  # one worker: the first compile builds it at the same cost
    cache2 = LocalCache(tmp_path / "cache2")
    ex = RecordingExecutor(2, cache2, tmp_path / "out2")
    assert Scheduler(tmp_path, cache2, ex, SchedulerOptions()).run(_warm_graph(["v4"], traces=False)).ok
    assert "warm_up" not in ex.kinds  # only compiles ready: nothing to overlap with
    cache3 = LocalCache(tmp_path / "cache3")
    ex = RecordingExecutor(2, cache3, tmp_path / "out3")
    assert Scheduler(tmp_path, cache3, ex, SchedulerOptions()).run(_graph({"a": 1})).ok
    assert "warm_up" not in ex.kinds  # no toolchain with a warm-up in the plan


class FailingWarmUp(RecordingExecutor):
    def wait(self, timeout: float | None) -> list[Completion]:
        if self.queue and self.queue[0].action.kind == "warm_up":
            job = self.queue.pop(0)
            return [Completion(job, False, "w", 0, error="g++ exploded", duration_s=0.5)]
        return super().wait(timeout)


def test_a_failed_warm_up_is_not_a_build_failure(tmp_path: Path) -> None:
    cache = LocalCache(tmp_path / "cache")
    got = Events()
    ex = FailingWarmUp(2, cache, tmp_path / "out")
    result = Scheduler(tmp_path, cache, ex, SchedulerOptions(), EventBus([got])).run(_warm_graph(["v4"]))
    assert result.ok and len(result.executed) == 2
    (finished,) = got.kinds(ev.WARM_UP_FINISHED)
    assert not finished.fields["ok"] and "g++ exploded" in finished.fields["error"]


class StoreWatchingExecutor(RecordingExecutor):
    """Notes, at each start, whether the previous completed job's outputs were already in the cache."""

    def __init__(self, slots: int, cache: LocalCache, tmp: Path) -> None:
        super().__init__(slots, cache, tmp)
        self.completed: list[str] = []
        self.stored_before_next_start: list[bool] = []

    def start(self, job: Job) -> Started:
        if self.completed:
            self.stored_before_next_start.append(self.cache.peek(self.completed[-1]))
        return super().start(job)

    def wait(self, timeout: float | None) -> list[Completion]:
        done = super().wait(timeout)
        self.completed += [c.job.action.fingerprint for c in done]
        return done


def test_a_freed_worker_gets_ready_work_before_the_finished_actions_outputs_are_stored(tmp_path: Path) -> None:
    cache = LocalCache(tmp_path / "cache")
    ex = StoreWatchingExecutor(1, cache, tmp_path / "out")
    result = Scheduler(tmp_path, cache, ex, SchedulerOptions()).run(_graph({"a": 0, "b": 0, "c": 0}))
    assert result.ok and len(result.executed) == 3
    # Independent traces: each next one started while its predecessor's outputs were still being stored.
    assert ex.stored_before_next_start == [False, False]
    ex = StoreWatchingExecutor(1, LocalCache(tmp_path / "c2"), tmp_path / "out2")
    assert Scheduler(tmp_path, ex.cache, ex, SchedulerOptions()).run(_graph({"a": 1})).ok
    assert ex.stored_before_next_start == [True]  # a compile needs its trace's stored output: it waits for it


class WeightsToolchain(WarmingToolchain):
    """A toolchain whose step holds its model's weights (as a weights action does): 100 MB + 1 MB per weight MB."""

    name = "weightstest"
    platforms = ("weightstest",)
    artifact_format = "weightstest"
    estimate_mb = 100.0
    estimate_mb_per_weight_mb = 1.0

    def warm_up_key(self, spec: dict[str, str]) -> dict[str, str] | None:
        return None


plugins.register_toolchain(WeightsToolchain())


def _weights_graph(ws: Path, sizes_mb: dict[str, int], buckets: int = 2) -> ActionGraph:
    """Per model: a weights file of the given size (sparse) in `ws`, its trace, and one weightstest step per bucket."""
    g = nx.DiGraph()
    actions: dict[str, Action] = {}
    for name, mb in sizes_mb.items():
        with open(ws / f"{name}.safetensors", "wb") as f:
            f.truncate(mb << 20)
        b0 = Bucket((("batch", 1),))
        w = Action(f"w-{name}".ljust(64, "0"), WEIGHTS, Label("p", name), Bucket(()), {},
                   {"model": {"weights": {"path": f"{name}.safetensors", "digest": "d"}}},
                   outputs=("constants.safetensors",))
        t = Action(f"t-{name}".ljust(64, "0"), TRACE, Label("p", name), b0, {}, {"model": {}}, outputs=("program.pt2",))
        actions[w.fingerprint], actions[t.fingerprint] = w, t
        g.add_node(w.fingerprint)
        g.add_node(t.fingerprint)
        for i in range(buckets):
            c = Action(f"c-{name}-{i}".ljust(64, "0"), COMPILE, Label("p", f"{name}_w"), Bucket((("batch", i + 1),)),
                       {"toolchain": {"x": "1"}}, {"toolchain": "weightstest", "step": COMPILE},
                       dep_inputs=(DepInput(t.fingerprint, "program.pt2", "program.pt2"),
                                   DepInput(w.fingerprint, "constants.safetensors", "constants.safetensors")),
                       outputs=("out",), platform="weightstest", target="weightstest")
            actions[c.fingerprint] = c
            g.add_edge(t.fingerprint, c.fingerprint)
            g.add_edge(w.fingerprint, c.fingerprint)
    return ActionGraph(actions, g, ())


class SnapshotExecutor(RecordingExecutor):
    """Records, at each start, the fingerprints of every job in flight then (the one starting included)."""

    def __init__(self, slots: int, cache: LocalCache, tmp: Path) -> None:
        super().__init__(slots, cache, tmp)
        self.snapshots: list[list[str]] = []

    def start(self, job: Job) -> Started:
        started = super().start(job)
        self.snapshots.append([j.action.fingerprint for j in self.queue])
        return started


def _admitted_sets(ex: SnapshotExecutor, got: Events) -> list[dict[str, float]]:
    """At each start: label[bucket] -> estimate (MB) of every action in flight then."""
    est = {e.fields["fingerprint"]: float(e.fields["estimate_mb"]) for e in got.kinds(ev.ACTION_STARTED)}
    name = {e.fields["fingerprint"]: e.fields["label"] + str(e.fields["bucket"]) for e in got.kinds(ev.ACTION_STARTED)}
    return [{name[fp]: est[fp] for fp in snap} for snap in ex.snapshots]


def test_first_build_estimates_come_from_weight_bytes_and_never_exceed_local_ram_together(tmp_path: Path) -> None:
    """Nothing recorded yet: a step estimated from its model's declared weight bytes (1000 MB -> 1100 MB) never starts
    beside another whose estimate would take the sum past --local-ram, while the same graph with small weights runs
    both steps at once; a trace on shapes is estimated small whatever its weights."""
    ws = tmp_path / "ws"
    ws.mkdir()
    cache = LocalCache(tmp_path / "cache")
    got = Events()
    ex = SnapshotExecutor(4, cache, tmp_path / "out")
    result = Scheduler(ws, cache, ex, SchedulerOptions(local_ram_mb=2000), EventBus([got])).run(
        _weights_graph(ws, {"big": 1000}))
    assert result.ok and len(result.executed) == 4
    est = {e.fields["label"] + str(e.fields.get("bucket")): e.fields["estimate_mb"]
           for e in got.kinds(ev.ACTION_STARTED)}
    steps = {k: v for k, v in est.items() if "big_w" in k}
    assert len(steps) == 2 and all(v == 1100.0 for v in steps.values())  # 100 + 1.0 x 1000 MB of weights
    # the trace on shapes: its default; the weights action: its default + one streamed piece
    assert sorted(v for k, v in est.items() if "big_w" not in k) == [800.0, 800.0 + 128.0]
    plan = got.kinds(ev.BUILD_STARTED)[0].fields["plan"]
    assert sum("weights" in p["estimate_mb_source"] for p in plan) == 3  # the weights action and the two steps
    sets = _admitted_sets(ex, got)
    assert all(sum(s.values()) <= 2000 for s in sets)
    assert max(len([k for k in s if "big_w" in k]) for s in sets) == 1  # the two steps one after the other
    finished = {e.fields["label"] + str(e.fields.get("bucket")): e.fields for e in got.kinds(ev.ACTION_FINISHED)}
    assert all(f["estimate_mb"] == est[k] and "peak_rss_mb" in f for k, f in finished.items())

    # The same graph with 10 MB of weights: both steps fit together.
    ws2 = tmp_path / "ws2"
    ws2.mkdir()
    got2 = Events()
    ex2 = SnapshotExecutor(4, LocalCache(tmp_path / "cache2"), tmp_path / "out2")
    assert Scheduler(ws2, ex2.cache, ex2, SchedulerOptions(local_ram_mb=2000), EventBus([got2])).run(
        _weights_graph(ws2, {"small": 10})).ok
    assert max(len([k for k in s if "small_w" in k]) for s in _admitted_sets(ex2, got2)) == 2


def test_a_recorded_peak_of_one_bucket_estimates_the_other_buckets(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    cache = LocalCache(tmp_path / "cache")
    ag = _weights_graph(ws, {"m": 1000}, buckets=3)
    first = next(a for a in ag.actions.values() if a.kind == COMPILE)
    IdentityIndex(cache.root).record(ActionResult("f" * 64, first.identity, {}, {}, 5.0, {"peak_rss_mb": 300.0}))
    got = Events()
    ex = SnapshotExecutor(4, cache, tmp_path / "out")
    assert Scheduler(ws, cache, ex, SchedulerOptions(local_ram_mb=2000), EventBus([got])).run(ag).ok
    steps = [e.fields["estimate_mb"] for e in got.kinds(ev.ACTION_STARTED) if e.fields["label"].endswith("m_w")]
    assert steps == [300.0, 300.0, 300.0]  # the recorded bucket's peak, not 100 + 1000 from the weights
    assert max(len([k for k in s if "m_w" in k]) for s in _admitted_sets(ex, got)) == 3
