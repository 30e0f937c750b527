"""Runs an ActionGraph: skips cached actions, runs the rest longest-critical-path first, stores results, reports events."""

from __future__ import annotations

import heapq
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import networkx as nx

from neuronbuild import plugins
from neuronbuild.analysis.action_graph import ActionGraph
from neuronbuild.analysis.estimate import Estimator, declared_weight_mb
from neuronbuild.execution import cutoff
from neuronbuild.execution import events as ev
from neuronbuild.execution.cache_api import CachedResult, Claim, SpawnCache
from neuronbuild.execution.events import EventBus, action_fields
from neuronbuild.execution.jobs import Completion, Executor, Job
from neuronbuild.execution.resources import RamBudget
from neuronbuild.execution.sandbox import InputChanged
from neuronbuild.plugin_api.actions import Action, Bucket, is_light, make_action, provider_name
from neuronbuild.plugin_api.toolchain import WARM_UP, warm_up_spec


@dataclass(frozen=True)
class Failure:
    """A failed action: what it was, the first lines of its error and its full log."""

    action: Action
    error: str
    log: Path
    worker_died: bool = False


@dataclass(frozen=True)
class BuildResult:
    """What a build did with each of its `total` actions: executed, cached (or produced by a concurrent build), failed,
    skipped (an input failed), stopped (running when a failure ended the build), not started (the build stopped
    first), or not needed (only consumers that were cached need it). Every action is in exactly one of these.

    `results`: {fingerprint: cache entry} of every action the build has a result of (cached, cut off, produced by
    another build, executed), as the scheduler found or stored it: what materialisation, bundles, the no-op stamp and
    the invocation record read instead of asking the cache again."""

    total: int
    executed: tuple[str, ...] = ()
    cached: tuple[str, ...] = ()
    failures: tuple[Failure, ...] = field(default=())
    wall_s: float = 0.0
    skipped: tuple[str, ...] = ()
    stopped: tuple[str, ...] = ()
    not_started: tuple[str, ...] = ()
    outputs_dir: str = ""  # where materialised outputs went (set by the build after materialisation)
    outputs: tuple[str, ...] = ()  # their paths relative to outputs_dir
    # --keep-going: the requested targets whose analysis failed (their one-line errors), left out of the plan
    analysis_errors: tuple[str, ...] = ()
    results: Mapping[str, CachedResult] = field(default_factory=dict, compare=False, repr=False)

    @property
    def ok(self) -> bool:
        return not self.failures and not self.analysis_errors

    @property
    def not_needed(self) -> int:
        return self.total - len(self.executed) - len(self.cached) - len(self.failures) - len(self.skipped) \
            - len(self.stopped) - len(self.not_started)

    def summary(self) -> str:
        s = (f"{self.total} actions: {len(self.executed)} executed, {len(self.cached)} cached "
             f"({self.wall_s:.1f} s)")
        for some, what in ((self.failures, "failed"), (self.skipped, "not run (an input failed)"),
                           (self.stopped, "stopped"), (self.not_started, "not started")):
            if some:
                s += f", {len(some)} {what}"
        if self.stopped or self.not_started:
            s += " (the first failure ends a build; --keep-going runs everything that does not need the failed one)"
        if self.not_needed > 0:
            s += f", {self.not_needed} not needed (their consumers are cached)"
        if self.analysis_errors:
            n = len(self.analysis_errors)
            s += f"; {n} requested target{'s' if n > 1 else ''} not built (analysis failed)"
        if self.outputs_dir:
            shown = ", ".join(self.outputs[:4]) + (f" and {len(self.outputs) - 4} more" if len(self.outputs) > 4 else "")
            s += f"\nOutputs in {self.outputs_dir}" + (f": {shown}" if shown else "")
        return s


@dataclass(frozen=True)
class SchedulerOptions:
    """How to run: continue after failures, retries after a worker died, the local memory cap (0: none)."""

    keep_going: bool = False
    retries: int = 0
    local_ram_mb: int = 0


