"""The build server (docs/server.md): commands through it build exactly what --batch builds, Ctrl-C cancels, a killed
server costs only a restart, another version or other startup options replace it, concurrent commands wait, the client
stays tiny, and the shared cache tier works through it. Every server a test starts is shut down by its fixture."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import REPO, run_cli, user_signals

sys.path.insert(0, str(REPO / "benchmarks"))
import gen_monorepo  # noqa: E402

PKG = gen_monorepo.package_name(0)
SLOW_MODEL = gen_monorepo.MODEL_PY.replace('def build(config):\n',
                                           'def build(config):\n    import time\n    time.sleep(SECONDS)\n')


def _imports(stderr: str) -> set[str]:
    return {ln.split("|")[-1].strip() for ln in stderr.splitlines() if ln.startswith("import time:")}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _server_lines(log: Path, pid: int) -> list[str]:
    """The lines server `pid` wrote to its log (the log of an output base holds every server it ran)."""
    lines = log.read_text().splitlines()
    start = max(i for i, ln in enumerate(lines) if f"server {pid} listening" in ln)
    return lines[start:]


def _wait(cond, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


class Servers:
    """Runs neuronbuild with the server enabled and a private output user root; shuts every server down after."""

    def __init__(self, root: Path, cache: Path) -> None:
        self.root, self.cache = root, cache
        self.env = {"NEURONBUILD_NO_SERVER": "", "NEURONBUILD_OUTPUT_USER_ROOT": str(root)}

    def run(self, args: list[str], cwd: Path, env: dict[str, str] | None = None,
            python_flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
        return run_cli(args, cwd, {**self.env, **(env or {})}, python_flags)

    def popen(self, args: list[str], cwd: Path, out: Path) -> subprocess.Popen[bytes]:
        full = {**os.environ, **self.env}
        with open(out, "wb") as f:
            return subprocess.Popen([sys.executable, "-m", "neuronbuild", *args], cwd=cwd, env=full, stdout=f,
                                    stderr=subprocess.STDOUT, preexec_fn=user_signals)

    def build(self, ws: Path, *extra: str, batch: bool = False, expect: int = 0) -> subprocess.CompletedProcess[str]:
        args = (["--batch"] if batch else []) + ["build", "//...", "--jobs", "2", "--cache-dir", str(self.cache),
                                                 *extra]
        p = self.run(args, ws)
        assert p.returncode == expect, p.stdout + p.stderr[-4000:]
        return p

    def info(self, ws: Path) -> dict:  # type: ignore[type-arg]
        p = self.run(["info", "--output", "json"], ws)
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout)


def _stop(info: Path) -> None:
    """Shut a test's server down politely (as `neuronbuild shutdown` does), else kill it."""
    import socket

    from neuronbuild.server import protocol

    try:
        data = json.loads(info.read_text())
        pid = int(data["pid"])
    except (OSError, ValueError, KeyError):
        return
    with contextlib.suppress(OSError, EOFError, protocol.ProtocolError), \
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(60)
        s.connect(data["socket"])
        protocol.send(s, {"type": "shutdown", "secret": protocol.read_secret(str(info.parent / "server.secret"))})
        protocol.recv(s)
    with contextlib.suppress(AssertionError):
        _wait(lambda: not _alive(pid), 30, "server exit")
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    _wait(lambda: not _alive(pid), 30, f"server {pid} to exit")


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Servers]:
    s = Servers(tmp_path / "ob", tmp_path / "cache")
    yield s
    for info in s.root.glob("*/server.json"):
        _stop(info)


def _ws(base: Path, model: str | None = None) -> Path:
    ws = base / "ws"
    gen_monorepo.generate(ws, 2, 1, 2)  # one package: weights, 1 trace, 2 lowerings, 2 Neuron compiles (load()ed macros)
    if model is not None:
        (ws / PKG / "model.py").write_text(model)
    return ws


def _shutdown(servers: Servers, ws: Path) -> None:
    p = servers.run(["shutdown"], ws)
    assert p.returncode == 0, p.stderr


def _executed(ws: Path, servers: Servers, *, batch: bool, cache: Path, env: dict[str, str] | None = None,
              expect: int = 0) -> set[str]:
    """Fingerprints of the actions one `build //...` executed (from its build events)."""
    events = ws.parent / f"events-{'batch' if batch else 'server'}.jsonl"
    events.unlink(missing_ok=True)
    args = (["--batch"] if batch else []) + ["build", "//...", "--jobs", "2", "--cache-dir", str(cache),
                                             "--build-event-json-file", str(events)]
    p = servers.run(args, ws, env)
    assert p.returncode == expect, p.stdout + p.stderr[-4000:]
    if not events.exists():
        return set()
    evs = [json.loads(ln) for ln in events.read_text().splitlines() if ln.strip()]
    return {e["fingerprint"] for e in evs if e["event"] == "action_started"}


def _plan(ws: Path, servers: Servers, *, batch: bool, cache: Path, env: dict[str, str] | None = None,
          expect: int = 0) -> set[str]:
    args = (["--batch"] if batch else []) + ["plan", "//...", "--cache-dir", str(cache), "--output", "json"]
    p = servers.run(args, ws, env)
    assert p.returncode == expect, p.stdout + p.stderr[-4000:]
    return {a["fingerprint"] for a in json.loads(p.stdout)["execute"]} if expect == 0 else set()


def _summary_executed(p: subprocess.CompletedProcess[str]) -> int:
    m = re.search(r"(\d+) executed", p.stdout)
    return int(m.group(1)) if m else -1


