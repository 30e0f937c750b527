"""`--executor dask-local`: a LocalCluster started by the build runs a small workspace's actions, gives the outputs a
local build gives, leaves records the local executor reuses, and leaves no process behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
from helpers import run_cli, running, write_ws

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


def _digests(ws: Path) -> dict[str, str]:
    m = json.loads((ws / "neuronbuild-out/pkg/c/manifest.json").read_text())
    return {f"{b['name']}/{n}": o["digest"] for b in m["buckets"] for n, o in b["outputs"].items()}


def _session(sid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid:
                out.append(p)
        except (OSError, psutil.Error):
            pass
    return out


def test_dask_local_builds_a_workspace_like_the_local_executor(tmp_path: Path) -> None:
    ws = write_ws(tmp_path / "farm" / "ws", {"pkg/BUILD": BUILD, "pkg/m.py": MODEL})
    cache, evf = tmp_path / "farm" / "cache", tmp_path / "events.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "neuronbuild", "build", "//pkg:c", "--executor", "dask-local",
                             "--jobs", "2", "--cache-dir", str(cache), "--build-event-json-file", str(evf)],
                            cwd=ws, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, out + err
    assert "7 actions: 7 executed, 0 cached" in out and "Traceback" not in err
    events = [json.loads(ln) for ln in evf.read_text().splitlines()]
    finished = [e for e in events if e["event"] == "action_finished"]
    assert len(finished) == 7
    # Every action ran on a LocalCluster worker (its address), none in the build process's own pool.
    assert all(e["worker"].startswith("tcp://127.0.0.1:") for e in finished), [e["worker"] for e in finished]
    # The cluster, its workers and their warm action processes are gone with the build.
    deadline = time.monotonic() + 30
    while _session(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _session(proc.pid), [p.cmdline() for p in _session(proc.pid)]

    # The local executor, on a fresh cache at another path: the same output bytes.
    local_ws = write_ws(tmp_path / "local" / "ws", {"pkg/BUILD": BUILD, "pkg/m.py": MODEL})
    local = run_cli(["build", "//pkg:c", "--jobs", "2", "--cache-dir", str(tmp_path / "local" / "cache")], local_ws)
    assert local.returncode == 0, local.stdout + local.stderr
    assert "7 executed" in local.stdout
    assert _digests(ws) == _digests(local_ws) and len(_digests(ws)) == 10  # 2 buckets x 5 files (+ program constants)

    # What dask-local stored is an ordinary cache: the local executor finds every action there.
    again = run_cli(["build", "//pkg:c", "--cache-dir", str(cache)], ws)
    assert again.returncode == 0 and "7 actions: 0 executed, 7 cached" in again.stdout, again.stdout + again.stderr
    verify = run_cli(["cache", "verify", "--cache-dir", str(cache)], ws)
    assert verify.returncode == 0 and "problems" not in verify.stdout, verify.stdout + verify.stderr


THREADS_MODEL = '''
import os

def build(config):
    raise RuntimeError("threads=" + os.environ.get("NEURONBUILD_THREADS", "unset") + " end")
'''


def test_farm_workers_get_their_hosts_cores_divided_among_the_dask_threads_on_it(tmp_path: Path) -> None:
    """dask-local --jobs 2: two single-thread Dask workers on one host, so each action's worker process may use
    cores // 2 compiler processes (as local --jobs 2 gives); --jobs 1: the one Dask worker gets every core."""
    from neuronbuild.platforms import host_cores

    ws = write_ws(tmp_path / "ws", {"pkg/BUILD": BUILD, "pkg/m.py": THREADS_MODEL})
    for jobs in (2, 1):
        proc = run_cli(["build", "//pkg:c", "--executor", "dask-local", "--jobs", str(jobs), "--cache-dir",
                        str(tmp_path / f"cache{jobs}")], ws)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert f"threads={max(1, host_cores() // jobs)} end" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_a_warm_up_whose_dask_worker_is_gone_ends_as_failed_instead_of_waiting_for_it(tmp_path: Path) -> None:
    """A warm-up runs on its Dask worker only (it warms that worker's zygote); if that worker leaves the cluster, the
    build must not wait for it forever: the warm-up ends as failed (the steps held back for it then go)."""
    from neuronbuild.cache.farm_store import open_farm_store
    from neuronbuild.cache.local import LocalCache
    from neuronbuild.execution.dask_executor import DaskExecutor
    from neuronbuild.execution.jobs import Job
    from neuronbuild.loading.labels import Label
    from neuronbuild.plugin_api.actions import Bucket, make_action
    from neuronbuild.plugin_api.toolchain import WARM_UP

    cache = LocalCache(tmp_path / "cache")
    ex = DaskExecutor(tmp_path, cache, str(cache.root), None, 1, open_farm_store, same=True,
                      toolchain_tmp=cache.toolchain_tmp)
    try:
        spec = {"toolchain": "neuron", "step": WARM_UP, "key": {"jax": "any"}}
        a = make_action(WARM_UP, Label("pkg", "m"), Bucket(()), {"warm_up": "neuron", "key": spec["key"]}, spec)
        ex.warm(1)  # learns the cluster's workers
        ex.start(Job(a, 0, tmp_path / "w.log", "tcp://127.0.0.1:9"))  # a Dask worker the cluster no longer has
        done: list[Any] = []
        deadline = time.monotonic() + 30
        while not done and time.monotonic() < deadline:
            done = ex.wait(None)
        assert len(done) == 1 and not done[0].ok and "left the cluster" in done[0].error, done
    finally:
        ex.shutdown()


