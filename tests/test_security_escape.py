"""Model code and workspace files never run anything outside the sandbox: no pickle reaches a process that trusts it
(every channel between the build process, its workers and an action's child carries JSON), an action's child holds
no descriptor of its worker's, and the build server imports nothing from the workspace (issue #31)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import _ENV_AT_START, named, run_cli, running, user_signals, write_ws

from neuronbuild.execution import channel

# A model that writes a pickle whose unpickling runs a shell command (which leaves a marker file outside the sandbox)
# into every pipe and socket it holds, framed as multiprocessing.connection frames a pickled message (a length, then
# the bytes); also as its own result. Any process that unpickled it would write the marker.
PICKLER = '''import os
import pickle
import stat
import struct

import torch


class Payload:
    def __reduce__(self):
        return (os.system, ("touch " + MARKER + "-$$",))


def _frames():
    data = pickle.dumps(Payload())
    return struct.pack("!i", len(data)) + data


def build(config):
    global MARKER
    MARKER = config["marker"]
    frame = _frames()
    reached = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            mode = os.fstat(fd).st_mode
        except OSError:
            continue
        if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
            continue
        try:
            os.set_blocking(fd, False)
            os.write(fd, frame * 4)
            reached.append(fd)
        except OSError:
            pass
    with open("reached.txt", "w") as f:  # in the sandbox (the action's cwd)
        f.write(repr(reached))
    return torch.nn.Linear(4, 3)
'''


def _one_model_ws(root: Path, src: str, config: dict[str, str]) -> Path:
    build = (f'neuron_model(name = "m", srcs = ["m.py"], entry = "m:build", inputs = {{"x": "float32[b, 4]"}},\n'
             f'             config = {json.dumps(config)})\n'
             'neuron_buckets(name = "bk", shapes = [{"b": 1}])\n'
             'neuron_target(name = "t", platform = "trn2")\n'
             'neuron_compile(name = "c", model = ":m", buckets = [":bk"], target = ":t")\n')
    return write_ws(root, {"pkg/BUILD": build, "pkg/m.py": src})


@pytest.mark.parametrize("jobs", ["1", "2"])  # one spawned worker; two forked from a zygote
def test_a_models_pickle_payload_written_to_every_descriptor_it_holds_runs_nowhere(tmp_path: Path, jobs: str) -> None:
    marker = tmp_path / "pwned"
    ws = _one_model_ws(tmp_path / "ws", PICKLER, {"marker": str(marker)})
    proc = run_cli(["--batch", "build", "//pkg:all", "--jobs", jobs, "--cache-dir", str(tmp_path / "cache")], ws)
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list(tmp_path.glob("pwned*")), "a pickle written by model code was unpickled outside the sandbox"


FD_LISTER = '''import os


def build(config):
    held = []
    for name in os.listdir("/proc/self/fd"):
        try:
            held.append((int(name), os.readlink(f"/proc/self/fd/{name}")))
        except OSError:  # the descriptor that listed the directory, closed since
            pass
    raise RuntimeError("FDS " + repr(sorted(held)))
'''


def test_an_action_child_holds_no_descriptor_but_its_result_pipe_and_stdio(tmp_path: Path) -> None:
    src = FD_LISTER
    ws = _one_model_ws(tmp_path / "ws", src, {"marker": str(tmp_path / "pwned")})
    proc = run_cli(["--batch", "build", "//pkg:all", "--jobs", "1", "--cache-dir", str(tmp_path / "cache")], ws)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = next(x for x in proc.stderr.splitlines() if "FDS " in x)
    held = re.findall(r"\((\d+), '([^']*)'\)", line.split("FDS ", 1)[1])
    assert held and held[0] == ("0", "/dev/null"), line
    # stdio (0: /dev/null; 1 and 2: the action's log), what run_action opened to redirect them, and the result pipe:
    # nothing of the worker's (its pipes to the build process, its pidfds, its own log).
    channels = [t for _fd, t in held if t.startswith(("pipe:", "socket:", "anon_inode:"))]
    assert len(channels) == 1, line  # its own result pipe
    assert not any(t.endswith("workers.log") for _fd, t in held), line
    assert not list(tmp_path.glob("pwned*"))


def test_a_malformed_message_is_refused_not_run(tmp_path: Path) -> None:
    import pickle
    import struct
    import threading
    from multiprocessing.connection import Connection

    class Payload:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    r, w = os.pipe()
    data = pickle.dumps(Payload())
    deep = b"[" * 100_000 + b"]" * 100_000
    frames = [struct.pack("!i", len(data)) + data, struct.pack("!i", len(deep)) + deep,
              struct.pack("!i", 9) + b'["list"]\n', struct.pack("!i", channel.MAX_MESSAGE + 1)]
    writer = threading.Thread(target=lambda: [os.write(w, f) for f in frames])
    writer.start()
    with Connection(r, writable=False) as conn:
        for expected in ("not JSON", "nested deeper than", "a list, not an object", "unreadable"):
            with pytest.raises(channel.BadMessage, match=expected):
                channel.recv(conn)
    writer.join()
    os.close(w)
    assert not (tmp_path / "pwned").exists()


# Modules a cloned repository could hold at its root, shadowing what the build server imports after it changes to the
# client's directory (the standard library's and a dependency's).
SHADOWS = ("argparse", "difflib", "networkx", "wsplug")
SHADOW_SRC = 'open({marker!r} + "-" + __name__, "w").close()\n'


@pytest.fixture
def server_env(tmp_path: Path):  # type: ignore[no-untyped-def]
    env = {"NEURONBUILD_NO_SERVER": "", "NEURONBUILD_OUTPUT_USER_ROOT": str(tmp_path / "ob")}
    yield env
    for ws in tmp_path.glob("ws*"):
        run_cli(["shutdown"], ws, env, ("-P",))


def test_the_build_server_imports_nothing_from_the_workspace(tmp_path: Path, server_env: dict[str, str]) -> None:
    marker = str(tmp_path / "pwned")
    files = {f"{m}.py": SHADOW_SRC.format(marker=marker) for m in SHADOWS}
    ws = _one_model_ws(tmp_path / "ws", "import torch\n\n\ndef build(config):\n    return torch.nn.Linear(4, 3)\n", {})
    write_ws(ws, files)
    cache = str(tmp_path / "cache")
    # The client runs with -P (its own sys.path holds no cwd entry), as the `neuronbuild` script does.
    proc = run_cli(["build", "//pkg:all", "--cache-dir", cache], ws, server_env, ("-P",))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    info = run_cli(["info", "--output", "json"], ws, server_env, ("-P",))
    assert info.returncode == 0 and json.loads(info.stdout)["pid"], info.stderr  # it ran through a server
    assert not list(tmp_path.glob("pwned*")), "the build server imported a module from the workspace"

    # A plug-in named in $NEURONBUILD_PLUGINS is found as in batch mode: never in the workspace.
    env = {**server_env, "NEURONBUILD_PLUGINS": "wsplug"}
    batch = run_cli(["--batch", "build", "//pkg:all", "--cache-dir", cache], ws, env, ("-P",))
    served = run_cli(["build", "//pkg:all", "--cache-dir", cache], ws, env, ("-P",))
    for p in (batch, served):
        assert p.returncode == 2, p.stdout + p.stderr
        assert "cannot import plug-in module 'wsplug'" in p.stderr and "Traceback" not in p.stderr
    assert not list(tmp_path.glob("pwned*")), "a plug-in was imported from the workspace"


# A model that tries to reach out: the build server's socket (a pathname Unix socket), any listening TCP port on
# 127.0.0.1, and killing its own worker so a daemon it leaves behind outlives the build.
REACHER = '''import os
import signal
import socket
import time

import torch


def _try(what, fn):
    try:
        fn()
        return what + "=ok"
    except OSError as e:
        return what + "=" + type(e).__name__


def build(config):
    out = []

    def unix():
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(config["unix"])
        s.sendall(b"hello from a model")

    def tcp():
        s = socket.create_connection(("127.0.0.1", int(config["port"])), timeout=5)
        s.sendall(b"hello from a model")

    out.append(_try("unix", unix))
    out.append(_try("tcp", tcp))
    out.append(_try("vsock", lambda: socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)))  # a VM's way to its host
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a daemon: fork again, leave the session, outlive the action
        os.setsid()
        if os.fork() == 0:
            import ctypes

            ctypes.CDLL(None).prctl(1, 0, 0, 0, 0)  # PR_SET_PDEATHSIG 0: nothing ends it when its parent dies
            ctypes.CDLL(None).prctl(15, config["token"].encode(), 0, 0, 0)  # PR_SET_NAME: found by the test
            os.write(w, str(os.getpid()).encode())
            while True:
                time.sleep(0.2)
        os._exit(0)
    os.waitpid(pid, 0)
    out.append("daemon=" + os.read(r, 32).decode())
    print("REACHED " + " ".join(out), flush=True)  # into the action's log
    print("REACHED kill-worker=" + _try("", lambda: os.kill(os.getppid(), signal.SIGKILL)), flush=True)
    time.sleep(0.5)
    raise RuntimeError("the model is done")
'''


def test_a_batch_build_and_the_page_it_renders_import_nothing_from_the_workspace(tmp_path: Path) -> None:
    """The invocation page is rendered by an interpreter spawned after the command answers, in the workspace: started
    as `python -c`, it put the workspace first on sys.path, and a cloned repo's json.py or argparse.py ran there."""
    marker = str(tmp_path / "pwned")
    ws = _one_model_ws(tmp_path / "ws", "import torch\n\n\ndef build(config):\n    return torch.nn.Linear(4, 3)\n", {})
    write_ws(ws, {f"{m}.py": SHADOW_SRC.format(marker=marker) for m in ("json", "argparse", "difflib", "html")})
    proc = run_cli(["--batch", "build", "//pkg:all", "--cache-dir", str(tmp_path / "cache")], ws, python_flags=("-P",))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    page = Path(re.findall(r"Invocation: file://(\S+)", proc.stdout + proc.stderr)[-1])
    deadline = time.monotonic() + 120
    while not page.exists() and not list(tmp_path.glob("pwned*")) and time.monotonic() < deadline:
        time.sleep(0.2)  # (rendered after the command answered)
    assert not list(tmp_path.glob("pwned*")), "a module from the workspace was imported"
    assert page.exists(), "the invocation page was never rendered"


