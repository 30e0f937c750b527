"""The dry-run plan: per compile target, the bucket matrix (cached or to build) and estimated time. Nothing runs."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import compress, count
from typing import Any

from neuronbuild.analysis.action_graph import ActionGraph
from neuronbuild.analysis.estimate import Estimate, Estimator, schedule, schedule_from
from neuronbuild.analysis.providers import CompileTarget
from neuronbuild.engine import Projection
from neuronbuild.history import History
from neuronbuild.plugin_api.actions import Action

BUILD = "build"
CACHED = "cached"
UNNEEDED = "-"  # a trace whose compiles are all cached is not needed
_FINGERPRINT = operator.attrgetter("fingerprint")
_SECONDS = operator.attrgetter("seconds")
_RECORDED = operator.attrgetter("recorded")
_DEPS = operator.attrgetter("deps")
# The engine's projection keys this module keeps (engine.py: their reuse is decided here, partly)
SCHEDULE = Projection("wall-time schedule")  # estimate.Schedule: resumed where the actions are unchanged
REPORT = Projection("plan report")  # ReportMemo: estimates per action, matrix rows per compile target, per stamp
LAYOUTS = Projection("matrix layouts")  # {id(CompileTarget): (it, its _Layout)}: a function of the target's value
_MISSING: Any = object()


@dataclass(frozen=True)
class PlanReport:
    """What `neuronbuild build` would do now: which actions execute (in order), which are cached, estimates."""

    ag: ActionGraph = field(hash=False, compare=False)
    todo: tuple[Action, ...] = ()
    cached: frozenset[str] = frozenset()
    estimates: dict[str, Estimate] = field(default_factory=dict, hash=False, compare=False)
    jobs: int = 1
    # the analysis engine's state (analysis_nodes.AnalysisMemo) keeping the wall-time schedule, or None (batch: afresh)
    engine: Any = field(default=None, hash=False, compare=False, repr=False)
    # the fingerprints of todo, in order (None: made from todo when needed)
    fps: list[str] | None = field(default=None, hash=False, compare=False, repr=False)
    # (the last report's fps list, h, t): the first h and last t of todo are that report's actions, at those places
    same: tuple[list[str], int, int] | None = field(default=None, hash=False, compare=False, repr=False)

    def status(self, fp: str) -> str:
        if fp in self.cached:
            return CACHED
        return BUILD if fp in self.estimates else UNNEEDED  # estimates hold exactly the actions to execute

    @cached_property
    def serial_s(self) -> float:
        return sum(self._seconds)  # (in the estimates' order)

    @cached_property
    def _seconds(self) -> list[float]:
        """Each estimate's seconds (0.0 for none), in the estimates' order (the order of todo)."""
        return [s or 0.0 for s in map(_SECONDS, self.estimates.values())]

    @property
    def unknown(self) -> int:
        return len(self.estimates) - sum(map(_RECORDED, self.estimates.values()))

    @cached_property
    def wall_s(self) -> float:
        # (the estimates hold exactly the actions of todo, in its order: _seconds is aligned with todo; an action's
        # own deps stand for the digraph's predecessors, without making the adjacency)
        todo = self.todo
        unique = len(self.estimates) == len(todo)  # (the estimates' keys: each action once)
        if not unique:  # (a report made by hand)
            get = self.estimates.get
            seconds = [(e.seconds or 0.0) if (e := get(a.fingerprint)) is not None else 0.0 for a in todo]
            fps = list(map(_FINGERPRINT, todo))
        else:
            seconds = self._seconds
            fps = self.fps if self.fps is not None else list(self.estimates)  # (the estimates' keys: todo's, in order)
        engine = self.engine
        if engine is None:
            return schedule(fps, list(map(_DEPS, todo)), seconds, self.jobs)
        # (each action's deps read only where the schedule places actions: _Deps)
        # (a schedule made from the last report's lists: its first h and last t are this one's, not compared again)
        prior, same = engine.engine.kept(SCHEDULE), self.same
        hint = (same[1], same[2]) if same is not None and prior is not None and fps is self.fps and \
            prior.fps is same[0] else None
        wall, made = schedule_from(prior, fps, _Deps(todo), seconds, self.jobs, owned=fps is self.fps,
                                   unique=unique, same=hint)
        engine.engine.keep(SCHEDULE, made)
        return wall

    def _cell(self, fp: str) -> dict[str, Any]:
        est = self.estimates.get(fp)
        return {"fingerprint": fp, "status": self.status(fp), "estimate_s": None if est is None else est.seconds}

    def to_json(self) -> dict[str, Any]:
        targets = []
        for ct in self.ag.compiles:
            rows = []
            for bucket, fp in ct.buckets:
                trace_fp = self.ag.trace_of(fp).fingerprint
                rows.append({"name": bucket.name, "bucket": bucket.as_dict(), "trace": self._cell(trace_fp),
                             "compile": self._cell(fp)})
            targets.append({"label": str(ct.label), "platform": ct.platform, "isa": ct.target.get("isa"),
                            "options": dict(ct.options), "buckets": rows})
        return {
            "targets": targets,
            "execute": [{"fingerprint": a.fingerprint, "identity": a.identity, "description": a.describe(),
                         "kind": a.kind, "estimate_s": self.estimates[a.fingerprint].seconds,
                         "estimate_source": self.estimates[a.fingerprint].source} for a in self.todo],
            "cached": sorted(self.cached),
            "total": len(self.ag.actions),
            "estimate": {"serial_s": round(self.serial_s, 3), "wall_s": round(self.wall_s, 3), "jobs": self.jobs,
                         "unknown": self.unknown},
        }

    @staticmethod
    def _cells(te: Estimate | None, ce: Estimate | None, trace_cached: bool, compile_cached: bool) -> str:
        """A matrix row's status and estimate columns."""
        if te is None and ce is None:
            shown = "-"
        else:
            est = (te.seconds or 0.0 if te is not None else 0.0) + (ce.seconds or 0.0 if ce is not None else 0.0)
            unknown = (te is not None and not te.recorded) or (ce is not None and not ce.recorded)
            shown = f"~{est:.1f} s" if unknown else f"{est:.1f} s"
        ts = CACHED if trace_cached else BUILD if te is not None else UNNEEDED
        cs = CACHED if compile_cached else BUILD if ce is not None else UNNEEDED
        return f"{ts:<7} {cs:<7} {shown}"

    def lines(self) -> list[str]:
        out = self.matrix_lines()
        out.append(self.summary_line())
        return out

    def matrix_lines(self) -> list[str]:
        """lines() but its last (the summary, which needs the wall-time schedule): `plan` prints these first."""
        out: list[str] = []
        seen: dict[tuple[int, int, bool, bool], str] = {}
        memo = self.engine.engine.kept(REPORT) if self.engine is not None else None
        if not isinstance(memo, ReportMemo) or memo.current is not self:
            for ct in self.ag.compiles:
                out.extend(self._target_lines(ct, seen))
            return out
        # The build server: a compile target's lines are a function of its value (the same object: _layout), the
        # estimates of its rows' actions (the same objects while the history's stamp holds, unless re-made) and their
        # statuses (whether cached or to execute). Lines made by report g are kept while none of their fingerprints
        # is among the changes of a later report (ReportMemo.since)
        rows, gen = memo.rows, memo.gen
        since: dict[int, set[str] | None] = {}
        for ct in self.ag.compiles:
            known = rows.get(id(ct))
            if known is not None and known[0] is ct:
                made_in = known[3]
                changed = since.get(made_in, _MISSING)
                if changed is _MISSING:
                    changed = since[made_in] = memo.since(made_in)
                if changed is not None and (not changed or changed.isdisjoint(known[1])):
                    out.extend(known[2])
                    continue
            lines = self._target_lines(ct, seen)
            out.extend(lines)
            if len(rows) >= _MAX_LAYOUTS:
                rows.clear()
            # (tuples of strings: the collector stops tracking them; one tracked tuple per target)
            rows[id(ct)] = (ct, (*self._layout(ct)[2], *(fp for _b, fp in ct.buckets)), tuple(lines), gen)
        return out

    def _target_lines(self, ct: CompileTarget, seen: dict[tuple[int, int, bool, bool], str]) -> list[str]:
        """One compile target's heading and matrix rows. `seen`: the status and estimate cells made so far, by their
        estimates' objects and the cached flags (estimates are shared: few distinct rows)."""
        estimates, cached = self.estimates, self.cached
        head, prefixes, traces = self._layout(ct)
        out = list(head)
        for prefix, (_bucket, fp), trace_fp in zip(prefixes, ct.buckets, traces, strict=True):
            te, ce = estimates.get(trace_fp), estimates.get(fp)  # (inlined status(): 100,000s)
            key = (id(te), id(ce), trace_fp in cached, fp in cached)
            cells = seen.get(key)
            if cells is None:
                cells = seen[key] = self._cells(te, ce, key[2], key[3])
            out.append(prefix + cells)
        return out

    @cached_property
    def _layouts(self) -> dict[int, tuple[CompileTarget, _Layout]]:
        """The compile targets' matrix layouts made so far: kept by the server's engine (LAYOUTS), else this report's."""
        if self.engine is None:
            return {}
        layouts = self.engine.engine.kept(LAYOUTS)
        if layouts is None:
            self.engine.engine.keep(LAYOUTS, layouts := {})
        return layouts

    def _layout(self, ct: CompileTarget) -> _Layout:
        """A compile target's matrix heading, its rows' starts and the trace of each bucket's compile: a function of
        its value alone (fingerprints are content addresses: a compile's fixes its inputs' actions), kept per object
        (analysis replays the same objects for unchanged targets; the entry holds it, so its id is not reused)."""
        layouts = self._layouts
        known = layouts.get(id(ct))
        if known is not None and known[0] is ct:
            return known[1]
        out = (*_make_layout(ct), _traces(ct, self.ag))
        if len(layouts) >= _MAX_LAYOUTS:
            layouts.clear()
        layouts[id(ct)] = (ct, out)
        return out

    def summary_line(self) -> str:
        n = len(self.todo)
        line = (f"{len(self.ag.actions)} actions: {n} to execute, {len(self.cached)} cached")
        if n:
            line += f"; estimated {self.serial_s:.1f} s of work, ~{self.wall_s:.1f} s wall with -j {self.jobs}"
            if self.unknown:
                line += f" ({self.unknown} action(s) without a recorded duration estimated from defaults)"
        return line


