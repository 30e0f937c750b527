"""The compile farm on a real Dask scheduler and workers on 127.0.0.1: `farm status`, workers refusing an action whose
fingerprint names another toolchain, workers that join mid-build, and Ctrl-C stopping actions already running."""

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
from helpers import MODEL_SRC, run_cli, user_signals, write_ws
from introspect_ws import tiny_ws

from neuronbuild.plugin_api.toolchain import package_version

DASK = str(Path(sys.executable).parent / "dask")
SLEEPY_SRC = MODEL_SRC + "\n\ndef sleepy(config):\n    import time\n    time.sleep(600)\n    return build_model(config)\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Farm:
    """`dask scheduler` + `dask worker` processes (1 thread each, no nanny), every listener on 127.0.0.1."""

    def __init__(self, tmp: Path, env: dict[str, str] | None = None) -> None:
        self.env = {**os.environ, **(env or {})}
        self.port = _free_port()
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.logs = tmp / "dask-logs"
        self.logs.mkdir()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.workers: list[subprocess.Popen[bytes]] = []
        self._spawn("scheduler", ["scheduler", "--host", "127.0.0.1", "--port", str(self.port), "--no-dashboard"])

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        with open(self.logs / f"{name}.log", "wb") as log:
            p = subprocess.Popen([DASK, *args], stdout=log, stderr=subprocess.STDOUT, cwd=self.logs, env=self.env)
        self.procs.append(p)
        return p

    def add_worker(self, wait: bool = True) -> subprocess.Popen[bytes]:
        n = len(self.workers) + 1
        w = self._spawn(f"worker{n}", ["worker", self.address, "--host", "127.0.0.1", "--nthreads", "1",
                                       "--no-nanny", "--no-dashboard", "--name", f"w{n}"])
        self.workers.append(w)
        if wait:
            from distributed import Client

            with Client(self.address, timeout="60s") as c:
                c.wait_for_workers(len(self.workers), timeout=120)
        return w

    def close(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                for child in psutil.Process(p.pid).children(recursive=True):
                    child.kill()
                p.kill()
                p.wait(timeout=30)


@pytest.fixture()
def farm(tmp_path: Path) -> Iterator[Farm]:
    f = Farm(tmp_path)
    try:
        yield f
    finally:
        f.close()


def _dask_build(ws: Path, farm: Farm, tmp: Path, *extra: str) -> list[str]:
    shared = tmp / "shared"
    shared.mkdir(exist_ok=True)
    return ["build", "--executor", "dask", "--scheduler", farm.address, "--remote-cache", str(shared),
            "--cache-dir", str(tmp / "cache"), *extra]


def test_farm_status_lists_workers_with_their_toolchains(farm: Farm) -> None:
    farm.add_worker()
    proc = run_cli(["farm", "status", "--scheduler", farm.address], Path.cwd())
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"scheduler {farm.address}: 1 worker(s), 1 thread(s)")
    row = next(ln for ln in lines if ln.startswith("tcp://127.0.0.1:"))
    assert socket.gethostname() in row and package_version("torch") in row and f"{sys.version_info[0]}." in row
    bad = run_cli(["farm", "status", "--scheduler", f"tcp://127.0.0.1:{_free_port()}", "--timeout", "2"], Path.cwd())
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "cannot reach" in bad.stderr


def test_a_worker_refuses_an_action_whose_fingerprint_names_another_torch(farm: Farm, tmp_path: Path) -> None:
    farm.add_worker()
    ws = tiny_ws(tmp_path / "ws", seqs=(8,))
    fake = tmp_path / "pp" / "torch-99.0.dist-info"  # the client believes torch is 99.0; the worker runs 2.13
    fake.mkdir(parents=True)
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 99.0\n")
    proc = run_cli(_dask_build(ws, farm, tmp_path), ws, {"PYTHONPATH": str(fake.parent), "NEURONX_CC": ""})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "toolchain does not match" in proc.stderr and "torch" in proc.stderr and "99.0" in proc.stderr
    assert not list((tmp_path / "shared" / "v1" / "ac").rglob("*.json"))  # nothing cached under the wrong versions
    assert not list((tmp_path / "cache" / "v1" / "ac").rglob("*.json"))


