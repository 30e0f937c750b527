"""The local executor under failure: --keep-going, a worker SIGKILLed mid-action (--retries), Ctrl-C, and --profile."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import blake3
import psutil
from helpers import running, write_ws

# Tiny models on the trn2 path (a few seconds per action). `gate`: the factory waits while that file exists, so a test
# can act while an action is certainly running.
MODEL = '''
import os
import time

import torch


class M(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.emb = torch.nn.Embedding(50, n)
        self.lin = torch.nn.Linear(n, n)

    def forward(self, x):
        return self.lin(self.emb(x)).relu()


def build(config):
    gate = config.get("gate")
    while gate and os.path.exists(gate):
        time.sleep(0.05)
    return M(config["n"])


def broken(config):
    raise RuntimeError("this model is broken on purpose")


def report_threads(config):
    raise RuntimeError("threads=" + os.environ.get("NEURONBUILD_THREADS", "unset") + " compile_threads="
                       + os.environ.get("TORCHINDUCTOR_COMPILE_THREADS", "unset") + " omp="
                       + os.environ.get("OMP_NUM_THREADS", "unset") + " torch=" + str(torch.get_num_threads()))
'''


def _build_file(models: dict[str, tuple[str, dict[str, Any]]]) -> str:
    out = ['neuron_buckets(name = "bk", shapes = [{"batch": 1, "seq": 4}])',
           'neuron_target(name = "trn2", platform = "trn2")']
    for name, (entry, config) in models.items():
        out.append(f'neuron_model(name = "{name}", srcs = ["m.py"], entry = "m:{entry}", config = {json.dumps(config)},'
                   f' inputs = {{"x": "int64[batch, seq]"}})')
        out.append(f'neuron_compile(name = "{name}_trn2", model = ":{name}", buckets = [":bk"], target = ":trn2")')
    return "\n".join(out) + "\n"


def _ws(root: Path, models: dict[str, tuple[str, dict[str, Any]]]) -> Path:
    return write_ws(root, {"pkg/BUILD": _build_file(models), "pkg/m.py": MODEL})


def _default_sigint() -> None:
    # A shell starts background jobs with SIGINT ignored (and that is inherited): give the build a terminal's default.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(args: list[str], cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "neuronbuild", *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_default_sigint)


def _events(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    return [json.loads(ln) for ln in lines if ln.endswith("}")]


def _wait_for(path: Path, pred: Any, proc: subprocess.Popen[str], timeout: float = 180) -> dict[str, Any]:
    """The first event matching pred, waiting for it while the build runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for e in _events(path):
            if pred(e):
                return e
        assert proc.poll() is None, f"the build ended early: {proc.communicate()}"
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"no matching event in {timeout} s: {_events(path)}")


def _started(desc: str) -> Any:
    return lambda e: e["event"] == "action_started" and e["description"] == desc


