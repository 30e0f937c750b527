"""Each action runs in its own pid and mount namespaces with a private /proc, and with its own $HOME and $TMPDIR
(issue #31): it sees no process but its own (not the cmdline, comm, stat or status of any other), whatever it forks
ends with it (a daemon that left the session and cleared its parent-death signal included), nothing it leaves in
$HOME or $TMPDIR is seen by the next action, it can neither write the machine's shared scratch dir nor open the lock
files of the precompiled headers there (holding one would stall every warm-up).

These run worker.run_isolated, the worker's own code path, from the test process with the action replaced by a probe
(run_action monkeypatched: the forked processes run it), confined by the real policy."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from neuronbuild.execution import confine_ns, limits, worker
from neuronbuild.execution.confine import confine, installation_roots


def _namespaces_allowed() -> bool:
    """Whether this machine lets a process enter pid and mount namespaces (a forked probe)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0 if confine_ns.enter() is None else 1)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


needs_namespaces = pytest.mark.skipif(not _namespaces_allowed(), reason="namespaces are refused here")


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, probe: Callable[[], dict[str, Any]],
         spec: dict[str, Any] | None = None, name: str = "a") -> dict[str, Any]:
    """One action through run_isolated whose work is `probe`, run confined; returns its result."""
    base = tmp_path / f"sandbox-{name}"
    (base / "in").mkdir(parents=True)
    (base / "out").mkdir()
    log = tmp_path / f"{name}.log"

    def fake_run_action(kind: str, spec: dict[str, Any], inputs: str, outputs: str, log_path: str,
                        expect: Any = None, policy: Any = None, notes: Any = ()) -> dict[str, Any]:
        with open(log_path, "a", encoding="utf-8") as f:
            f.writelines(f"neuronbuild: {n}\n" for n in notes)
        assert policy is not None
        confine(policy)
        os.chdir(inputs)
        return {"ok": True, "metadata": probe()}

    monkeypatch.setattr(worker, "run_action", fake_run_action)
    msg = {"kind": "weights", "spec": spec or {"step": "weights"}, "inputs": str(base / "in"),
           "outputs": str(base / "out"), "log": str(log)}
    res = worker.run_isolated(msg, installation_roots())
    assert res["ok"], (res, log.read_text() if log.exists() else "")
    return dict(res["metadata"])


def _comms() -> dict[int, str]:
    out = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                out[int(p)] = Path(f"/proc/{p}/comm").read_text().strip()
            except OSError:
                pass
    return out


@needs_namespaces
def test_an_action_sees_only_its_own_processes_and_nothing_it_forks_outlives_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token = f"nbd{os.getpid() % 100000}"  # the daemon's name (comm: at most 15 characters)
    outer = os.getpid()  # this test process (the action's worker here): outside the action's namespace

    def probe() -> dict[str, Any]:
        seen = {str(p): c for p, c in _comms().items()}
        got = {}
        for what in ("cmdline", "comm", "stat", "status"):
            try:
                Path(f"/proc/{outer}/{what}").read_bytes()
                got[what] = "read"
            except OSError:
                got[what] = "absent"
        status = Path("/proc/self/status").read_text()  # its own /proc works (g++, inductor read it)
        own = int(next(ln for ln in status.splitlines() if ln.startswith("Pid:")).split()[1])
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # a daemon: leaves the session, forks again, clears its parent-death signal, sleeps
            os.setsid()
            if os.fork() == 0:
                libc = ctypes.CDLL(None)
                libc.prctl(1, 0, 0, 0, 0)  # PR_SET_PDEATHSIG 0
                libc.prctl(15, token.encode(), 0, 0, 0)  # PR_SET_NAME
                os.write(w, b"x")
                while True:
                    time.sleep(0.2)
            os._exit(0)
        os.waitpid(pid, 0)
        os.read(r, 1)
        return {"seen": seen, "outer": got, "pid": os.getpid(), "own": own}

    got = _run(tmp_path, monkeypatch, probe)
    assert got["own"] == got["pid"]
    # Only the namespace's init (pid 1) and the action itself: no sibling, worker, build process or shell.
    assert sorted(int(p) for p in got["seen"]) == [1, got["pid"]], got["seen"]
    assert got["outer"] == {w: "absent" for w in ("cmdline", "comm", "stat", "status")}, got["outer"]
    left = [p for p, c in _comms().items() if c == token]
    deadline = time.monotonic() + 30
    while left and time.monotonic() < deadline:  # (the kernel ends them as the namespace's init exits)
        time.sleep(0.1)
        left = [p for p, c in _comms().items() if c == token]
    for p in left:
        os.kill(p, 9)
    assert not left, "a daemon the action started outlived it"