def needed_actions(ag: ActionGraph, cache: SpawnCache, probe: bool = False,
                   results: dict[str, CachedResult] | None = None) -> tuple[list[Action], list[str]]:
    """Actions to execute (in topological order) and those satisfied from the cache (any tier), whose entries
    (cached or cut off) go into `results` (not with `probe`).

    A producer is only needed when one of its consumers must run: a cached compile never forces its trace.
    With `probe` (plan, explain, dry runs) entries are only checked, never fetched from a shared tier or counted."""
    order = ag.topological_seq()
    hits = cache.peek_many(ag.order_fingerprints()) if probe else None  # (a probe writes nothing: one pass)
    if hits is not None and not hits:
        # Nothing is cached: nothing can be cut off either (that needs cached inputs), and every uncached action is
        # needed (a sink is; every other one has consumers, all uncached and, by induction, needed).
        return list(order), []
    cached: set[str] = set(hits) if hits is not None else set()
    missing = [a for a in order if a.fingerprint not in cached] if hits is not None else order
    found: dict[str, CachedResult] = {} if results is None else results
    for a in missing:  # (in topological order: an input cut off is in `cached` before its consumers are asked)
        res = cache.lookup(a.fingerprint) if hits is None else None
        if res is None and a.dep_inputs and all(d.action in cached for d in a.dep_inputs):
            if probe:
                if cutoff.peek(a, cache, probe=True) is not None:
                    cached.add(a.fingerprint)
                continue
            reused = cutoff.reuse(a, cache, found)  # early cutoff: its inputs' outputs are an earlier result's
            res = reused[1] if reused is not None else None
        if res is not None:
            cached.add(a.fingerprint)
            found[a.fingerprint] = res
    need: set[str] = set()
    uncached = [a for a in missing if a.fingerprint not in cached]
    if uncached:
        consumers_of = ag.consumers
        for a in reversed(uncached):  # (an action is needed when a consumer is: consumers come first here)
            fp = a.fingerprint
            consumers = consumers_of[fp]
            if not consumers or not need.isdisjoint(consumers):
                need.add(fp)
    return [a for a in uncached if a.fingerprint in need], [a.fingerprint for a in order if a.fingerprint in cached]


def critical_paths(ag: ActionGraph, todo: list[Action], duration: dict[str, float]) -> dict[str, float]:
    """For each action to run: its duration plus the longest chain of durations of the actions that wait for it."""
    need = {a.fingerprint for a in todo}
    cp: dict[str, float] = {}
    for a in reversed(todo):  # todo is topological: consumers come first here
        tail = max((cp[s] for s in ag.consumers[a.fingerprint] if s in need), default=0.0)
        cp[a.fingerprint] = duration[a.fingerprint] + tail
    return cp


def warm_ups(todo: list[Action], apart: bool = False) -> dict[str, Action]:
    """{fingerprint of an action to run: the warm-up pseudo-action it benefits from}, one pseudo-action per
    (step provider, warm-up key) among the steps to run (see plugin_api/toolchain.py). A pseudo-action
    carries the toolchain versions of the first step needing it, so a farm worker with another toolchain refuses it.

    Only warm-ups that leave something for the machine's other workers (files: inductor's precompiled headers) get
    a pseudo-action; a toolchain whose warm-up only fills its worker process (`warm_up_shared = False`: the Neuron
    toolchain's jax import) is warmed by each worker before its first such step (worker.warm_before), where a
    pseudo-action would only take a worker away from the traces; unless warm-ups run `apart` (in the local pool's
    zygote, which every worker is forked from: there the process's state is what is shared)."""
    made: dict[str, Action] = {}
    out: dict[str, Action] = {}
    providers = plugins.step_providers()
    for a in todo:
        spec = warm_up_spec(providers, a.spec, shared_only=not apart)
        if spec is not None:
            w = make_action(WARM_UP, a.label, Bucket(()), {"warm_up": provider_name(spec), "key": spec["key"],
                                                            "toolchain": dict(a.versions)},
                            spec, platform=a.platform, target=a.target)
            out[a.fingerprint] = made.setdefault(w.fingerprint, w)
    return out