def test_keep_going_builds_the_good_model_past_a_broken_action_and_a_target_whose_analysis_fails(
        tmp_path: Path) -> None:
    ws = _ws(tmp_path / "ws", {"good": ("build", {"n": 8}), "bad": ("broken", {"n": 8})})
    # A third target whose analysis fails (bad input, found before any action runs): left out, the rest built.
    build = ws / "pkg/BUILD"
    build.write_text(build.read_text() + 'neuron_compile(name = "unplannable", model = ":good", buckets = [":bk"],'
                     ' target = ":trn2", tp_degree = 0)\n'
                     'neuron_bundle(name = "ships_it", srcs = [":unplannable"])\n')
    line = len(build.read_text().splitlines()) - 1
    prof, evf = tmp_path / "profile.json", tmp_path / "events.jsonl"
    proc = _start(["build", "//pkg:all", "--keep-going", "--jobs", "2", "--cache-dir", str(tmp_path / "cache"),
                   "--profile", str(prof), "--build-event-json-file", str(evf)], ws)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 2, out + err  # (bad input, as without --keep-going; the actions' failures are named too)
    assert f"pkg/BUILD:{line}:" in err and "'tp_degree' must be a positive int" in err, err
    assert f"pkg/BUILD:{line + 1}:" in err and "//pkg:ships_it is not built: a target it depends on failed" in err
    assert "2 requested targets not built (analysis failed)" in out, out
    assert not (ws / "neuronbuild-out/pkg/unplannable").exists()
    assert (ws / "neuronbuild-out/pkg/good_trn2/batch1_seq4/model.hlo.pb").is_file()
    assert not (ws / "neuronbuild-out/pkg/bad_trn2").exists()
    # the good model's 4 actions; the bad one's factory fails its weights action and its trace
    assert "8 actions: 4 executed, 0 cached" in out and "2 failed, 2 not run" in out, out
    # The summary names the failed action (label, bucket), the first line of its error and its full log.
    summary = err[err.index("  FAILED"):]
    assert "FAILED Trace //pkg:bad [batch=1, seq=4]" in summary
    assert "RuntimeError: this model is broken on purpose" in summary
    log = Path(summary.split("log: ")[1].split()[0])
    assert "Traceback" in log.read_text() and "broken on purpose" in log.read_text()
    assert "Traceback" not in err

    events = _events(evf)
    kinds = [e["event"] for e in events]
    assert kinds[0] == "cache_checked" and kinds[1] == "build_started" and kinds[-1] == "build_finished"
    finished = [e for e in events if e["event"] == "action_finished"]
    assert sorted(e["description"] for e in finished) == ["Compile //pkg:good_trn2 [batch=1, seq=4] for trn2",
                                                          "Lower //pkg:good [batch=1, seq=4]",
                                                          "Trace //pkg:good [batch=1, seq=4]",
                                                          "Weights //pkg:good"]
    assert all(len(e["fingerprint"]) == 64 and e["duration_s"] > 0 for e in finished)
    # Each action's CPU seconds (its process and its compilers): measured (a trace and a lowering are CPU work),
    # and no more than its wall allows on this machine's cores.
    cores = len(os.sched_getaffinity(0))
    assert all(0 < e["cpu_s"] <= e["duration_s"] * cores + 0.5 for e in finished), finished
    assert all(e["cpu_s"] > 0.1 for e in finished if e["description"].startswith(("Trace", "Lower"))), finished
    failed = [e for e in events if e["event"] == "action_failed"]  # the bad model's weights action and its trace
    assert len(failed) == 2 and all(f["label"] == "//pkg:bad" and not f["worker_died"] for f in failed)
    assert str(log) in {f["log"] for f in failed}
    assert sorted(e["label"] for e in events if e["event"] == "action_skipped") == ["//pkg:bad", "//pkg:bad_trn2"]

    # --profile: valid trace-event JSON, one complete slice per executed action (plus the failed attempt) on
    # named worker tracks.
    trace = json.loads(prof.read_text())
    evs = trace["traceEvents"]
    for e in evs:
        assert e["ph"] in ("X", "M", "i") and isinstance(e["pid"], int) and isinstance(e["tid"], int)
        if e["ph"] == "X":
            assert isinstance(e["ts"], (int, float)) and e["dur"] > 0 and e["name"]
    slices = [e for e in evs if e["ph"] == "X" and e["cat"] == "action"]
    assert sorted(e["args"]["fingerprint"] for e in slices if e["args"]["ok"]) == \
        sorted(e["fingerprint"] for e in finished)
    assert {e["args"]["fingerprint"]: e["args"]["cpu_s"] for e in slices if e["args"]["ok"]} == \
        {e["fingerprint"]: e["cpu_s"] for e in finished}
    assert sorted(e["args"]["fingerprint"] for e in slices if not e["args"]["ok"]) == \
        sorted(f["fingerprint"] for f in failed)
    # Each executed action's measured peak beside the memory estimate --local-ram admitted it by (the same as in
    # its action_started event).
    # Light steps (Neuron compiles without neuronx-cc) run on the build process's own track with no process of
    # their own to measure.
    admitted = {e["fingerprint"]: e["estimate_mb"] for e in events if e["event"] == "action_started"}
    names = {e["tid"]: e["args"]["name"] for e in evs if e["ph"] == "M" and e["name"] == "thread_name"}
    assert all((e["args"]["peak_rss_mb"] > 0) == (names[e["tid"]] != "build")
               and e["args"]["estimate_mb"] == admitted[e["args"]["fingerprint"]] > 0
               for e in slices if e["args"]["ok"])
    assert {names[e["tid"]] for e in slices} <= {"worker-1", "worker-2", "build"}
    assert {names[e["tid"]] for e in slices if "Compile" in e["name"] and "trn2" in e["name"]} == {"build"}
    assert any(e["name"] == "cache check" for e in evs)