def test_an_actions_home_and_tmpdir_are_its_own_and_the_shared_ones_are_not_writable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shared_tmp, shared_home = tmp_path / "v1" / "toolchain-tmp", tmp_path / "v1" / "home"
    shared_tmp.mkdir(parents=True)
    shared_home.mkdir()
    monkeypatch.setenv("TMPDIR", str(shared_tmp))  # as a worker's action environment has them
    monkeypatch.setenv("HOME", str(shared_home))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(shared_tmp / "torchinductor_x"))  # what torch derives from it

    def probe() -> dict[str, Any]:
        home, tmp = Path(os.environ["HOME"]), Path(tempfile.gettempdir())
        found = sorted(p.name for d in (home, tmp) for p in d.iterdir())
        (home / ".cache").mkdir()
        (home / ".cache" / "left-by-an-action").write_text("x")
        (tmp / "left-by-an-action").write_text("x")
        shared = []
        for d in (shared_tmp, shared_home):
            try:
                (d / "planted").write_text("x")
                shared.append("written")
            except PermissionError:
                shared.append("refused")
        return {"home": str(home), "tmp": str(tmp), "env_tmp": os.environ["TMPDIR"], "found": found,
                "shared": shared, "inductor": os.environ["TORCHINDUCTOR_CACHE_DIR"]}

    first = _run(tmp_path, monkeypatch, probe, name="a")
    second = _run(tmp_path, monkeypatch, probe, name="b")
    assert second["found"] == [] and first["found"] == [], (first, second)  # nothing the first left is seen
    for got, name in ((first, "a"), (second, "b")):
        assert got["home"] == str(tmp_path / f"sandbox-{name}" / "home")
        assert got["tmp"] == got["env_tmp"] == str(tmp_path / f"sandbox-{name}" / "tmp")
        assert got["inductor"] == str(tmp_path / f"sandbox-{name}" / "tmp" / "torchinductor_x")
        assert got["shared"] == ["refused", "refused"], got
    assert sorted(p.name for d in (shared_tmp, shared_home) for p in d.iterdir()) == []


def test_an_action_cannot_open_the_precompiled_headers_lock_files(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor's per-header lock files: a warm-up (in the worker) waits for each; an action that could open one (even
    read-only: flock needs no write right) could hold it and stall every warm-up of the machine."""
    pytest.importorskip("torch")
    from neuronbuild.toolchains import compile as cc

    shared_tmp = tmp_path / "v1" / "toolchain-tmp"
    shared_tmp.mkdir(parents=True)
    monkeypatch.setenv("TMPDIR", str(shared_tmp))
    monkeypatch.delenv("NEURONBUILD_SHARED_TMPDIR", raising=False)
    tempfile.tempdir = None
    try:
        locks = cc.header_lock_dir()  # where the worker's warm-up takes them
        headers = cc.header_dir()
        locks.mkdir(parents=True)
        (locks / "abc.lock").write_text("")
    finally:
        tempfile.tempdir = None

    def probe() -> dict[str, Any]:
        import fcntl

        try:
            fd = os.open(locks / "abc.lock", os.O_RDONLY)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held = "held"
        except PermissionError:
            held = "refused"
        return {"held": held, "locks": str(cc.header_lock_dir()), "headers": str(cc.header_dir())}

    got = _run(tmp_path, monkeypatch, probe, spec={"toolchain": "cpu", "step": "compile", "isa": "x86-64"})
    assert got["held"] == "refused", got
    assert got["locks"] == str(locks) and got["headers"] == str(headers), got  # the same dirs as the warm-up's


# Device nodes no action uses, harmless to open read-only (no watchdog, nothing that starts anything).
_OTHER_DEVICES = ("/dev/kvm", "/dev/vcs", "/dev/vcsa", "/dev/loop-control", "/dev/hwrng", "/dev/btrfs-control",
                  "/dev/vga_arbiter", "/dev/userfaultfd", "/dev/fuse", "/dev/ptmx", "/dev/kmsg", "/dev/mem")


def _other_devices() -> list[str]:
    """Devices outside confine.DEV_NODES this process may open read-only: the list above and the machine's block
    devices (its disks: /sys/block)."""
    names = [*_OTHER_DEVICES]
    with contextlib.suppress(OSError):
        names += [f"/dev/{b}" for b in sorted(os.listdir("/sys/block"))]
    out = []
    for d in names:
        try:
            fd = os.open(d, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
        except OSError:
            continue
        os.close(fd)
        out.append(d)
    return out


def test_an_action_opens_no_device_but_the_few_it_uses_and_changes_nothing_in_dev(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As root an action owns every node of /dev: a rule allowing all of /dev let it read and write the machine's
    block devices (every file on a disk, past every other rule), open /dev/kvm or a console's screen, and create or
    remove entries of /dev (the machine's /dev/null). The kernel (Landlock) must refuse all but null, zero, full,
    random, urandom, tty and /dev/shm; opened through libc, not Python (whose audit hook refuses them too)."""
    devices = _other_devices()
    if not devices:
        pytest.skip("no device outside the actions' ones can be opened here")
    probe_name, shm_name = f"/dev/nb-probe-{os.getpid()}", f"/dev/shm/nb-probe-{os.getpid()}"

    def probe() -> dict[str, Any]:
        libc = ctypes.CDLL(None, use_errno=True)

        def c_open(path: str, flags: int) -> str:
            fd = libc.open(path.encode(), ctypes.c_int(flags | os.O_NONBLOCK | os.O_NOCTTY), ctypes.c_int(0o600))
            if fd < 0:
                return os.strerror(ctypes.get_errno())
            os.close(fd)
            return "opened"

        return {"others": {d: c_open(d, os.O_RDONLY) for d in devices},
                "others_rw": {d: c_open(d, os.O_RDWR) for d in devices},
                "create": c_open(probe_name, os.O_CREAT | os.O_WRONLY),
                "null": c_open("/dev/null", os.O_RDWR), "urandom": c_open("/dev/urandom", os.O_RDONLY),
                "shm": c_open(shm_name, os.O_CREAT | os.O_RDWR)}

    try:
        got = _run(tmp_path, monkeypatch, probe)
    finally:
        for left in (probe_name, shm_name):
            with contextlib.suppress(OSError):
                os.unlink(left)
    assert set(got["others"].values()) | set(got["others_rw"].values()) == {"Permission denied"}, got
    assert got["create"] == "Permission denied", got
    assert got["null"] == got["urandom"] == got["shm"] == "opened", got