def test_server_rebuilds_exactly_what_batch_rebuilds_over_every_kind_of_edit(servers: Servers,
                                                                            tmp_path: Path) -> None:
    """The differential test: one workspace, two caches filled alike; after each edit, a build through the server
    (its warm load cache, digests and workers) and a --batch build execute the same actions, plans agree, and both
    then take the no-op path."""
    ws = _ws(tmp_path)
    cs, cb = tmp_path / "cache-server", tmp_path / "cache-batch"
    pp = tmp_path / "pp"  # an import path both see: a fake torch distribution appears here (toolchain change)
    pp.mkdir()
    env = {"PYTHONPATH": str(pp)}
    first = _executed(ws, servers, batch=False, cache=cs, env=env)
    assert len(first) == 6  # the weights action, 1 trace, 2 lowerings, 2 Neuron compiles
    shutil.copytree(cs, cb)

    def same(expect: int = 0) -> set[str]:
        time.sleep(0.05)  # edits made just before a build are in its racy window (as in test_scale_noop.py)
        plans = (_plan(ws, servers, batch=False, cache=cs, env=env, expect=expect if expect == 2 else 0),
                 _plan(ws, servers, batch=True, cache=cb, env=env, expect=expect if expect == 2 else 0))
        assert plans[0] == plans[1]
        ran_s = _executed(ws, servers, batch=False, cache=cs, env=env, expect=expect)
        ran_b = _executed(ws, servers, batch=True, cache=cb, env=env, expect=expect)
        assert ran_s == ran_b
        if expect == 0:
            assert ran_s <= plans[0]  # (early cutoff may skip some planned actions, identically in both)
            for batch, cache in ((False, cs), (True, cb)):  # then both are no-ops, through the stamp
                p = servers.run((["--batch"] if batch else []) + ["build", "//...", "--jobs", "2", "--cache-dir",
                                                                  str(cache)], ws, env)
                assert p.returncode == 0 and _summary_executed(p) == 0, p.stdout + p.stderr[-3000:]
        return ran_s

    # 1. a bucket-list edit (tests/test_scale_noop.py, benchmarks/scale_bench.py)
    gen_monorepo.edit_one_bucket_list(ws, 0, 1)
    assert len(same()) == 5
    # 2. a load()ed .bzl edit: the trn2 compile's options change
    defs = ws / "common" / "defs.bzl"
    defs.write_text(defs.read_text().replace('options = "//common:" + kind[1]', 'options = "//common:base"'))
    assert len(same()) == 1
    # 3. an option-set edit in a BUILD file (tests/test_incremental.py): compiles only, no trace
    common = ws / "common" / "BUILD"
    common.write_text(common.read_text().replace('model_type = "transformer"', 'model_type = "generic"'))
    assert len(same()) == 2
    # 4. a model source edit keeping size and mtime
    src = ws / PKG / "model.py"
    st = src.stat()
    src.write_text(src.read_text().replace("torch.relu", "torch.tanh"))
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert len(same()) >= 3
    # 5. a missing output: restored from the cache, nothing executed
    out = next(p for p in (ws / "neuronbuild-out").rglob("*") if p.is_file() and p.name != "manifest.json")
    out.unlink()
    assert same() == set()
    assert out.is_file()
    # 5b. a materialised output rewritten (another size) and a stray file beside it: the warm server (which kept
    # what it materialised) repairs the directory as a batch build does, executing nothing
    good = out.read_bytes()
    for batch in (False, True):
        out.write_bytes(good + b"x")
        (out.parent / "stray.txt").write_text("not an output")
        time.sleep(0.05)
        p = servers.run((["--batch"] if batch else []) + ["build", "//...", "--jobs", "2", "--cache-dir",
                                                          str(cs if not batch else cb)], ws, env)
        assert p.returncode == 0 and _summary_executed(p) == 0, p.stdout + p.stderr[-3000:]
        assert out.read_bytes() == good and not (out.parent / "stray.txt").exists()
    # 5c. a cached blob damaged in place (same size, other bytes) in both caches, after the server verified it in
    # earlier builds: evicted and its action executed again by both builds, alike. (Builds only: the server's plan
    # reuses its peek verdict, as the blob's shard directory did not change: docs/server.md.)
    bucket = next(b for b in json.loads((out.parent.parent / "manifest.json").read_text())["buckets"]
                  if b["name"] == out.parent.name)
    fp, digest = bucket["fingerprint"], bucket["outputs"][out.name]["digest"]
    for cache in (cs, cb):
        blob = cache / "v1" / "cas" / digest[:2] / digest
        blob.chmod(0o644)
        data = blob.read_bytes()
        blob.write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])
    ran_s = _executed(ws, servers, batch=False, cache=cs, env=env)
    assert ran_s and ran_s == _executed(ws, servers, batch=True, cache=cb, env=env)  # (whichever action made it)
    assert same() == set()
    import blake3

    for cache in (cs, cb):  # the output's record references an intact blob again
        d = json.loads((cache / "v1" / "ac" / fp[:2] / f"{fp}.json").read_text())["outputs"][out.name]["digest"]
        assert blake3.blake3((cache / "v1" / "cas" / d[:2] / d).read_bytes()).hexdigest() == d
    # 6. a new package
    shutil.copytree(ws / PKG, ws / "g000" / "p00001")
    (ws / "g000" / "p00001" / "BUILD").write_text(gen_monorepo.build_file(1, 1, 2))
    assert len(same()) >= 1  # at least its weights action (programs equal to ones built already are cached)
    # 6b. a weights file declared in it, then its bytes changed (same size): its weights action runs again (traces,
    # Lowers and compiles work on shapes and never read the weights file)
    new_pkg = ws / "g000" / "p00001"
    _weights_file(new_pkg / "w.safetensors", 0)
    (new_pkg / "BUILD").write_text((new_pkg / "BUILD").read_text().replace(
        "seed = 1)", 'seed = 1, weights = "w.safetensors")'))
    assert len(same()) >= 1
    _weights_file(new_pkg / "w.safetensors", 1)
    assert len(same()) == 1
    # 7. a removed package
    shutil.rmtree(ws / "g000" / "p00001")
    assert same() == set()
    # 8. a new broken package: both refuse it (exit 2)
    (ws / "g009").mkdir()
    (ws / "g009" / "BUILD").write_text("neuron_target(name = \n")
    same(expect=2)
    shutil.rmtree(ws / "g009")
    # 9. a toolchain version change (a torch distribution of another version on the import path): every action is
    # planned anew and the workers refuse to store a result under it, in both modes alike; undone, nothing changed.
    dist = pp / "torch-99.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 99.0\n")
    same(expect=1)
    dist.rename(dist.with_name("torch-99.0.dist-info.off"))
    assert same() == set()


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache the tests below share (content-addressed): the fast model is compiled once for all of them."""
    return tmp_path_factory.mktemp("server-cache")


def test_ctrl_c_in_the_client_cancels_the_builds_actions(servers: Servers, tmp_path: Path,
                                                         shared_cache: Path) -> None:
    servers.cache = shared_cache
    ws = _ws(tmp_path, SLOW_MODEL.replace("SECONDS", "600"))
    log = tmp_path / "client.log"
    client = servers.popen(["build", "//...", "--jobs", "2", "--cache-dir", str(shared_cache)], ws, log)
    try:
        _wait(lambda: "executing" in log.read_text(), 120, "the build to start executing")
        info = servers.info(ws)
        assert info["running"] and info["busy"] and info["workers"] >= 1, info
        workers = _worker_pids(info)
        time.sleep(1.0)  # the trace is sleeping inside the model's code
        client.send_signal(signal.SIGINT)
        rc = client.wait(timeout=60)
    finally:
        if client.poll() is None:
            client.kill()
    text = log.read_text()
    assert rc == 8, text
    assert "interrupted" in text
    _wait(lambda: not any(_alive(p) for p in workers), 30, "the cancelled build's workers to end")
    after = servers.info(ws)
    assert after["running"] and not after["busy"] and after["pid"] == info["pid"]  # the server lives on
    (ws / PKG / "model.py").write_text(gen_monorepo.MODEL_PY)
    p = servers.build(ws)
    assert "6 actions" in p.stdout
    verify = servers.run(["--batch", "cache", "verify", "--cache-dir", str(shared_cache)], ws)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def _worker_pids(info: dict) -> list[int]:  # type: ignore[type-arg]
    return [int(p) for p in info.get("worker_pids", [])]


def test_a_server_killed_mid_build_costs_the_next_command_only_a_restart(servers: Servers, tmp_path: Path,
                                                                        shared_cache: Path) -> None:
    servers.cache = shared_cache
    ws = _ws(tmp_path, SLOW_MODEL.replace("SECONDS", "600"))
    log = tmp_path / "client.log"
    client = servers.popen(["build", "//...", "--jobs", "2", "--cache-dir", str(shared_cache)], ws, log)
    try:
        _wait(lambda: "executing" in log.read_text(), 120, "the build to start executing")
        info = servers.info(ws)
        workers = _worker_pids(info)
        assert workers
        time.sleep(1.0)
        os.kill(info["pid"], signal.SIGKILL)
        rc = client.wait(timeout=60)
    finally:
        if client.poll() is None:
            client.kill()
    assert rc == 1 and "the build server died" in log.read_text(), log.read_text()
    _wait(lambda: not any(_alive(p) for p in workers), 60, "the dead server's workers to end")
    (ws / PKG / "model.py").write_text(gen_monorepo.MODEL_PY)
    p = servers.build(ws)  # a new server, and a correct build
    assert "6 actions" in p.stdout and "failed" not in p.stdout
    assert servers.info(ws)["pid"] != info["pid"]
    verify = servers.run(["--batch", "cache", "verify", "--cache-dir", str(shared_cache)], ws)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_another_version_or_other_startup_options_replace_the_server(servers: Servers, tmp_path: Path,
                                                                    shared_cache: Path) -> None:
    servers.cache = shared_cache
    ws = _ws(tmp_path)
    servers.build(ws)
    first = servers.info(ws)["pid"]
    # other startup options
    p = servers.run(["--max-idle-secs", "600", "plan", "//...", "--cache-dir", str(shared_cache)], ws)
    assert p.returncode == 0 and "restarting it" in p.stderr, p.stderr
    second = servers.run(["--max-idle-secs", "600", "info", "--output", "json"], ws)
    info2 = json.loads(second.stdout)
    assert info2["pid"] != first and info2["max_idle_secs"] == 600
    assert not _alive(first)
    # another neuronbuild version: a copy of the package with another version string, first on the import path
    alt = tmp_path / "alt"
    shutil.copytree(REPO / "neuronbuild", alt / "neuronbuild", ignore=shutil.ignore_patterns("__pycache__"))
    init = alt / "neuronbuild" / "__init__.py"
    init.write_text(init.read_text().replace('__version__ = "', '__version__ = "9.9.9+'))
    p = servers.run(["--max-idle-secs", "600", "plan", "//...", "--cache-dir", str(shared_cache)], ws,
                    {"PYTHONPATH": str(alt)})
    assert p.returncode == 0 and "restarting it" in p.stderr, p.stderr
    info3 = json.loads(servers.run(["--max-idle-secs", "600", "info", "--output", "json"], ws,
                                   {"PYTHONPATH": str(alt)}).stdout)
    assert info3["pid"] != info2["pid"] and not _alive(info2["pid"])
    # and back: the original version replaces it again
    p = servers.run(["--max-idle-secs", "600", "plan", "//...", "--cache-dir", str(shared_cache)], ws)
    assert p.returncode == 0 and "restarting it" in p.stderr
    # another umask: a server keeps its starting client's (it never changes its umask per command), so it is replaced
    old = os.umask(0o027)
    try:
        p = servers.run(["--max-idle-secs", "600", "plan", "//...", "--cache-dir", str(shared_cache)], ws)
    finally:
        os.umask(old)
    assert p.returncode == 0 and "another umask; restarting it" in p.stderr, p.stderr


def test_concurrent_commands_wait_with_a_message(servers: Servers, tmp_path: Path, shared_cache: Path) -> None:
    servers.cache = shared_cache
    ws = _ws(tmp_path, SLOW_MODEL.replace("SECONDS", "8"))
    log = tmp_path / "client.log"
    first = servers.popen(["build", "//...", "--jobs", "2", "--cache-dir", str(shared_cache)], ws, log)
    try:
        _wait(lambda: "executing" in log.read_text(), 120, "the first build to start executing")
        second = servers.run(["plan", "//...", "--cache-dir", str(shared_cache)], ws)
        assert first.wait(timeout=300) == 0, log.read_text()
    finally:
        if first.poll() is None:
            first.kill()
    assert second.returncode == 0, second.stderr
    assert "another command is running in the server; waiting" in second.stderr
    # the plan ran after the build: everything cached
    assert re.search(r"^6 actions: 0 to execute, 6 cached", second.stdout, re.M), second.stdout


def test_the_client_imports_no_torch_networkx_or_starlark_and_the_socket_is_private(
        servers: Servers, tmp_path: Path, shared_cache: Path) -> None:
    servers.cache = shared_cache
    ws = _ws(tmp_path)
    for _ in range(2):  # a full build, then a no-op: through the server, neither imports anything heavy here
        time.sleep(0.05)
        p = servers.run(["build", "//...", "--jobs", "2", "--cache-dir", str(shared_cache)], ws,
                        python_flags=("-X", "importtime"))
        assert p.returncode == 0, p.stderr[-3000:]
        mods = _imports(p.stderr)
        assert "neuronbuild.server.client" in mods
        heavy = sorted(m for m in mods if m.split(".")[0] in ("torch", "networkx", "starlark_go") or
                       m.startswith(("neuronbuild.loading", "neuronbuild.analysis", "neuronbuild.build")))
        assert heavy == [], heavy
    assert _summary_executed(p) == 0
    # The no-op's client is mostly interpreter start: none of these costly-to-import modules (docs/server.md)
    assert not {"typing", "pathlib", "socket", "signal", "hashlib", "json", "re", "enum"} & mods, sorted(mods)
    info = servers.info(ws)
    base = Path(info["output_base"])
    assert stat.S_IMODE(base.stat().st_mode) == 0o700
    sock = Path(info["socket"])
    assert stat.S_ISSOCK(sock.stat().st_mode) and stat.S_IMODE(sock.stat().st_mode) == 0o600
    assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700
    assert info["rss_kib"] > 0
    assert (base / "server.log").is_file()


def test_the_shared_cache_tier_works_through_the_server(servers: Servers, tmp_path: Path) -> None:
    ws = _ws(tmp_path)
    remote = tmp_path / "shared"
    remote.mkdir()
    p = servers.run(["build", "//...", "--jobs", "2", "--cache-dir", str(tmp_path / "c1"), "--remote-cache",
                     str(remote)], ws)
    assert p.returncode == 0 and "6 executed" in p.stdout, p.stdout + p.stderr[-3000:]
    shutil.rmtree(ws / "neuronbuild-out")
    p = servers.run(["build", "//...", "--jobs", "2", "--cache-dir", str(tmp_path / "c2"), "--remote-cache",
                     str(remote)], ws)
    assert p.returncode == 0 and "0 executed" in p.stdout, p.stdout + p.stderr[-3000:]
    assert list((ws / "neuronbuild-out").rglob("model.hlo.pb"))  # fetched from the shared tier


def test_shutdown_and_idle_timeout_end_the_server_and_its_workers(servers: Servers, tmp_path: Path,
                                                                 shared_cache: Path) -> None:
    servers.cache = shared_cache
    ws = _ws(tmp_path)
    servers.build(ws)
    info = servers.info(ws)
    assert info["running"]
    _shutdown(servers, ws)
    _wait(lambda: not _alive(info["pid"]) and not any(_alive(p) for p in _worker_pids(info)), 30, "shutdown")
    assert not servers.info(ws)["running"]
    p = servers.run(["--max-idle-secs", "2", "plan", "//...", "--cache-dir", str(shared_cache)], ws)
    assert p.returncode == 0
    pid = json.loads(servers.run(["--max-idle-secs", "2", "info", "--output", "json"], ws).stdout)["pid"]
    _wait(lambda: not _alive(pid), 30, "the idle server to exit")


def test_a_cached_build_warms_workers_after_its_answer_and_idle_ones_are_released(
        servers: Servers, tmp_path: Path, shared_cache: Path) -> None:
    """A build whose actions were all cached starts no worker while it runs; once its answer is sent the server warms
    them in the background (so the first edit's build finds them warm), `info` counts them, and after
    NEURONBUILD_WORKERS_IDLE_SECS without a command they are ended while the server stays, and `info` says none."""
    servers.cache = shared_cache
    ws = _ws(tmp_path)
    servers.build(ws, batch=True)  # every action cached
    events = tmp_path / "events.jsonl"  # (asking for events takes the full build path, not the no-op stamp)
    env = {"NEURONBUILD_WORKERS_IDLE_SECS": "10"}  # read by the server this command starts
    p = servers.run(["build", "//...", "--jobs", "2", "--cache-dir", str(shared_cache), "--build-event-json-file",
                     str(events)], ws, env)
    assert p.returncode == 0 and "0 executed" in p.stdout, p.stdout + p.stderr[-3000:]
    assert not [ln for ln in events.read_text().splitlines() if '"action_started"' in ln]
    info = servers.info(ws)
    log = Path(info["output_base"]) / "server.log"
    assert info["workers_idle_secs"] == 10

    def warm_line() -> str | None:
        return next((ln for ln in log.read_text().splitlines() if "warm workers starting in the background" in ln),
                    None)

    _wait(lambda: warm_line() is not None, 30, "the background warm-up")
    lines = log.read_text().splitlines()
    answered = next(i for i, ln in enumerate(lines) if " build //... " in ln and "-> 0 in" in ln)
    started = lines.index(str(warm_line()))
    assert started > answered, lines  # the warm-up starts once the command has answered
    pids = [int(x) for x in re.findall(r"\d+", str(warm_line()).rpartition("pids")[2])]
    assert pids and all(_alive(q) for q in pids), (pids, lines)
    seen = servers.info(ws)
    assert "warm workers released" not in log.read_text(), "released before `info` could count them"
    assert seen["workers"] == len(pids) and sorted(_worker_pids(seen)) == sorted(pids), (seen, pids)
    assert seen["pid"] == info["pid"]

    _wait(lambda: "warm workers released" in log.read_text(), 120, "the idle workers' release")
    _wait(lambda: not any(_alive(q) for q in pids), 30, "the released workers to end")
    after = servers.info(ws)
    assert after["running"] and after["pid"] == info["pid"]  # the server stays
    assert after["workers"] == 0 and after["worker_pids"] == [] and after["workers_rss_kib"] == 0, after
    text = log.read_text()
    assert text.index("warm workers released") > text.index("warm workers starting in the background")
    # the next build starts them again (and, all cached, warms them again once answered)
    p = servers.run(["build", "//...", "--jobs", "2", "--cache-dir", str(shared_cache), "--build-event-json-file",
                     str(events)], ws)
    assert p.returncode == 0 and "0 executed" in p.stdout, p.stdout + p.stderr[-3000:]
    _wait(lambda: len(re.findall("warm workers starting in the background", log.read_text())) == 2, 30,
          "the second background warm-up")


def test_a_first_command_that_starts_no_worker_still_warms_them_after_its_answer(
        servers: Servers, tmp_path: Path, shared_cache: Path) -> None:
    """A fresh server whose first command makes no worker pool (a build answered from its no-op stamp, a plan, a
    query) warms the workers the next build would use once its answer is sent (so the first edit's build finds them
    warm), and releases them after NEURONBUILD_WORKERS_IDLE_SECS. Checked by the order of the server log's lines."""
    servers.cache = shared_cache
    ws = _ws(tmp_path)
    servers.build(ws, batch=True)  # every action cached
    env = {"NEURONBUILD_WORKERS_IDLE_SECS": "8", "NEURONBUILD_CACHE_DIR": str(shared_cache)}
    build = ["build", "//...", "--jobs", "2", "--cache-dir", str(shared_cache)]
    assert servers.run(build, ws, env).returncode == 0  # (writes the no-op stamp for this environment)
    _shutdown(servers, ws)
    for first in (build,
                  ["plan", "//...", "--jobs", "2", "--cache-dir", str(shared_cache)],
                  ["query", "//..."]):
        p = servers.run(first, ws, env)
        assert p.returncode == 0, p.stdout + p.stderr[-3000:]
        info = servers.info(ws)
        log = Path(info["output_base"]) / "server.log"

        def this_server(log: Path = log, pid: int = info["pid"]) -> list[str]:
            return _server_lines(log, pid)

        def warm_line() -> str | None:
            return next((ln for ln in this_server() if "warm workers starting in the background" in ln), None)

        _wait(lambda: warm_line() is not None, 60, f"the background warm-up after `{first[0]}`")
        lines = this_server()
        answered = next(i for i, ln in enumerate(lines) if f" {first[0]} " in ln and "-> 0 in" in ln)
        assert lines.index(str(warm_line())) > answered, lines  # once the command has answered
        pids = [int(x) for x in re.findall(r"\d+", str(warm_line()).rpartition("pids")[2])]
        assert pids, lines
        if first[0] == "build":
            assert "0 executed" in p.stdout and info["kept"]["memoised_targets"] == 0, (p.stdout, info)  # (no analysis)
        _wait(lambda: any("warm workers released" in ln for ln in this_server()), 120, "the idle workers' release")
        _wait(lambda pids=pids: not any(_alive(q) for q in pids), 30, "the released workers to end")
        _shutdown(servers, ws)


def test_commands_back_to_back_are_answered_before_the_background_warm_up_starts(
        servers: Servers, tmp_path: Path, shared_cache: Path) -> None:
    """The background warm-up after an answer (the zygote importing torch, the workers' forks, the build's imports)
    starts only once no command came for NEURONBUILD_WARM_GRACE_SECS: a script's commands back to back do not share
    the machine with it (at 1,000 graphs ten no-ops in a row took 0.27 s each instead of 0.09 s beside it). Checked by
    the order of the server log's lines."""
    servers.cache = shared_cache
    ws = _ws(tmp_path)
    servers.build(ws, batch=True)  # every action cached
    env = {"NEURONBUILD_WARM_GRACE_SECS": "8"}  # read by the server the first command starts
    build = ["build", "//...", "--jobs", "2", "--cache-dir", str(shared_cache)]
    for _ in range(3):
        p = servers.run(build, ws, env)
        assert p.returncode == 0 and "0 executed" in p.stdout, p.stdout + p.stderr[-3000:]
    info = servers.info(ws)
    log = Path(info["log"])

    def this_server() -> list[str]:
        return _server_lines(log, info["pid"])

    _wait(lambda: any("warm workers starting in the background" in ln for ln in this_server()), 60,
          "the background warm-up")
    lines = this_server()
    answered = [i for i, ln in enumerate(lines) if " build //... " in ln and "-> 0 in" in ln]
    started = next(i for i, ln in enumerate(lines) if "warm workers starting in the background" in ln)
    assert len(answered) == 3 and started > answered[-1], lines


def test_the_pages_of_commands_back_to_back_are_rendered_once_the_server_idles(
        servers: Servers, tmp_path: Path, shared_cache: Path) -> None:
    """Each build's page is rendered by a spawned interpreter; the server spawns them once it idles (after
    NEURONBUILD_WARM_GRACE_SECS without a command), so a script's commands back to back do not share the machine with
    their renderers (ten no-ops at 1,000 graphs: 0.18 s each beside them, 0.04-0.05 s in the server's log without).
    Every page still appears. Checked by the pages' times against the last command's end, never by durations."""
    servers.cache = shared_cache
    ws = _ws(tmp_path)
    servers.build(ws, batch=True)  # every action cached; writes the no-op stamp
    env = {"NEURONBUILD_WARM_GRACE_SECS": "6"}
    build = ["build", "//...", "--cache-dir", str(shared_cache)]
    pages = []
    for i in range(3):
        if i:
            time.sleep(2)  # (a renderer spawned at an answer has its page written well before the next command)
        p = servers.run(build, ws, env)
        assert p.returncode == 0, p.stdout + p.stderr[-3000:]
        pages.append(Path(re.findall(r"^Invocation: file://(\S+)$", p.stdout, re.M)[-1]))
    last_answered = time.time()
    assert len(set(pages)) == 3
    assert not any(pg.exists() for pg in pages)  # no command came 6 s after another's answer yet
    _wait(lambda: all(pg.exists() for pg in pages), 90, "the pages")
    assert all(pg.stat().st_mtime > last_answered for pg in pages), [(pg.stat().st_mtime, last_answered) for pg in pages]


def test_a_record_the_server_could_not_write_after_its_answer_is_reported_by_the_next_command(
        servers: Servers, tmp_path: Path, shared_cache: Path) -> None:
    """The server writes a build's invocation record after the answer is sent; a record it cannot write (here: the
    output base's `invocations` is a file) gets the same warning a batch build prints, shown once, on the stderr of
    the next command instead of only in the server's log."""
    servers.cache = shared_cache
    ws = _ws(tmp_path)
    servers.build(ws, batch=True)  # every action cached; writes the no-op stamp
    build = ["build", "//...", "--cache-dir", str(shared_cache)]
    assert servers.run(build, ws).returncode == 0
    inv = Path(servers.info(ws)["output_base"]) / "invocations"
    shutil.rmtree(inv)
    inv.write_text("not a directory\n")
    try:
        p = servers.run(build, ws)  # answered from the no-op stamp; its record is written after the answer
        assert p.returncode == 0 and "was not written" not in p.stderr, p.stderr
        shown = "warning: after the previous command's answer: the invocation record was not written"
        p = servers.run(["query", "//..."], ws)
        assert p.returncode == 0 and shown in p.stderr, p.stderr
        p = servers.run(["query", "//..."], ws)
        assert p.returncode == 0 and "after the previous command's answer" not in p.stderr, p.stderr  # once
    finally:
        inv.unlink()


def _tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()}


