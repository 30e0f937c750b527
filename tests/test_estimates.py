"""One estimator for every figure: `plan` on a fresh cache estimates from the same defaults the build's ETA uses,
recorded durations replace them after a build, and the live ETA keeps moving while actions overrun."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import run_cli
from introspect_ws import cli_json, tiny_ws

from neuronbuild.execution import events as ev
from neuronbuild.execution.events import BuildEvent
from neuronbuild.execution.progress import _Tally


def test_plan_and_build_share_estimates_and_learn_durations(tmp_path: Path) -> None:
    ws, cache = tiny_ws(tmp_path / "ws"), str(tmp_path / "cache")
    env = {"NEURONX_CC": ""}
    planned = cli_json(["plan", "--cache-dir", cache], ws, env)
    assert planned["estimate"]["serial_s"] > 0  # a fresh cache no longer estimates "0.0 s of work"
    guessed = [a for a in planned["execute"] if a["estimate_source"] != "skipped (no neuronx-cc)"]
    assert planned["estimate"]["unknown"] == len(guessed) > 0  # every action estimated from defaults (but the
    # Neuron compiles: without neuronx-cc they only write compile_flags.json, estimated at no time)
    fresh = {a["fingerprint"]: a["estimate_s"] for a in planned["execute"]}
    events, profile = tmp_path / "events.jsonl", tmp_path / "profile.json"
    proc = run_cli(["build", "--cache-dir", cache, "--build-event-json-file", str(events), "--jobs", "2",
                    "--profile", str(profile)], ws, env)
    assert proc.returncode == 0, proc.stderr
    trace = json.loads(profile.read_text())
    slices = [e for e in trace["traceEvents"] if e.get("cat") == "action"]
    u = trace["otherData"]  # worker utilisation: busy worker-seconds / (wall x workers)
    assert float(u["workers"]) == 2 and 0 < float(u["utilisation"]) <= 1
    assert abs(float(u["busy_worker_s"]) - sum(e["dur"] for e in slices) / 1e6) < 0.05
    started = next(json.loads(line) for line in events.read_text().splitlines()
                   if json.loads(line)["event"] == ev.BUILD_STARTED)
    assert {p["fingerprint"]: p["estimate_s"] for p in started["plan"]} == fresh  # the ETA's numbers are plan's
    took = {json.loads(line)["fingerprint"]: json.loads(line)["duration_s"] for line in events.read_text().splitlines()
            if json.loads(line)["event"] == ev.ACTION_FINISHED}
    other = tiny_ws(tmp_path / "ws2", seqs=(8, 32))  # same identities for seq=8, a new bucket seq=32
    again = cli_json(["plan", "--cache-dir", cache], other, env)
    by_desc = {a["description"]: a for a in again["execute"]}
    new_trace = by_desc["Trace //m:tiny [batch=1, seq=32]"]
    assert new_trace["estimate_source"].startswith("mean of")  # learnt from the recorded traces, not a default
    recorded_traces = [d for fp, d in took.items() if fp in fresh and "Trace" in
                       next(a["description"] for a in planned["execute"] if a["fingerprint"] == fp)]
    assert abs(new_trace["estimate_s"] - sum(recorded_traces) / len(recorded_traces)) < 0.01


def _started(plan: list[tuple[str, float]], jobs: int) -> BuildEvent:
    return BuildEvent(ev.BUILD_STARTED, 0.0, {"to_execute": len(plan), "cached": 0, "jobs": jobs,
                                              "plan": [{"fingerprint": f, "estimate_s": s} for f, s in plan]})


def test_the_eta_keeps_moving_while_actions_run_past_their_estimates() -> None:
    t = _Tally()
    t.update(_started([("a", 10.0), ("b", 10.0), ("c", 20.0)], jobs=2))
    for fp in ("a", "b"):
        t.update(BuildEvent(ev.ACTION_STARTED, 100.0, {"fingerprint": fp, "description": fp}))
    assert t.eta_s(105.0) == (5 + 5 + 20) / 2
    past = [t.eta_s(100.0 + s) for s in (12, 20, 40, 60)]  # a and b overrun their 10 s estimates
    assert all(later > earlier for earlier, later in zip(past, past[1:], strict=False)), past
    assert past[0] > 20 / 2  # never less than the work not started yet


def test_a_task_queued_on_the_farm_counts_as_running_only_once_a_thread_frees() -> None:
    t = _Tally()
    t.update(_started([("a", 10.0), ("b", 10.0), ("c", 10.0)], jobs=2))
    t.update(BuildEvent(ev.ACTION_STARTED, 100.0, {"fingerprint": "a", "description": "a", "slots": 2}))
    t.update(BuildEvent(ev.ACTION_STARTED, 100.0, {"fingerprint": "b", "description": "b", "slots": 2}))
    t.update(BuildEvent(ev.ACTION_STARTED, 100.0, {"fingerprint": "c", "description": "c", "slots": 2,
                                                   "queued": True}))
    assert set(t.running) == {"a", "b"} and set(t.queued) == {"c"}
    assert t.eta_s(108.0) == (2 + 2 + 10) / 2  # c has not begun: its whole estimate is left
    t.update(BuildEvent(ev.ACTION_FINISHED, 108.0, {"fingerprint": "a", "description": "a"}))
    assert set(t.running) == {"b", "c"} and not t.queued
    assert t.running["c"][1] == 108.0  # its elapsed time counts from the freed thread, not from when it was sent
    t.update(BuildEvent(ev.ACTION_STARTED, 109.0, {"fingerprint": "d", "description": "d", "slots": 3}))
    assert t.jobs == 3 and set(t.running) == {"b", "c", "d"}  # a worker joined: three run at once
