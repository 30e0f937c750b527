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
    return re.findall(r"^\[\d+/\d+\] (.+?)(?: \(\d|: skipped \()", stderr, re.M)  # (no neuronx-cc: skipped)


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


# A Neuron graph is three actions: trace, lower (to the HLO module), compile; the model's weights action is shared.
ALL = {"Weights //pkg:m", "Trace //pkg:m [batch=1, seq=4]", "Trace //pkg:m [batch=2, seq=4]",
       "Lower //pkg:m [batch=1, seq=4]", "Lower //pkg:m [batch=2, seq=4]",
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


# 32 MiB of weights: each stored program is that big, so a store (copy + hash + fsync into the CAS, then the upload to
# the shared tier) lasts long enough to be caught by polling its staging directory. The seed makes variants.
BIG_MODEL = '''
import torch

def build(config):
    torch.manual_seed({seed})
    return torch.nn.Sequential(torch.nn.Embedding(1 << 17, 64), torch.nn.Linear(64, 4))
'''


def _staged(tmps: list[Path]) -> set[Path]:
    """Blobs being written into a CAS: staged as <root>/v1/tmp/.blob-*, renamed into cas/ when whole."""
    out: set[Path] = set()
    for t in tmps:
        with contextlib.suppress(FileNotFoundError):
            out.update(t / n for n in os.listdir(t) if n.startswith(".blob-"))
    return out


def _kill_during_a_store(p: subprocess.Popen[bytes], tmps: list[Path], skip: int, timeout: float) -> bool:
    """SIGKILL the build's process group the moment the (skip+1)-th new blob starts being staged; False if the build
    ended first. Polls every millisecond (a 32 MiB store takes tens of milliseconds or more)."""
    before = _staged(tmps)
    seen: set[Path] = set()
    deadline = time.monotonic() + timeout
    while p.poll() is None and time.monotonic() < deadline:
        seen |= _staged(tmps) - before
        if len(seen) > skip:
            os.killpg(p.pid, signal.SIGKILL)
            return True
        time.sleep(0.001)
    return False


def test_builds_killed_at_random_moments_and_during_stores_leave_no_partial_entries(tmp_path: Path) -> None:
    """SIGKILL builds (no chance to clean up) at random moments, then exactly while an output is being stored.
    After every kill the cache verifies clean; most store-timed kills provably landed inside the store (a
    half-written staging file outlived its writer); a final build completes from whatever the kills left."""
    ws = write_ws(tmp_path / "ws", {"pkg/BUILD": BUILD, "pkg/m.py": BIG_MODEL.format(seed=0)})
    cache, shared = tmp_path / "cache", tmp_path / "shared"
    shared.mkdir()
    tmps = [cache / "v1" / "tmp", shared / "v1" / "tmp"]
    for t in tmps:
        t.mkdir(parents=True)
    rng = random.Random(1234)
    remote = ("--remote-cache", str(shared))
    rounds: list[str] = []  # what each round saw, for the failure messages

    def build() -> subprocess.Popen[bytes]:
        with open(tmp_path / "out.log", "w") as log:
            return subprocess.Popen([sys.executable, "-m", "neuronbuild", "build", "//pkg:c", "--jobs", "2",
                                     "--cache-dir", str(cache), *remote], cwd=ws, stdout=log, stderr=log,
                                    start_new_session=True)

    def after_kill(p: subprocess.Popen[bytes], what: str) -> None:
        p.wait()
        tail = (tmp_path / "out.log").read_text(errors="replace").strip().splitlines()[-1:]
        rounds.append(f"{what}: exit {p.returncode}, last line {tail}")
        # After every kill: whatever is visible is whole.
        _verify_clean(cache, *remote)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)  # reap orphaned workers (they would hold CPU)

    for i in range(2):  # random moments (on a busy machine mostly start-up and tracing; stores come next)
        p = build()
        time.sleep(rng.uniform(0.3, 6.0))
        if i % 2:
            os.killpg(p.pid, signal.SIGKILL)  # the build and its workers
        else:
            p.send_signal(signal.SIGKILL)  # the build only; its workers are orphaned
        after_kill(p, f"random kill {i}")

    interrupted = 0
    for i in range(1, 4):  # during a store: a new model variant each round, so every action has outputs to store
        (ws / "pkg" / "m.py").write_text(BIG_MODEL.format(seed=i))
        p = build()
        left_before = _staged(tmps)
        killed = _kill_during_a_store(p, tmps, skip=rng.randrange(3), timeout=300)
        after_kill(p, f"store kill {i} (killed: {killed})")
        # A staging file that outlived its writer: the kill hit between the start of a blob's store and its rename.
        interrupted += killed and bool(_staged(tmps) - left_before)
    assert interrupted >= 2, f"{interrupted} of 3 kills interrupted a store:\n" + "\n".join(rounds)

    proc = run_cli(["build", "//pkg:c", "--jobs", "2", "--cache-dir", str(cache), *remote], ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (ws / "neuronbuild-out/pkg/c/manifest.json").is_file()
    _verify_clean(cache, *remote)


def test_materialising_leaves_a_concurrent_builds_copy_in_flight_but_prunes_stale_ones(tmp_path: Path) -> None:
    # Two builds of one workspace materialise the same target: one build's prune must not delete the temporary copy
    # the other is about to rename onto its output; a crashed build's old temporary copy and stray files still go.
    from neuronbuild.cache.cas import COPY_TEMP_PREFIX
    from neuronbuild.packaging.materialize import IN_FLIGHT_S, _prune

    bucket = tmp_path / "out" / "batch1"
    bucket.mkdir(parents=True)
    (bucket / "model.hlo.pb").write_bytes(b"kept")
    fresh, stale, stray = bucket / f"{COPY_TEMP_PREFIX}fresh", bucket / f"{COPY_TEMP_PREFIX}stale", bucket / "old.neff"
    for p in (fresh, stale, stray):
        p.write_bytes(b"x")
    old = time.time() - IN_FLIGHT_S - 60
    os.utime(stale, (old, old))
    _prune(tmp_path / "out", {"batch1/model.hlo.pb"})
    assert sorted(p.name for p in bucket.iterdir()) == sorted(["model.hlo.pb", fresh.name])