def test_the_first_edits_build_finds_the_toolchain_warm_up_done_after_the_answer_and_a_command_during_it_is_answered(
        servers: Servers, tmp_path: Path, shared_cache: Path) -> None:
    """After a fresh server's first command (a build answered from its no-op stamp) the server warms, once the answer
    is sent, what the first edit's build would otherwise pay: the build's imports, the workers' forks and the
    toolchain warm-ups of the plan (the Neuron lowering's jax import, in the zygote). A `plan` sent right after the
    answer arrives during that warm-up and is answered as a batch plan is; the warm-up still completes after it; the
    first edit's build then finds the warm-up held (its own warm-up pseudo-action reports `held_before` in the build
    events: it did not do the work), and its outputs are byte-identical to a fresh batch build's. Checked by the
    order of the server log's lines and the events, never by timing."""
    servers.cache = shared_cache
    ws = _ws(tmp_path)
    servers.build(ws, batch=True)  # every action cached
    env = {"NEURONBUILD_WORKERS_IDLE_SECS": "300"}
    build = ["build", "//...", "--jobs", "2", "--cache-dir", str(shared_cache)]
    assert servers.run(build, ws, env).returncode == 0  # (writes the no-op stamp; its plan names the warm-ups)
    _shutdown(servers, ws)
    p = servers.run(build, ws, env)  # the fresh server's first command: answered from its no-op stamp
    assert p.returncode == 0 and "0 executed" in p.stdout, p.stdout + p.stderr[-3000:]
    info = servers.info(ws)
    log = Path(info["log"])

    def this_server() -> list[str]:
        return _server_lines(log, info["pid"])

    _wait(lambda: any("warm workers starting in the background" in ln for ln in this_server()), 60,
          "the background warm-up's start")
    during = _plan(ws, servers, batch=False, cache=shared_cache)  # sent at once: the zygote is importing torch
    assert during == _plan(ws, servers, batch=True, cache=shared_cache)

    def done_line() -> str | None:
        return next((ln for ln in this_server() if "background warm-up done" in ln), None)

    _wait(lambda: done_line() is not None, 180, "the background warm-up")
    lines = this_server()
    first = next(i for i, ln in enumerate(lines) if " build //... " in ln and "-> 0 in" in ln)
    started = next(i for i, ln in enumerate(lines) if "warm workers starting in the background" in ln)
    planned = next(i for i, ln in enumerate(lines) if " plan //... " in ln and "-> 0 in" in ln)
    toolchains = next(i for i, ln in enumerate(lines) if "toolchain warm-ups in the zygote" in ln)
    assert first < started < planned < toolchains < lines.index(str(done_line())), lines  # the plan came during it
    assert "neuron" in lines[toolchains], lines
    pids = [int(x) for x in re.findall(r"\d+", str(done_line()).rpartition("pids")[2])]
    assert sorted(_worker_pids(servers.info(ws))) == sorted(pids) and len(pids) == 3, (pids, lines)  # 2 + zygote

    (ws / PKG / "model.py").write_text((ws / PKG / "model.py").read_text() + "\n# an edit\n")
    events = tmp_path / "events.jsonl"
    servers.build(ws, "--build-event-json-file", str(events))
    evs = [json.loads(ln) for ln in events.read_text().splitlines() if ln.strip()]
    warmed = [e for e in evs if e["event"] == "warm_up_finished"]
    assert warmed and all(e["ok"] and e["metadata"].get("held_before") for e in warmed), warmed
    ran = [e for e in evs if e["event"] == "action_started"]
    assert ran and {e["pid"] for e in ran} <= set(pids), (ran, pids)  # in the workers forked in the background
    outputs = _tree_bytes(ws / "neuronbuild-out")
    assert outputs
    servers.build(ws, "--cache-dir", str(tmp_path / "fresh-cache"), batch=True)  # (the last --cache-dir wins)
    assert _tree_bytes(ws / "neuronbuild-out") == outputs