class _Deps(Sequence[tuple[str, ...]]):
    """The deps of each of `todo`'s actions, read when asked (by place or slice)."""

    def __init__(self, todo: Sequence[Action]) -> None:
        self.todo = todo

    def __len__(self) -> int:
        return len(self.todo)

    def __getitem__(self, i: Any) -> Any:
        return list(map(_DEPS, self.todo[i])) if isinstance(i, slice) else self.todo[i].deps


_Layout = tuple[tuple[str, str], tuple[str, ...], tuple[str, ...]]  # (PlanReport._layout)
_MAX_LAYOUTS = 200_000


def _make_layout(ct: CompileTarget) -> tuple[tuple[str, str], tuple[str, ...]]:
    """A compile target's matrix heading and the start of each bucket's row."""
    opts = " ".join(f"{k}={','.join(v) if isinstance(v, list) else v}" for k, v in ct.options.items()
                    if v not in (None, []))
    width = max([len("bucket"), *(len(str(b)) for b, _fp in ct.buckets)])
    head = (f"{ct.label}  {ct.description}  {opts}".rstrip(), f"  {'bucket':<{width}}  {'trace':<7} {'compile':<7} est.")
    return head, tuple(f"  {str(b):<{width}}  " for b, _fp in ct.buckets)


def _traces(ct: CompileTarget, ag: ActionGraph) -> tuple[str, ...]:
    """The fingerprint of the trace each bucket's compile derives from (ActionGraph.trace_of)."""
    return tuple(ag.trace_of(fp).fingerprint for _b, fp in ct.buckets)