def test_a_dask_local_build_spawns_workers_that_import_nothing_from_the_workspace(tmp_path: Path) -> None:
    """dask-local's worker processes are spawned by multiprocessing (`python -c ...`) in the build's working
    directory, the workspace: a cloned repo's multiprocessing.py there ran in each of them before they took the build
    process's sys.path."""
    pytest.importorskip("distributed")
    marker = str(tmp_path / "pwned")
    ws = _one_model_ws(tmp_path / "ws", "import torch\n\n\ndef build(config):\n    return torch.nn.Linear(4, 3)\n", {})
    write_ws(ws, {f"{m}.py": SHADOW_SRC.format(marker=marker) for m in ("multiprocessing", "pickle", "socket")})
    script = Path(sys.executable).parent / "neuronbuild"  # as users start it (not -m: that puts the cwd first)
    if not script.is_file():
        pytest.skip("no neuronbuild script beside this interpreter")
    env = {k: v for k, v in os.environ.items() if k in _ENV_AT_START or not k.startswith("TORCHINDUCTOR_")}
    proc = subprocess.run([str(script), "--batch", "build", "//pkg:all", "--executor", "dask-local", "--jobs", "1",
                           "--cache-dir", str(tmp_path / "cache")], cwd=ws, env=env, capture_output=True, text=True,
                          timeout=900)
    assert not list(tmp_path.glob("pwned*")), "a module from the workspace was imported: " + proc.stderr[-2000:]
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_model_cannot_connect_to_a_unix_socket_or_the_network_nor_leave_a_daemon(tmp_path: Path) -> None:
    import socket

    unix_path = str(tmp_path / "server.sock")  # as the build server's socket
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as us, socket.socket() as ts:
        us.bind(unix_path)
        us.listen(4)
        ts.bind(("127.0.0.1", 0))
        ts.listen(4)
        port = ts.getsockname()[1]
        token = f"nbdaemon{os.getpid() % 10000}"
        ws = _one_model_ws(tmp_path / "ws", REACHER, {"unix": unix_path, "port": str(port), "token": token})
        proc = run_cli(["--batch", "build", "//pkg:all", "--jobs", "1", "--cache-dir", str(tmp_path / "cache")], ws)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        for s in (us, ts):
            s.settimeout(0.5)
            with pytest.raises(TimeoutError):
                s.accept()  # nobody connected
    log = "\n".join(p.read_text(errors="replace") for p in (tmp_path / "cache").rglob("*.log"))
    line = next(x for x in log.splitlines() if x.startswith("REACHED unix"))
    assert "unix=PermissionError" in line and "tcp=PermissionError" in line, line
    assert "vsock=PermissionError" in line, line
    # The worker is outside the action's Landlock domain: the action cannot signal it (nor any process of the user).
    assert "REACHED kill-worker==PermissionError" in log, log[-3000:]
    # Whatever the action started is gone once the build is over (its namespace's init, or its worker, ended it):
    # found by its name (its pid as the action saw it is its pid namespace's).
    assert int(line.split("daemon=")[1].split()[0]) > 0, line
    deadline = time.monotonic() + 30
    while (left := named(token)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for daemon in left:
        os.kill(daemon, signal.SIGKILL)
    assert not left, "a daemon the model started outlived the build"


NET_VIEWER = '''def build(config):
    unix = open("/proc/net/unix").read()
    ifaces = sorted(ln.split(":")[0].strip() for ln in open("/proc/net/dev").read().splitlines()[2:])
    print("NETVIEW", "sock-seen" if config["sock"] in unix else "sock-unseen", "ifaces=" + ",".join(ifaces), flush=True)
    raise RuntimeError("looked")
'''


def test_a_model_sees_no_host_socket_or_interface_in_its_own_network_namespace(tmp_path: Path) -> None:
    import socket

    visible = str(tmp_path / "listening.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as us:
        us.bind(visible)
        us.listen(1)
        with open("/proc/net/unix") as f:
            assert visible in f.read()  # (the check can fail: the machine's table lists it)
        ws = _one_model_ws(tmp_path / "ws", NET_VIEWER, {"sock": visible})
        proc = run_cli(["--batch", "build", "//pkg:all", "--jobs", "1", "--cache-dir", str(tmp_path / "cache")], ws)
    assert proc.returncode == 1 and "looked" in proc.stderr, proc.stdout + proc.stderr
    log = "\n".join(p.read_text(errors="replace") for p in (tmp_path / "cache").rglob("*.log"))
    assert "NETVIEW sock-unseen ifaces=lo" in log, log[-3000:]


def _raw(sock_path: str, msg: dict) -> list[dict]:  # type: ignore[type-arg]
    """Send one request to a server's socket as any process of the user could, and read every answer frame."""
    import socket

    from neuronbuild.server import protocol

    out = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(60)
        s.connect(sock_path)
        protocol.send(s, msg)
        try:
            while True:
                out.append(protocol.recv(s))
        except (OSError, EOFError, protocol.ProtocolError):
            pass
    return out


def test_the_server_obeys_only_requests_carrying_its_secret_and_checks_every_field(
        tmp_path: Path, server_env: dict[str, str]) -> None:
    ws = _one_model_ws(tmp_path / "ws", "import torch\n\n\ndef build(config):\n    return torch.nn.Linear(4, 3)\n", {})
    started = run_cli(["plan", "//pkg:all", "--cache-dir", str(tmp_path / "cache")], ws, server_env, ("-P",))
    assert started.returncode == 0, started.stderr
    info = run_cli(["info", "--output", "json"], ws, server_env, ("-P",))
    assert info.returncode == 0, info.stderr
    data = json.loads(info.stdout)
    assert data["running"] and data["commands"] == 1, data
    secret_file = Path(data["output_base"]) / "server.secret"
    assert secret_file.stat().st_mode & 0o777 == 0o600
    secret = secret_file.read_text().strip()
    assert len(secret) == 64 and secret not in info.stdout  # never handed out by `info`
    evil = tmp_path / "evil-bin"
    evil.mkdir()
    for tool in ("g++", "c++", "gcc"):  # a PATH whose compiler leaves a marker, as a model's daemon would send
        (evil / tool).write_text(f"#!/bin/sh\ntouch {tmp_path / 'pwned'}\n")
        (evil / tool).chmod(0o755)
    command = {"type": "command", "argv": ["build", "//pkg:all", "--cache-dir", str(tmp_path / "cache")],
               "cwd": str(ws), "env": {"PATH": f"{evil}:/usr/bin:/bin"}, "tty": [False, False],
               "stamp": data["stamp"], "pid": 1}
    sock = data["socket"]
    for msg in (command, {**command, "secret": "0" * 64}, {"type": "shutdown"}, {"type": "info"}):
        assert _raw(sock, msg) == [], msg  # no answer: the connection is closed unread
    bad = _raw(sock, {**command, "secret": secret, "env": {"PATH": 5}})
    assert bad[-1] == {"t": "exit", "code": 2} and "a malformed command (env must map names to strings)" in bad[0]["d"]
    after = json.loads(run_cli(["info", "--output", "json"], ws, server_env, ("-P",)).stdout)
    assert after["pid"] == data["pid"] and after["commands"] == data["commands"]  # alive, and ran nothing
    assert not (tmp_path / "pwned").exists()


CPU_MODEL = '''import os

import torch


def build(config):
    if config["poison"]:  # append a constructor to every precompiled header, header and inductor source it can find
        tmp = os.environ["TMPDIR"]
        for top in (tmp, os.path.join(os.path.dirname(tmp), "toolchain-headers")):
            for d, _dirs, files in os.walk(top):
                for n in files:
                    if n.endswith((".h", ".gch", ".cpp")):
                        try:
                            with open(os.path.join(d, n), "ab") as f:
                                f.write(b"\\n__attribute__((constructor)) static void poisoned(void) {}\\n"
                                        b"__attribute__((used)) static const char nb_mark[] = \\"NB_POISONED_BY\\";\\n")
                        except OSError:
                            pass
    torch.manual_seed(int(config["seed"]))
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
'''
CPU_BUILD = '''neuron_model(name = "m", srcs = ["m.py"], entry = "m:build", config = {{"poison": {poison}, "seed": {seed}}},
             inputs = {{"x": "float32[b, 4]"}})
neuron_buckets(name = "bk", shapes = [{{"b": 1}}])
neuron_target(name = "cpu", platform = "cpu", isa = "native")
neuron_compile(name = "c", model = ":m", buckets = [":bk"], target = ":cpu")
'''


def _header_bytes(cache: Path) -> dict[str, str]:
    import hashlib

    return {str(p.relative_to(cache)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in (cache / "v1").glob("toolchain-*/**/*") if p.is_file() and p.name.endswith((".h", ".gch"))}


def test_a_model_cannot_change_the_precompiled_headers_or_sources_later_compiles_build(tmp_path: Path) -> None:
    import zipfile

    cache = tmp_path / "cache"
    good = write_ws(tmp_path / "ws-good", {"pkg/m.py": CPU_MODEL,
                                           "pkg/BUILD": CPU_BUILD.format(poison="False", seed=0)})
    first = run_cli(["--batch", "build", "//pkg:all", "--jobs", "2", "--cache-dir", str(cache)], good)
    assert first.returncode == 0, first.stdout + first.stderr[-3000:]  # a compile that read the warmed headers
    headers = _header_bytes(cache)
    assert any(h.endswith(".gch") for h in headers), headers
    evil = write_ws(tmp_path / "ws-evil", {"pkg/m.py": CPU_MODEL,
                                           "pkg/BUILD": CPU_BUILD.format(poison="True", seed=0)})
    hostile = run_cli(["--batch", "build", "//pkg:all", "--jobs", "2", "--cache-dir", str(cache)], evil)
    # The steps running model code (its weights action and trace) either see no header directory at all (only a
    # compile step is given it) or are refused the write: in neither case does a header change.
    assert hostile.returncode == 0 or "PermissionError" in hostile.stderr, hostile.stdout + hostile.stderr[-3000:]
    assert _header_bytes(cache) == headers  # no later compile, of any workspace, includes the model's code
    # New weights, the same program: the compile runs again and generates the same kernel and wrapper sources, under
    # the same content-hash names, as the first one did. None of them is the model's version.
    (good / "pkg" / "BUILD").write_text(CPU_BUILD.format(poison="False", seed=1))
    again = run_cli(["--batch", "build", "//pkg:all", "--jobs", "2", "--cache-dir", str(cache)], good)
    assert again.returncode == 0 and " 0 executed" not in again.stderr, again.stdout + again.stderr[-3000:]
    (package,) = (good / "neuronbuild-out").rglob("model.pt2")
    with zipfile.ZipFile(package) as z:
        assert not [n for n in z.namelist() if b"NB_POISONED_BY" in z.read(n)]


# Two models built at once (--jobs 2): the reader waits until its sibling runs (each names itself in /proc/<pid>/comm,
# which stays readable), then tries every other process's environ, maps, mem and open descriptors: its worker, the
# zygote, the build process, the build's parent (`timeout`, standing for the user's shell), the sibling action, pid 1.
PROC_READER = """import ctypes
import json
import os
import time


def comm(pid):
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def ancestors():
    out, pid = [], os.getppid()
    while pid > 1:
        out.append(pid)
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
    return out


def attempt(pid, what):
    try:
        if what == "fd":
            return [os.readlink(f"/proc/{pid}/fd/{n}") for n in os.listdir(f"/proc/{pid}/fd")] and "read"
        with open(f"/proc/{pid}/{what}", "rb") as f:
            data = f.read(1 << 20)
        return "SECRET" if SECRET in data else "read"
    except OSError as e:
        return "refused" if e.errno in (1, 13) else "gone"


def build(config):
    global SECRET
    SECRET = config["secret"].encode()
    ctypes.CDLL(None).prctl(15, b"nbreader", 0, 0, 0)  # PR_SET_NAME
    ns = os.getppid() == 1  # pid 2 of its own pid namespace (its init is 1): no other process to wait for
    sibling, deadline = None, time.monotonic() + (0 if ns else 120)
    while sibling is None and time.monotonic() < deadline:
        sibling = next((int(p) for p in os.listdir("/proc") if p.isdigit() and comm(p) == "nbsibling"), None)
        time.sleep(0.1)
    me = os.getpid()
    seen = {}
    for p in os.listdir("/proc"):
        if p.isdigit() and int(p) != me:
            seen[p] = {w: attempt(p, w) for w in ("environ", "maps", "mem", "fd")}
    outer = int(config["outer"])  # the test's process, outside any namespace of the build
    print("PROCS " + json.dumps({"sibling": sibling, "ancestors": ancestors(), "seen": seen, "ns": ns,
                                 "outer": {w: attempt(outer, w) for w in ("environ", "cmdline", "status")},
                                 "own": attempt(me, "environ")}), flush=True)
    raise RuntimeError("the reader is done")
"""

PROC_SIBLING = """import ctypes
import os
import time

import torch


def build(config):
    ctypes.CDLL(None).prctl(15, b"nbsibling", 0, 0, 0)
    seen, deadline = False, time.monotonic() + (0 if os.getppid() == 1 else 150)  # (its own pid namespace: 0)
    while time.monotonic() < deadline:  # until the reader has come and gone
        names = set()
        for p in os.listdir("/proc"):
            try:
                with open(f"/proc/{p}/comm") as f:
                    names.add(f.read().strip())
            except OSError:
                pass
        if "nbreader" in names:
            seen = True
        elif seen:
            break
        time.sleep(0.1)
    return torch.nn.Linear(4, 3)
"""


def test_a_model_reads_no_other_processs_environ_maps_memory_or_descriptors(tmp_path: Path) -> None:
    import subprocess
    import sys

    secret = f"hunter2-{os.getpid()}-{time.time_ns()}"
    build_file = "".join(
        f'neuron_model(name = "{n}", srcs = ["{n}.py"], entry = "{n}:build", inputs = {{"x": "float32[b, 4]"}},\n'
        f'             config = {{"secret": "{secret}", "outer": "{os.getpid()}"}})\n'
        f'neuron_buckets(name = "{n}_bk", shapes = [{{"b": 1}}])\n'
        f'neuron_compile(name = "{n}_c", model = ":{n}", buckets = [":{n}_bk"], target = ":t")\n'
        for n in ("reader", "sibling")) + 'neuron_target(name = "t", platform = "trn2")\n'

    ws = write_ws(tmp_path / "ws", {"pkg/BUILD": build_file, "pkg/reader.py": PROC_READER,
                                    "pkg/sibling.py": PROC_SIBLING})
    env = {k: v for k, v in os.environ.items() if k in _ENV_AT_START or not k.startswith("TORCHINDUCTOR_")}
    env.update(AWS_SECRET_ACCESS_KEY=secret, NB_TEST_TOKEN=secret)  # the build's (and its parent's) environment
    # `timeout` holds the secret in its own environ, as the user's shell would; every worker and action holds it too
    # (a declared --action-env), so a sibling's or a worker's environ would give it away.
    proc = subprocess.run(["timeout", "900", sys.executable, "-m", "neuronbuild", "--batch", "build", "//pkg:all",
                           "--jobs", "2", "--action-env", "NB_TEST_TOKEN", "--cache-dir", str(tmp_path / "cache")],
                          cwd=ws, env=env, capture_output=True, text=True, timeout=1000)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert "the reader is done" in proc.stderr, proc.stderr[-3000:]
    log = "\n".join(p.read_text(errors="replace") for p in (tmp_path / "cache").rglob("*.log"))
    report = json.loads(next(x for x in log.splitlines() if x.startswith("PROCS "))[len("PROCS "):])
    seen = report["seen"]
    assert report["own"] == "SECRET"  # its own environ is its own (the declared variable is there)
    if report["ns"]:  # its own pid namespace and /proc: it sees its init (pid 1) and itself, nothing outside
        assert set(seen) <= {"1"} and report["sibling"] is None, report
        assert report["ancestors"] == [] and set(report["outer"].values()) == {"gone"}, report
        got = seen.get("1")  # the init (a fork of the worker: it holds the declared secret) is not readable
        assert got is not None and all(v in ("refused", "gone") for v in got.values()), got
        return
    assert report["sibling"] is not None, "the two actions never ran at the same time"
    ancestors = report["ancestors"]  # worker, (zygote), build process, timeout, pytest, ...
    assert len(ancestors) >= 3, ancestors
    for pid in [report["sibling"], *ancestors, 1]:
        got = seen.get(str(pid))
        assert got is not None and all(v in ("refused", "gone") for v in got.values()), (pid, got)
    leaked = {pid: got for pid, got in seen.items() if "SECRET" in got.values()}
    assert not leaked, leaked


ETC_READER = '''import ctypes
import errno
import os


def build(config):
    libc = ctypes.CDLL(None, use_errno=True)  # libc's open: what a C extension or a compiler does (the kernel's rules)
    seen = []
    for path in ("/etc/shadow", "/etc/gshadow", "/etc/sudoers", "/etc/passwd", "/etc/ld.so.cache"):
        if os.path.exists(path):
            fd = libc.open(path.encode(), os.O_RDONLY)
            seen.append(f"{path}:{'read' if fd >= 0 else errno.errorcode[ctypes.get_errno()]}")
    raise RuntimeError("ETC " + " ".join(seen))
'''


def test_a_model_cannot_read_secrets_under_etc_but_libc_reads_the_rest(tmp_path: Path) -> None:
    ws = _one_model_ws(tmp_path / "ws", ETC_READER, {})
    proc = run_cli(["--batch", "build", "//pkg:all", "--jobs", "1", "--cache-dir", str(tmp_path / "cache")], ws)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = next(ln for ln in proc.stderr.splitlines() if "RuntimeError: ETC " in ln)
    seen = dict(item.rsplit(":", 1) for item in line.split("RuntimeError: ETC ", 1)[1].split(" (at ")[0].split())
    assert seen["/etc/passwd"] == "read" and seen["/etc/ld.so.cache"] == "read", line
    secrets = {k: v for k, v in seen.items() if k in ("/etc/shadow", "/etc/gshadow", "/etc/sudoers")}
    assert secrets and all(v == "EACCES" for v in secrets.values()), line


SPIN_BUILD = '''def spin():
    n = 0
    for i in range(1000000000000):
        n += i
    return n

spin()
'''


def test_a_cancelled_endless_starlark_loop_does_not_wedge_the_server(tmp_path: Path,
                                                                       server_env: dict[str, str]) -> None:
    import subprocess
    import sys

    ws = write_ws(tmp_path / "ws", {"pkg/BUILD": SPIN_BUILD})
    env = {**os.environ, **server_env}
    cache = str(tmp_path / "cache")
    spinning = subprocess.Popen([sys.executable, "-P", "-m", "neuronbuild", "plan", "//pkg:all", "--cache-dir", cache],
                                cwd=ws, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                preexec_fn=user_signals)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # until the server runs the command (busy)
        info = run_cli(["info", "--output", "json"], ws, server_env, ("-P",))
        if info.returncode == 0 and json.loads(info.stdout).get("busy"):
            break
        time.sleep(0.5)
    else:
        spinning.kill()
        raise AssertionError("the server never ran the command")
    first = json.loads(info.stdout)["pid"]
    time.sleep(1.0)  # inside the loop by now
    spinning.send_signal(signal.SIGINT)  # Ctrl-C: the client asks the server to cancel
    assert spinning.wait(timeout=60) == 8
    (ws / "pkg" / "BUILD").write_text('neuron_target(name = "t", platform = "trn2")\n')
    after = subprocess.run([sys.executable, "-P", "-m", "neuronbuild", "plan", "//pkg:all", "--cache-dir", cache],
                           cwd=ws, env=env, capture_output=True, text=True, timeout=300)  # never wedged behind it
    assert after.returncode == 0, after.stdout + after.stderr
    assert not running(first) or json.loads(
        run_cli(["info", "--output", "json"], ws, server_env, ("-P",)).stdout)["pid"] != first


def test_python_started_with_the_action_environment_runs_no_pth_an_action_left_in_the_shared_home(
        tmp_path: Path) -> None:
    """Workers share $HOME (<cache>/v1/home; each action has its own, which actions cannot reach, but a second line
    of defence): a .pth left in its user site-packages would run in any Python interpreter outside a virtualenv at
    start: a worker spawned for the next build (unconfined), or a compiler written in Python. The action environment
    turns user site-packages off."""
    import subprocess
    import sys

    from neuronbuild.execution.env import action_environment

    env = action_environment(tmp_path / "tmp", tmp_path / "home")
    python = getattr(sys, "_base_executable", sys.executable)  # an installation's python: user site-packages on
    without = {k: v for k, v in env.items() if k != "PYTHONNOUSERSITE"}
    probe = "import site, sys; print(site.getusersitepackages())"
    user_site = Path(subprocess.run([python, "-c", probe], env=without, capture_output=True, text=True,
                                    check=True).stdout.strip())
    assert user_site.is_relative_to(tmp_path / "home"), user_site
    user_site.mkdir(parents=True)
    marker = tmp_path / "ran"
    (user_site / "evil.pth").write_text(f"import os; open({str(marker)!r}, 'w').close()\n")
    subprocess.run([python, "-c", "pass"], env=without, check=True)
    assert marker.exists()  # (the control: such an interpreter runs it)
    marker.unlink()
    subprocess.run([python, "-c", "pass"], env=env, check=True)
    subprocess.run([python, "-P", "-s", "-c", "pass"], env=without, check=True)  # a worker's flags
    assert not marker.exists()


ESCAPER = '''def build(config):
    # OSC 52 (set the clipboard), clear the screen, a carriage return that would print over the line
    raise RuntimeError("innocent\\x1b]52;c;cm0gLXJmIH4=\\x07\\x1b[2J\\rall good \\x9b31m")
'''


def test_an_error_a_model_raises_reaches_the_terminal_with_its_control_characters_escaped(tmp_path: Path) -> None:
    ws = _one_model_ws(tmp_path / "ws", ESCAPER, {})
    proc = run_cli(["--batch", "build", "//pkg:all", "--jobs", "1", "--cache-dir", str(tmp_path / "cache")], ws)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "innocent\\x1b]52;c;cm0gLXJmIH4=\\x07\\x1b[2J\\x0dall good \\x9b31m" in proc.stderr, proc.stderr[-3000:]
    assert not re.search("[\x00-\x08\x0b-\x1f\x7f-\x9f]", proc.stdout + proc.stderr), repr(proc.stderr[-3000:])


def test_a_model_calling_sys_exit_fails_its_action_with_a_message_and_a_log(tmp_path: Path) -> None:
    ws = _one_model_ws(tmp_path / "ws", "import sys\n\n\ndef build(config):\n    sys.exit(3)\n", {})
    proc = run_cli(["--batch", "build", "//pkg:all", "--jobs", "2", "--cache-dir", str(tmp_path / "cache")], ws)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    # (whichever of the model's actions calling its factory, its trace or its weights, fails first ends the build)
    assert re.search(r"FAILED: (Trace //pkg:m \[b=1\]|Weights //pkg:m): SystemExit: 3 \(at pkg/m\.py:5\)",
                     proc.stderr), proc.stderr[-3000:]
    assert "worker process died" not in proc.stderr and "exit status" not in proc.stderr
    log = Path(re.search(r"\(log: (\S+)\)", proc.stderr)[1])  # type: ignore[index]
    assert "SystemExit: 3" in log.read_text()  # the action's log holds the traceback


# A model that, once its trace's outputs are written and its result sent, turns each output into a symbolic link to a
# file it may not read (os._exit replaced: the action's process ends through it): the build process, unconfined,
# would copy that file into the cache (a shared tier, bundles) as the trace's program.
OUTPUT_LINKER = '''import os

import torch


def build(config):
    real_exit = os._exit
    outdir = os.path.join(os.path.dirname(os.getcwd()), "out")

    def link_outputs_then_exit(code):
        for name in os.listdir(outdir):
            path = os.path.join(outdir, name)
            if os.path.isfile(path) and not os.path.islink(path):
                os.unlink(path)
                os.symlink(config["secret"], path)
        real_exit(code)

    os._exit = link_outputs_then_exit
    return torch.nn.Linear(4, 3)
'''


def test_an_output_a_model_turned_into_a_link_to_a_file_it_may_not_read_is_not_stored(tmp_path: Path) -> None:
    secret_dir = tmp_path / "private"
    secret_dir.mkdir(mode=0o700)
    secret = secret_dir / "credentials"
    token = f"nb-secret-{os.getpid()}-{time.time_ns()}"
    secret.write_text(token)
    secret.chmod(0o600)
    ws = _one_model_ws(tmp_path / "ws", OUTPUT_LINKER, {"secret": str(secret)})
    cache = tmp_path / "cache"
    proc = run_cli(["--batch", "build", "//pkg:all", "--jobs", "1", "--cache-dir", str(cache)], ws)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "in its outputs as a symbolic link" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    stored = [p for p in cache.rglob("*") if p.is_file() and not p.is_symlink() and token.encode() in p.read_bytes()]
    assert not stored, f"a file the model may not read was stored as its output: {stored}"