@needs_namespaces
def test_what_an_action_leaves_in_dev_shm_is_its_own_and_ends_with_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """/dev/shm (POSIX shared memory, semaphores: writable by every action) is a fresh tmpfs in each action's mount
    namespace: nothing one action leaves there is seen by the next, nor stays on the machine (the machine's /dev/shm
    is memory: an action could otherwise fill it for good)."""
    name = f"nb-left-{os.getpid()}"

    def probe() -> dict[str, Any]:
        found = sorted(os.listdir("/dev/shm"))
        with open(f"/dev/shm/{name}", "w") as f:
            f.write("left by an action")
        return {"found": found}

    try:
        first = _run(tmp_path, monkeypatch, probe, name="a")
        second = _run(tmp_path, monkeypatch, probe, name="b")
        left = os.path.exists(f"/dev/shm/{name}")
    finally:
        with contextlib.suppress(OSError):
            os.unlink(f"/dev/shm/{name}")
    assert name not in second["found"] and name not in first["found"], (first, second)
    assert not left, "what an action wrote to /dev/shm outlived it, on the machine's /dev/shm"


def test_the_namespaces_work_for_a_non_root_user(tmp_path: Path) -> None:
    """The namespace path as uid 65534 (a user namespace owns the pid and mount namespaces): the action sees only
    its own processes, a read-only bind mount refuses chmod, and a signal death is reported as such."""
    python = shutil.which("python3", path="/usr/bin:/bin")
    setpriv = shutil.which("setpriv")
    if os.getuid() != 0 or python is None or setpriv is None:
        pytest.skip("needs root, setpriv and a system python3 another user can run")
    d = Path(tempfile.mkdtemp(prefix="nb-ns-", dir="/tmp"))
    try:
        (d / "pkg").mkdir()
        shutil.copy(confine_ns.__file__, d / "pkg" / "confine_ns.py")
        ro = d / "ro"
        ro.mkdir()
        (ro / "big").write_text("weights")
        for p in (d, d / "pkg", d / "pkg" / "confine_ns.py", ro):
            os.chmod(p, 0o755)
        os.chown(ro / "big", 65534, 65534)
        os.chmod(ro / "big", 0o444)
        script = NON_ROOT.replace("RO", repr(str(ro)))
        proc = subprocess.run([setpriv, "--reuid", "65534", "--regid", "65534", "--clear-groups", python, "-I",
                               "-c", script], cwd=d / "pkg", env={"PATH": "/usr/bin:/bin"},
                              capture_output=True, text=True, timeout=60)
        if proc.returncode == 3:
            pytest.skip(f"unprivileged user namespaces are refused here: {proc.stdout.strip()}")
        assert proc.returncode == -9, proc.stdout + proc.stderr  # the action's process died by SIGKILL
        assert proc.stdout.split() == ["uid=65534", "pids=[1,", "2]", "chmod=EROFS"], proc.stdout
        assert (ro / "big").stat().st_mode & 0o777 == 0o444
    finally:
        shutil.rmtree(d, ignore_errors=True)