def test_workers_joining_mid_build_are_used(farm: Farm, tmp_path: Path) -> None:
    farm.add_worker()
    ws = tiny_ws(tmp_path / "ws", seqs=(8, 16, 24, 32, 40, 48))
    evf = tmp_path / "events.jsonl"
    build = subprocess.Popen([sys.executable, "-m", "neuronbuild", *_dask_build(ws, farm, tmp_path),
                              "--build-event-json-file", str(evf)], cwd=ws, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**_env(), "NEURONX_CC": ""})
    # Mid-build by the events, not by a sleep: the second worker joins once the first action has finished on the
    # first one (20 actions, one worker thread: most of the build is still to run).
    deadline = time.monotonic() + 600
    while '"action_finished"' not in (evf.read_text() if evf.exists() else "") and build.poll() is None:
        assert time.monotonic() < deadline, "no action finished in 600 s"
        time.sleep(0.2)
    farm.add_worker(wait=True)
    joined = time.time()
    out, err = build.communicate(timeout=900)
    assert build.returncode == 0, out + err
    events = [json.loads(line) for line in evf.read_text().splitlines()]
    assert any(e["event"] == "action_started" and e["time"] > joined for e in events), "the build ended first"
    ran_on = {e["worker"] for e in events if e["event"] == "action_finished"}
    assert len(ran_on) == 2, ran_on
    assert all(e["cpu_s"] > 0 for e in events if e["event"] == "action_finished")  # measured on the workers
    # The scheduler dispatched to both at once: the new worker's thread counts as a slot. An action holds its slot
    # from when it started on its worker (`start`) to when its run there ended (`end`; its outputs are stored after,
    # beside the worker's next action). Never more at once than the workers' threads, though the client keeps one
    # more action per thread queued on the workers (its `action_started` event says when it was sent).
    edges = [t for e in events if e["event"] == "action_finished" for t in ((e["start"], 1), (e["end"], -1))]
    in_flight = most = 0
    for _t, step in sorted(edges, key=lambda x: (x[0], x[1])):
        in_flight += step
        most = max(most, in_flight)
    assert most == 2, most
    # That queued action starts the moment its worker's previous one ends: it was sent before that one ended, instead
    # of after the result's round trip through the client.
    sent = {e["fingerprint"]: e["time"] for e in events if e["event"] == "action_started"}
    runs = sorted((e["worker"], e["start"], e["end"], e["fingerprint"]) for e in events if e["event"] == "action_finished")
    assert any(a[0] == b[0] and sent[b[3]] < a[2] for a, b in zip(runs, runs[1:], strict=False)), runs

    # The farm's next build (a new bucket: 3 actions) runs in the warm processes the first one left on the workers:
    # every action's worker process was forked from a zygote (torch imported, warm-ups run) older than this build.
    ws2 = tiny_ws(tmp_path / "ws2", seqs=(56,))
    evf2, started = tmp_path / "events2.jsonl", time.time()
    again = run_cli([*_dask_build(ws2, farm, tmp_path), "--build-event-json-file", str(evf2)], ws2, {"NEURONX_CC": ""})
    assert again.returncode == 0 and "3 executed" in again.stdout, again.stdout + again.stderr
    events2 = [json.loads(line) for line in evf2.read_text().splitlines()]
    pids = {e["pid"] for e in events2 if e["event"] == "action_finished"}
    zygotes = {psutil.Process(pid).parent() for pid in pids}
    assert pids and all("neuronbuild-worker-zygote" in z.cmdline() and z.create_time() < started for z in zygotes)
    assert [e["ok"] for e in events2 if e["event"] == "warm_up_finished"] == [True, True]  # one per Dask worker


def _env() -> dict[str, str]:
    return dict(os.environ)


