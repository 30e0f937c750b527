"""An invocation's record: what a build (or plan) was asked, what became of each action, and its timeline.

`InvocationRecorder` is a build-event listener (execution/events.py); `build_record` joins what it heard with the
action graph (each action's fingerprint record, dependencies and place in the compile matrix) when the build ends,
also when it failed or was interrupted. The same events come from local, build-server and Dask builds."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neuronbuild.execution import events as ev
from neuronbuild.execution.events import BuildEvent
from neuronbuild.report.states import (
    CACHED_LOCAL,
    CACHED_SHARED,
    CUTOFF,
    EXECUTED,
    FAILED,
    NOT_NEEDED,
    NOT_STARTED,
    SKIPPED,
    STATES,
    STOPPED,
)
from neuronbuild.report.store import FORMAT

if TYPE_CHECKING:
    from neuronbuild.analysis.action_graph import ActionGraph
    from neuronbuild.cache.local import LocalCache

LOG_EXCERPT_LINES = 40
LOG_EXCERPT_CHARS = 4000
FULL_RECORDS_UP_TO = 5000  # actions; a larger build keeps no fingerprint records (bounded invocation files)


def log_excerpt(path: str) -> str:
    """The last lines of an action's log (where its error and traceback are)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 4 * LOG_EXCERPT_CHARS))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    lines = text.splitlines()[-LOG_EXCERPT_LINES:]
    return "\n".join(lines)[-LOG_EXCERPT_CHARS:]


class InvocationRecorder:
    """Hears a build's events: each action's fate, its attempts on workers, warm-ups, the build's totals."""

    def __init__(self) -> None:
        self.started = time.time()
        self.actions: dict[str, dict[str, Any]] = {}
        self.slices: list[dict[str, Any]] = []  # one per attempt that reached a worker, and per warm-up
        self.jobs = 1
        self.executor = ""
        self.estimates: dict[str, float] = {}
        self.finished: dict[str, Any] = {}
        self.dispatched: set[str] = set()  # reached a worker (running when a Ctrl-C ended the build: stopped)

    def on_event(self, e: BuildEvent) -> None:
        f = e.fields
        k = e.kind
        if k == ev.CACHE_CHECKED:  # the build's wall time (the summary's) starts here: so does the timeline's axis
            self.started = float(f["start"])
        elif k == ev.BUILD_STARTED:
            self.jobs = int(f.get("jobs") or 1)
            self.executor = str(f.get("executor") or "")
            self.estimates = {p["fingerprint"]: float(p["estimate_s"]) for p in f.get("plan") or ()}
        elif k == ev.ACTION_STARTED:
            self.dispatched.add(f["fingerprint"])
        elif k == ev.ACTION_CACHED:
            self.actions[f["fingerprint"]] = {"state": CUTOFF if f.get("cutoff") else CACHED_LOCAL,
                                              "by_other_build": bool(f.get("by_other_build"))}
        elif k == ev.ACTION_FINISHED:
            self.actions[f["fingerprint"]] = {
                "state": EXECUTED, "duration_s": f["duration_s"], "cpu_s": f.get("cpu_s", 0.0),
                "peak_rss_mb": f.get("peak_rss_mb", 0.0), "estimate_mb": f.get("estimate_mb", 0.0),
                "worker": f.get("worker", ""), "attempt": f["attempt"],
                "start": f.get("start"), "end": f.get("end"), "outputs": dict(f.get("outputs") or {})}
            if f.get("skipped"):  # its step's real work was left out (e.g. a Neuron compile without neuronx-cc)
                self.actions[f["fingerprint"]]["skipped_step"] = str(f["skipped"])
            self._slice(f, True)
        elif k == ev.ACTION_FAILED:
            if f.get("worker"):
                self._slice(f, False)
            if not f.get("will_retry"):
                self.actions[f["fingerprint"]] = {
                    "state": FAILED, "duration_s": f.get("duration_s", 0.0), "worker": f.get("worker", ""),
                    "attempt": f.get("attempt", 1), "start": f.get("start"), "end": f.get("end"),
                    "error": f.get("error", ""), "log": f.get("log", ""), "worker_died": bool(f.get("worker_died"))}
        elif k == ev.ACTION_SKIPPED:
            fp = f["fingerprint"]
            because = f.get("because")
            self.actions[fp] = {"state": STOPPED} if because == "stopped" else {"state": SKIPPED, "because": because}
        elif k == ev.WARM_UP_FINISHED:
            self.slices.append({"worker": str(f.get("worker") or ""), "start": float(f["start"]), "end": e.time,
                                "name": f["description"], "kind": "warm_up", "ok": bool(f.get("ok"))})
        elif k == ev.BUILD_FINISHED:
            self.finished = dict(f)

    def _slice(self, f: Mapping[str, Any], ok: bool) -> None:
        start = f.get("start")
        if start is None:
            return
        self.slices.append({"worker": str(f.get("worker") or ""), "start": float(start),
                            "end": float(f.get("end") or start + float(f.get("duration_s") or 0.0)),
                            "name": f["description"], "fingerprint": f["fingerprint"], "kind": "action", "ok": ok,
                            "attempt": f.get("attempt", 1)})

    def close(self) -> None:
        pass


def action_entry(a: Any, with_record: bool) -> dict[str, Any]:
    """What the page shows of an action besides its fate: identity, where it sits in the matrix, its record."""
    d: dict[str, Any] = {"fingerprint": a.fingerprint, "kind": a.kind, "label": str(a.label),
                         "bucket": str(a.bucket), "dims": a.bucket.as_dict(), "graph": a.bucket.graph,
                         "description": a.describe(), "identity": a.identity, "platform": a.platform,
                         "target": a.target, "deps": list(a.deps), "outputs_declared": list(a.outputs)}
    if with_record:
        d["record"] = a.record
    return d


