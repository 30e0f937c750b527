"""A command's own state is an object (neuronbuild/command.py, issue #45): a command the build server runs sees its
client's environment, directory and umask, and none of them (nor its output streams) stays in the server process;
the bundle signing key reaches packaging through the command, never through os.environ."""

from __future__ import annotations

import os
import socket
import stat
import sys
from pathlib import Path
from typing import Any

import pytest

from neuronbuild import envvars
from neuronbuild.command import Command, current
from neuronbuild.server import protocol


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _run_in_server(server: Any, argv: list[str], env: dict[str, str], cwd: Path, umask: int) -> tuple[int, str]:
    """One command through Server.run_command in this process, as a client's message; (exit code, its output)."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        msg = {"type": "command", "argv": argv, "env": env, "cwd": str(cwd), "umask": umask, "tty": [False, False]}
        code = server.run_command(theirs, msg)
        theirs.shutdown(socket.SHUT_WR)
        text = []
        while True:
            try:
                frame = protocol.recv(ours)
            except (EOFError, OSError):
                break
            text.append(str(frame.get("d", "")))
    return code, "".join(text)


@pytest.fixture
def server(tmp_path: Path) -> Any:
    from neuronbuild.server.daemon import Server

    s = Server({"output_base": str(tmp_path / "ob"), "socket": str(tmp_path / "ob" / "sock"), "stamp": "test",
                "opts": {"max_idle_secs": 60}})
    yield s
    s.warm.close()


def test_two_clients_commands_see_their_own_env_cwd_and_umask_and_the_server_keeps_its_own(
        server: Any, tmp_path: Path) -> None:
    from neuronbuild.execution import local_executor

    environ, cwd, umask, streams = dict(os.environ), os.getcwd(), _umask(), (sys.stdout, sys.stderr)
    executor_module = dict(vars(local_executor))  # (the server's kept pools reach builds as Command.pools)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path / "home")}
    env_a = {**base, "NEURONBUILD_CACHE_DIR": str(tmp_path / "cache-a"), "ONLY_A": "1"}
    env_b = {**base, "NEURONBUILD_CACHE_DIR": str(tmp_path / "cache-b")}

    # the environment: each command's NEURONBUILD_CACHE_DIR; the directory: a relative --cache-dir
    code, out_a = _run_in_server(server, ["--norc", "cache", "stats"], env_a, a, 0o022)
    assert code == 0, out_a
    code, out_b = _run_in_server(server, ["--norc", "cache", "stats", "--cache-dir", "rel"], env_b, b, 0o077)
    assert code == 0, out_b
    assert f"local  {tmp_path / 'cache-a'}:" in out_a and f"local  {b / 'rel'}:" in out_b
    # the umask and the directory: files `init` writes
    assert _run_in_server(server, ["--norc", "init", "proj"], env_a, a, 0o022)[0] == 0
    assert _run_in_server(server, ["--norc", "init", "proj"], env_b, b, 0o077)[0] == 0
    assert stat.S_IMODE((a / "proj" / "WORKSPACE.neuronbuild").stat().st_mode) == 0o644
    assert stat.S_IMODE((b / "proj" / "WORKSPACE.neuronbuild").stat().st_mode) == 0o600
    # nothing of either stayed in the server process
    assert dict(os.environ) == environ and "ONLY_A" not in os.environ
    assert os.getcwd() == cwd and _umask() == umask
    assert (sys.stdout, sys.stderr) == streams
    assert dict(vars(local_executor)) == executor_module and not server.warm.wanting


def test_a_command_object_resolves_paths_and_modes_as_its_client_would(tmp_path: Path) -> None:
    cmd = Command.from_message({"argv": ["build"], "env": {"NEURONBUILD_SIGNING_KEY": "keys/k.pem", "HOME": "/h"},
                                "cwd": str(tmp_path), "umask": 0o027}, sys.stdout, sys.stderr)
    assert cmd.path("x/y") == tmp_path / "x" / "y" and cmd.path("/abs") == Path("/abs")
    assert cmd.path("~/k") == Path("/h/k")  # (the command's HOME, not the process's)
    assert cmd.mode() == 0o640 and cmd.mode(0o777) == 0o750
    # the signing key: the flag, else the command's $NEURONBUILD_SIGNING_KEY; resolved against the command's cwd
    assert cmd.signing_key(None) == Path(os.path.realpath(tmp_path / "keys" / "k.pem"))
    assert cmd.signing_key("other.pem") == Path(os.path.realpath(tmp_path / "other.pem"))
    assert cmd.with_env({"NEURONBUILD_SIGNING_KEY": None}).signing_key(None) is None
    assert cmd.in_directory("sub").path("f") == tmp_path / "sub" / "f"
    with cmd.active():
        assert current() is cmd and envvars.current().text("NEURONBUILD_SIGNING_KEY") == "keys/k.pem"
    assert current() is not cmd


def test_the_signing_key_reaches_the_build_context_and_not_the_process_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from neuronbuild.context import make_context

    monkeypatch.delenv("NEURONBUILD_SIGNING_KEY", raising=False)
    (tmp_path / "WORKSPACE.neuronbuild").write_text("")
    cmd = Command(("build",), {"HOME": str(tmp_path)}, tmp_path, sys.stdout, sys.stderr)
    with cmd.active():
        ctx = make_context(cache_dir=str(tmp_path / "c"), signing_key="k.pem", need_workspace=False)
    assert ctx.signing_key == Path(os.path.realpath(tmp_path / "k.pem")) and ctx.command is cmd
    assert "NEURONBUILD_SIGNING_KEY" not in os.environ


def test_a_server_command_learns_its_own_environment_s_facts_not_the_previous_command_s(
        server: Any, tmp_path: Path) -> None:
    """What a command learns of its environment (here the host's ISA level, which cpu targets resolve `native` to)
    is kept with that command (envvars.fact), so the next command through the same server learns its own, as a batch
    process would, while the server keeps its session (load caches, analysis engine) for both."""
    from helpers import copy_example

    ws = copy_example(tmp_path / "ws")
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path / "home"),
            "NEURONBUILD_CACHE_DIR": str(tmp_path / "cache")}
    argv = ["--norc", "plan", "//models:llama_tiny_cpu"]
    outs = [_run_in_server(server, argv, {**base, "NEURONBUILD_HOST_ISA": isa}, ws, 0o022)
            for isa in ("x86-64-v2", "x86-64-v3", "x86-64-v2")]
    assert [code for code, _out in outs] == [0, 0, 0], outs
    assert "cpu/x86-64-v2" in outs[0][1] and "cpu/x86-64-v3" in outs[1][1] and "cpu/x86-64-v2" in outs[2][1]
    assert "cpu/x86-64-v2" not in outs[1][1] and server.warm.session.stats()["analysis_memos"] == 1