def _actions_on(worker: subprocess.Popen[bytes]) -> list[psutil.Process]:
    """The worker processes forked from the Dask worker's zygote (its children), and their actions. The zygote itself
    (the Dask worker's child) runs no action and stays, warm, for the farm's next build."""
    out = []
    for c in psutil.Process(worker.pid).children(recursive=True):
        try:  # (a process may end between the listing and the look)
            if "neuronbuild.execution" in " ".join(c.cmdline()) and c.ppid() != worker.pid \
                    and c.status() != psutil.STATUS_ZOMBIE:
                out.append(c)
        except psutil.Error:
            continue
    return out


def test_ctrl_c_stops_actions_already_running_on_workers(farm: Farm, tmp_path: Path) -> None:
    """Ctrl-C kills the action running on a worker, and the one queued behind it on that worker never starts."""
    worker = farm.add_worker()
    ws = write_ws(tmp_path / "ws", {"m/llama.py": SLEEPY_SRC, "m/BUILD": """
neuron_model(name = "slow", srcs = ["llama.py"], entry = "llama:sleepy",
             config = {"vocab": 64, "hidden": 16, "layers": 1, "heads": 2}, inputs = {"input_ids": "int64[batch, seq]"})
neuron_buckets(name = "b", dims = {"batch": [1], "seq": [8, 16]})
neuron_target(name = "trn2", platform = "trn2")
neuron_compile(name = "slow_trn2", model = ":slow", buckets = [":b"], target = ":trn2")
"""})
    build = subprocess.Popen([sys.executable, "-m", "neuronbuild", *_dask_build(ws, farm, tmp_path)], cwd=ws,
                             text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env={**_env(), "NEURONX_CC": ""}, preexec_fn=user_signals)
    try:
        deadline = time.monotonic() + 120
        running: list[psutil.Process] = []
        while not running and time.monotonic() < deadline and build.poll() is None:
            running = _actions_on(worker)
            time.sleep(0.3)
        assert running, "the action never started on the worker"
        time.sleep(3.0)  # the action is in its 600 s sleep
        build.send_signal(signal.SIGINT)
        _out, err = build.communicate(timeout=120)
    finally:  # a failure above must not leave the build running (holding the farm and this run's pipes)
        if build.poll() is None:
            build.kill()
            build.communicate(timeout=30)
    assert build.returncode == 8, err
    gone_by = time.monotonic() + 15
    while time.monotonic() < gone_by and any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in running):
        time.sleep(0.2)
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in running), \
        "the action kept running on the worker after the build was interrupted"
    time.sleep(1.0)  # the worker's thread is free: a queued task would have started its action by now
    assert not _actions_on(worker), "the action queued on the worker started after the build was interrupted"


AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_EC2_METADATA_DISABLED": "true"}


def test_a_farm_without_a_shared_filesystem_works_through_s3(tmp_path: Path) -> None:
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    farm = Farm(tmp_path, AWS_ENV)
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                          aws_secret_access_key="testing")
        s3.create_bucket(Bucket="farm")
        farm.add_worker()
        farm.add_worker()
        ws = tiny_ws(tmp_path / "ws")
        env = {**AWS_ENV, "NEURONX_CC": ""}
        tier = ["--remote-cache", "s3://farm/ci", "--s3-endpoint-url", endpoint]
        proc = run_cli(["build", "--executor", "dask", "--scheduler", farm.address, *tier,
                        "--cache-dir", str(tmp_path / "cache")], ws, env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "7 actions: 7 executed" in proc.stdout
        keys = [o["Key"] for o in s3.list_objects_v2(Bucket="farm", Prefix="ci/v1/ac/").get("Contents", [])]
        assert len(keys) == 7  # every record went to S3 (the workers share no directory with the client)
        manifest = json.loads((ws / "neuronbuild-out" / "m" / "tiny_trn2" / "manifest.json").read_text())
        assert [len(b["outputs"]) > 0 for b in manifest["buckets"]] == [True, True]
        # Another machine with an empty cache and no farm: everything comes from S3.
        again = run_cli(["build", *tier, "--cache-dir", str(tmp_path / "other")], ws, env)
        assert again.returncode == 0 and "0 executed, 7 cached" in again.stdout, again.stdout + again.stderr
    finally:
        farm.close()
        server.stop()