def test_batch_and_no_server_env_run_in_the_client(servers: Servers, tmp_path: Path, shared_cache: Path) -> None:
    servers.cache = shared_cache
    ws = _ws(tmp_path)
    p = servers.run(["--batch", "plan", "//...", "--cache-dir", str(shared_cache)], ws)
    assert p.returncode == 0
    p = servers.run(["plan", "//...", "--cache-dir", str(shared_cache)], ws, {"NEURONBUILD_NO_SERVER": "1"})
    assert p.returncode == 0
    assert not servers.info(ws)["running"]
    assert not list(servers.root.glob("*/server.json"))
    p = servers.run(["--max-idle-secs", "0", "plan"], ws)
    assert p.returncode == 2 and p.stderr.startswith("neuronbuild: error: --max-idle-secs"), p.stderr


def test_a_server_whose_workspace_is_deleted_exits(servers: Servers, tmp_path: Path, shared_cache: Path) -> None:
    ws = _ws(tmp_path)
    p = servers.run(["plan", "//...", "--cache-dir", str(shared_cache)], ws)
    assert p.returncode == 0, p.stderr
    pid = servers.info(ws)["pid"]
    shutil.rmtree(ws)  # e.g. a test's temporary directory: nobody can reach this server again
    _wait(lambda: not _alive(pid), 30, "the server of a deleted workspace to exit")


