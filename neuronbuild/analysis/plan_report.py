"""The dry-run plan: per compile target, the bucket matrix (cached or to build) and estimated time. Nothing runs."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import compress
from typing import Any

from neuronbuild.analysis.actions import Action
from neuronbuild.analysis.estimate import Estimate, Estimator, wall_time_at, wall_time_of
from neuronbuild.analysis.planner import ActionGraph
from neuronbuild.analysis.providers import CompileTarget
from neuronbuild.history import History

BUILD = "build"
CACHED = "cached"
UNNEEDED = "-"  # a trace whose compiles are all cached is not needed
_FINGERPRINT = operator.attrgetter("fingerprint")
_ESTIMATES = ("", "estimates")  # the estimate memo's keys for its kept estimates and matrix rows (no action has
_BLOCKS = ("", "blocks")  # this fingerprint and identity)
_PREVIOUS = ("", "previous")  # (and the last report's fingerprints, estimates and seconds, in its order)
_SECONDS = operator.attrgetter("seconds")
_RECORDED = operator.attrgetter("recorded")


@dataclass(frozen=True)
class PlanReport:
    """What `neuronbuild build` would do now: which actions execute (in order), which are cached, estimates."""

    ag: ActionGraph = field(hash=False, compare=False)
    todo: tuple[Action, ...] = ()
    cached: frozenset[str] = frozenset()
    estimates: dict[str, Estimate] = field(default_factory=dict, hash=False, compare=False)
    jobs: int = 1
    memo: dict[Any, Any] | None = field(default=None, hash=False, compare=False)  # the build server's (plan_report)

    def status(self, fp: str) -> str:
        if fp in self.cached:
            return CACHED
        return BUILD if fp in self.estimates else UNNEEDED  # estimates hold exactly the actions to execute

    @property
    def serial_s(self) -> float:
        known = self.__dict__.get("_serial_s")  # (frozen: computed once, kept in __dict__ directly)
        if known is None:
            known = self.__dict__["_serial_s"] = sum(self._seconds())  # (the same sum, in the same order)
        return known  # type: ignore[no-any-return]

    def _seconds(self) -> list[float]:
        """Each estimate's seconds (0.0 for none), in the estimates' order (a C pass, made once); plan_report with
        the server's memo sets them in the order of todo (its estimates may be in another)."""
        known = self.__dict__.get("_seconds_list")
        if known is None:
            known = list(map(_SECONDS, self.estimates.values()))
            if None in known:
                known = [s or 0.0 for s in known]
            self.__dict__["_seconds_list"] = known
        return known  # type: ignore[no-any-return]

    @property
    def unknown(self) -> int:
        return len(self.estimates) - sum(map(_RECORDED, self.estimates.values()))

    @property
    def wall_s(self) -> float:
        known = self.__dict__.get("_wall_s")
        if known is None:
            known = self.__dict__["_wall_s"] = self._wall_s()
        return known  # type: ignore[no-any-return]

    def _wall_s(self) -> float:
        fps = self.__dict__.get("_todo_fps") or list(map(_FINGERPRINT, self.todo))
        estimates = self.estimates
        if self.__dict__.get("_todo_fps") is fps and "_seconds_list" in self.__dict__:
            seconds = self._seconds()  # (plan_report made them in the order of fps, one per action)
        elif len(estimates) == len(fps):  # (estimates hold exactly the actions to execute: no lookup can miss)
            seconds = list(map(_SECONDS, map(estimates.__getitem__, fps)))
            if None in seconds:
                seconds = [s or 0.0 for s in seconds]
        else:
            get = estimates.get
            seconds = [(e.seconds or 0.0) if (e := get(fp)) is not None else 0.0 for fp in fps]
        if self.memo is not None or "_order_deps" in self.ag.__dict__:  # (the build server: kept for the next plan)
            wall = self._wall_at(seconds)
            if wall is not None:
                return wall
        return wall_time_of(self.ag.graph, fps, seconds, self.jobs)

    def _wall_at(self, seconds: list[float]) -> float | None:
        """The schedule by place in the graph's order (estimate.wall_time_at), when the actions to run are known
        as places in it: all of them, or the mask needed_actions made; else None."""
        ag = self.ag
        order = ag.topological_seq()
        if len(self.todo) == len(order):  # (a subsequence of the order as long as it: the order)
            places: Any = None
            dep, many = ag.order_deps()
            deps: Any = dep
        else:
            known = ag.__dict__.get("_todo_mask")  # (incremental.needed_actions: todo = compress(order, mask))
            if known is None or known[0] is not self.__dict__.get("_todo_source") or len(known[1]) != len(order):
                return None
            dep, many = ag.order_deps()
            places, deps = compress(range(1, len(order) + 1), known[1]), compress(dep, known[1])
        return wall_time_at(places, deps, many, len(order), seconds, self.jobs)

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
        estimates, cached, ag = self.estimates, self.cached, self.ag
        seen: dict[tuple[int, int, bool, bool], str] = {}
        # The build server: each compile target's rows as the previous report rendered them, reused when the target
        # is the same object and none of its actions' statuses can differ (incremental.needed_actions patched the
        # previous answer and names what changed; the estimates are those memoised with the same token)
        memo = self.memo
        needed = ag.__dict__.get("_needed") if memo is not None else None
        kept = memo.get(_BLOCKS) if memo is not None else None
        old: dict[int, tuple[CompileTarget, list[str]]] = {}
        changed: set[str] = set()
        if kept is not None and needed is not None and needed.base is kept[0] and needed.changed is not None:
            old, changed = kept[1], needed.changed
            # a compile target rendered last time (the same object) shows actions of both graphs: neither added nor
            # removed (incremental._patch_needed's `changed` holds both; `_diff` is against the same graph), so only
            # the kept actions whose status changed can make it differ
            added, removed = ag.__dict__["_diff"]
            changed = {fp for fp in changed if fp not in added and fp not in removed}
        blocks: dict[int, tuple[CompileTarget, list[str]]] = {}
        for ct in ag.compiles:
            k = old.get(id(ct))
            if k is not None and k[0] is ct and (not changed or changed.isdisjoint(_fingerprints(ct, ag))):
                out.extend(k[1])
                blocks[id(ct)] = k
                continue
            start = len(out)
            head, prefixes = _layout(ct)
            out.extend(head)
            for prefix, (_bucket, fp), trace_fp in zip(prefixes, ct.buckets, _traces(ct, ag), strict=True):
                te, ce = estimates.get(trace_fp), estimates.get(fp)  # (inlined status(): 100,000s)
                key = (id(te), id(ce), trace_fp in cached, fp in cached)  # (estimates are shared: few distinct rows)
                cells = seen.get(key)
                if cells is None:
                    cells = seen[key] = self._cells(te, ce, key[2], key[3])
                out.append(prefix + cells)
            if memo is not None:
                blocks[id(ct)] = (ct, out[start:])
        if memo is not None:
            memo[_BLOCKS] = (needed, blocks) if needed is not None else None
        return out

    def summary_line(self) -> str:
        n = len(self.todo)
        line = (f"{len(self.ag.actions)} actions: {n} to execute, {len(self.cached)} cached")
        if n:
            line += f"; estimated {self.serial_s:.1f} s of work, ~{self.wall_s:.1f} s wall with -j {self.jobs}"
            if self.unknown:
                line += f" ({self.unknown} action(s) without a recorded duration estimated from defaults)"
        return line