def warm_up_description(a: Action, host: str = "") -> str:
    """"Warm up aoti for cpu/x86-64-v3 on HOST"; a warm-up for steps without a target (the Neuron lowering, shared
    by every Neuron platform) names none."""
    where = a.target or a.platform
    return f"Warm up {provider_name(a.spec)}" + (f" for {where}" if where else "") + (f" on {host}" if host else "")


@dataclass
class _Warming:
    job: Job
    worker: str
    pid: int
    started: float
    apart: bool = False  # run beside the workers (the pool's zygote): takes no slot, holds back the steps needing it


@dataclass
class _Running:
    job: Job
    claim: Claim
    mem_mb: float
    started: float


class Scheduler:
    """Dispatches missing actions to an executor as their inputs become available.

    Before executing an action it takes the cache's claim on it, only when a worker is free to run it; if another
    build holds the claim, it runs other work meanwhile and then reuses that build's result, so concurrent builds
    execute each action once and share the work between them."""

    POLL_S = 0.2

    def __init__(self, root: Path, cache: SpawnCache, executor: Executor, options: SchedulerOptions | None = None,
                 bus: EventBus | None = None) -> None:
        self.root = root
        self.cache = cache
        self.executor = executor
        self.options = options or SchedulerOptions()
        self.bus = bus or EventBus()

    def run(self, ag: ActionGraph) -> BuildResult:
        start = time.perf_counter()
        t0 = time.time()
        results: dict[str, CachedResult] = {}
        todo, cached_list = needed_actions(ag, self.cache, results=results)
        self.bus.emit(ev.CACHE_CHECKED, start=t0, duration_s=time.time() - t0, lookups=len(ag.actions),
                      hits=len(cached_list))
        est = Estimator(self.cache.history())
        duration = {a.fingerprint: est.estimate(a).seconds for a in todo}
        prio = critical_paths(ag, todo, duration)
        weight_mb = declared_weight_mb(todo, ag.actions, self.root)
        peaks = {a.fingerprint: est.peak_mb(a, weight_mb[a.fingerprint]) for a in todo}
        mem = {fp: p.mb for fp, p in peaks.items()}
        self.bus.emit(ev.BUILD_STARTED, total_actions=len(ag.actions), to_execute=len(todo), cached=len(cached_list),
                      jobs=self.executor.slots, executor=self.executor.name,
                      plan=[{"fingerprint": a.fingerprint, "description": a.describe(),
                             "estimate_s": round(duration[a.fingerprint], 3),
                             "estimate_mb": round(mem[a.fingerprint], 1),
                             "estimate_mb_source": peaks[a.fingerprint].source,
                             "critical_path_s": round(prio[a.fingerprint], 3)} for a in todo])
        for fp in cached_list:
            self.bus.emit(ev.ACTION_CACHED, **action_fields(ag.actions[fp]))
        run = _Run(self, ag, todo, prio, mem, results)
        run.duration = duration
        run.mem_recorded = {fp: p.recorded for fp, p in peaks.items()}
        interrupted = False
        try:
            run.loop()
        except BaseException:
            interrupted = True
            raise
        finally:
            run.cleanup()
            done = {*run.executed, *run.reused, *(f.action.fingerprint for f in run.failures), *run.skipped,
                    *run.stopped_fps}
            result = BuildResult(len(ag.actions), tuple(run.executed), tuple(cached_list) + tuple(run.reused),
                                 tuple(run.failures), time.perf_counter() - start, tuple(run.skipped),
                                 tuple(run.stopped_fps), tuple(fp for fp in run.todo if fp not in done),
                                 results=run.results)
            self.bus.emit(ev.BUILD_FINISHED, ok=result.ok and not interrupted, interrupted=interrupted,
                          executed=len(result.executed), cached=len(result.cached), failed=len(result.failures),
                          skipped=len(result.skipped), stopped=len(result.stopped),
                          not_started=len(result.not_started), wall_s=round(result.wall_s, 3))
        return result