def _weights_file(path: Path, fill: int) -> None:
    """A safetensors file of the generated Tiny model's parameters (analysis digests it; nothing reads it here)."""
    n = gen_monorepo.FEAT
    header = json.dumps({"fc.weight": {"dtype": "F32", "shape": [n, n], "data_offsets": [0, 4 * n * n]},
                         "fc.bias": {"dtype": "F32", "shape": [n], "data_offsets": [4 * n * n, 4 * n * n + 4 * n]}})
    raw = header.encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes([fill]) * (4 * n * n + 4 * n))


@pytest.mark.parametrize("group_roots", [64, 3])
def test_memoised_analysis_plans_what_a_fresh_analysis_plans_over_edits_it_could_get_wrong(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, group_roots: int) -> None:
    """The server's memoised analysis (analysis/planner.AnalysisMemo, kept across commands in one process) against
    a fresh analysis after each edit: the same actions, in the same order, the same compile targets and bundles; and
    only the edited targets (and those depending on them) are analysed again. With groups of 3 roots (planner._Group)
    the 8 roots make several groups, sharing nodes (option sets, bucket sets, targets) across their boundaries."""
    from neuronbuild import incremental
    from neuronbuild.analysis import planner
    from neuronbuild.context import make_context
    from neuronbuild.errors import UserInputError
    from neuronbuild.loading.target_graph import load_targets

    monkeypatch.setattr(planner, "GROUP_ROOTS", group_roots)

    ws = tmp_path / "ws"
    gen_monorepo.generate(ws, 16, 2, 2)  # 4 packages: 0 and 2 through the load()ed macros, 1 and 3 direct
    (ws / "common" / "BUILD").write_text((ws / "common" / "BUILD").read_text() +
                                         'neuron_target(name = "cpu", platform = "cpu", isa = "native")\n')
    monkeypatch.chdir(ws)
    cache = str(tmp_path / "cache")

    def plan(memo: bool, **flags: Any) -> tuple[Any, ...]:
        ctx = make_context(cache_dir=cache, **flags)
        if memo:  # the server's load: its kept load cache
            graph = ctx.load(["//..."])
        else:  # a batch load without any load cache
            graph = load_targets(ctx.workspace.root, ["//..."], ctx.workspace.cwd_package, None)
        m = incremental.analysis_memo(ctx.workspace.root, ctx.settings) if memo else None
        ag = planner.plan(graph, ctx.settings, m)  # memo None: a fresh analysis, as in batch mode
        counts = (m.reused, m.analysed, m.grouped) if m is not None else (0, 0, 0)
        # the loaded targets and packages; the whole graph: actions in registration order, the topological order,
        # every node's predecessors and successors in networkx's order
        return ([(str(lbl), t.kind, dict(t.attrs)) for lbl, t in graph.targets.items()], list(graph.packages),
                list(map(str, graph.requested)),
                [a.fingerprint for a in ag.topological()], [(str(c.label), c.buckets, c.options) for c in ag.compiles],
                sorted(map(str, ag.bundles)), list(ag.actions), sorted(ag.graph.nodes), sorted(ag.graph.edges),
                [list(ag.graph.predecessors(fp)) for fp in ag.actions],
                [list(ag.graph.successors(fp)) for fp in ag.actions], counts)

    def same_error(**flags: Any) -> str:
        """A bad edit: the server's load and plan and a fresh batch one refuse it with the same error."""
        time.sleep(0.05)
        messages = []
        for memo in (True, False):
            with pytest.raises(UserInputError) as e:
                plan(memo, **flags)
            messages.append(str(e.value))
        assert messages[0] == messages[1]
        return messages[0]

    incremental.keep_in_memory(True)
    try:
        first = plan(True)
        assert first[-1][0] == 0 and first[-1][1] > 0

        def same(**flags: Any) -> tuple[int, int]:
            time.sleep(0.05)  # out of the racy window of the edit
            warm, fresh = plan(True, **flags), plan(False, **flags)
            assert warm[:-1] == fresh[:-1]
            return warm[-1]

        pkg = [ws / gen_monorepo.package_name(i) for i in range(4)]
        reused, analysed, grouped = same()  # nothing changed: everything replayed
        assert analysed == 0 and reused > 0 and grouped == 8  # (every root provided by a group: 8 roots)
        # a bucket-list edit: that package's bucket set and the compiles using it
        gen_monorepo.edit_one_bucket_list(ws, 0, 2, 40)
        assert same()[1] == 3  # shapes + 2 compiles of package 0
        # a .bzl edit used by some packages (0 and 2, through the macros), not by the others
        defs = ws / "common" / "defs.bzl"
        defs.write_text(defs.read_text().replace('options = "//common:" + kind[1]', 'options = "//common:base"'))
        same()
        # an edit of a target other packages' targets depend on (an option set in //common)
        common = ws / "common" / "BUILD"
        common.write_text(common.read_text().replace("opt_level = 1", "opt_level = 3"))
        same()
        # a neuron_target's platform changes (its kind is never memoised: its dependants compare its provider)
        common.write_text(common.read_text().replace('name = "trn1", platform = "trn1"',
                                                     'name = "trn1", platform = "inf2"'))
        same()
        # a cpu target (isa = "native", resolved on this machine) used by another package's compile
        with open(pkg[3] / "BUILD", "a") as f:
            f.write('neuron_compile(name = "cpu", model = ":m", buckets = [":shapes"], target = "//common:cpu")\n')
        same()
        # a compile in package 1 of package 0's model; then package 0's model changes (a cross-package dependant)
        with open(pkg[1] / "BUILD", "a") as f:
            f.write(f'neuron_compile(name = "other", model = "//{gen_monorepo.package_name(0)}:m", '
                    'buckets = [":shapes"], target = "//common:trn2")\n')
        same()
        # a bundle in package 1 shipping a compile of its own and one of package 3 (provided by the bundle's root
        # before package 3's roots ask for it: a node with events shared across groups); package 3 edited; removed
        b1 = pkg[1] / "BUILD"
        before = b1.read_text()
        b1.write_text(before + f'neuron_bundle(name = "rel", srcs = [":c_0", "//{gen_monorepo.package_name(3)}:c_1"])\n')
        same()
        assert same()[2] == 11  # (nothing changed: all 11 roots by groups; package 3's leaves out what the bundle added)
        gen_monorepo.edit_one_bucket_list(ws, 3, 2, 41)
        same()
        b1.write_text(before)
        same()
        b0 = pkg[0] / "BUILD"
        b0.write_text(b0.read_text().replace("width = 16, seed = 0", "width = 16, seed = 7"))
        assert same()[1] >= 4  # model + its compiles, package 1's "other" among them
        # a model source edited keeping its size and mtime
        src = pkg[2] / "model.py"
        st = src.stat()
        src.write_text(src.read_text().replace("torch.relu", "torch.tanh"))
        os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert same()[1] >= 3
        # a weights file: declared, then its bytes change (same size), then it is replaced by a link elsewhere
        _weights_file(pkg[1] / "w.safetensors", 1)
        b1 = pkg[1] / "BUILD"
        b1.write_text(b1.read_text().replace('seed = 1)', 'seed = 1, weights = "w.safetensors")'))
        same()
        _weights_file(pkg[1] / "w.safetensors", 2)
        assert same()[1] >= 3
        # a package deleted, then added back
        shutil.rmtree(pkg[3])
        same()
        shutil.copytree(pkg[2], pkg[3])
        (pkg[3] / "BUILD").write_text(gen_monorepo.build_file(3, 2, 2))
        same()
        # bad edits the re-load must refuse as a full load does: a reference to a missing target, a target of the
        # wrong kind, a dependency cycle, a missing source file; each fixed again afterwards
        b2 = pkg[2] / "BUILD"
        good = b2.read_text()
        b2.write_text(good.replace('buckets = [":shapes"]', 'buckets = [":nope"]', 1))
        assert "does not exist" in same_error()
        b2.write_text(good.replace('buckets = [":shapes"]', 'buckets = [":m"]', 1))
        assert "must be a" in same_error()
        b2.write_text(good)
        same()
        common_good = common.read_text()
        common.write_text(common_good.replace('compiler_options(name = "base", ',
                                              'compiler_options(name = "base", deps = [":fast"], '))
        assert "cycle" in same_error()
        common.write_text(common_good)
        same()
        (pkg[2] / "model.py").rename(pkg[2] / "model.moved")
        assert "does not exist" in same_error()
        (pkg[2] / "model.moved").rename(pkg[2] / "model.py")
        same()
        # a new package in a new directory, then one more level down; a directory without a BUILD file
        (ws / "extra" / "deeper").mkdir(parents=True)
        (ws / "extra" / "notes").mkdir()
        shutil.copy(pkg[1] / "model.py", ws / "extra" / "model.py")
        (ws / "extra" / "BUILD").write_text(gen_monorepo.build_file(1, 2, 2))
        same()
        shutil.copy(pkg[1] / "model.py", ws / "extra" / "deeper" / "model.py")
        (ws / "extra" / "deeper" / "BUILD").write_text(gen_monorepo.build_file(1, 3, 1))
        same()
        # a target made manual (requested no more), then a bucket edit in another package reusing the rest
        (ws / "extra" / "BUILD").write_text(gen_monorepo.build_file(1, 2, 2).replace(
            'name = "c_0", ', 'name = "c_0", tags = ["manual"], '))
        same()
        gen_monorepo.edit_one_bucket_list(ws, 1, 2, 43)
        assert same()[1] == 4  # its bucket set, its 2 compiles and "other" (added above) are analysed again
        # other settings: a declared action env and a what-if toolchain get their own memo
        same(action_env=["FOO=1"])
        same(toolchain=["torch=9.9"])
        assert same()[1] == 0  # the original settings' memo is still there
    finally:
        incremental.keep_in_memory(False)