def compiles_entry(ag: ActionGraph) -> list[dict[str, Any]]:
    """The matrix: per compile target, per bucket, the primary action and every action its artifacts come from."""
    out = []
    for ct in ag.compiles:
        out.append({"label": str(ct.label), "model": str(ct.model), "platform": ct.platform,
                    "target": ct.description or ct.platform,
                    "buckets": [{"bucket": str(b), "name": b.name, "graph": b.graph, "dims": b.as_dict(), "primary": fp,
                                 "actions": sorted(ag.closure(fp), key=lambda x: ag.actions[x].kind != "trace")}
                                for b, fp in ct.buckets]})
    return out


def _unfinished(fp: str, unstarted: set[str], recorder: InvocationRecorder | None) -> str:
    """The state of an action the build ended without a word on: stopped (it was running: Ctrl-C), not started (it
    was to run), else not needed (only cached consumers need it)."""
    if recorder is not None and fp in recorder.dispatched:
        return STOPPED
    if fp in unstarted or (recorder is not None and fp in recorder.estimates):
        return NOT_STARTED
    return NOT_NEEDED


def build_record(*, inv_id: str, command: str, argv: Iterable[str], patterns: Iterable[str],
                 flags: Mapping[str, Any], workspace: Path, cache_dir: Path, outcome: str, exit_code: int,
                 started: float, ag: ActionGraph | None, recorder: InvocationRecorder | None,
                 cache: LocalCache | None, not_started: Iterable[str] = (), planned: Mapping[str, str] | None = None,
                 extra: Mapping[str, Any] | None = None, results: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The invocation record (format in docs/report.md). `planned` (a plan): {fingerprint: to_build | cached}.
    `results`: the build's (BuildResult.results) when it returned; else cached entries are read from the cache."""
    served: Mapping[str, str] = dict(cache.stats.served) if cache is not None else {}
    actions: list[dict[str, Any]] = []
    heard = recorder.actions if recorder is not None else {}
    unstarted = set(not_started)
    saved_s = 0.0
    large_plan = planned is not None and ag is not None and len(ag.actions) > FULL_RECORDS_UP_TO
    if ag is not None and not large_plan:  # (a large plan, which must stay fast, records its counts only)
        full = len(ag.actions) <= FULL_RECORDS_UP_TO
        for fp, a in ag.actions.items():
            d = action_entry(a, full)
            if planned is not None:
                d["state"] = planned.get(fp, NOT_NEEDED)
            else:
                d.update(heard.get(fp) or {"state": _unfinished(fp, unstarted, recorder)})
            if d["state"] == CACHED_LOCAL and not d.get("by_other_build"):
                tier = served.get(fp)
                d["state"] = CACHED_SHARED if tier == "shared" else CACHED_LOCAL if tier == "local" else CUTOFF
            if d["state"] in (CACHED_LOCAL, CACHED_SHARED, CUTOFF) and cache is not None and full:
                res = results.get(fp) if results is not None else cache.lookup_local(fp)[0]
                if res is not None:
                    d["outputs"] = {k: v.digest for k, v in sorted(res.outputs.items())}
                    d["recorded_s"] = round(res.duration_s, 3)
                    d["peak_rss_mb"] = (res.metadata or {}).get("peak_rss_mb", 0.0)
                    saved_s += res.duration_s
            if d["state"] == FAILED and d.get("log"):
                d["log_excerpt"] = log_excerpt(d["log"])
            if recorder is not None and fp in recorder.estimates:
                d["estimate_s"] = recorder.estimates[fp]
            actions.append(d)
    counts = {s: 0 for s in STATES}
    for d in actions:
        counts[d["state"]] += 1
    if large_plan and planned is not None:
        for state in planned.values():
            counts[state] += 1
    fin = recorder.finished if recorder is not None else {}
    slices = recorder.slices if recorder is not None else []
    t0 = recorder.started if recorder is not None else started
    jobs = recorder.jobs if recorder is not None else 0
    wall = float(fin.get("wall_s") or 0.0)
    busy = sum(max(0.0, s["end"] - s["start"]) for s in slices if not str(s["worker"]).startswith("zygote"))
    record: dict[str, Any] = {
        "format": FORMAT, "id": inv_id, "command": command, "argv": list(argv), "patterns": list(patterns),
        "flags": {k: v for k, v in flags.items() if v not in (None, False, [], ())},
        "workspace": str(workspace), "cache_dir": str(cache_dir), "started": round(started, 3),
        "finished": round(time.time(), 3), "outcome": outcome, "exit_code": exit_code,
        "executor": recorder.executor if recorder is not None else "", "jobs": jobs, "t0": t0,
        "wall_s": round(wall, 3), "total_s": round(time.time() - started, 3),
        "cpu_s": round(sum(float(d.get("cpu_s") or 0.0) for d in actions), 3),
        "busy_worker_s": round(busy, 3), "utilisation": round(busy / (wall * jobs), 4) if wall > 0 and jobs else 0.0,
        "peak_rss_mb": max((float(d.get("peak_rss_mb") or 0.0) for d in actions if d["state"] == EXECUTED),
                           default=0.0),
        "saved_s": round(saved_s, 3),
        "work_s": round(sum(float(d.get("duration_s") or d.get("recorded_s") or 0.0) for d in actions), 3), "counts": counts, "total": len(ag.actions) if ag is not None else 0,
        "actions": actions, "compiles": compiles_entry(ag) if ag is not None and not large_plan else [],
        "slices": slices,
    }
    record.update(extra or {})
    return record
