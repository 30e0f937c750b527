"""--profile PATH: the build as a Chrome trace-event JSON file (opens in Perfetto or chrome://tracing).

One track per worker with one complete ("X") slice per executed action attempt (and per toolchain warm-up), and a
scheduler track with the cache check, each store of outputs, and an instant per cached action. `otherData` holds the
build's utilisation: busy worker-seconds / (wall x workers)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from neuronbuild.atomic import atomic_write_bytes, umask_mode
from neuronbuild.execution import events as ev
from neuronbuild.execution.events import BuildEvent

_PID = 1
_SCHEDULER_TID = 0


class TraceProfile:
    """Collects events during the build and writes the trace file when the build ends (or is interrupted)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._t0: float | None = None
        self._events: list[dict[str, Any]] = []
        self._tids: dict[str, int] = {}
        self._written = False
        self._jobs = 1
        self._busy_s = 0.0  # dispatch to completion of every action attempt and warm-up
        self._action_s = 0.0  # run time inside the workers (what actions record as their duration)
        self._warm_up_s = 0.0
        self._cpu_s = 0.0  # CPU seconds of the actions and warm-ups (their processes and compilers)
        self._wall_s = 0.0
        self._first_start: float | None = None

    def _us(self, t: float) -> float:
        if self._t0 is None:
            self._t0 = t
        return round((t - self._t0) * 1e6, 1)

    def _tid(self, worker: str) -> int:
        if not worker:
            return _SCHEDULER_TID
        if worker not in self._tids:
            self._tids[worker] = len(self._tids) + 1
        return self._tids[worker]

    def _slice(self, name: str, cat: str, start: float, end: float, tid: int, args: dict[str, Any]) -> None:
        ts = self._us(start)
        self._events.append({"name": name, "cat": cat, "ph": "X", "ts": ts,
                             "dur": max(1.0, round(self._us(end) - ts, 1)), "pid": _PID, "tid": tid, "args": args})

    def on_event(self, e: BuildEvent) -> None:
        f = e.fields
        if e.kind == ev.BUILD_STARTED:
            self._jobs = max(1, int(f.get("jobs") or 1))
        if e.kind == ev.CACHE_CHECKED:
            self._slice("cache check", "cache", f["start"], f["start"] + f["duration_s"], _SCHEDULER_TID,
                        {"lookups": f["lookups"], "hits": f["hits"]})
        elif e.kind == ev.ACTION_CACHED:
            self._events.append({"name": f"cached: {f['description']}", "cat": "cache", "ph": "i", "s": "t",
                                 "ts": self._us(e.time), "pid": _PID, "tid": _SCHEDULER_TID,
                                 "args": {"fingerprint": f["fingerprint"]}})
        elif e.kind in (ev.ACTION_FINISHED, ev.ACTION_FAILED) and f.get("worker"):
            args = {"fingerprint": f["fingerprint"], "attempt": f["attempt"], "ok": e.kind == ev.ACTION_FINISHED,
                    "duration_s": f["duration_s"]}
            if e.kind == ev.ACTION_FAILED:
                args["error"] = f["error"]
            else:
                args["peak_rss_mb"] = f["peak_rss_mb"]
                if "estimate_mb" in f:  # what --local-ram admitted it by
                    args["estimate_mb"] = f["estimate_mb"]
                args["cpu_s"] = f.get("cpu_s", 0.0)
            end = float(f.get("end") or e.time)  # the worker was free from then on (storing came after)
            self._slice(f["description"], "action", f["start"], end, self._tid(f["worker"]), args)
            self._busy(float(f["start"]), end)
            self._action_s += float(f.get("duration_s") or 0.0)
            self._cpu_s += float(f.get("cpu_s") or 0.0)
        elif e.kind == ev.WARM_UP_FINISHED:
            self._slice(f["description"], "warm_up", f["start"], e.time, self._tid(f["worker"]),
                        {"ok": f["ok"], "duration_s": f["duration_s"], "cpu_s": f.get("cpu_s", 0.0),
                         **dict(f.get("metadata") or {}),
                         **({"error": f["error"]} if not f["ok"] else {})})
            if not str(f["worker"]).startswith("zygote"):  # beside the workers (in a zygote): keeps none busy
                self._busy(float(f["start"]), e.time)
            self._warm_up_s += max(0.0, e.time - float(f["start"]))
            self._cpu_s += float(f.get("cpu_s") or 0.0)
        elif e.kind == ev.OUTPUTS_STORED:
            self._slice("store outputs", "cache", f["start"], f["start"] + f["duration_s"], _SCHEDULER_TID,
                        {"fingerprint": f["fingerprint"]})
        elif e.kind == ev.BUILD_FINISHED:
            self._wall_s = float(f.get("wall_s") or 0.0)
            self.write()

    def _busy(self, start: float, end: float) -> None:
        self._busy_s += max(0.0, end - start)
        self._first_start = start if self._first_start is None else min(self._first_start, start)

    def utilisation(self) -> dict[str, float]:
        """Busy worker-seconds (dispatch to completion of every action attempt and warm-up: a worker still importing
        torch for its first action counts as busy) / (the scheduler's wall time, from the cache check to the end, x
        workers; loading and planning before it are not counted); `action_utilisation` counts only the actions' own
        run time; `first_dispatch_s`: from the cache check to the first dispatch; `cpu_s`: the CPU seconds of every
        action attempt and warm-up, their compilers included (0 where not measured: on Dask)."""
        denom = self._wall_s * self._jobs
        first = (self._first_start - self._t0) if self._first_start is not None and self._t0 is not None else 0.0
        return {"busy_worker_s": round(self._busy_s, 3), "action_s": round(self._action_s, 3),
                "warm_up_s": round(self._warm_up_s, 3), "wall_s": round(self._wall_s, 3), "workers": self._jobs,
                "utilisation": round(self._busy_s / denom, 4) if denom > 0 else 0.0,
                "action_utilisation": round(self._action_s / denom, 4) if denom > 0 else 0.0,
                "first_dispatch_s": round(max(0.0, first), 3), "cpu_s": round(self._cpu_s, 3)}

    def write(self) -> None:
        if self._written:
            return
        self._written = True
        meta: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": _PID, "tid": 0, "args": {"name": "neuronbuild build"}},
            {"name": "thread_name", "ph": "M", "pid": _PID, "tid": _SCHEDULER_TID, "args": {"name": "scheduler"}},
        ]
        meta += [{"name": "thread_name", "ph": "M", "pid": _PID, "tid": tid, "args": {"name": w}}
                 for w, tid in self._tids.items()]
        data = json.dumps({"traceEvents": meta + self._events, "displayTimeUnit": "ms",
                           "otherData": {k: str(v) for k, v in self.utilisation().items()}}, indent=0)
        atomic_write_bytes(self.path, data.encode("utf-8"), durable=False, mode=umask_mode())

    def close(self) -> None:
        self.write()