NON_ROOT = r'''
import errno, os, sys
sys.path.insert(0, os.getcwd())
import confine_ns

why = confine_ns.enter()
if why is not None:
    print(why)
    sys.exit(3)
r, w = os.pipe()
init = os.fork()
if init == 0:
    problems = [x for x in (confine_ns.private_proc(), confine_ns.read_only_bind(RO)) if x]
    child = os.fork()
    if child == 0:
        try:
            os.chmod(os.path.join(RO, "big"), 0o666)
            ch = "changed"
        except OSError as e:
            ch = errno.errorcode[e.errno]
        pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
        os.write(w, f"uid={os.getuid()} pids={pids} chmod={ch} {' '.join(problems)}".encode())
        os.kill(os.getpid(), 9)
    os._exit(confine_ns.init_wait(child))
os.close(w)
out = os.read(r, 1000).decode()
code = os.waitstatus_to_exitcode(os.waitpid(init, 0)[1])
print(out, flush=True)
confine_ns.reraise(128 - code if code < 0 else code)  # as the worker's child relays it (no fork here: the namespace
# this process forks into has ended with its init)
'''


BUILTIN_HOME = r'''
import json, os, sys
from pathlib import Path

base = Path(sys.argv[1])
os.environ["HOME"], os.environ["TMPDIR"] = str(base / "v1" / "home"), str(base / "v1" / "tmp")
from neuronbuild.execution import worker
from neuronbuild.execution.confine import confine, installation_roots

msg = {"kind": "trace", "spec": {"model": {"entry": "neuronbuild.toolchains.hf_causal_lm:context"}},
       "inputs": str(base / "sandbox" / "in"), "outputs": str(base / "sandbox" / "out"), "log": str(base / "a.log")}
worker.import_builtin_factory(msg)  # as serve() does before the fork
imported = "neuronbuild.toolchains.hf_causal_lm" in sys.modules


def probe(kind, spec, inputs, outputs, log_path, expect=None, policy=None, notes=()):
    confine(policy)
    from huggingface_hub import constants

    return {"ok": True, "metadata": {"hf_home": constants.HF_HOME, "token": constants.HF_TOKEN_PATH,
                                     "home": os.environ["HOME"]}}


worker.run_action = probe
res = worker.run_isolated(msg, installation_roots())
print(json.dumps({"imported": imported, **res}))
'''


