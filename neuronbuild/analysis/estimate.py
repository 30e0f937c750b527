"""The one time and memory estimator: recorded history first, then defaults per action kind and toolchain.

Used by `plan`, `explain`, `upgrade-impact`, the scheduler's critical-path order and memory budget, and the live ETA,
so every figure a user sees comes from the same numbers."""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import compress, count
from pathlib import Path
from typing import Any

import networkx as nx

from neuronbuild.history import History, LatestEntry
from neuronbuild.plugin_api import registry as plugins
from neuronbuild.plugin_api.actions import TRACE, WEIGHTS, Action

TRACE_DEFAULT_S = 4.0  # a trace of a small model, when nothing was recorded
TRACE_DEFAULT_MB = 800.0
# A trace runs on shapes; the model's weights action streams the weights into its file in pieces of at most 64 MB
# (stored and converted copy): what it holds beyond torch does not grow with the weights (1B-shaped model: < 700
# MiB, see docs/benchmarks.md #28).
TRACE_STREAM_MB = 128.0


@dataclass(frozen=True)
class Estimate:
    """Seconds one action is expected to take and where the figure comes from."""

    seconds: float
    source: str
    recorded: bool = True  # False: a default, nothing recorded to go by


@dataclass(frozen=True)
class PeakEstimate:
    """Peak resident MB one action is expected to need and where the figure comes from."""

    mb: float
    source: str
    recorded: bool = True


def _kind_platform(identity: str) -> tuple[str, str]:
    kind = identity.split(" ", 1)[0]
    _, sep, platform = identity.rpartition(" for ")
    return kind, platform if sep else ""


def _mean(entries: Sequence[LatestEntry]) -> float:
    return sum(e.duration_s for e in entries) / len(entries)


def default_estimate(action: Action) -> tuple[float, float]:
    """(seconds, peak MB) assumed for an action nothing was recorded for: per kind, or its toolchain's figures."""
    if action.kind == TRACE or not action.toolchain:
        return TRACE_DEFAULT_S, TRACE_DEFAULT_MB
    tc = plugins.toolchain(action.toolchain)
    return float(tc.estimate_s), float(tc.estimate_mb)


def default_peak_mb(action: Action, weight_mb: float) -> float:
    """The peak MB assumed for an action nothing was recorded for, from the weight bytes of its model: a trace (on
    shapes, weights streamed) holds its default plus one streamed piece; a toolchain step its `estimate_mb` plus
    `estimate_mb_per_weight_mb` (optional, 0 when left out: the step works on shapes) times the weights' MB."""
    if action.kind == TRACE or not action.toolchain:
        return TRACE_DEFAULT_MB + (TRACE_STREAM_MB if weight_mb > 0 else 0.0)
    tc = plugins.toolchain(action.toolchain)
    return float(tc.estimate_mb) + float(getattr(tc, "estimate_mb_per_weight_mb", 0.0)) * weight_mb


def declared_weight_mb(todo: Iterable[Action], actions: Mapping[str, Action], root: Path) -> dict[str, float]:
    """Per action of `todo`: the MB of the weight files it streams (a weights action: its model's; a compile step that
    binds them: its weights action's), from their sizes on disk; 0.0 for a step on shapes only (a trace, a Lower) and
    for a model without weight files."""
    by_trace: dict[str, float] = {}
    out: dict[str, float] = {}

    def of_trace(a: Action) -> float:
        known = by_trace.get(a.fingerprint)
        if known is None:
            w = (a.spec.get("model") or {}).get("weights") or {}
            paths = [s[0] for s in w.get("shards") or ()] or ([w["path"]] if w.get("path") else [])
            total = 0
            for p in paths:
                try:
                    total += (root / str(p)).stat().st_size
                except (OSError, ValueError):
                    pass
            known = by_trace[a.fingerprint] = total / (1 << 20)
        return known

    for a in todo:
        if a.kind == WEIGHTS:
            out[a.fingerprint] = of_trace(a)
            continue
        w = next((actions[d.action] for d in a.dep_inputs
                  if d.action in actions and actions[d.action].kind == WEIGHTS), None)
        out[a.fingerprint] = of_trace(w) if w is not None else 0.0
    return out