def test_a_reused_root_whose_target_an_edited_root_provided_first_is_analysed_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A requested root asks for a target an earlier root provided first; an edit makes the earlier root stop asking
    for it: the later root (unchanged, its package too) now provides it first; the kept engine's plan equals a fresh
    one (the same actions in the same order, compile targets and edges)."""
    from neuronbuild import incremental
    from neuronbuild.analysis import planner
    from neuronbuild.context import make_context
    from neuronbuild.loading.target_graph import load_targets

    ws = tmp_path / "ws"
    gen_monorepo.generate(ws, 8, 2, 2)  # 2 packages
    monkeypatch.chdir(ws)
    cache = str(tmp_path / "cache")
    far = gen_monorepo.package_name(1)
    b0 = ws / gen_monorepo.package_name(0) / "BUILD"
    original = b0.read_text()
    b0.write_text(original + f'neuron_compile(name = "x", model = "//{far}:m", buckets = [":shapes"], '
                             'target = "//common:trn2")\n')  # (package 0's roots come first: it provides //far:m)

    def plan(memo: bool) -> tuple[Any, ...]:
        ctx = make_context(cache_dir=cache)
        graph = ctx.load(["//..."]) if memo else load_targets(ctx.workspace.root, ["//..."], ctx.workspace.cwd_package,
                                                              None)
        ag = planner.plan(graph, ctx.settings,
                          incremental.analysis_memo(ctx.workspace.root, ctx.settings) if memo else None)
        return (list(ag.actions), [a.fingerprint for a in ag.topological()],
                [(str(c.label), c.buckets) for c in ag.compiles], [list(ag.graph.successors(fp)) for fp in ag.actions])

    def same() -> None:
        time.sleep(0.05)
        assert plan(True) == plan(False)

    incremental.keep_in_memory(True)
    try:
        same()
        b0.write_text(original + 'neuron_compile(name = "x", model = ":m", buckets = [":shapes"], '
                                 'target = "//common:trn2")\n')
        same()
        b0.write_text(original + f'neuron_compile(name = "x", model = "//{far}:m", buckets = [":shapes"], '
                                 'target = "//common:trn2")\n')
        same()
        b0.write_text(original + 'neuron_compile(name = "x", model = ":m", buckets = [":shapes"], '
                                 'target = "//common:trn2")\n')
        same()
    finally:
        incremental.keep_in_memory(False)


def _plan_report(cache_dir: Path, server: bool, patterns: tuple[str, ...] = ("//...",)) -> tuple[Any, Any]:
    """`plan //...`'s report (in the current directory's workspace) as the build server makes it (its kept load cache
    and analysis engine) or as --batch does (the engine starting empty): (report, action graph)."""
    from neuronbuild import incremental
    from neuronbuild.analysis import planner
    from neuronbuild.analysis.plan_report import plan_report
    from neuronbuild.context import make_context
    from neuronbuild.execution.scheduler import needed_actions

    ctx = make_context(cache_dir=str(cache_dir))
    graph = ctx.load(list(patterns))
    m = incremental.analysis_memo(ctx.workspace.root, ctx.settings) if server else None
    ag = planner.plan(graph, ctx.settings, m)
    cache = ctx.open_cache()
    todo, cached = needed_actions(ag, cache, probe=True)
    return plan_report(ag, todo, cached, ctx.history(cache), 2, m), ag


def test_the_servers_plan_report_equals_a_fresh_one_as_the_cache_and_workspace_change(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`plan` as the server makes it (memoised analysis, peek verdicts memoised per cache shard, answered from shard
    listings) against `plan` as a batch command makes it (fresh analysis, every record opened): the same matrix
    text and JSON report after results are stored (cached and unneeded cells, recorded durations), a record and a
    blob go, a bucket list is edited and a package is deleted."""
    from neuronbuild import incremental
    from neuronbuild.cache.identity_index import IdentityIndex
    from neuronbuild.context import make_context

    ws = tmp_path / "ws"
    gen_monorepo.generate(ws, 16, 2, 2)
    monkeypatch.chdir(ws)
    cache_dir = tmp_path / "cache"

    def report(server: bool) -> tuple[list[str], Any, Any]:
        r, ag = _plan_report(cache_dir, server)
        return r.lines(), r.to_json(), ag

    def same() -> Any:
        time.sleep(0.05)  # out of the racy window of the last change
        (wl, wj, ag), (fl, fj, _ag) = report(True), report(False)
        assert wl == fl
        assert wj == fj
        return ag

    incremental.keep_in_memory(True)
    try:
        ag = same()
        same()  # the verdicts memoised by the first plan, reused
        # an edit loop with nothing cached (every action to run): the estimates, their seconds, the dependencies'
        # places and the places of the removed actions (the last edit's) are patched from the previous plan's
        build = ws / gen_monorepo.package_name(2) / "BUILD"
        for size in (30, 31, 32, 31):
            build.write_text(re.sub(r'"batch": \[([0-9, ]*?)(\d+)\]', rf'"batch": [\g<1>{size}]', build.read_text()))
            same()
        ag = same()
        # results stored for one trace (with its lowerings) and for one compile: cached and unneeded cells, and
        # the recorded durations become the estimates of that trace's other actions
        out = tmp_path / "out"
        out.mkdir()
        cache = make_context(cache_dir=str(cache_dir)).open_cache()
        trace = next(a for a in ag.topological() if a.kind == "trace")
        lowered = [ag.actions[fp] for fp in ag.graph.successors(trace.fingerprint)]
        compiled = ag.actions[next(iter(ag.graph.successors(lowered[0].fingerprint)))]
        stored = []
        for i, a in enumerate([trace, *lowered, compiled]):
            for name in a.outputs:
                (out / name).write_bytes(f"{a.fingerprint} {name}".encode())
            stored.append(cache.store_outputs(a.fingerprint, a.identity, dict(a.record), out, a.outputs, 1.5 + i, {}))
        ag = same()
        lines = report(True)[0]
        # (a recorded estimate has no "~": the stored durations became estimates of that target's other actions)
        assert any(" cached " in ln for ln in lines) and \
            any(" build " in ln and ln.rstrip().endswith(" s") and "~" not in ln for ln in lines), lines
        # only the identity history changes (another duration for a Lower not cached: its estimate changes; the
        # Neuron compiles here are skipped without neuronx-cc, estimated at nothing whatever their history)
        done = {r.fingerprint for r in stored}
        other = next(a for a in ag.topological() if a.kind == "lower" and a.fingerprint not in done
                     and a.identity not in {ag.actions[fp].identity for fp in done})
        IdentityIndex(cache.root).record(dataclasses.replace(stored[1], identity=other.identity, duration_s=7.25))
        same()
        assert {e["fingerprint"]: e["estimate_s"] for e in report(True)[1]["execute"]}[other.fingerprint] == 7.25
        # a record deleted, then a blob of another stored result (the memoised verdicts of their shards go)
        cache.actions.path(compiled.fingerprint).unlink()
        same()
        blob = next(iter(stored[1].outputs.values())).digest
        cache.blobs.path(blob).unlink()
        same()
        # a bucket-list edit, then a package deleted: the order and the needed actions are patched
        gen_monorepo.edit_one_bucket_list(ws, 0, 2, 40)
        same()
        shutil.rmtree(ws / gen_monorepo.package_name(3))
        same()
        # a result stored between two plans of the same graph: its shard changed, the whole pass runs again
        a = next(a for a in report(True)[2].topological() if a.kind == "trace")
        for name in a.outputs:
            (out / name).write_bytes(f"{a.fingerprint} {name}".encode())
        cache.store_outputs(a.fingerprint, a.identity, dict(a.record), out, a.outputs, 0.5, {})
        same()
        gen_monorepo.edit_one_bucket_list(ws, 1, 2, 41)
        same()
    finally:
        incremental.keep_in_memory(False)


_STORE_IN_ANOTHER_PROCESS = """
import json, sys
from pathlib import Path
from neuronbuild.cache.local import LocalCache
args = json.loads(Path(sys.argv[1]).read_text())
out = Path(args["out"])
out.mkdir(exist_ok=True)
for name in args["outputs"]:
    (out / name).write_bytes((args["fp"] + name).encode())
LocalCache(Path(args["cache"])).store_outputs(args["fp"], args["identity"], args["record"], out, args["outputs"],
                                              args["seconds"], {})
"""