class _Run:
    """The state of one scheduler run."""

    def __init__(self, s: Scheduler, ag: ActionGraph, todo: list[Action], prio: dict[str, float],
                 mem: dict[str, float], results: dict[str, CachedResult]) -> None:
        self.s = s
        self.results = results  # every action's cache entry as found or stored (BuildResult.results)
        self.ag = ag
        self.todo = {a.fingerprint: a for a in todo}
        self.prio = prio
        self.mem = mem
        self.duration: dict[str, float] = {}  # the estimated seconds of each action (its default timeout's base)
        self.mem_recorded: dict[str, bool] = {}  # whether each peak estimate comes from a recorded run
        self.blockers = {a.fingerprint: {d for d in a.deps if d in self.todo} for a in todo}
        self.ready: list[tuple[float, int, str]] = []
        self._seq = 0
        for fp, deps in self.blockers.items():
            if not deps:
                self._push(fp)
        self.running: dict[str, _Running] = {}
        self.held: dict[str, Claim] = {}  # claims kept across a retry
        self.other_build: set[str] = set()  # claimed by another build: wait for its result
        self.attempts: dict[str, int] = {}
        self.executed: list[str] = []
        self.reused: list[str] = []
        self.failures: list[Failure] = []
        self.skipped: list[str] = []
        self.stopped_fps: list[str] = []  # running when the build stopped: cancelled, not failed
        self.stopped = False
        self.budget = RamBudget(s.options.local_ram_mb) if s.options.local_ram_mb and s.executor.local else None
        self.warming: dict[str, _Warming] = {}  # toolchain warm-ups running (pseudo-jobs), by job id
        self.warm_for: dict[str, str] = {}  # fingerprint of a step -> its warm-up's, while that runs apart

    def _push(self, fp: str) -> None:
        self._seq += 1
        heapq.heappush(self.ready, (-self.prio[fp], self._seq, fp))

    def loop(self) -> None:
        if not self.todo:
            return
        ex = self.s.executor  # workers for what is ready (more start on demand); none for light steps run here
        runs_light = getattr(ex, "runs_light", False)
        heavy = sum(1 for _p, _n, fp in self.ready if not (runs_light and is_light(self.todo[fp])))
        if heavy:
            ex.warm(min(heavy, ex.slots))
        self._start_warm_ups()
        while True:
            self._poll_other_builds()
            if not self.stopped:
                self._dispatch()
            if not self.running and not self.warming:
                if self.other_build and not self.stopped:
                    time.sleep(self.s.POLL_S)
                    continue
                if self.ready and not self.stopped:
                    continue
                return
            finished: list[tuple[Completion, _Running]] = []
            completions = self.s.executor.wait(self.s.POLL_S if self.other_build else None)
            now = time.time()
            for c in completions:
                if c.job.id in self.warming:
                    self._warmed(c)
                else:
                    finished.append((c, self.running.pop(c.job.id)))
            if finished and not self.stopped and all(c.ok for c, _r in finished):
                self._dispatch()  # freed workers take other ready work first: storing outputs takes seconds
            for c, r in finished:
                self._complete(c, r, now)
            if self.stopped and (self.running or self.warming):
                self._cancel_running()

    def _start_warm_ups(self) -> None:
        """Per-machine toolchain warm-ups (precompiled headers) as pseudo-jobs at the start, beside the first
        actions, when they can overlap with work that does not need them (traces) on another worker. With one
        worker, or only steps needing the warm-up ready, the worker warms up before its first step (worker.warm_before)."""
        ex = self.s.executor
        apart = bool(getattr(ex, "warms_apart", False))
        if ex.slots < 2 and not apart:
            return
        needs = warm_ups(list(self.todo.values()), apart)
        if not needs or (not apart and all(fp in needs for _p, _n, fp in self.ready)):
            return
        hosts = ex.hosts() if hasattr(ex, "hosts") else [""]
        seen: set[str] = set()
        for a in needs.values():
            if a.fingerprint in seen:
                continue
            seen.add(a.fingerprint)
            for i, host in enumerate(hosts):
                if not apart and len(self.warming) >= ex.slots - 1:  # leave a worker for the actions
                    return
                log = self.s.cache.logs / WARM_UP / f"{a.fingerprint}-{i}.log"
                job = Job(a, i, log, host)
                desc = warm_up_description(a, host)
                try:
                    log.parent.mkdir(parents=True, exist_ok=True)
                    log.write_text(f"# {desc}\n", encoding="utf-8")
                    started = ex.start(job)
                except (InputChanged, OSError):
                    continue
                runs_apart = apart and started.worker == "zygote"
                self.warming[job.id] = _Warming(job, started.worker, started.pid, time.time(), runs_apart)
                if runs_apart:
                    self.warm_for.update({fp: a.fingerprint for fp, w in needs.items() if w.fingerprint == a.fingerprint})
                self.s.bus.emit(ev.WARM_UP_STARTED, description=desc, toolchain=provider_name(a.spec),
                                key=dict(a.spec["key"]), host=host, worker=started.worker, pid=started.pid)

    def _warmed(self, c: Completion) -> None:
        """A warm-up ended: said in events and the profile; its failure is not the build's (a step that needs what
        it would have built builds it itself)."""
        w = self.warming.pop(c.job.id)
        a = c.job.action
        if not any(o.job.action.fingerprint == a.fingerprint for o in self.warming.values()):
            # the last one (a farm warms each Dask worker): the steps held back for it go now
            self.warm_for = {fp: k for fp, k in self.warm_for.items() if k != a.fingerprint}
        self.s.executor.finish(c.job)
        desc = warm_up_description(a, c.job.host)
        self.s.bus.emit(ev.WARM_UP_FINISHED, description=desc, toolchain=provider_name(a.spec),
                        key=dict(a.spec["key"]), host=c.job.host, worker=c.worker or w.worker, pid=c.pid or w.pid,
                        start=w.started, duration_s=round(c.duration_s, 3), cpu_s=round(c.cpu_s, 3), ok=c.ok, error=c.error,
                        metadata=dict(c.metadata), log=str(c.job.log))

    def _dispatch(self) -> None:
        ex = self.s.executor
        held_back: list[tuple[float, int, str]] = []  # steps whose warm-up runs apart: dispatched when it is done
        try:
            self._dispatch_ready(ex, held_back)
        finally:
            for item in held_back:
                heapq.heappush(self.ready, item)

    def _dispatch_ready(self, ex: Executor, held_back: list[tuple[float, int, str]]) -> None:
        in_slots = self._warming_in_slots()
        limit = ex.slots + (int(getattr(ex, "ahead", 0)) if self.budget is None else 0)  # a farm queues some ahead
        while self.ready and len(self.running) + in_slots < limit:
            fp = self.ready[0][2]
            if fp in self.warm_for:
                held_back.append(heapq.heappop(self.ready))
                continue
            if self.budget is not None:
                used = sum(r.mem_mb for r in self.running.values())
                if not self.budget.admits(used, self.mem[fp], len(self.running)):
                    return  # held back until a running action frees memory
            heapq.heappop(self.ready)
            claim = self.held.pop(fp, None)
            if claim is None:
                claim = self._claim(fp)
                if claim is None:
                    continue
            self._start(self.todo[fp], claim)

    def _warming_in_slots(self) -> int:
        """Warm-ups taking an executor slot (not those running apart, in a zygote beside the workers)."""
        return sum(1 for w in self.warming.values() if not w.apart)

    def _claim(self, fp: str) -> Claim | None:
        """Our claim on fp, or None when its result exists (done) or another build is running it (waiting)."""
        cache = self.s.cache
        if self._found(fp):
            self._done(fp, reused=True)
            return None
        claim = cache.try_claim(fp)
        if claim is None:
            self.other_build.add(fp)
            self.s.bus.emit(ev.ACTION_WAITING, **action_fields(self.todo[fp]))
            return None
        if self._found(fp):
            claim.release()
            self._done(fp, reused=True)
            return None
        reused = cutoff.reuse(self.todo[fp], cache, self.results)
        if reused is not None:  # its inputs re-ran to byte-identical outputs: the earlier result stands
            claim.release()
            self.results[fp] = reused[1]
            self._done(fp, reused=True, cutoff_from=reused[0])
            return None
        return claim

    def _found(self, fp: str) -> bool:
        """Whether fp's result is in the cache now (another build's): kept in `results` if so."""
        res = self.s.cache.lookup(fp)
        if res is not None:
            self.results[fp] = res
        return res is not None

    def _poll_other_builds(self) -> None:
        for fp in list(self.other_build):
            if self._found(fp):
                self.other_build.discard(fp)
                self._done(fp, reused=True)
                continue
            claim = self.s.cache.try_claim(fp)
            if claim is None:
                continue
            self.other_build.discard(fp)
            if self._found(fp):
                claim.release()
                self._done(fp, reused=True)
            else:  # the other build gave up on it (failed or was stopped): run it ourselves
                self.held[fp] = claim
                self._push(fp)

    def _start(self, a: Action, claim: Claim) -> None:
        fp = a.fingerprint
        attempt = self.attempts.get(fp, 0)
        log = self.s.cache.logs / fp[:2] / f"{fp}.log"
        job = Job(a, attempt, log, estimate_s=self.duration.get(fp, 0.0), estimate_mb=self.mem.get(fp, 0.0),
                  estimate_mb_recorded=self.mem_recorded.get(fp, True))
        try:
            log.parent.mkdir(parents=True, exist_ok=True)
            if attempt == 0:
                log.write_text(f"# {a.describe()}\n# fingerprint {fp}\n", encoding="utf-8")
            else:
                with open(log, "a", encoding="utf-8") as f:
                    f.write(f"\n# attempt {attempt + 1}\n")
            started = self.s.executor.start(job)
        except (InputChanged, OSError) as e:  # incl. a corrupt blob (an OSError)
            claim.release()
            self._fail(a, str(e), log, False)
            return
        except BaseException:
            claim.release()
            raise
        # Sent beyond the executor's slots (a farm's task queued on its Dask worker): it starts when a thread frees
        queued = len(self.running) + self._warming_in_slots() >= self.s.executor.slots
        self.running[job.id] = _Running(job, claim, self.mem[fp], time.time())
        self.s.bus.emit(ev.ACTION_STARTED, **action_fields(a), attempt=attempt + 1, worker=started.worker,
                        pid=started.pid, queued=queued, slots=self.s.executor.slots, estimate_mb=round(self.mem[fp], 1))

    def _complete(self, c: Completion, r: _Running, ended: float) -> None:
        """`ended`: when the executor handed the completion back (the worker was free from then on)."""
        a = c.job.action
        fp = a.fingerprint
        ok, error = c.ok, c.error
        stored_s = 0.0
        if ok:
            assert c.outputs is not None
            t = time.time()
            try:
                self.results[fp] = self.s.cache.store_outputs(
                    fp, a.identity, a.record, c.outputs, a.outputs, c.duration_s,
                    {**c.metadata, "peak_rss_mb": round(c.peak_rss_mb, 1)}, expect=c.digests, scratch=True)
            except OSError as e:
                ok, error = False, f"storing outputs failed: {e}"
            stored_s = time.time() - t
            if ok:
                cutoff.remember(a, self.s.cache, self.results)
                self.s.bus.emit(ev.OUTPUTS_STORED, at=t + stored_s, fingerprint=fp, start=t, duration_s=stored_s,
                                worker=c.worker)
        self.s.executor.finish(c.job)
        start, ended = c.started or r.started, c.ended or ended  # on its worker, when the executor knows (farm)
        if ok:
            r.claim.release()
            self.executed.append(fp)
            self.s.bus.emit(ev.ACTION_FINISHED, **action_fields(a), attempt=c.job.attempt + 1, worker=c.worker,
                            pid=c.pid, start=start, end=ended, duration_s=round(c.duration_s, 3),
                            peak_rss_mb=round(c.peak_rss_mb, 1), estimate_mb=round(r.mem_mb, 1),
                            cpu_s=round(c.cpu_s, 3),
                            outputs={k: v.digest for k, v in sorted(self.results[fp].outputs.items())})
            self._done(fp)
            return
        retry = c.worker_died and self.attempts.get(fp, 0) < self.s.options.retries and not self.stopped
        self.s.bus.emit(ev.ACTION_FAILED, **action_fields(a), attempt=c.job.attempt + 1, worker=c.worker,
                        pid=c.pid, start=start, end=ended, duration_s=round(c.duration_s, 3), error=error,
                        log=str(c.job.log), worker_died=c.worker_died, will_retry=retry)
        if retry:
            self.attempts[fp] = self.attempts.get(fp, 0) + 1
            self.held[fp] = r.claim
            self._push(fp)
            return
        r.claim.release()
        self._fail(a, error, c.job.log, c.worker_died, emitted=True)

    def _done(self, fp: str, reused: bool = False, cutoff_from: str | None = None) -> None:
        if cutoff_from is not None:
            self.reused.append(fp)
            self.s.bus.emit(ev.ACTION_CACHED, **action_fields(self.todo[fp]), cutoff=cutoff.reason(self.todo[fp]),
                            cutoff_from=cutoff_from)
        elif reused:
            self.reused.append(fp)
            self.s.bus.emit(ev.ACTION_CACHED, **action_fields(self.todo[fp]), by_other_build=True)
        for succ in self.ag.consumers[fp]:
            deps = self.blockers.get(succ)
            if deps is not None and fp in deps:
                deps.discard(fp)
                if not deps and not self.stopped:
                    self._push(succ)

    def _fail(self, a: Action, error: str, log: Path, worker_died: bool, emitted: bool = False) -> None:
        fp = a.fingerprint
        try:
            self.s.cache.record_failure(fp, a.identity, a.record, error, log)
        except OSError:
            pass
        if not emitted:
            self.s.bus.emit(ev.ACTION_FAILED, **action_fields(a), attempt=self.attempts.get(fp, 0) + 1, worker="",
                            pid=0, start=time.time(), duration_s=0.0, error=error, log=str(log),
                            worker_died=worker_died, will_retry=False)
        self.failures.append(Failure(a, error, log, worker_died))
        for d in nx.descendants(self.ag.graph, fp):
            if d in self.todo and d not in self.skipped:
                self.skipped.append(d)
                self.s.bus.emit(ev.ACTION_SKIPPED, **action_fields(self.todo[d]), because=fp)
        if not self.s.options.keep_going:
            self.stopped = True
            self.ready.clear()

    def _cancel_running(self) -> None:
        """Without --keep-going the first failure ends the build: running actions are stopped, not stored."""
        self.s.executor.cancel()
        self.warming.clear()
        for r in self.running.values():
            r.claim.release()
            self.stopped_fps.append(r.job.action.fingerprint)
            self.s.bus.emit(ev.ACTION_SKIPPED, **action_fields(r.job.action), because="stopped")
        self.running.clear()

    def cleanup(self) -> None:
        """After the loop, normally or not (Ctrl-C): end running work, drop scratch space, release every claim."""
        if self.running or self.warming:
            self.s.executor.cancel()
        self.warming.clear()
        for r in self.running.values():
            r.claim.release()
        self.running.clear()
        for claim in self.held.values():
            claim.release()
        self.held.clear()


def describe_failure(f: Failure) -> list[str]:
    """Lines for the end-of-build summary: the action (label, bucket, target), its error's first lines, its log."""
    lines = [f"  FAILED {f.action.describe()}"]
    lines += [f"    {ln}" for ln in (f.error.splitlines() or ["(no message)"])[:5]]
    lines.append(f"    log: {f.log}")
    return lines