class Estimator:
    """Estimates in order of trust: this fingerprint's own run, the identity's most recent run, the mean of the
    other buckets of the same label and target, the mean of every recorded action of the same kind and platform,
    then the per-kind / per-toolchain default."""

    def __init__(self, history: History) -> None:
        self.history = history
        self._by_class: dict[tuple[str, str], list[LatestEntry]] | None = None
        self._fallback: dict[tuple[str, str, Any], Estimate] = {}  # (kind, platform, the spec's toolchain)
        self._skipped: dict[Any, Estimate] = {}

    def estimate(self, action: Action) -> Estimate:
        skipped = action.spec.get("skipped")
        if skipped:  # its real work is left out (a Neuron compile without neuronx-cc): ~nothing
            known = self._skipped.get(skipped)  # (one value per reason: the plan's matrix shares its rows by value)
            if known is None:
                known = self._skipped[skipped] = Estimate(0.0, f"skipped ({skipped})")
            return known
        own = self.history.result(action.fingerprint)
        if own is not None:
            return Estimate(own.duration_s, "this fingerprint's recorded run")
        if self._by_class is None or self._by_class:  # (an empty history has no identity's run or group to ask)
            latest = self.history.latest(action.identity)
            if latest is not None:
                return Estimate(latest.duration_s, "the last run of this action identity")
            group = list(self.history.group(action.identity))
            if group:
                return Estimate(_mean(group), f"mean of {len(group)} other bucket(s) of this target")
        kind, platform = action.kind, action.platform  # (= _kind_platform(action.identity), without parsing it)
        key = (kind, platform, action.spec.get("toolchain"))  # (the class: Action.toolchain without its str())
        known = self._fallback.get(key)  # the same for every action of a class: made once (100,000s at scale)
        if known is None:
            known = self._fallback[key] = self._class_estimate(action, kind, platform)
        return known

    def _class_estimate(self, action: Action, kind: str, platform: str) -> Estimate:
        if self._by_class is None:
            self._by_class = {}
            for e in self.history.entries():
                self._by_class.setdefault(_kind_platform(e.identity), []).append(e)
        same = self._by_class.get((kind, platform))
        if same:
            where = f" for {platform}" if platform else ""
            return Estimate(_mean(same), f"mean of {len(same)} recorded {kind} action(s){where}")
        seconds, _mb = default_estimate(action)
        return Estimate(seconds, f"default for a {action.kind}" + (f" ({action.toolchain})" if action.toolchain
                                                                   else ""), recorded=False)

    def peak_mb(self, action: Action, weight_mb: float = 0.0) -> PeakEstimate:
        """The memory an action is expected to need (what --local-ram admits it by): the identity's recorded peak, else
        the highest recorded peak of the other buckets of its label and target, else default_peak_mb from the weight
        bytes of its model (`weight_mb`)."""
        latest = self.history.latest(action.identity)
        if latest is not None and latest.peak_rss_mb > 0:
            return PeakEstimate(latest.peak_rss_mb, "the last run of this action identity")
        peaks = [e.peak_rss_mb for e in self.history.group(action.identity) if e.peak_rss_mb > 0]
        if peaks:
            return PeakEstimate(max(peaks), f"the highest of {len(peaks)} other bucket(s) of this target")
        return PeakEstimate(default_peak_mb(action, weight_mb),
                            f"default for a {action.kind}" + (f" with {weight_mb:.0f} MB of weights" if weight_mb else ""),
                            recorded=False)


def wall_time(graph: nx.DiGraph, todo: Sequence[Action], seconds: Mapping[str, float], jobs: int) -> float:
    """Greedy list schedule of `todo` on `jobs` workers in dependency order (each action on the worker free first)."""
    fps = [a.fingerprint for a in todo]
    return wall_time_of(graph.predecessors, fps, [seconds.get(fp, 0.0) for fp in fps], jobs)


def wall_time_of(pred: Callable[[str], Iterable[str]], fps: Sequence[str], seconds: Sequence[float],
                 jobs: int) -> float:
    """wall_time() of the actions `fps` (topologically ordered) taking `seconds` each (a list in the same order);
    `pred`: an action's dependencies (a digraph's predecessors, or the actions' own deps)."""
    return schedule(fps, list(map(pred, fps)), seconds, jobs)