def test_a_farm_client_adopts_its_workers_verified_outputs_without_a_second_copy(tmp_path: Path) -> None:
    """What a farm client stores for each output a worker put into the farm's shared directory: the worker's blob,
    verified against the digest the worker reported and adopted by a hard link (no second copy and sync of every
    output on the machine); bytes that do not match are refused (nothing recorded, the blob evicted from the shared
    store: it is untrusted input). An action's output in its sandbox is linked too, unless it has other names (a
    user's file the action linked into its outputs is copied: editing that file must not reach the cache)."""
    import pytest

    from neuronbuild.cache.cas import CorruptBlob
    from neuronbuild.cache.farm_store import open_farm_store
    from neuronbuild.cache.shared_fs import SharedDirTier
    from neuronbuild.cache.tiered import TieredCache

    (tmp_path / "shared").mkdir()
    store = open_farm_store(str(tmp_path / "shared"))  # what the Dask workers write into
    cache = TieredCache(tmp_path / "cache", SharedDirTier(tmp_path / "shared"))  # the client's cache over it
    out = tmp_path / "out"  # a worker's outputs in its sandbox
    out.mkdir()
    (out / "program.pt2").write_bytes(b"program" * 1000)
    (out / "params.json").write_bytes(b"{}")
    user_file = tmp_path / "user.txt"
    user_file.write_bytes(b"a user's file")
    os.link(user_file, out / "linked.txt")
    digests = {n: store.put_file(out / n, scratch=True)[0] for n in ("program.pt2", "params.json")}
    shared_blob = store.blobs.path(digests["program.pt2"])
    assert shared_blob.stat().st_ino == (out / "program.pt2").stat().st_ino  # linked, not copied
    linked = store.put_file(out / "linked.txt", scratch=True)[0]
    assert store.blobs.path(linked).stat().st_ino != user_file.stat().st_ino  # another name: copied

    # The client places them unverified (hard links) and its store verifies and adopts them.
    fetched = tmp_path / "fetched"
    for n, d in digests.items():
        store.link_blob(d, fetched / n)
    res = cache.store_outputs("f" * 64, "id", {"a": 1}, fetched, sorted(digests), 1.0, {}, expect=digests,
                              scratch=True)
    assert {n: o.digest for n, o in res.outputs.items()} == digests
    assert cache.blobs.path(digests["program.pt2"]).stat().st_ino == shared_blob.stat().st_ino
    assert cache.lookup("f" * 64) is not None
    assert SharedDirTier(tmp_path / "shared").get_record("f" * 64) is not None  # recorded in the shared store

    # A blob changed in the shared store after its worker reported it: refused, evicted, nothing recorded.
    (out / "other.bin").write_bytes(b"other output")
    bad = store.put_file(out / "other.bin")[0]
    os.chmod(store.blobs.path(bad), 0o644)
    store.blobs.path(bad).write_bytes(b"tampered!!!!")
    store.link_blob(bad, fetched / "other.bin")
    with pytest.raises(CorruptBlob):
        cache.store_outputs("e" * 64, "id", {"a": 2}, fetched, ["other.bin"], 1.0, {}, expect={"other.bin": bad},
                            scratch=True)
    assert cache.lookup("e" * 64) is None and not cache.blobs.has(bad)
    assert not store.blobs.path(bad).exists()


