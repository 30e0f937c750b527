"""Per-action limits on by default (#49): a fork bomb in a model factory is bounded and fails its action naming the
limit; a memory hog is ended at its limit; an endless trace is ended by the default timeout (scaled small here).
The process and memory cases run twice: with the host's cgroups (where it offers them; root here) and with the
worker's own watch, the fallback of hosts that offer none ($NEURONBUILD_ACTION_CGROUPS=0)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from helpers import run_cli, write_ws
from test_security_hangs import build_watching, child_name, none_left

from neuronbuild.execution import limits

MODEL = '''import ctypes
import os
import sys
import time

import torch


def build(config):
    print("STARTED " + config["mode"], file=sys.stderr, flush=True)
    if config["mode"] == "bomb":  # forks without end, one process every 5 ms (linear: the suite's machine is shared,
        while True:               # and an exponential bomb outruns a 4 Hz watch there; a real one meets the same limit)
            try:
                pid = os.fork()
            except OSError:
                time.sleep(0.01)
                continue
            if pid == 0:
                ctypes.CDLL(None).prctl(15, config["name"].encode(), 0, 0, 0)  # PR_SET_NAME: how the test finds it
                time.sleep(600)
                os._exit(0)
            time.sleep(0.005)
    if config["mode"] == "hog":  # 3 GiB, every page written
        keep = []
        for _ in range(3072):
            keep.append(b"\\x01" * (1 << 20))
    if config["mode"] == "hang":
        time.sleep(600)
    return torch.nn.Linear(4, 2)
'''

CGROUPS = [pytest.param("cgroups", id="cgroups"), pytest.param("watch", id="watch")]


def _ws(tmp_path: Path, mode: str) -> tuple[Path, str]:
    name = child_name(tmp_path, mode)
    build = ('neuron_model(name = "m", srcs = ["m.py"], entry = "m:build", inputs = {"x": "float32[b, n]"},\n'
             f'             config = {{"name": "{name}", "mode": "{mode}"}})\n'
             'neuron_buckets(name = "bk", shapes = [{"b": 1, "n": 4}])\n'
             'neuron_target(name = "t", platform = "trn2")\n'
             'neuron_compile(name = "c", model = ":m", buckets = [":bk"], target = ":t")\n')
    return write_ws(tmp_path / f"ws-{mode}", {"pkg/BUILD": build, "pkg/m.py": MODEL}), name


def _env(how: str) -> dict[str, str]:
    return {limits.CGROUPS_VAR: "1" if how == "cgroups" else "0"}


def _needs(how: str) -> None:
    if how == "cgroups" and not limits.host_offers().startswith("cgroup"):
        pytest.skip(f"this host offers no writable cgroup ({limits.host_offers()})")


@pytest.mark.parametrize("how", CGROUPS)
def test_a_fork_bomb_in_a_model_factory_is_bounded_and_fails_naming_the_process_limit(tmp_path: Path,
                                                                                       how: str) -> None:
    _needs(how)
    ws, name = _ws(tmp_path, "bomb")
    proc, took, _seen = build_watching(["build", "//pkg:all", "--jobs", "1", "--cache-dir", str(tmp_path / "cache"),
                                        "--action-pids", "32"], ws, name, _env(how))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "exceeded its limit of 32 processes and threads" in proc.stderr, proc.stderr
    assert "--action-pids N" in proc.stderr and "Traceback" not in proc.stderr
    assert ("pids cgroup" in proc.stderr) == (how == "cgroups"), proc.stderr
    assert took < 300
    assert none_left(name), "a process of the fork bomb outlived its action"
    assert not list((tmp_path / "cache" / "v1" / "ac").rglob("*.json"))


@pytest.mark.parametrize("how", CGROUPS)
def test_a_memory_hog_in_a_model_factory_is_ended_at_its_memory_limit(tmp_path: Path, how: str) -> None:
    _needs(how)
    ws, _name = _ws(tmp_path, "hog")
    proc = run_cli(["build", "//pkg:all", "--jobs", "1", "--cache-dir", str(tmp_path / "cache"),
                    "--action-memory", "512M"], ws, env=_env(how))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "exceeded its memory limit of 512 MiB" in proc.stderr, proc.stderr
    assert "--action-memory SIZE" in proc.stderr and "Traceback" not in proc.stderr
    assert not list((tmp_path / "cache" / "v1" / "ac").rglob("*.json"))


def test_an_endless_trace_is_ended_by_the_default_timeout_scaled_from_its_estimate(tmp_path: Path) -> None:
    ws, name = _ws(tmp_path, "hang")
    start = time.monotonic()
    # The default, scaled down: a trace's is 10 x its estimate (4 s: nothing recorded), at least 900 s; x 0.01: 9 s.
    proc, took, seen = build_watching(["build", "//pkg:all", "--jobs", "1", "--cache-dir", str(tmp_path / "cache"),
                                       "--action-timeout", "auto*0.01"], ws, name)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "timed out after 9 s (the default for a trace action: 10 x its estimate of 4 s, at least 900 s, scaled by " \
           "auto*0.01; --action-timeout SECONDS changes it" in proc.stderr, proc.stderr
    assert took < 200 and time.monotonic() - start < 200
    assert none_left(name)


def test_malformed_limit_flags_are_one_line_errors(tmp_path: Path) -> None:
    ws, _name = _ws(tmp_path, "ok")
    for flag, value in (("--action-pids", "-3"), ("--action-memory", "lots"), ("--action-timeout", "auto*x")):
        bad = run_cli(["build", "//pkg:all", "--cache-dir", str(tmp_path / "cache"), flag, value], ws)
        assert bad.returncode == 2 and flag in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr


def test_default_limits_scale_with_the_estimate_and_state_where_they_come_from() -> None:
    auto = limits.LimitSettings()
    small = limits.for_action(auto, "trace", None, 4.0, 500.0)
    assert small.timeout_s == 900.0 and small.memory_mb == 2048 and small.pids >= limits.MIN_PIDS
    big = limits.for_action(auto, "trace", None, 400.0, 1500.0)
    assert big.timeout_s == 4000.0 and big.memory_mb == 4500
    assert "--action-timeout" in big.timeout_source and "--action-memory" in big.memory_source
    step = limits.for_action(auto, "compile", "cpu", 1.0, 100.0)
    assert step.timeout_s == limits.MIN_STEP_TIMEOUT_S and "a cpu step" in step.timeout_source
    off = limits.for_action(limits.LimitSettings(0.0, 1.0, 0.0, 1.0, 0), "trace", None, 4.0, 800.0)
    assert (off.timeout_s, off.memory_mb, off.pids) == (0.0, 0, 0)
    first = limits.for_action(auto, "compile", "neuron", 4.0, 900.0, mb_recorded=False)  # (a default estimate)
    assert first.memory_mb == int(max(2700, 0.5 * limits.host_ram_mb())) or first.memory_mb >= 0.9 * limits.host_ram_mb()
    assert "until a run of it is recorded" in first.memory_source
    attr = limits.for_action(auto, "trace", None, 4.0, 800.0, (6.0, "timeout = 6 on //pkg:c"))
    assert attr.timeout_s == 6.0 and attr.timeout_source == "timeout = 6 on //pkg:c"


def test_explain_states_each_actions_limits_and_what_enforces_them(tmp_path: Path) -> None:
    import json

    ws, _name = _ws(tmp_path, "ok")
    proc = run_cli(["explain", "//pkg:all", "--cache-dir", str(tmp_path / "cache"), "--action-pids", "64"], ws)
    assert proc.returncode == 0, proc.stderr
    # Nothing recorded yet: the memory limit is at least half the machine's RAM until a run of the action is.
    ram = limits.host_ram_mb()
    mem = int(min(max(2048, 0.9 * ram), max(2048, 0.5 * ram, 2400)))
    assert "limits: timeout 900 s (the default for a trace action: 10 x its estimate of 4 s, at least 900 s; " \
           f"--action-timeout SECONDS changes it, 0: none); memory {mem} MiB (the default: 3 x its peak estimate " \
           "of 800 MB, at least" in proc.stdout, proc.stdout
    assert "until a run of it is recorded" in proc.stdout
    assert "processes and threads 64 (--action-pids 64)" in proc.stdout
    assert f"their limits are enforced by {limits.host_offers()}" in proc.stdout
    js = run_cli(["explain", "//pkg:all", "--cache-dir", str(tmp_path / "cache"), "--output", "json",
                  "--action-timeout", "0", "--action-memory", "8G"], ws)
    got = [e["limits"] for e in json.loads(js.stdout)["execute"]]
    assert got and all(g["timeout_s"] == 0 and g["memory_mb"] == 8192 and g["pids"] >= limits.MIN_PIDS for g in got)


NPROC_IN_USERNS = r'''
import os, resource, sys, time
sys.path.insert(0, os.getcwd())
import confine_ns

why = confine_ns.enter()
if why is not None:
    print(why)
    sys.exit(3)
init = os.fork()
if init == 0:  # pid 1 of the user namespace's pid namespace, as worker._init: the limit, then the action's tasks
    resource.setrlimit(resource.RLIMIT_NPROC, (NMAX, NMAX))
    made = 0
    for _ in range(4 * NMAX):
        try:
            pid = os.fork()
        except BlockingIOError:
            break
        if pid == 0:
            time.sleep(30)
            os._exit(0)
        made += 1
    print(f"made={made}", flush=True)
    os._exit(0)  # (the namespace's init: every process left is killed with it)
os.waitpid(init, 0)
'''


def test_rlimit_nproc_bounds_a_non_root_actions_tasks_in_its_own_user_namespace(tmp_path: Path) -> None:
    """The fallback for a non-root user without a cgroup (limits.nproc_in_user_namespace): the kernel counts
    RLIMIT_NPROC per user namespace, so the action's forks stop at the limit although the uid may run more processes
    elsewhere (here: the test's uid 65534 holds none, but the limit is what stops the loop, not the machine)."""
    import os
    import shutil
    import subprocess
    import tempfile

    from neuronbuild.execution import confine_ns

    python = shutil.which("python3", path="/usr/bin:/bin")
    setpriv = shutil.which("setpriv")
    if os.getuid() != 0 or python is None or setpriv is None:
        pytest.skip("needs root, setpriv and a system python3 another user can run")
    d = Path(tempfile.mkdtemp(prefix="nb-nproc-", dir="/tmp"))
    try:
        shutil.copy(confine_ns.__file__, d / "confine_ns.py")
        os.chmod(d, 0o755)
        os.chmod(d / "confine_ns.py", 0o644)
        proc = subprocess.run([setpriv, "--reuid", "65534", "--regid", "65534", "--clear-groups", python, "-I", "-c",
                               NPROC_IN_USERNS.replace("NMAX", "12")], cwd=d, env={"PATH": "/usr/bin:/bin"},
                              capture_output=True, text=True, timeout=120)
        if proc.returncode == 3:
            pytest.skip(f"unprivileged user namespaces are refused here: {proc.stdout.strip()}")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        made = int(proc.stdout.split("made=")[1].split()[0])
        assert 1 <= made < 12, proc.stdout  # (the init counts too: at most the limit's tasks, never 4 times more)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_a_workspace_rc_that_lifts_the_limits_is_named_on_stderr(tmp_path: Path) -> None:
    ws, _name = _ws(tmp_path, "ok")
    (ws / ".neuronbuildrc").write_text("build --action-pids 0 --action-memory 0 --action-timeout 0\n")
    proc = run_cli(["explain", "//pkg:all", "--cache-dir", str(tmp_path / "cache")], ws,
                   env={"HOME": str(tmp_path / "home")})
    assert proc.returncode == 0, proc.stderr
    for flag in ("--action-pids", "--action-memory", "--action-timeout"):
        assert f"(a workspace rc file) sets {flag} '0'" in proc.stderr, proc.stderr
    assert "limits: timeout none (--action-timeout 0); memory none (--action-memory 0); processes and threads none " \
           "(--action-pids 0)" in proc.stdout, proc.stdout