@dataclass(frozen=True)
class Schedule:
    """A finished wall-time schedule as a node of the analysis engine (its projection key plan_report.SCHEDULE):
    its inputs (the actions in order, their seconds, the workers) and what the list schedule held before every
    CHECK-th action. A schedule of the same actions in the same order with the same seconds up to some point is the
    same up to there (an action's dependencies are a function of its fingerprint), so it resumes there; and from a
    later CHECK-th place on it is the same again (it converges) when the actions from there on are the same, the
    workers are free at the same times there, and no action from there on reads one whose finish differs before it
    (`last_use`)."""

    fps: list[str]
    seconds: list[float]
    jobs: int
    ends: list[float]  # each action's finish, in order
    states: list[Any]  # before action i * CHECK: the workers' free times
    # {fingerprint: at least the last place of an action reading it} for every action read (a stale later place
    # only makes convergence rarer), or None: not known (no convergence from this node)
    last_use: dict[str, int] | None = None


CHECK = 1024


def schedule(fps: Sequence[str], deps: Sequence[Iterable[str]], seconds: Sequence[float], jobs: int) -> float:
    """wall_time_of() with each action's dependencies given in a list aligned with `fps`."""
    return schedule_from(None, fps, deps, seconds, jobs, keep=False)[0]


def _first_change(n: int, a: Iterable[Any], b: Iterable[Any], c: Iterable[Any], d: Iterable[Any]) -> int:
    """The first place where `a` holds another object than `b` or `c` than `d` (compared by identity, in C, without
    reading them: an equal value in another object counts as a change, which only resumes less); `n` (the shorter
    length) when none does."""
    return min(next(compress(count(), map(operator.is_not, a, b)), n),
               next(compress(count(), map(operator.is_not, c, d)), n))


def _resume(prior: Schedule | None, fps: Sequence[str], seconds: Sequence[float], jobs: int) -> int:
    """How many actions at the start of `fps` the `prior` schedule has already placed exactly so (a multiple of
    CHECK): the same actions, in the same order, with the same seconds."""
    if prior is None or prior.jobs != jobs:
        return 0
    same = _first_change(min(len(fps), len(prior.fps)), prior.fps, fps, prior.seconds, seconds)
    return same - same % CHECK


def _same_tail(prior: Schedule | None, fps: list[str], seconds: list[float], jobs: int, start: int) -> int:
    """The first CHECK-th place (above `start`) from which `fps` and `seconds` are those of `prior` (as many actions,
    the same at each place up to the end); len(fps) when none is."""
    n = len(fps)
    if prior is None or prior.jobs != jobs or len(prior.fps) != n or prior.last_use is None:
        return n
    same = _first_change(n, reversed(prior.fps), reversed(fps), reversed(prior.seconds), reversed(seconds))
    t = n - same  # (from the end)
    t += -t % CHECK  # (up to a CHECK-th place)
    return t if t < n else n