def test_a_dask_workers_pool_of_warm_processes_ends_when_its_thread_share_changes(tmp_path: Path) -> None:
    """A Dask worker keeps its warm processes (a zygote with torch, its workers) between builds, one pool per thread
    share; when the share changes (workers joined or left the host), the pool of the old share is never used again
    and must not stay with torch loaded: its processes end (at once when it is idle)."""
    from neuronbuild.execution import dask_executor as de

    tmp = str(tmp_path / "toolchain-tmp")
    other = str(tmp_path / "other-client")
    old = de._farm_pool(tmp, 1, 1)
    kept = de._farm_pool(other, 1, 1)  # another client's pool (another toolchain tmp) on the same Dask worker
    try:
        for p in (old, kept):
            p.warm()
        deadline = time.monotonic() + 30
        while not (old.pool.pids() and kept.pool.pids()) and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = old.pool.pids()
        assert pids and all(psutil.pid_exists(p) for p in pids)
        new = de._farm_pool(tmp, 2, 1)
        assert new is not old and de._farm_pool(tmp, 2, 1) is new
        deadline = time.monotonic() + 30
        while any(running(p) for p in pids) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pids if running(p)]
        assert kept.pool.pids() and de._farm_pool(other, 1, 1) is kept
    finally:
        for key in list(de._POOLS):
            if key[0] in (tmp, other):
                de._POOLS.pop(key).retire()


def test_a_farm_worker_places_verified_read_only_copies_an_action_cannot_change_the_store_through(
        tmp_path: Path, monkeypatch: Any) -> None:
    """A farm worker places its inputs from the farm's shared directory as the local executor does
    (sandbox.place_input): a verified read-only copy, never a hard link to the store's blob (the action owns its
    sandbox's files: through a link it could chmod the blob and change the bytes every later reader gets); a corrupt
    blob is refused and evicted."""
    import pytest

    from neuronbuild.cache.cas import BlobStore, CorruptBlob
    from neuronbuild.cache.farm_store import open_farm_store
    from neuronbuild.execution import dask_executor as de

    hashed: list[str] = []
    copy_read_only = BlobStore.copy_read_only

    def counted(self: BlobStore, d: str, dest: Path) -> None:  # a verified copy: hashed as it is written
        hashed.append(d)
        copy_read_only(self, d, dest)

    monkeypatch.setattr(BlobStore, "copy_read_only", counted)
    (tmp_path / "shared").mkdir()
    store = open_farm_store(str(tmp_path / "shared"))
    out = tmp_path / "job-1" / "out"  # a trace's output in its sandbox, stored by its worker
    out.mkdir(parents=True)
    data = os.urandom(1 << 20)
    (out / "program.pt2").write_bytes(data)
    digest, _size = de._store_output(store, out / "program.pt2")
    assert store.blobs.verify(digest)

    placed = tmp_path / "job-2" / "in" / "program.pt2"  # the next action's sandbox
    de._place_input(store, digest, placed)
    blob = store.blobs.path(digest)
    assert hashed == [digest] and placed.read_bytes() == data
    assert placed.stat().st_ino != blob.stat().st_ino and placed.stat().st_mode & 0o777 == 0o444
    os.chmod(placed, 0o644)  # what a hostile action can do to its own input
    placed.write_bytes(b"tampered")
    assert blob.read_bytes() == data and store.blobs.verify(digest)

    os.chmod(blob, 0o644)  # changed in the store: refused and evicted
    with open(blob, "r+b") as f:
        f.write(b"tampered")
    with pytest.raises(CorruptBlob):
        de._place_input(store, digest, tmp_path / "job-3" / "in" / "program.pt2")
    assert not blob.exists()