class ReportMemo:
    """The plan report's nodes of the analysis engine (its projection key REPORT, in the build server): each action's
    estimate and each compile target's matrix lines, valid while the cache's history has the same stamp
    (CacheHistory.stamp: the record and index directories). An estimate is a function of its action's value and of
    the history, so it is kept per Action object (analysis replays the same objects for unchanged targets, and the
    entry holds its object: its id is not reused)."""

    def __init__(self, stamp: Any) -> None:
        self.stamp = stamp
        # (two maps by fingerprint, not a pair per action: no object per action for the collector to track)
        self.estimates: dict[str, Estimate] = {}
        self.actions: dict[str, Action] = {}  # the object each of `estimates` was made for
        # per compile target (by id): the target, its rows' fingerprints, its lines, the report that made them
        self.rows: dict[int, tuple[CompileTarget, tuple[str, ...], tuple[str, ...], int]] = {}
        self.cached: frozenset[str] = frozenset()  # the last report's cached actions
        # the last report's actions to execute, their fingerprints and estimates, in order
        self.last_todo: tuple[Action, ...] = ()
        self.fps: list[str] = []
        self.ests: list[Estimate] = []
        # per report made with this memo (numbered by `gen`, the last CHANGES): the fingerprints whose status or
        # estimate differs from the report before (lines made by an earlier report are re-made when one of theirs
        # is in a later report's changes)
        self.gen = 0
        self.changes: dict[int, set[str]] = {}
        self.current: Any = None  # the last PlanReport made with this memo (only its matrix_lines use the rows)

    CHANGES = 64

    def since(self, gen: int) -> set[str] | None:
        """The fingerprints changed by the reports after `gen` up to the current one; None when not all of those
        are known any more (lines that old are made again)."""
        if gen == self.gen:
            return set()
        if gen + 1 not in self.changes:
            return None
        out: set[str] = set()
        for g in range(gen + 1, self.gen + 1):
            out |= self.changes[g]
        return out


