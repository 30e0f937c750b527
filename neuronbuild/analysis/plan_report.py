"""The dry-run plan: per compile target, the bucket matrix (cached or to build) and estimated time. Nothing runs."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from neuronbuild.analysis.actions import Action
from neuronbuild.analysis.estimate import Estimate, Estimator, wall_time_of
from neuronbuild.analysis.planner import ActionGraph
from neuronbuild.analysis.providers import CompileTarget
from neuronbuild.history import History

BUILD = "build"
CACHED = "cached"
UNNEEDED = "-"  # a trace whose compiles are all cached is not needed
_FINGERPRINT = operator.attrgetter("fingerprint")
_TOKEN = ("", "")  # the estimate memo's key for its token (no action has this fingerprint and identity)


@dataclass(frozen=True)
class PlanReport:
    """What `neuronbuild build` would do now: which actions execute (in order), which are cached, estimates."""

    ag: ActionGraph = field(hash=False, compare=False)
    todo: tuple[Action, ...] = ()
    cached: frozenset[str] = frozenset()
    estimates: dict[str, Estimate] = field(default_factory=dict, hash=False, compare=False)
    jobs: int = 1

    def status(self, fp: str) -> str:
        if fp in self.cached:
            return CACHED
        return BUILD if fp in self.estimates else UNNEEDED  # estimates hold exactly the actions to execute

    @property
    def serial_s(self) -> float:
        return sum(e.seconds or 0.0 for e in self.estimates.values())

    @property
    def unknown(self) -> int:
        return sum(1 for e in self.estimates.values() if not e.recorded)

    @property
    def wall_s(self) -> float:
        get = self.estimates.get
        fps = list(map(_FINGERPRINT, self.todo))
        return wall_time_of(self.ag.graph, fps, [(e.seconds or 0.0) if (e := get(fp)) is not None else 0.0
                                                 for fp in fps], self.jobs)

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
        out: list[str] = []
        estimates, cached, ag = self.estimates, self.cached, self.ag
        seen: dict[tuple[int, int, bool, bool], str] = {}
        for ct in ag.compiles:
            head, prefixes = _layout(ct)
            out.extend(head)
            for prefix, (_bucket, fp), trace_fp in zip(prefixes, ct.buckets, _traces(ct, ag), strict=True):
                te, ce = estimates.get(trace_fp), estimates.get(fp)  # (inlined status(): 100,000s)
                key = (id(te), id(ce), trace_fp in cached, fp in cached)  # (estimates are shared: few distinct rows)
                cells = seen.get(key)
                if cells is None:
                    cells = seen[key] = self._cells(te, ce, key[2], key[3])
                out.append(prefix + cells)
        n = len(self.todo)
        line = (f"{len(self.ag.actions)} actions: {n} to execute, {len(self.cached)} cached")
        if n:
            line += f"; estimated {self.serial_s:.1f} s of work, ~{self.wall_s:.1f} s wall with -j {self.jobs}"
            if self.unknown:
                line += f" ({self.unknown} action(s) without a recorded duration estimated from defaults)"
        out.append(line)
        return out


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


def _traces(ct: CompileTarget, ag: ActionGraph) -> tuple[str, ...]:
    """The fingerprint of the trace each bucket's compile derives from (ActionGraph.trace_of), kept in the
    CompileTarget as its layout is: a fingerprint is the digest of everything its action reads, its inputs'
    fingerprints included, so the trace a compile fingerprint derives from is the same in every graph holding it."""
    known = ct.__dict__.get("_plan_traces")
    if known is None:
        known = ct.__dict__["_plan_traces"] = tuple(ag.trace_of(fp).fingerprint for _b, fp in ct.buckets)
    return known  # type: ignore[no-any-return]


def plan_report(ag: ActionGraph, todo: Sequence[Action], cached: Sequence[str], history: History,
                jobs: int, memo: dict[tuple[str, str], Estimate] | None = None) -> PlanReport:
    """`todo`/`cached` come from the scheduler's own needed_actions(), so the report matches what a build runs.
    `memo`: the build server's memo of earlier plans' estimates, valid for this `history` (incremental.estimate_memo;
    a new dict whenever the history or a record shard changed): each action keeps its estimate with the memo's token
    (an action is one fingerprint and one identity, the estimate's inputs), so a re-plan makes no key per action."""
    est = Estimator(history)
    if memo is None:
        estimates = {a.fingerprint: est.estimate(a) for a in todo}
    else:  # each action's estimate kept in the action with the memo's token: valid while the memo is (no key made)
        token = memo.get(_TOKEN)
        if token is None:
            token = memo[_TOKEN] = Estimate(0.0, "token")  # (a new memo, after a change: a new token)
        estimates = {}
        for a in todo:
            kept = a.__dict__.get("_plan_estimate")
            if kept is not None and kept[0] is token:
                e = kept[1]
            else:
                e = est.estimate(a)
                a.__dict__["_plan_estimate"] = (token, e)  # (frozen: written to __dict__ directly)
            estimates[a.fingerprint] = e
    return PlanReport(ag, tuple(todo), frozenset(cached), estimates, jobs)
