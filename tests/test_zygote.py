"""Workers forked from one warm zygote: a build's workers do not import torch again, and an action in them still runs
confined in its own fork; the zygote and its workers end with the build."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
from helpers import running, write_ws

MODEL = '''
import os
import time

import torch


class M(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.lin = torch.nn.Linear(n, n)

    def forward(self, x):
        return self.lin(x).relu()


def build(config):
    while os.path.exists(config["gate"]):
        time.sleep(0.05)
    return M(4)


def escape(config):
    with open(config["path"]) as f:  # outside the sandbox: confinement refuses it
        f.read()
    return M(4)
'''


def _build_file(models: dict[str, tuple[str, dict[str, Any]]]) -> str:
    out = ['neuron_buckets(name = "bk", shapes = [{"b": 1}])', 'neuron_target(name = "trn2", platform = "trn2")']
    for name, (entry, config) in models.items():
        out.append(f'neuron_model(name = "{name}", srcs = ["m.py"], entry = "m:{entry}", config = {json.dumps(config)},'
                   ' inputs = {"x": "float32[b, 4]"})')
        out.append(f'neuron_compile(name = "{name}_trn2", model = ":{name}", buckets = [":bk"], target = ":trn2")')
    return "\n".join(out) + "\n"


def _events(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(ln) for ln in path.read_text().splitlines() if ln.endswith("}")]
    except OSError:
        return []


def _cpu(p: psutil.Process) -> float:
    t = p.cpu_times()
    return float(t.user + t.system)  # the process itself, not its children


def test_workers_are_forked_from_one_zygote_and_actions_in_them_stay_confined(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    gate.write_text("")
    secret = tmp_path / "elsewhere" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("not for models")
    ws = write_ws(tmp_path / "ws", {"pkg/BUILD": _build_file({
        "a": ("build", {"gate": str(gate), "n": 1}), "b": ("build", {"gate": str(gate), "n": 2}),
        "c": ("escape", {"path": str(secret)})}), "pkg/m.py": MODEL})
    evf = tmp_path / "events.jsonl"
    # --batch: the build process itself runs the pool (not a build server).
    proc = subprocess.Popen([sys.executable, "-m", "neuronbuild", "--batch", "build", "//pkg:all", "--jobs", "2",
                             "--keep-going",
                             "--cache-dir", str(tmp_path / "cache"), "--build-event-json-file", str(evf)],
                            cwd=ws, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # Both workers hold a gated trace: both are alive, busy, and were forked before any action ran.
        deadline = time.monotonic() + 300
        started: list[dict[str, Any]] = []
        while len(started) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            started = [e for e in _events(evf) if e["event"] == "action_started"
                       and e["description"].startswith(("Trace //pkg:a ", "Trace //pkg:b "))]
            time.sleep(0.05)
        workers = [psutil.Process(int(e["pid"])) for e in started]
        assert workers[0].pid != workers[1].pid
        (zygote,) = {w.parent() for w in workers}  # one parent for both
        assert zygote is not None and zygote.parent().pid == proc.pid  # the build started it
        assert "neuronbuild-worker-zygote" in " ".join(zygote.cmdline())
        # The zygote imported torch (seconds of CPU); a forked worker did not import it again.
        assert _cpu(zygote) > 1.0, _cpu(zygote)
        for w in workers:
            assert _cpu(w) < 0.5, (w.pid, _cpu(w))
            # Each action runs in its own child of the worker (the confined fork), not in the worker: the gated trace
            # cannot end, so its child is there once the worker has taken the message (a loaded machine: not yet).
            while not [c for c in w.children() if c.pid != w.pid]:
                assert time.monotonic() < deadline, w.pid
                time.sleep(0.05)
        everyone = [zygote.pid, *(w.pid for w in workers)]
    finally:
        gate.unlink()
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 1, out + err
    # The model that reads outside its sandbox fails in a forked worker as in a spawned one: confined.
    assert "FAILED Trace //pkg:c [b=1]" in err, err
    assert f"the action read '{secret}', which is not among its declared inputs" in err, err
    for name in ("a", "b"):
        assert (ws / f"neuronbuild-out/pkg/{name}_trn2/b1/model.hlo.pb").is_file()
    time.sleep(0.5)
    assert not [p for p in everyone if running(p)]


def test_a_worker_that_dies_while_the_zygote_warms_up_is_reported_at_once(monkeypatch: Any) -> None:
    """The zygote runs a toolchain's warm-up (seconds: a lowering's jax import, a cpu build's headers) in its only
    thread; a forked worker that dies meanwhile is reaped and its exit status reported during the warm-up, not after
    it (the pool waits only seconds for the report; without it the action's failure says 'how is unknown' instead of
    'killed by SIGKILL'). The warm-up's result follows, and no thread is left behind to meet the next fork."""
    import os
    import select
    import signal
    import socket
    import threading

    from neuronbuild.execution import worker, zygote

    child = subprocess.Popen(["sleep", "60"])
    children = {os.pidfd_open(child.pid): child.pid}
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    during: list[bool] = []

    def warm_up(msg: Any, warmed: set[str]) -> dict[str, Any]:
        child.send_signal(signal.SIGKILL)
        during.append(bool(select.select([ours], [], [], 10.0)[0]))  # the report came while this ran
        return {"ok": True, "duration_s": 0.1}

    monkeypatch.setattr(worker, "run_warm_up", warm_up)
    monkeypatch.setattr(worker, "cap_log", lambda path: None)
    threads = threading.active_count()
    zygote._warm(theirs, {"msg": {"log": "unused"}, "task": "t1"}, children, set())
    assert during == [True]
    assert json.loads(ours.recv(1 << 16)) == {"exit": child.pid, "code": -signal.SIGKILL}
    result = json.loads(ours.recv(1 << 16))
    assert result["task"] == "t1" and result["result"]["ok"]
    assert not children and threading.active_count() == threads