def test_a_builtin_factory_the_worker_imported_finds_its_caches_under_the_actions_own_home(tmp_path: Path) -> None:
    """hf_causal_lm (transformers, huggingface_hub) is imported by the worker before the fork
    (worker.import_builtin_factory): the paths huggingface_hub derived from the worker's $HOME at import are the
    action's own $HOME's in the action's process, as if it had imported them itself (the worker's is not its to use)."""
    pytest.importorskip("transformers")
    for d in ("v1/home", "v1/tmp", "sandbox/in", "sandbox/out"):
        (tmp_path / d).mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "XDG_"))}
    proc = subprocess.run([sys.executable, "-c", BUILTIN_HOME, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["imported"] and got["ok"], got
    home = got["metadata"]["home"]
    assert home == str(tmp_path / "sandbox" / "home"), got
    assert got["metadata"]["hf_home"] == f"{home}/.cache/huggingface", got
    assert got["metadata"]["token"] == f"{home}/.cache/huggingface/token", got


@needs_namespaces
def test_a_prepared_action_process_runs_the_next_action_alone_and_nothing_of_it_is_left(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """#53: a worker forks the next action's processes while it idles (worker.prepare); the action dispatched next
    runs in them (the prepared init is its pid 1: the result's action_pid), in namespaces of its own (not the
    previous action's), seeing no process of the next prepared one; afterwards, and once a prepared process is
    discarded, this process has no child left."""
    if os.getuid() != 0:
        pytest.skip("processes are prepared ahead for a root worker only (a non-root one forks at dispatch)")
    installation = installation_roots()

    def probe() -> dict[str, Any]:
        return {"ns": os.readlink("/proc/self/ns/pid"), "mnt": os.readlink("/proc/self/ns/mnt"),
                "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit())}

    def children() -> list[int]:
        return limits.children(os.getpid())

    monkeypatch.setattr(worker, "FREEZE", [False])
    seen, held = [], []
    for name in ("a", "b"):
        def fake_run_action(kind: str, spec: dict[str, Any], inputs: str, outputs: str, log_path: str,
                            expect: Any = None, policy: Any = None, notes: Any = ()) -> dict[str, Any]:
            confine(policy)
            return {"ok": True, "metadata": probe()}

        monkeypatch.setattr(worker, "run_action", fake_run_action)
        prep = worker.prepare(installation)
        assert prep is not None and children() == [prep.pid]
        assert worker.prepare(installation) is prep  # (one at a time)
        # hold its namespaces open until the end: the kernel numbers a namespace with the lowest free id, so a dead
        # action's number could come back for the next one (ci81) and the comparison below would prove nothing
        deadline = time.monotonic() + 30
        while os.readlink(f"/proc/{prep.pid}/ns/mnt") == os.readlink("/proc/self/ns/mnt"):  # (its own, once set up)
            assert time.monotonic() < deadline, "the prepared init never entered its own mount namespace"
            time.sleep(0.01)
        held += [os.open(f"/proc/{prep.pid}/ns/{ns}", os.O_RDONLY) for ns in ("pid", "mnt")]
        # the prepared one waits: it runs nothing before its action comes (its init and the action's process)
        base = tmp_path / f"sandbox-{name}"
        (base / "in").mkdir(parents=True)
        (base / "out").mkdir()
        msg = {"kind": "weights", "spec": {"step": "weights"}, "inputs": str(base / "in"),
               "outputs": str(base / "out"), "log": str(tmp_path / f"{name}.log")}
        res = worker.run_isolated(msg, installation)
        assert res["ok"], res
        assert res["action_pid"] == prep.pid
        assert res["metadata"]["pids"] == [1, 2]  # its init and itself: no other action's, no prepared one's
        seen.append(res["metadata"])
        worker.end_descendants()
        assert children() == []
    assert seen[0]["ns"] != seen[1]["ns"] and seen[0]["mnt"] != seen[1]["mnt"]
    for fd in held:
        os.close(fd)
    prep = worker.prepare(installation)
    assert prep is not None and children() == [prep.pid]
    worker.discard_prepared()
    assert children() == [] and not worker._PREPARED


@needs_namespaces
def test_nothing_an_action_started_still_writes_once_its_result_is_handed_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """#53: the worker's loop hands a prepared action's result on before its init's exit has ended (run_isolated's
    `defer`); by then the init has killed and reaped every process of the namespace, so a daemon the action left
    (its own session, SIGTERM ignored) writes nothing more into its outputs, which the build then hashes and stores."""
    if os.getuid() != 0:
        pytest.skip("processes are prepared ahead for a root worker only (a non-root one forks at dispatch)")
    import signal

    def fake_run_action(kind: str, spec: dict[str, Any], inputs: str, outputs: str, log_path: str,
                        expect: Any = None, policy: Any = None, notes: Any = ()) -> dict[str, Any]:
        confine(policy)
        if os.fork() == 0:
            os.setsid()
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            while True:
                with open(os.path.join(outputs, "tick"), "a") as f:
                    f.write("x")
                time.sleep(0.001)
        while not os.path.exists(os.path.join(outputs, "tick")):
            time.sleep(0.001)
        return {"ok": True, "metadata": {}}

    monkeypatch.setattr(worker, "FREEZE", [False])
    monkeypatch.setattr(worker, "run_action", fake_run_action)
    base = tmp_path / "sandbox"
    (base / "in").mkdir(parents=True)
    (base / "out").mkdir()
    msg = {"kind": "weights", "spec": {"step": "weights"}, "inputs": str(base / "in"), "outputs": str(base / "out"),
           "log": str(tmp_path / "a.log")}
    assert worker.prepare(installation_roots()) is not None
    try:
        res = worker.run_isolated(msg, installation_roots(), defer=True)
        assert res["ok"], res
        size = (base / "out" / "tick").stat().st_size
        time.sleep(0.2)
        assert (base / "out" / "tick").stat().st_size == size, "a process of the action wrote after its result"
    finally:
        worker.reap_deferred()
        worker.end_descendants()
    assert limits.children(os.getpid()) == []
