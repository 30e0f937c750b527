"""No hangs: endless Starlark loops stop on Ctrl-C/SIGTERM, forked children neither hang a build nor outlive it, and
--action-timeout fails an action that runs too long."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import _ENV_AT_START, named, run_cli, user_signals, write_ws

LOOP_BUILD = '''print("spinning")

def spin():
    for i in range(1000000000000000):
        pass

spin()
'''


def _popen(args: list[str], cwd: Path) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k in _ENV_AT_START or not k.startswith("TORCHINDUCTOR_")}
    env["PYTHONFAULTHANDLER"] = "1"  # a process that hangs is sent SIGABRT: every thread's stack is on its stderr
    return subprocess.Popen([sys.executable, "-m", "neuronbuild", *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=user_signals)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_endless_starlark_loop_ends_on_interrupt_promptly(tmp_path: Path, sig: int) -> None:
    ws = write_ws(tmp_path / "ws", {"pkg/BUILD": LOOP_BUILD})
    proc = _popen(["build", "//pkg:all", "--cache-dir", str(tmp_path / "cache")], ws)
    assert proc.stderr is not None
    # The BUILD file's print, just before its loop: signal only once it runs (a loaded machine starts slowly).
    ready, _, _ = select.select([proc.stderr], [], [], 300)
    seen = proc.stderr.readline() if ready else "(nothing on stderr in 300 s)"
    assert "spinning" in seen, seen + proc.communicate()[1]
    time.sleep(0.5)  # inside the loop
    assert proc.poll() is None, proc.communicate()
    sent = time.monotonic()
    proc.send_signal(sig)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)  # the faulthandler's dump of where it hangs is the failure's message
        pytest.fail(f"no exit 30 s after signal {sig}:\n{proc.communicate(timeout=30)[1][-6000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
    took = time.monotonic() - sent
    _out, err = proc.communicate()
    assert proc.returncode == 8, err
    assert "interrupted" in err and "Traceback" not in err
    # The loop never ends by itself (wait's 30 s would have run out, and the exit code would not be 8); the bound is
    # generous for a loaded 2-core machine: the interrupt is handled between Starlark steps, in milliseconds idle.
    assert took < 10.0, f"took {took:.2f} s to stop"


# 100 bytes that would take terabytes: every element of `keep` is a fresh 1,000,001-element list.
GREEDY_BUILD = '''big = [0] * 1000000
keep = [big + [i] for i in range(100000)]
'''


def _limit_data() -> None:
    """Without the budget, the child fails at 3 GiB of data instead of taking the machine. Not RLIMIT_AS: the Go
    runtime of the Starlark binding reserves ~5.6 GiB of address space (PROT_NONE, no data) when it starts, so an
    address-space limit of 6 GiB left ~0.3 GiB for the heap and Go's own out-of-memory crash raced the budget (a CI
    run printed Go's goroutine dump before the budget's error)."""
    import resource

    resource.setrlimit(resource.RLIMIT_DATA, (3 << 30, 3 << 30))


def test_a_build_file_that_allocates_without_bound_fails_located_within_its_memory_budget(tmp_path: Path) -> None:
    import resource

    ws = write_ws(tmp_path / "ws", {"pkg/BUILD": GREEDY_BUILD})
    env = {k: v for k, v in os.environ.items() if k in _ENV_AT_START or not k.startswith("TORCHINDUCTOR_")}
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    proc = subprocess.run([sys.executable, "-m", "neuronbuild", "plan", "//pkg:all", "--cache-dir",
                           str(tmp_path / "cache")], cwd=ws, env={**env, "NEURONBUILD_STARLARK_MEMORY_MB": "256"},
                          capture_output=True, text=True, timeout=300, preexec_fn=_limit_data)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip() == ("pkg/BUILD:1:1: error: evaluating pkg/BUILD used more than 256 MiB of memory (the "
                                   "per-file Starlark budget, $NEURONBUILD_STARLARK_MEMORY_MB); is a loop building "
                                   "ever larger values?"), proc.stderr[-3000:]
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if peak_kib > before:  # (the largest child so far: this one, unless an earlier child of this process was larger)
        assert peak_kib < 1536 << 10, f"peak RSS {peak_kib >> 10} MiB"


MODEL = '''import ctypes
import os
import sys
import time

import torch


def build(config):
    pid = os.fork()
    if pid == 0:  # the child: holds every inherited descriptor, including the worker's result pipe
        ctypes.CDLL(None).prctl(15, config["name"].encode(), 0, 0, 0)  # PR_SET_NAME: how the test finds it
        time.sleep(600)
        os._exit(0)
    print("FORKED " + config["name"], file=sys.stderr, flush=True)  # into the action's log
    if config["mode"] == "die":
        os._exit(3)
    if config["mode"] == "hang":
        time.sleep(600)
    return torch.nn.Linear(4, 2)
'''


def child_name(where: Path, mode: str) -> str:
    """The name (comm, at most 15 characters) the model's forked child takes: unique to this test's directory, so
    runs of this test elsewhere on the machine are never mistaken for it (its pid is its action's namespace's)."""
    import hashlib

    return "nb" + hashlib.sha1(f"{where}:{mode}".encode()).hexdigest()[:12]


def model_ws(root: Path, name: str, mode: str, compile_attrs: str = "") -> Path:
    build = (f'neuron_model(name = "m", srcs = ["m.py"], entry = "m:build", inputs = {{"x": "float32[b, n]"}},\n'
             f'             config = {{"name": "{name}", "mode": "{mode}"}})\n'
             'neuron_buckets(name = "bk", shapes = [{"b": 1, "n": 4}])\n'
             'neuron_target(name = "t", platform = "trn2")\n'
             f'neuron_compile(name = "c", model = ":m", buckets = [":bk"], target = ":t"{compile_attrs})\n')
    return write_ws(root, {"pkg/BUILD": build, "pkg/m.py": MODEL})


def _ws(tmp_path: Path, mode: str, compile_attrs: str = "") -> Path:
    return model_ws(tmp_path / f"ws-{mode}", child_name(tmp_path, mode), mode, compile_attrs)




def none_left(name: str, within: float = 5.0) -> bool:
    """No process called `name` is left within `within` seconds (SIGKILL is delivered asynchronously); kills any
    that are, so a failing test leaves nothing behind."""
    deadline = time.monotonic() + within
    while named(name) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = named(name)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return not left


def build_watching(args: list[str], ws: Path, name: str, env: dict[str, str] | None = None
                   ) -> tuple[subprocess.CompletedProcess[str], float, bool]:
    """Run the CLI, looking meanwhile for a process called `name`: (its result, seconds, whether it was seen)."""
    full = {k: v for k, v in os.environ.items() if k in _ENV_AT_START or not k.startswith("TORCHINDUCTOR_")}
    full.update(env or {})
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "neuronbuild", *args], cwd=ws, env=full, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=user_signals)
    seen = False
    try:
        while proc.poll() is None:
            seen = seen or bool(named(name))
            time.sleep(0.2)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), time.monotonic() - start, seen


def _forked(tmp_path: Path, name: str) -> bool:
    """The model reached its fork (it says so in its action's log)."""
    return any(f"FORKED {name}" in p.read_text(errors="replace") for p in (tmp_path / "cache").rglob("*.log"))


def _build(ws: Path, tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    proc = run_cli(["build", "//pkg:all", "--jobs", "1", "--cache-dir", str(tmp_path / "cache"), *extra], ws)
    return proc, time.monotonic() - start


def test_a_model_that_forks_and_dies_fails_its_action_instead_of_hanging(tmp_path: Path) -> None:
    ws = _ws(tmp_path, "die")
    proc, took = _build(ws, tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "worker process died" in proc.stderr and took < 120
    name = child_name(tmp_path, "die")
    assert _forked(tmp_path, name)
    assert none_left(name), "the forked child outlived the build"


def test_children_of_a_successful_action_do_not_outlive_it(tmp_path: Path) -> None:
    ws = _ws(tmp_path, "ok")
    proc, _took = _build(ws, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    name = child_name(tmp_path, "ok")
    assert _forked(tmp_path, name)
    assert none_left(name, within=0.5), "the forked child outlived the build"


def test_action_timeout_fails_the_action_and_kills_its_processes(tmp_path: Path) -> None:
    ws = _ws(tmp_path, "hang")
    name = child_name(tmp_path, "hang")
    proc, took, seen = build_watching(["build", "//pkg:all", "--jobs", "1", "--cache-dir", str(tmp_path / "cache"),
                                       "--action-timeout", "8"], ws, name)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "timed out after 8 s (--action-timeout)" in proc.stderr
    assert took < 90 and seen
    assert none_left(name)
    bad = run_cli(["build", "//pkg:all", "--action-timeout", "-1"], ws)
    assert bad.returncode == 2 and "--action-timeout" in bad.stderr


def test_a_targets_timeout_attribute_overrides_the_flag(tmp_path: Path) -> None:
    ws = _ws(tmp_path, "hang", ", timeout = 6")
    name = child_name(tmp_path, "hang")
    proc, took, seen = build_watching(["build", "//pkg:all", "--jobs", "1", "--cache-dir", str(tmp_path / "cache"),
                                       "--action-timeout", "600"], ws, name)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "timed out after 6 s (timeout = 6 on //pkg:c)" in proc.stderr
    assert took < 90 and "Traceback" not in proc.stderr and seen
    assert none_left(name)
    assert not list((tmp_path / "cache" / "v1" / "ac").rglob("*.json"))
    (ws / "pkg" / "BUILD").write_text((ws / "pkg" / "BUILD").read_text().replace("timeout = 6", "timeout = -1"))
    bad = run_cli(["build", "//pkg:all", "--cache-dir", str(tmp_path / "cache")], ws)
    assert bad.returncode == 2 and "pkg/BUILD:" in bad.stderr and "'timeout'" in bad.stderr, bad.stderr
