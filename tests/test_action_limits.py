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
    if config["mode"] == "bomb":  # every process forks on, without end
        while True:
            try:
                pid = os.fork()
            except OSError:
                time.sleep(0.01)
                continue
            if pid == 0:
                ctypes.CDLL(None).prctl(15, config["name"].encode(), 0, 0, 0)  # PR_SET_NAME: how the test finds it
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
    assert "timed out after 9 s (the default for a trace: 10 x its estimate of 4 s, at least 900 s, scaled by " \
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
    attr = limits.for_action(auto, "trace", None, 4.0, 800.0, (6.0, "timeout = 6 on //pkg:c"))
    assert attr.timeout_s == 6.0 and attr.timeout_source == "timeout = 6 on //pkg:c"