def test_the_servers_plan_shows_the_history_another_process_records_between_plans(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The build server keeps each action's estimate and each compile target's matrix rows while the cache's history
    is unchanged (its stamp: the record and index directories). Another process storing a result (a record and its
    identity's index entry), deleting that record, or changing only an index entry between two plans: the server's
    next plan shows the statuses and estimates a fresh batch plan shows."""
    from neuronbuild import incremental
    from neuronbuild.cache.identity_index import IdentityIndex
    from neuronbuild.context import make_context

    ws = tmp_path / "ws"
    gen_monorepo.generate(ws, 8, 3, 2)
    monkeypatch.chdir(ws)
    cache_dir = tmp_path / "cache"

    def same() -> tuple[list[str], Any, Any]:
        time.sleep(0.05)  # out of the racy window of the last change
        (wr, ag), (fr, _ag) = _plan_report(cache_dir, True), _plan_report(cache_dir, False)
        assert wr.lines() == fr.lines()
        assert wr.to_json() == fr.to_json()
        return wr.lines(), wr.to_json(), ag

    def estimates(j: Any) -> dict[str, tuple[float, str]]:
        return {e["fingerprint"]: (e["estimate_s"], e["estimate_source"]) for e in j["execute"]}

    incremental.keep_in_memory(True)
    try:
        same()
        lines, before, ag = same()  # (the second: estimates and rows kept from the first)
        trace = next(a for a in ag.topological() if a.kind == "trace")
        sibling = next(a for a in ag.topological() if a.kind == "trace" and a.label == trace.label and a is not trace)
        spec = tmp_path / "store.json"
        spec.write_text(json.dumps({"cache": str(cache_dir), "out": str(tmp_path / "out"),
                                    "fp": trace.fingerprint, "identity": trace.identity, "record": dict(trace.record),
                                    "outputs": list(trace.outputs), "seconds": 9.5}))
        subprocess.run([sys.executable, "-c", _STORE_IN_ANOTHER_PROCESS, str(spec)], check=True)
        lines2, after, _ag = same()
        # the stored trace is cached now, and its sibling bucket is estimated from the stored run
        assert trace.fingerprint in after["cached"] and trace.fingerprint not in before["cached"]
        assert estimates(after)[sibling.fingerprint] == (9.5, "mean of 1 other bucket(s) of this target") != \
            estimates(before)[sibling.fingerprint]
        assert lines2 != lines
        # the record deleted (its index entry stays): to execute again, estimated from its own identity's run
        cache = make_context(cache_dir=str(cache_dir)).open_cache()
        stored = cache.actions.get(trace.fingerprint)
        assert stored is not None
        cache.actions.path(trace.fingerprint).unlink()
        _l, gone, _ag = same()
        assert trace.fingerprint not in gone["cached"]
        assert estimates(gone)[trace.fingerprint] == (9.5, "the last run of this action identity")
        # only the identity index changes (another process records a run of the sibling's identity)
        IdentityIndex(cache.root).record(dataclasses.replace(stored, identity=sibling.identity, duration_s=3.25))
        _l, indexed, _ag = same()
        assert estimates(indexed)[sibling.fingerprint] == (3.25, "the last run of this action identity")
    finally:
        incremental.keep_in_memory(False)


def test_the_servers_plan_report_re_estimates_the_actions_an_edit_replaced_at_the_start_middle_and_end(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The build server's report keeps the last report's estimates for the actions at the start and the end of the
    plan that are the same objects at the same places, and estimates those between afresh. Every bucket size an
    edit loop visits has its own recorded duration, so an edit of the first, the last or a middle package replaces
    actions at that place by ones with other estimates: after each edit the server's lines and JSON equal a fresh
    batch plan's."""
    from neuronbuild import incremental
    from neuronbuild.cache.action_cache import ActionResult
    from neuronbuild.cache.identity_index import IdentityIndex
    from neuronbuild.context import make_context

    ws = tmp_path / "ws"
    gen_monorepo.generate(ws, 16, 2, 2)  # (4 packages)
    monkeypatch.chdir(ws)
    cache_dir = tmp_path / "cache"
    sizes = {0: (20, 21), 3: (22, 23), 1: (24, 25)}

    def edit(i: int, size: int) -> None:
        build = ws / gen_monorepo.package_name(i) / "BUILD"
        build.write_text(re.sub(r'"batch": \[([0-9, ]*?)(\d+)\]', rf'"batch": [\g<1>{size}]', build.read_text()))

    # every action (trace, lowering) of every state the loop visits, each identity with its own recorded duration
    seen: dict[str, Any] = {}
    for i, pair in sizes.items():
        for size in pair:
            edit(i, size)
            seen.update({a.identity: a for a in _plan_report(cache_dir, False)[1].topological()
                         if a.kind in ("trace", "lower")})
    index = IdentityIndex(make_context(cache_dir=str(cache_dir)).open_cache().root)
    for k, (identity, a) in enumerate(sorted(seen.items())):
        index.record(ActionResult(a.fingerprint, identity, {}, dict(a.record), 1.0 + k / 4))

    def same() -> dict[str, float]:
        time.sleep(0.05)  # out of the racy window of the last change
        (wr, _ag), (fr, _fag) = _plan_report(cache_dir, True), _plan_report(cache_dir, False)
        assert wr.lines() == fr.lines()
        assert wr.to_json() == fr.to_json()
        return {e["fingerprint"]: e["estimate_s"] for e in wr.to_json()["execute"]
                if e["estimate_source"] == "the last run of this action identity"}

    incremental.keep_in_memory(True)
    try:
        same()
        for i, (a, b) in sizes.items():
            for size in (a, b, a):
                before = same()
                edit(i, size)
                after = same()
                # (the edited package's actions: other fingerprints, each with its own recorded estimate)
                assert after and set(after.values()) != set(before.values())
    finally:
        incremental.keep_in_memory(False)


def test_the_servers_plan_report_rerenders_a_kept_target_whose_trace_becomes_needed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compile target the server rendered last time (the same object, replayed) whose trace was not needed (its
    lowering and compiles cached) and is needed after an edit adds a compile with another lowering of it: its rows
    are rendered again (the trace's cell changes), as a batch `plan` shows them."""
    from neuronbuild import incremental
    from neuronbuild.context import make_context

    ws = tmp_path / "ws"
    gen_monorepo.generate(ws, 8, 2, 2)
    monkeypatch.chdir(ws)
    cache_dir = tmp_path / "cache"

    def report(server: bool) -> tuple[list[str], Any]:
        r, ag = _plan_report(cache_dir, server)
        return r.lines(), ag

    def same() -> tuple[list[str], Any]:
        time.sleep(0.05)  # out of the racy window of the last change
        (wl, ag), (fl, _ag) = report(True), report(False)
        assert wl == fl
        return wl, ag

    incremental.keep_in_memory(True)
    try:
        _lines, ag = same()
        pkg = gen_monorepo.package_name(1)
        cts = [ct for ct in ag.compiles if ct.label.package == pkg]
        compiles = [ag.actions[ct.buckets[0][1]] for ct in cts]
        lowers = {c.deps[0]: ag.actions[c.deps[0]] for c in compiles}
        out = tmp_path / "out"
        out.mkdir()
        cache = make_context(cache_dir=str(cache_dir)).open_cache()
        for a in [*lowers.values(), *compiles]:  # (not the trace: it is not needed then)
            for name in a.outputs:
                (out / name).write_bytes(f"{a.fingerprint} {name}".encode())
            cache.store_outputs(a.fingerprint, a.identity, dict(a.record), out, a.outputs, 1.0, {})
        lines, ag = same()
        row = next(i for i, ln in enumerate(lines) if ln.startswith(str(cts[0].label))) + 2
        bucket = str(cts[0].buckets[0][0])

        def cells(ln: str) -> list[str]:  # (the trace's and the compile's status)
            return ln.split(bucket, 1)[1].split()[:2]

        assert cells(lines[row]) == ["-", "cached"]
        same()  # (the next plan patches this one's needed actions)
        build = ws / pkg / "BUILD"
        build.write_text(build.read_text() + 'neuron_compile(name = "extra", model = ":m", buckets = [":shapes"], '
                                              'target = "//common:trn2", options = "//common:fast")\n')
        lines, ag = same()
        assert ag.compiles[[ct.label for ct in ag.compiles].index(cts[0].label)] is cts[0]  # (replayed: kept)
        assert cells(lines[row]) == ["build", "cached"]
    finally:
        incremental.keep_in_memory(False)


def test_the_servers_plan_rerenders_a_kept_target_whose_trace_became_needed_while_other_patterns_were_planned(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compile target rendered by a `plan //...` (its trace not needed: its lowering and compile cached), then a
    compile of the same model added in another package and only that package planned (the trace needed there; the
    target not in that plan), then `plan //...` again: the target's rows show the trace to build, as a batch `plan`
    shows them, although the trace's status did not change between the last two plans."""
    from neuronbuild import incremental
    from neuronbuild.context import make_context

    ws = tmp_path / "ws"
    gen_monorepo.generate(ws, 4, 1, 1)
    monkeypatch.chdir(ws)
    cache_dir = tmp_path / "cache"

    def same(patterns: tuple[str, ...] = ("//...",)) -> tuple[list[str], Any]:
        time.sleep(0.05)  # out of the racy window of the last change
        (wr, ag), (fr, _ag) = _plan_report(cache_dir, True, patterns), _plan_report(cache_dir, False, patterns)
        assert wr.lines() == fr.lines()
        return wr.lines(), ag

    incremental.keep_in_memory(True)
    try:
        _lines, ag = same()
        pkg = gen_monorepo.package_name(1)
        ct = next(ct for ct in ag.compiles if ct.label.package == pkg)
        compile_ = ag.actions[ct.buckets[0][1]]
        lower = ag.actions[compile_.deps[0]]
        out = tmp_path / "out"
        out.mkdir()
        cache = make_context(cache_dir=str(cache_dir)).open_cache()
        for a in (lower, compile_):  # (not the trace: it is not needed then)
            for name in a.outputs:
                (out / name).write_bytes(f"{a.fingerprint} {name}".encode())
            cache.store_outputs(a.fingerprint, a.identity, dict(a.record), out, a.outputs, 1.0, {})
        lines, ag = same()
        row = next(i for i, ln in enumerate(lines) if ln.startswith(str(ct.label))) + 2
        bucket = str(ct.buckets[0][0])

        def cells(ln: str) -> list[str]:  # (the trace's and the compile's status)
            return ln.split(bucket, 1)[1].split()[:2]

        assert cells(lines[row]) == ["-", "cached"]
        # another package: the same compile as the target's (the same actions) and one with other options (another
        # lowering of the same trace): planned alone, the trace is needed and the target's compile cached
        same_compile = next(ln for ln in (ws / pkg / "BUILD").read_text().splitlines()
                            if ln.startswith("neuron_compile(")).replace('":m"', f'"//{pkg}:m"')
        (ws / "other").mkdir()
        (ws / "other" / "BUILD").write_text(
            same_compile.replace('":shapes"', f'"//{pkg}:shapes"') + "\n" +
            f'neuron_compile(name = "extra", model = "//{pkg}:m", buckets = ["//{pkg}:shapes"], '
            'target = "//common:trn2", options = "//common:fast")\n')
        other, _ag = same(("//other/...",))
        assert any(ln.split()[-4:-2] == ["build", "cached"] for ln in other), other
        lines, ag = same()
        assert ag.compiles[[c.label for c in ag.compiles].index(ct.label)] is ct  # (replayed: kept)
        assert cells(lines[row]) == ["build", "cached"]
    finally:
        incremental.keep_in_memory(False)


def test_output_larger_than_a_frame_reaches_the_client_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """One write larger than the protocol's frame limit (`plan --output json` prints ~100 MB in one write at 100,000
    graphs: the client refused the frame and reported the server dead) is sent as several frames, in order, with
    stdout and stderr interleaved as written; every frame is below the limit the client enforces."""
    import socket
    import threading

    from neuronbuild.server import protocol
    from neuronbuild.server.daemon import Outbox

    monkeypatch.setattr(protocol, "MAX_FRAME", 1 << 20)  # (the client's limit, scaled down with the frame size)
    monkeypatch.setattr(Outbox, "FRAME_CHARS", 64 << 10)
    a, b = socket.socketpair()
    big = "".join(f"{i} é\\n" for i in range(200_000))  # ~2 MB, non-ASCII and escapes included
    writes = [("o", big), ("e", "note\n"), ("o", big[:1000]), ("o", "end\n")]
    got: list[tuple[str, str]] = []

    def read() -> None:
        while True:
            try:
                msg = protocol.recv(b)
            except EOFError:
                return
            got.append((msg["t"], msg["d"]))

    reader = threading.Thread(target=read)
    reader.start()
    out = Outbox(a)
    for kind, text in writes:
        out.write(kind, text)
    out.close()
    a.close()
    reader.join(30)
    assert len(got) > 3 and all(len(d) <= Outbox.FRAME_CHARS for _k, d in got)
    joined: list[tuple[str, str]] = []
    for kind, d in got:
        if joined and joined[-1][0] == kind:
            joined[-1] = (kind, joined[-1][1] + d)
        else:
            joined.append((kind, d))
    assert joined == [("o", big), ("e", "note\n"), ("o", big[:1000] + "end\n")]


def test_a_large_write_is_sent_while_the_command_goes_on() -> None:
    """A write of more than a batch is handed to the Outbox's thread: the command continues (the server computes
    `plan`'s summary while its 7 MB matrix travels) though the client has not read it yet; everything arrives, in
    order, once the client reads."""
    import socket
    import threading

    from neuronbuild.server import protocol
    from neuronbuild.server.daemon import Outbox

    a, b = socket.socketpair()
    a.settimeout(5.0)  # (a send waiting longer for the reader fails: the output is then lost, not hung)
    big = "x" * (4 << 20)  # (far more than the socket's buffer: a send in the writer would wait for the reader)
    out = Outbox(a)
    out.write("o", big)  # (no reader yet: a write that sent itself would wait for one, time out and lose the output)
    got: list[str] = []

    def read() -> None:
        while True:
            try:
                got.append(protocol.recv(b)["d"])
            except EOFError:
                return

    reader = threading.Thread(target=read)
    reader.start()
    out.write("o", "summary\n")
    out.close()
    a.close()
    reader.join(30)
    assert "".join(got) == big + "summary\n"


def test_a_collection_between_commands_waits_for_memory_growth_and_a_quick_one_is_made_when_idle() -> None:
    """At 100,000 graphs a full collection took seconds and a command arriving meanwhile waited for it (after 8
    commands in a row, or after an idle pause of 5 s to edit), although a re-plan leaves ~9 MiB of garbage; at 1,000
    graphs the 9th of ten no-ops back to back waited 0.5-0.8 s for a quick one."""
    import gc

    from neuronbuild.server.warm import WarmState

    w = WarmState()
    assert not w.collect_due(idle=True)  # nothing ran since
    w.pending = 1
    assert w.collect_due(idle=True) is (gc.get_freeze_count() < w.GC_QUICK_OBJECTS)  # before the first: by what is kept
    w.last_gc_s, w.rss_after_gc_kib = 0.01, 200_000  # collections are quick
    assert w.collect_due(idle=True, rss=200_000)
    w.pending = 50
    assert not w.collect_due(rss=200_000)  # between back-to-back commands: not for a quick one either
    w.last_gc_s, w.rss_after_gc_kib = 3.0, 1_000_000  # a slow one, 1 GB kept
    for idle in (True, False):
        assert not w.collect_due(idle=idle, rss=1_100_000)  # +10 %: no command waits seconds for it
        assert w.collect_due(idle=idle, rss=1_000_000 + int(w.GC_GROWTH * 1_000_000) + 1)  # +25 %: bounded
    for w.last_gc_s in (3.0, 0.01):
        w.rss_after_gc_kib = 200_000  # a small server: 25 % is under the floor
        assert not w.collect_due(rss=200_000 + w.GC_GROWTH_MIN_KIB - 1)
        assert w.collect_due(rss=200_000 + w.GC_GROWTH_MIN_KIB)  # back to back, memory stays bounded


def test_the_collection_rule_counts_the_kept_objects_only_when_that_decides_and_answers_as_counting_always(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Counting the kept (frozen) objects walks them all (0.26 s for 5.2 M at 100,000 graphs, after every command,
    so a back-to-back re-plan waited for it): the rule counts them only when the answer depends on it, and answers
    as the rule counting them every time does."""
    import gc
    import itertools

    from neuronbuild.server.warm import WarmState

    kept = [0]
    counted = [0]

    def count() -> int:
        counted[0] += 1
        return kept[0]

    monkeypatch.setattr(gc, "get_freeze_count", count)

    def always(w: WarmState, idle: bool, rss: int) -> bool:  # (the rule, counting every time)
        if not w.pending:
            return False
        quick = kept[0] < w.GC_QUICK_OBJECTS if w.last_gc_s is None else w.last_gc_s <= w.GC_QUICK_S
        grown = rss - w.rss_after_gc_kib >= max(w.GC_GROWTH_MIN_KIB, w.GC_GROWTH * w.rss_after_gc_kib)
        return grown or (idle and quick)

    w = WarmState()
    for pending, last, base, objects, idle, rss in itertools.product(
            (0, 1, 8, 50), (None, 0.01, 3.0), (0, 200_000, 1_000_000), (10, 10_000_000), (False, True),
            (200_000, 400_000, 1_100_000, 1_300_000)):
        w.pending, w.last_gc_s, w.rss_after_gc_kib, kept[0] = pending, last, base, objects
        assert w.collect_due(idle=idle, rss=rss) is always(w, idle, rss), (pending, last, base, objects, idle, rss)
    # between back-to-back commands (not idle, not grown): nothing counted, however many came in a row
    for w.pending in (1, 8, 50):
        w.last_gc_s, w.rss_after_gc_kib, kept[0] = None, 1_000_000, 10_000_000
        counted[0] = 0
        assert not w.collect_due(rss=1_050_000)
        assert counted[0] == 0


def test_a_big_servers_first_warm_command_does_not_wait_for_a_collection_of_what_its_cold_start_built() -> None:
    """At 100,000 graphs the first warm command after a cold start waited 6.9 s for a collection: before any, all of
    the server's RSS counted as growth. Growth counts from the end of the first command instead."""
    from neuronbuild.execution.resources import rss_kib
    from neuronbuild.server.warm import WarmState

    w = WarmState()
    w.GC_QUICK_OBJECTS = 0  # (as at 100,000 graphs: more objects kept than a quick collection scans)
    with w.active():
        pass  # the cold first command
    base = w.rss_after_gc_kib
    assert base >= rss_kib() // 2 > 0
    with w.active():
        pass
    assert not w.collect_due(rss=base + w.GC_GROWTH_MIN_KIB - 1)  # the next command does not wait for a collection
    assert not w.collect_due(idle=True, rss=base + w.GC_GROWTH_MIN_KIB - 1)
    assert w.collect_due(rss=max(base + w.GC_GROWTH_MIN_KIB, int(base * (1 + w.GC_GROWTH)) + 1))  # still bounded
