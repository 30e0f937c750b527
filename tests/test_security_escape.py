"""Model code and workspace files never run anything outside the sandbox: no pickle reaches a process that trusts it
(every channel between the build process, its workers and an action's child carries JSON), an action's child holds
no descriptor of its worker's, and the build server imports nothing from the workspace (issue #31)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from helpers import run_cli, write_ws

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
        for expected in ("not JSON", "not JSON", "a list, not an object", "unreadable"):
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