def schedule_from(prior: Schedule | None, fps: Sequence[str], deps: Sequence[Iterable[str]],
                  seconds: Sequence[float], jobs: int, keep: bool = True,
                  owned: bool = False, unique: bool = False,
                  same: tuple[int, int] | None = None) -> tuple[float, Schedule]:
    """schedule() and the Schedule node it makes, resumed from `prior` (the previous one, or None) where its
    actions, order and seconds are still the same, and taken over from `prior` again from the first CHECK-th place
    where it converges (Schedule): each action placed is placed as a full run places it, from the same state, so
    the figure is the one a full run computes. `keep`: make the node (else only the figure is used); `owned`: `fps`
    and `seconds` are lists nobody changes afterwards (the node keeps them instead of copies); `unique`: no
    fingerprint is in `fps` twice; `same`: (h, t): the first h and the last t of `fps` and `seconds` are known to be
    `prior`'s (the caller made them from the same lists), so they are not compared."""
    import heapq

    if not (owned and isinstance(fps, list) and isinstance(seconds, list)):
        fps, seconds = list(fps), list(seconds)
    n = len(fps)
    if same is not None and prior is not None and prior.jobs == jobs:
        start = same[0] - same[0] % CHECK
        tail = n
        if keep and len(prior.fps) == n and prior.last_use is not None:
            t = n - same[1]
            t += -t % CHECK
            tail = min(t, n)
    else:
        start = _resume(prior, fps, seconds, jobs)
        tail = _same_tail(prior, fps, seconds, jobs, start) if keep else n
    if prior is not None:  # (a state is kept before each CHECK-th action prior placed: none after its last)
        start = min(start, (len(prior.states) - 1) * CHECK)
    states: list[Any]
    if start:
        assert prior is not None
        states = prior.states[:start // CHECK + 1]
        finish = dict(zip(fps[:start], prior.ends[:start], strict=True))
        state = states[-1]
    else:
        states = []
        finish = {}  # (fps is topologically ordered: a dependency to run is in here before its user)
        state = 0.0 if jobs <= 1 else (0.0, 0.0) if jobs == 2 else [(0.0, i) for i in range(jobs)]
        states.append(state)
    get = finish.get
    differ: set[str] = set()  # the actions placed (or placed before by `prior`) whose finish differs from prior's
    upto = n  # where the actions placed end (the rest: prior's)
    for b in range(start, n, CHECK):
        if b > start:
            if b >= tail:  # (converged: the same state, the same actions after, none reading one that differs)
                assert prior is not None and prior.last_use is not None
                used = prior.last_use.get
                if state == prior.states[b // CHECK] and all(used(d, -1) < b for d in differ) and \
                        (unique or finish.keys().isdisjoint(fps[b:])):  # (and no action placed twice)
                    upto = b
                    break
            states.append(list(state) if jobs > 2 else state)
        e = min(b + CHECK, n)
        block = zip(fps[b:e], seconds[b:e], deps[b:e], strict=True)
        if jobs <= 1:  # (one worker: each action starts when the previous one ends, or its inputs are ready)
            free = state
            for fp, s, ds in block:
                ready = free
                for d in ds:
                    f = get(d)
                    if f is not None and f > ready:
                        ready = f
                free = finish[fp] = ready + s
            state = free
        elif jobs == 2:  # (the heap of two workers as two numbers: the first free, the lower index on a tie)
            free0, free1 = state
            for fp, s, ds in block:
                ready = 0.0
                for d in ds:
                    f = get(d)
                    if f is not None and f > ready:
                        ready = f
                if free0 <= free1:
                    free0 = finish[fp] = (ready if ready > free0 else free0) + s
                else:
                    free1 = finish[fp] = (ready if ready > free1 else free1) + s
            state = (free0, free1)
        else:
            workers = list(state)  # (free at, worker): a heap
            replace = heapq.heapreplace
            for fp, s, ds in block:
                ready = 0.0
                for d in ds:
                    f = get(d)
                    if f is not None and f > ready:
                        ready = f
                free, i = workers[0]
                end = finish[fp] = (ready if ready > free else free) + s
                replace(workers, (end, i))
            state = workers
        if tail < n:  # (convergence is possible: which finishes differ from prior's in this block)
            assert prior is not None
            was_fps, was_ends = prior.fps, prior.ends
            for i in range(b, e):
                fp, was = fps[i], was_fps[i]
                if fp != was or finish.get(fp) != was_ends[i]:
                    differ.add(fp)
                    differ.add(was)
    ends = list(finish.values())
    if len(ends) != upto:  # (an action twice: nothing to resume from)
        return max(ends, default=0.0), Schedule([], [], jobs, [], [])
    if upto < n:
        assert prior is not None
        ends += prior.ends[upto:]
        states += prior.states[upto // CHECK:]
    if not keep:
        return max(ends, default=0.0), Schedule(fps, seconds, jobs, ends, states)
    # (the places reading each action: those of the actions placed now, and prior's for the rest, the same actions
    # at the same places)
    base = prior.last_use if prior is not None and (start or upto < n) else None
    last_use = dict(base) if base is not None else {}
    seen = last_use.get
    for i in range(start if base is not None else 0, upto):
        for d in deps[i]:
            if seen(d, -1) < i:
                last_use[d] = i
    return max(ends, default=0.0), Schedule(fps, seconds, jobs, ends, states,
                                            last_use if len(last_use) <= 2 * n + CHECK else None)
