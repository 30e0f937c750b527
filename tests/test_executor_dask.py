"""The Dask executor against a real scheduler and two workers on 127.0.0.1: same outputs as a local build, and the
action of a worker killed mid-action is run again on the other worker without failing the build."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from helpers import copy_example, running

from neuronbuild.execution.events import BuildEvent
from neuronbuild.execution.progress import _Tally

DASK = str(Path(sys.executable).parent / "dask")
TARGETS = ["//models:llama_trn2", "//models:llama_tiny_cpu"]
N_ACTIONS = 2 + 5 + 4 + 4 + 1  # weights (llama, llama_tiny), traces (4 llama graphs + llama_tiny), trn2 lowerings,
# trn2 compiles, 1 AOTInductor compile


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture()
def dask_cluster(tmp_path: Path) -> Iterator[tuple[str, list[subprocess.Popen[bytes]]]]:
    """`dask scheduler` + 2 `dask worker` processes (1 thread each, no nanny), every listener on 127.0.0.1."""
    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    logs = tmp_path / "dask-logs"
    logs.mkdir()
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(name: str, args: list[str]) -> subprocess.Popen[bytes]:
        with open(logs / f"{name}.log", "wb") as log:
            p = subprocess.Popen([DASK, *args], stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
        procs.append(p)
        return p

    spawn("scheduler", ["scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"])
    workers = [spawn(f"worker{i}", ["worker", address, "--host", "127.0.0.1", "--nthreads", "1", "--no-nanny",
                                    "--no-dashboard", "--name", f"w{i}"]) for i in (1, 2)]
    from distributed import Client

    with Client(address, timeout="60s") as c:
        c.wait_for_workers(2, timeout=120)
    try:
        yield address, workers
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                for child in psutil.Process(p.pid).children(recursive=True):
                    child.kill()
                p.kill()
                p.wait(timeout=30)


def _manifest_digests(ws: Path, target: str) -> dict[str, str]:
    m = json.loads((ws / "neuronbuild-out/models" / target / "manifest.json").read_text())
    return {f"{b['name']}/{n}": o["digest"] for b in m["buckets"] for n, o in b["outputs"].items()}


def _action_children(worker: subprocess.Popen[bytes]) -> list[psutil.Process]:
    try:
        kids = psutil.Process(worker.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for k in kids:
        try:
            # "neuronbuild-worker": a spawned worker; "neuronbuild-worker-zygote": the zygote, and the workers and
            # actions forked from it (a fork keeps its parent's command line)
            if any(arg.startswith("neuronbuild-worker") for arg in k.cmdline()):
                out.append(k)
        except psutil.Error:
            pass
    return out


def _executing_on(address: str, worker: str) -> list[str]:
    """The keys of the tasks a Dask worker is executing right now (the worker's own state, not the scheduler's)."""
    from distributed import Client

    def executing(dask_worker):  # type: ignore[no-untyped-def]  # nested: pickled by value, runs on the worker
        return sorted(str(ts.key) for ts in dask_worker.state.executing)

    with Client(address, timeout="30s") as c:
        return list(c.run(executing, workers=[worker])[worker])


def _worker_addresses(address: str) -> dict[str, str]:
    """Dask worker name (w1, w2) -> its tcp address."""
    from distributed import Client

    with Client(address, timeout="30s") as c:
        return {str(w["name"]): a for a, w in c.scheduler_info()["workers"].items()}


def test_dask_farm_builds_the_example_like_a_local_build_and_reruns_the_action_of_a_lost_worker(
        built_example, dask_cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    local_ws, _ = built_example
    address, workers = dask_cluster
    names = _worker_addresses(address)
    ws = copy_example(tmp_path / "ws")
    shared, cache, evf = tmp_path / "shared", tmp_path / "cache", tmp_path / "events.jsonl"
    shared.mkdir()  # the farm's shared directory must exist (a missing mount is an error, not created)
    proc = subprocess.Popen(
        [sys.executable, "-m", "neuronbuild", "build", *TARGETS, "--executor", "dask", "--scheduler", address,
         "--remote-cache", str(shared), "--cache-dir", str(cache), "--build-event-json-file", str(evf)],
        cwd=ws, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    # Kill a whole `dask worker` (and the action process it runs) while it is executing an action.
    victim, victim_address = None, ""
    lost: list[str] = []
    doomed: list[int] = []
    deadline = time.monotonic() + 300
    while not lost and time.monotonic() < deadline and proc.poll() is None:
        for i, w in enumerate(workers, 1):
            if _action_children(w):
                time.sleep(1.0)  # well into the action (its worker process imports torch, then traces)
                # Only actions: a toolchain warm-up (key neuronbuild-warmup-...) is not an action and is not re-run.
                lost = [k for k in _executing_on(address, names[f"w{i}"]) if not k.startswith("neuronbuild-warmup")]
                if lost:
                    victim = w
                    doomed = [w.pid] + [c.pid for c in _action_children(w)]
                    os.kill(w.pid, signal.SIGKILL)
                    victim_address = names[f"w{i}"]
                break
        time.sleep(0.2)
    if victim is None or not lost:
        proc.kill()
        out, err = proc.communicate(timeout=60)
        raise AssertionError(f"no Dask worker was seen executing an action (build exit {proc.returncode}):\n{out}{err}")
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, out + err
    assert f"{N_ACTIONS} actions: {N_ACTIONS} executed, 0 cached" in out

    # The lost worker's action process ended with it (it watches its parent).
    time.sleep(2.0)
    assert not [p for p in doomed if running(p)]
    events = [json.loads(ln) for ln in evf.read_text().splitlines()]
    finished = {e["fingerprint"]: e for e in events if e["event"] == "action_finished"}
    assert len(finished) == N_ACTIONS
    # The action the victim was executing (task key neuronbuild-<fingerprint[:16]>-...) was lost with it and run
    # again, to completion, on the surviving worker; Dask re-ran it, so the build saw no failure at all.
    assert len(lost) == 1 and lost[0].startswith("neuronbuild-"), lost
    rerun = [e for fp, e in finished.items() if fp.startswith(lost[0].split("-")[1])]
    assert len(rerun) == 1, (lost, list(finished))
    survivor = names["w2" if victim_address == names["w1"] else "w1"]
    ran_on = {fp: e["worker"].split(" ")[0] for fp, e in finished.items()}  # "tcp://127.0.0.1:PORT (host)"
    assert ran_on[rerun[0]["fingerprint"]] == survivor != victim_address
    assert not [e for e in events if e["event"] == "action_failed"]
    assert set(ran_on.values()) <= {victim_address, survivor}
    # The client sends a task beyond each Dask thread (queued there); the live display shows those as queued, so it
    # never counts more actions running than the farm's two threads (it replays these same events).
    assert [e["queued"] for e in events if e["event"] == "action_started"][:4] == [False, False, True, True]
    tally = _Tally()
    for e in events:
        tally.update(BuildEvent(e["event"], e["time"], e))
        assert len(tally.running) <= 2, (e, tally.running)
    # Each toolchain warm-up (the cpu headers, the Neuron jax import) ran in the surviving Dask worker's zygote while
    # that worker's single thread ran actions: an action started there before the warm-ups were done (a warm-up that
    # held the thread would have kept every action waiting until it ended).
    warm = [e for e in events if e["event"] == "warm_up_finished" and e["host"] == survivor]
    assert sorted(e["toolchain"] for e in warm) == ["aoti", "neuron"], warm
    assert all(e["ok"] and e["worker"].startswith(f"zygote@{survivor} ") for e in warm), warm
    assert min(e["start"] for fp, e in finished.items() if ran_on[fp] == survivor) < max(e["time"] for e in warm)
    sched_log = (tmp_path / "dask-logs" / "scheduler.log").read_text(errors="replace")
    assert f"Remove worker addr: {victim_address} name: " in sched_log  # the scheduler saw it go

    # Outputs identical to the local build of the same targets (built_example, local executor).
    for target in ("llama_trn2", "llama_tiny_cpu"):
        assert _manifest_digests(ws, target) == _manifest_digests(local_ws, target)
    # The shared tier holds the records and blobs (what other farm clients reuse).
    assert len(list((shared / "v1" / "ac").rglob("*.json"))) == N_ACTIONS
    # Each output is stored once on this host: the client's cache adopted the workers' blobs from the shared
    # directory (verified, hard links), instead of copying and syncing every output a second time.
    local_blobs = {p.name: p.stat().st_ino for p in (cache / "v1" / "cas").glob("*/*")}
    shared_blobs = {p.name: p.stat().st_ino for p in (shared / "v1" / "cas").glob("*/*")}
    outputs = {d for e in finished.values() for d in e["outputs"].values()}
    assert outputs and all(local_blobs[d] == shared_blobs[d] for d in outputs)