def _layout(ct: CompileTarget) -> tuple[tuple[str, str], tuple[str, ...]]:
    """A compile target's matrix heading and the start of each bucket's row: made once per CompileTarget object and
    kept in it (frozen: written to its __dict__ directly), so the build server renders a replayed target's layout
    once, not per command."""
    known = ct.__dict__.get("_plan_layout")
    if known is None:
        opts = " ".join(f"{k}={','.join(v) if isinstance(v, list) else v}" for k, v in ct.options.items()
                        if v not in (None, []))
        width = max([len("bucket"), *(len(str(b)) for b, _fp in ct.buckets)])
        head = (f"{ct.label}  {ct.description}  {opts}".rstrip(), f"  {'bucket':<{width}}  {'trace':<7} {'compile':<7} est.")
        known = ct.__dict__["_plan_layout"] = (head, tuple(f"  {str(b):<{width}}  " for b, _fp in ct.buckets))
    return known  # type: ignore[no-any-return]


def _fingerprints(ct: CompileTarget, ag: ActionGraph) -> tuple[str, ...]:
    """Every fingerprint a compile target's matrix rows show (its compiles and their traces), kept in it."""
    known = ct.__dict__.get("_plan_fps")
    if known is None:
        known = ct.__dict__["_plan_fps"] = tuple(fp for _b, fp in ct.buckets) + _traces(ct, ag)
    return known  # type: ignore[no-any-return]


def _traces(ct: CompileTarget, ag: ActionGraph) -> tuple[str, ...]:
    """The fingerprint of the trace each bucket's compile derives from (ActionGraph.trace_of), kept in the
    CompileTarget as its layout is: a fingerprint is the digest of everything its action reads, its inputs'
    fingerprints included, so the trace a compile fingerprint derives from is the same in every graph holding it."""
    known = ct.__dict__.get("_plan_traces")
    if known is None:
        known = ct.__dict__["_plan_traces"] = tuple(ag.trace_of(fp).fingerprint for _b, fp in ct.buckets)
    return known  # type: ignore[no-any-return]


