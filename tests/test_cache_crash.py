"""Real concurrent and SIGKILLed `neuronbuild build` processes over one cache (and one shared tier): execute-once,
no partial entries, and a clean `cache verify` afterwards."""

from __future__ import annotations

import collections
import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers import run_cli, write_ws

MODEL = '''
import torch

def build(config):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 4))
'''
BUILD = '''
neuron_model(name = "m", srcs = ["m.py"], entry = "m:build", inputs = {"x": "int64[batch, seq]"})
neuron_buckets(name = "b", shapes = [{"batch": 1, "seq": 4}, {"batch": 2, "seq": 4}])
neuron_target(name = "t", platform = "trn2")
neuron_compile(name = "c", model = ":m", buckets = [":b"], target = ":t")
'''


def _start(ws: Path, cache: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "neuronbuild", "build", "//pkg:c", "--jobs", "1",
                             "--cache-dir", str(cache), *extra], cwd=ws, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _executed(stderr: str) -> list[str]:
    return re.findall(r"^\[\d+/\d+\] (.+?) \(\d", stderr, re.M)


def _verify_clean(cache: Path, *extra: str) -> None:
    v = run_cli(["cache", "verify", "--cache-dir", str(cache), *extra], cache.parent)
    assert v.returncode == 0, v.stdout + v.stderr
    assert "problems" not in v.stdout, v.stdout


def _run_three(ws: Path, caches: list[Path], *extra: str) -> collections.Counter[str]:
    procs = [_start(ws, c, *extra) for c in caches]
    runs: collections.Counter[str] = collections.Counter()
    for p in procs:
        out, err = p.communicate(timeout=900)
        assert p.returncode == 0, out + err
        assert "Traceback" not in err
        runs.update(_executed(err))
    return runs


ALL = {"Trace //pkg:m [batch=1, seq=4]", "Trace //pkg:m [batch=2, seq=4]",
       "Compile //pkg:c [batch=1, seq=4] for trn2", "Compile //pkg:c [batch=2, seq=4] for trn2"}


def test_three_concurrent_builds_on_one_cache_execute_each_action_once(tmp_path: Path) -> None:
    ws = write_ws(tmp_path / "ws", {"pkg/BUILD": BUILD, "pkg/m.py": MODEL})
    cache = tmp_path / "cache"
    runs = _run_three(ws, [cache] * 3)
    assert set(runs) == ALL and all(n == 1 for n in runs.values()), runs
    _verify_clean(cache)


def test_three_machines_on_one_shared_directory_execute_each_action_once(tmp_path: Path) -> None:
    """Three local caches (three 'machines') share one directory tier: its lock files give execute-once."""
    ws = write_ws(tmp_path / "ws", {"pkg/BUILD": BUILD, "pkg/m.py": MODEL})
    shared = tmp_path / "shared"
    shared.mkdir()
    caches = [tmp_path / f"machine{i}" for i in range(3)]
    runs = _run_three(ws, caches, "--remote-cache", str(shared))
    assert set(runs) == ALL and all(n == 1 for n in runs.values()), runs
    for c in caches:
        _verify_clean(c, "--remote-cache", str(shared))
    assert not list((shared / "v1" / "locks").glob("*.lock"))  # every claim was released


def test_builds_killed_at_random_moments_leave_no_partial_entries(tmp_path: Path) -> None:
    ws = write_ws(tmp_path / "ws", {"pkg/BUILD": BUILD, "pkg/m.py": MODEL})
    cache, shared = tmp_path / "cache", tmp_path / "shared"
    shared.mkdir()
    rng = random.Random(1234)
    remote = ("--remote-cache", str(shared))
    for i in range(20):
        with open(tmp_path / "out.log", "w") as log:
            p = subprocess.Popen([sys.executable, "-m", "neuronbuild", "build", "//pkg:c", "--jobs", "2",
                                  "--cache-dir", str(cache), *remote], cwd=ws, stdout=log, stderr=log,
                                 start_new_session=True)
        time.sleep(rng.uniform(0.3, 6.0))
        if i % 2:
            os.killpg(p.pid, signal.SIGKILL)  # the build and its workers
        else:
            p.send_signal(signal.SIGKILL)  # the build only; its workers are orphaned
        p.wait()
        # After every kill: whatever is visible is whole.
        _verify_clean(cache, *remote)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)  # reap orphaned workers (they would hold CPU)
    proc = run_cli(["build", "//pkg:c", "--jobs", "2", "--cache-dir", str(cache), *remote], ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (ws / "neuronbuild-out/pkg/c/manifest.json").is_file()
    _verify_clean(cache, *remote)