def plan_report(ag: ActionGraph, todo: Sequence[Action], cached: Sequence[str], history: History,
                jobs: int, engine: Any = None) -> PlanReport:
    """`todo`/`cached` come from the scheduler's own needed_actions(), so the report matches what a build runs.
    `engine`: the build server's analysis engine (analysis_nodes.AnalysisMemo), which keeps the wall-time schedule and the
    report's estimates and matrix lines (ReportMemo) for as long as the history's stamp stays the same."""
    est = Estimator(history)
    stamp_of = getattr(history, "stamp", None)
    stamp = stamp_of() if engine is not None and stamp_of is not None else None  # (taken before anything is read)
    if stamp is None:  # (batch, or a history without a sound stamp now: everything afresh)
        if engine is not None:
            engine.engine.keep(REPORT, None)
        return PlanReport(ag, tuple(todo), frozenset(cached), {a.fingerprint: est.estimate(a) for a in todo}, jobs,
                          engine)
    memo = engine.engine.kept(REPORT)
    if not isinstance(memo, ReportMemo) or memo.stamp != stamp:
        memo = ReportMemo(stamp)
        engine.engine.keep(REPORT, memo)
    known, objects = memo.estimates, memo.actions
    if len(known) > 2 * len(todo) + 100_000:  # (actions gone: keep the memory bounded)
        known.clear()
        objects.clear()
    # The actions at the start and at the end of `todo` that are the same objects, at the same places, as in the last
    # report's (compared by identity, in C, without reading them) keep that report's estimates; the others between
    # are looked up (or estimated) one by one
    todo = tuple(todo)
    last = memo.last_todo
    n, m = len(todo), len(last)
    shorter = min(n, m)
    p = next(compress(count(), map(operator.is_not, todo, last)), shorter)
    q = next(compress(count(), map(operator.is_not, reversed(todo), reversed(last))), shorter) if p < shorter else 0
    q = min(q, shorter - p)
    made_for = objects.get
    mid_fps: list[str] = []
    mid: list[Estimate] = []
    made: list[str] = []
    for a in todo[p:n - q]:
        fp = a.fingerprint
        mid_fps.append(fp)
        if made_for(fp) is a:
            mid.append(known[fp])
        else:
            e = known[fp] = est.estimate(a)
            mid.append(e)
            objects[fp] = a
            made.append(fp)
    fps = memo.fps[:p] + mid_fps + memo.fps[m - q:]
    ests = memo.ests[:p] + mid + memo.ests[m - q:]
    estimates = dict(zip(fps, ests, strict=True))
    cached_set = frozenset(cached)
    # (the keys that came or went are among the two middles': the rest are the same actions at the same places)
    changed = set(mid_fps).symmetric_difference(memo.fps[p:m - q])
    changed |= cached_set ^ memo.cached
    changed.update(made)
    memo.gen += 1
    memo.changes[memo.gen] = changed
    memo.changes.pop(memo.gen - ReportMemo.CHANGES, None)
    memo.cached = cached_set
    same = (memo.fps, p, q)
    memo.last_todo, memo.fps, memo.ests = todo, fps, ests
    report = memo.current = PlanReport(ag, todo, cached_set, estimates, jobs, engine, fps, same)
    return report