def plan_report(ag: ActionGraph, todo: Sequence[Action], cached: Sequence[str], history: History,
                jobs: int, memo: dict[Any, Any] | None = None) -> PlanReport:
    """`todo`/`cached` come from the scheduler's own needed_actions(), so the report matches what a build runs.
    `memo`: the build server's memo of earlier plans' estimates, valid for this `history` (incremental.estimate_memo;
    a new dict whenever the history or a record shard changed): each action keeps its estimate with the memo's token
    (an action is one fingerprint and one identity, the estimate's inputs), so a re-plan makes no key per action."""
    est = Estimator(history)
    estimates: dict[str, Any]
    if memo is None:
        estimates = {a.fingerprint: est.estimate(a) for a in todo}
    else:  # the estimates of the last report made with this memo (valid while it is), the others made now
        last: dict[str, Estimate] = memo.get(_ESTIMATES) or {}
        known = ag.__dict__.get("_todo_fps")  # (incremental.needed_actions': the fingerprints of this very todo)
        fps = known[1] if known is not None and known[0] is todo else list(map(_FINGERPRINT, todo))
        if len(last) > 2 * len(fps) + 1024:
            last = {}
        seconds: list[float] | None = None
        spliced = _spliced_estimates(ag, fps, memo.get(_PREVIOUS), last, est)
        if spliced is not None:
            estimates, seconds = spliced
        else:
            estimates = dict(zip(fps, map(last.get, fps), strict=True))
            if len(estimates) != len(fps):  # (an action twice in todo: never from needed_actions; one by one)
                estimates = {a.fingerprint: last.get(a.fingerprint) or est.estimate(a) for a in todo}
                last = {}
            else:
                if not last:  # (nothing memoised: a first plan makes every estimate, in one pass in todo's order)
                    estimates = dict(zip(fps, map(est.estimate, todo), strict=True))
                    last = estimates.copy()
                elif not all(estimates.values()):  # (an Estimate is always true: the new actions' are None)
                    actions = ag.actions
                    for fp in list(compress(fps, map(operator.not_, estimates.values()))):
                        estimates[fp] = last[fp] = est.estimate(actions[fp])
                seconds = list(map(_SECONDS, estimates.values()))  # (in the order of fps, as the estimates)
                if None in seconds:
                    seconds = [s or 0.0 for s in seconds]
        memo[_ESTIMATES] = last
        memo[_PREVIOUS] = (fps, estimates, seconds) if seconds is not None else None
        report = PlanReport(ag, tuple(todo), frozenset(cached), estimates, jobs, memo)
        report.__dict__["_todo_fps"] = fps  # (for wall_s: the same list, not made again)
        report.__dict__["_todo_source"] = todo  # (for wall_s: the list needed_actions' mask made)
        if seconds is not None:
            report.__dict__["_seconds_list"] = seconds  # (each action's seconds in the order of todo)
        return report
    report = PlanReport(ag, tuple(todo), frozenset(cached), estimates, jobs, memo)
    report.__dict__["_todo_source"] = todo
    return report


def _spliced_estimates(ag: ActionGraph, fps: list[str], previous: Any, last: dict[str, Estimate],
                       est: Estimator) -> tuple[dict[str, Estimate], list[float]] | None:
    """The build server's re-plan where the previous report and this one execute every action of their graphs and
    this graph's order was patched from the previous one (ActionGraph._patched): the previous estimates (a copy of
    the dict, in another order than `fps`: only looked up) without the removed actions and with the added ones', and
    their seconds in the order of `fps`, the previous list with the same places removed and added (the same numbers
    in the same order as made from the estimates: the serial sum and the schedule are those of a fresh report).
    None otherwise (then the estimates are taken one by one from `last`)."""
    splice = ag.__dict__.get("_splice")
    diff = ag.__dict__.get("_diff")
    if previous is None or splice is None or diff is None or fps is not ag.__dict__.get("_order_fps"):
        return None
    old_fps, keep, inserted, _rel = splice
    prev_fps, prev_estimates, prev_seconds = previous
    added, removed = diff
    if prev_fps is not old_fps or len(prev_estimates) != len(old_fps) or len(inserted) != len(added) or \
            len(fps) != len(old_fps) - len(removed) + len(added):
        return None
    estimates = prev_estimates.copy()
    try:
        for fp in removed:
            del estimates[fp]
    except KeyError:
        return None
    kept = prev_seconds if keep is None else list(compress(prev_seconds, keep))
    seconds: list[float] = []
    actions = ag.actions
    f = 0
    for j, q in enumerate(inserted):
        fp = fps[q]
        e = last.get(fp)
        if e is None:
            e = last[fp] = est.estimate(actions[fp])
        estimates[fp] = e
        seconds.extend(kept[f:q - j])
        f = q - j
        seconds.append(e.seconds or 0.0)
    seconds.extend(kept[f:])
    if len(estimates) != len(fps) or len(seconds) != len(fps):
        return None
    return estimates, seconds