def test_worker_killed_mid_action_fails_only_that_action_then_retries_on_a_new_worker(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    gate.write_text("")
    ws = _ws(tmp_path / "ws", {"a": ("build", {"n": 8, "gate": str(gate)}), "b": ("build", {"n": 12})})
    cache, evf = tmp_path / "cache", tmp_path / "events.jsonl"

    # 1. No retries: the killed worker's action fails with a clear message; the other model is built.
    proc = _start(["build", "//pkg:all", "--keep-going", "--jobs", "2", "--cache-dir", str(cache),
                   "--build-event-json-file", str(evf)], ws)
    victim = _wait_for(evf, _started("Trace //pkg:a [batch=1, seq=4]"), proc)["pid"]
    os.kill(victim, signal.SIGKILL)
    # (a's weights action calls the gated factory too: killed the same way, so the build can end)
    os.kill(_wait_for(evf, _started("Weights //pkg:a"), proc)["pid"], signal.SIGKILL)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 1, out + err
    assert "FAILED Trace //pkg:a [batch=1, seq=4]" in err
    assert "the worker process died: killed by SIGKILL" in err
    assert (ws / "neuronbuild-out/pkg/b_trn2/batch1_seq4/model.hlo.pb").is_file()
    assert not psutil.pid_exists(victim)

    # 2. --retries 1 and one worker: killed again mid-action, the action re-runs on a replacement worker.
    evf = tmp_path / "events2.jsonl"
    proc = _start(["build", "//pkg:all", "--retries", "1", "--jobs", "1", "--cache-dir", str(cache),
                   "--build-event-json-file", str(evf)], ws)
    victim = _wait_for(evf, _started("Trace //pkg:a [batch=1, seq=4]"), proc)["pid"]
    os.kill(victim, signal.SIGKILL)
    _wait_for(evf, lambda e: e["event"] == "action_failed" and e["will_retry"], proc)
    gate.unlink()
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, out + err
    assert "8 actions: 4 executed, 4 cached" in out, out  # a's 4 actions (its weights failed in step 1); b cached
    assert "RETRY: Trace //pkg:a [batch=1, seq=4]: the worker process died: killed by SIGKILL" in err
    events = _events(evf)
    (retried,) = [e for e in events if e["event"] == "action_failed"]
    assert retried["worker_died"] and retried["pid"] == victim
    done = [e for e in events if e["event"] == "action_finished" and e["description"].startswith("Trace //pkg:a ")]
    assert len(done) == 1 and done[0]["attempt"] == 2 and done[0]["pid"] != victim
    assert (ws / "neuronbuild-out/pkg/a_trn2/batch1_seq4/model.hlo.pb").is_file()


def test_ctrl_c_mid_build_ends_workers_and_leaves_a_clean_cache(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    gate.write_text("")
    ws = _ws(tmp_path / "ws", {"a": ("build", {"n": 8, "gate": str(gate)}), "b": ("build", {"n": 12})})
    cache, evf = tmp_path / "cache", tmp_path / "events.jsonl"
    proc = _start(["build", "//pkg:all", "--jobs", "2", "--cache-dir", str(cache), "--build-event-json-file",
                   str(evf)], ws)
    _wait_for(evf, lambda e: e["event"] == "outputs_stored", proc)  # something is cached already
    _wait_for(evf, _started("Trace //pkg:a [batch=1, seq=4]"), proc)
    pids = {e["pid"] for e in _events(evf) if e["event"] == "action_started"}
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 8, out + err
    assert "interrupted" in err and "Traceback" not in err
    time.sleep(0.5)
    assert not [p for p in pids if running(p)]
    assert json.loads(evf.read_text().splitlines()[-1])["interrupted"] is True

    root = cache / "v1"
    assert not list((root / "sandbox").iterdir())  # no sandboxes left
    assert not [p for p in (root / "tmp").rglob("*") if p.is_file()]  # no half-written files
    records = list((root / "ac").rglob("*.json"))
    assert records
    for rec in records:  # every record is whole and all its blobs are there and intact
        data = json.loads(rec.read_text())
        assert data["identity"] != "trace //pkg:a [batch=1, seq=4]"
        for o in data["outputs"].values():
            blob = root / "cas" / o["digest"][:2] / o["digest"]
            assert blake3.blake3(blob.read_bytes()).hexdigest() == o["digest"]
    for lock in (root / "locks").glob("*.lock"):  # no claim is still held
        with open(lock) as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)

    gate.unlink()
    proc = _start(["build", "//pkg:all", "--jobs", "2", "--cache-dir", str(cache)], ws)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, out + err
    assert (ws / "neuronbuild-out/pkg/a_trn2/batch1_seq4/model.hlo.pb").is_file()


def test_each_worker_gets_its_share_of_the_cores_and_torch_stays_single_threaded(tmp_path: Path) -> None:
    """--jobs N: every worker may run cores // N compiler processes (at least 1): one worker gets the whole machine.
    Torch's own threads stay at 1 whatever --jobs is (inductor's codegen reads them: artifacts must not depend on
    --jobs). Seen from inside a real action (the model's factory reports its environment)."""
    from neuronbuild.platforms import host_cores

    ws = _ws(tmp_path / "ws", {"t": ("report_threads", {"n": 8})})
    cores = host_cores()
    for jobs in (1, 2, cores + 1):
        proc = subprocess.run([sys.executable, "-m", "neuronbuild", "build", "//pkg:t_trn2", "--jobs", str(jobs),
                               "--cache-dir", str(tmp_path / f"cache{jobs}")], cwd=ws, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        share = max(1, cores // jobs)
        assert f"threads={share} compile_threads={share} omp=1 torch=1" in proc.stdout + proc.stderr, \
            proc.stdout + proc.stderr
