"""The thin client: decides whether a command goes to the workspace's server, starts one if needed, and relays the
command's output, Ctrl-C and exit code. A no-op through the server is mostly this process's start, so it imports only
built-in modules (_socket and _signal, not socket and signal: their enum wrappers cost milliseconds; no json: see
protocol.py) and neuronbuild's import-free modules; never torch, networkx or starlark. Starting a server imports more
(subprocess, json)."""

from __future__ import annotations

import _signal
import _socket
import os
import sys
import time

from neuronbuild import envvars
from neuronbuild.server import protocol
from neuronbuild.server.protocol import ServerPaths, StartupOptions

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from types import FrameType
    from typing import Any

# As neuronbuild.errors (not imported here: it pulls in dataclasses, and this module must stay small).
EXIT_BUILD_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 1, 2, 8

START_TIMEOUT_S = 120.0  # a loaded machine can take a while to import the analysis modules
_BOOT = ("import os, sys; sys.path[:] = [p for p in sys.path if os.path.isabs(p)]; "
         "sys.path.insert(0, sys.argv[1]); "
         "from neuronbuild.server.daemon import main; main(sys.argv[2])")


class Invocation:
    """What the client read of the command line before the command name (Bazel's startup options and -C)."""

    __slots__ = ("command", "batch", "directory", "output_user_root", "max_idle_secs", "error")

    def __init__(self, command: str | None, batch: bool, directory: str | None, output_user_root: str | None,
                 max_idle_secs: int | None, error: str | None = None) -> None:
        self.command, self.batch, self.directory = command, batch, directory
        self.output_user_root, self.max_idle_secs, self.error = output_user_root, max_idle_secs, error


def prescan(argv: Sequence[str]) -> Invocation:
    """The options before the command, read without argparse (the full parse happens where the command runs)."""
    batch = False
    directory = root = None
    idle: int | None = None
    i = 0
    while i < len(argv):
        a = argv[i]
        name, eq, val = a.partition("=")
        if a in ("-h", "--help", "--version"):
            return Invocation(None, True, directory, root, idle)
        if a == "--batch":
            batch = True
        elif a == "--norc":
            pass
        elif a == "-C" or name in ("--output-user-root", "--max-idle-secs") or a.startswith("-C"):
            if a.startswith("-C") and a != "-C":
                val, eq = a[2:], "="
            if not eq:
                i += 1
                if i >= len(argv):
                    return Invocation(None, True, directory, root, idle)  # argparse says what is missing
                val = argv[i]
            if a.startswith("-C"):
                directory = val
            elif name == "--output-user-root":
                root = val
            else:
                try:
                    idle = int(val)
                except ValueError:
                    idle = -1
                if idle <= 0:
                    return Invocation(None, True, directory, root, None,
                                      f"--max-idle-secs must be a positive whole number of seconds, not {val!r}")
        elif a.startswith("-"):
            return Invocation(None, True, directory, root, idle)  # unknown: the batch parser reports it
        else:
            return Invocation(a, batch, directory, root, idle)
        i += 1
    return Invocation(None, True, directory, root, idle)


def startup_options(output_user_root: str | None, max_idle_secs: int | None) -> StartupOptions:
    root = os.path.abspath(os.path.expanduser(output_user_root)) if output_user_root else \
        protocol.default_output_user_root()
    return StartupOptions(root, max_idle_secs or protocol.DEFAULT_MAX_IDLE_SECS)


def workspace_paths(inv: Invocation) -> tuple[ServerPaths, StartupOptions, str] | None:
    """The server files of the workspace this command runs in, or None outside any workspace."""
    try:
        root = protocol.find_workspace_root(inv.directory or os.getcwd())
    except OSError:
        return None
    if root is None:
        return None
    opts = startup_options(inv.output_user_root, inv.max_idle_secs)
    return protocol.server_paths(root, opts.output_user_root), opts, root


def maybe_run(argv: Sequence[str], check: Callable[[list[str]], int | None] | None = None) -> int | None:
    """Run the command through the server and return its exit code, or None: run it in this process (--batch,
    NEURONBUILD_NO_SERVER=1, a command the server does not take, or no workspace). `check(argv)`: the exit code of a
    command line this process would refuse (its error printed), asked before a server is started for it."""
    inv = prescan(argv)
    if inv.error:
        print(f"neuronbuild: error: {inv.error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if inv.batch or inv.command not in protocol.SERVER_COMMANDS or envvars.current().flag("NEURONBUILD_NO_SERVER"):
        return None
    found = workspace_paths(inv)
    if found is None:
        return None
    paths, opts, root = found
    return run(paths, opts, list(argv), root, check)


def connect(paths: ServerPaths, timeout: float | None = None) -> _socket.socket | None:
    """A connection to the running server, or None when there is none (no socket, or nobody listening)."""
    try:
        st = os.lstat(paths.socket)
    except OSError:
        return None
    if st.st_uid != os.geteuid():
        return None
    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(paths.socket)
    except OSError:
        s.close()
        return None
    s.settimeout(None)
    return s


def read_info_file(paths: ServerPaths) -> dict[str, Any]:
    import json

    try:
        with open(paths.info, encoding="utf-8") as f:
            data = json.loads(f.read())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (our own child that exited) counts as gone.
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pid: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.02)
    return False


def start_server(paths: ServerPaths, opts: StartupOptions, stamp: str, workspace: str = "") -> None:
    """Start the daemon (unless another client just did) and wait until it accepts connections."""
    import contextlib
    import fcntl
    import json
    import subprocess

    protocol.private_dir(paths.output_base)
    protocol.private_dir(os.path.dirname(paths.socket))
    with open(paths.start_lock, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        s = connect(paths)
        if s is not None:
            s.close()
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(paths.socket)  # stale: its server is gone
        with contextlib.suppress(OSError):
            if os.stat(paths.log).st_size > 16 << 20:
                os.unlink(paths.log)  # keep the log bounded
        print(f"neuronbuild: starting the build server (log {paths.log}; `neuronbuild shutdown` stops it, --batch "
              "runs without it)", file=sys.stderr, flush=True)
        config = json.dumps({"output_base": paths.output_base, "socket": paths.socket, "stamp": stamp,
                             "opts": opts.to_json(), "workspace": workspace})
        pkg_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
        fd = os.open(paths.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            # Its own session (no terminal signals), no inherited descriptors besides /dev/null and the log: a CI
            # job that waits for our stdout to close is not held open by the daemon.
            proc = subprocess.Popen([sys.executable, "-P", "-c", _BOOT, pkg_parent, config, "neuronbuild-server"],
                                    stdin=subprocess.DEVNULL, stdout=fd, stderr=fd, close_fds=True,
                                    start_new_session=True, cwd=paths.output_base)
        finally:
            os.close(fd)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            s = connect(paths)
            if s is not None:
                s.close()
                return
            if proc.poll() is not None:
                break
            time.sleep(0.01)
        tail = ""
        with contextlib.suppress(OSError), open(paths.log, encoding="utf-8", errors="replace") as f:
            tail = f.read()[-2000:]
        with contextlib.suppress(OSError):
            proc.kill()
        raise RuntimeError(f"the build server did not start (log {paths.log}):\n{tail}")


class _Relay:
    """Forwards Ctrl-C (and SIGTERM) to the server as a cancel request while a command runs."""

    def __init__(self, sock: _socket.socket) -> None:
        self.sock = sock
        self.interrupts = 0

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.interrupts += 1
        if self.interrupts >= 3:
            raise KeyboardInterrupt  # the server cancels on its own when we hang up
        try:
            protocol.send(self.sock, {"type": "cancel"})
        except OSError:
            pass


def _stream(sock: _socket.socket) -> tuple[str, Any]:
    """Relay frames until the command's end: ("exit", code), ("mismatch", pid) or ("died", None)."""
    relay = _Relay(sock)
    old = {s: _signal.signal(s, relay) for s in (_signal.SIGINT, _signal.SIGTERM)}
    try:
        while True:
            try:
                msg = protocol.recv(sock)
            except (EOFError, OSError, protocol.ProtocolError):
                return "died", None
            t = msg.get("t")
            if t == "out" or t == "err":
                stream = sys.stdout if t == "out" else sys.stderr
                stream.write(str(msg.get("d", "")))
                stream.flush()
            elif t == "exit":
                return "exit", int(msg.get("code", EXIT_BUILD_FAILED))
            elif t == "mismatch":
                return ("stopped" if msg.get("stopping") else "mismatch"), msg.get("pid")
    except KeyboardInterrupt:
        return "exit", EXIT_INTERRUPTED
    finally:
        for s, h in old.items():
            _signal.signal(s, h)


def run(paths: ServerPaths, opts: StartupOptions, argv: list[str], workspace: str = "",
        check: Callable[[list[str]], int | None] | None = None) -> int:
    stamp = protocol.server_stamp(opts)
    tty = [sys.stdout.isatty(), sys.stderr.isatty()]
    env = dict(os.environ)
    if any(tty) and "COLUMNS" not in env:
        try:
            env["COLUMNS"] = str(os.get_terminal_size(sys.stderr.fileno()).columns)
        except OSError:
            pass
    umask = os.umask(0o022)  # (read it: the server writes the command's outputs with the client's umask)
    os.umask(umask)
    req = {"type": "command", "argv": argv, "cwd": os.getcwd(), "env": env, "tty": tty, "stamp": stamp,
           "pid": os.getpid(), "umask": umask}
    for _attempt in range(3):
        sock = connect(paths)
        if sock is None:
            if _attempt == 0 and check is not None:
                bad = check(argv)  # (a mistyped flag is refused before a server is started for it)
                if bad is not None:
                    return bad
            try:
                start_server(paths, opts, stamp, workspace)
            except (OSError, RuntimeError) as e:
                print(f"neuronbuild: error: {e}", file=sys.stderr)
                return EXIT_BUILD_FAILED
            sock = connect(paths)
            if sock is None:
                continue
        try:
            try:
                protocol.send(sock, {**req, "secret": protocol.read_secret(paths.secret)})
            except OSError:
                continue  # it went away between connect and send: start another
            what, val = _stream(sock)
        finally:
            sock.close()
        if what == "exit":
            return int(val)
        if what in ("mismatch", "stopped"):
            if what == "mismatch":
                print("neuronbuild: the build server was started by another neuronbuild version, with other startup "
                      "options or another umask; restarting it", file=sys.stderr, flush=True)
            if isinstance(val, int) and not wait_gone(val):
                try:
                    os.kill(val, _signal.SIGKILL)
                except OSError:
                    pass
                wait_gone(val, 5.0)
            continue
        print(f"neuronbuild: error: the build server died during this command (log {paths.log}); the next command "
              "starts a new one", file=sys.stderr)
        return EXIT_BUILD_FAILED
    print("neuronbuild: error: could not reach the build server (run with --batch to build without it)",
          file=sys.stderr)
    return EXIT_BUILD_FAILED


def request(paths: ServerPaths, msg: dict[str, Any], timeout: float | None = 10.0) -> dict[str, Any] | None:
    """One request/answer exchange with a running server (info, shutdown); None when no server answers."""
    sock = connect(paths, timeout)
    if sock is None:
        return None
    try:
        sock.settimeout(timeout)
        protocol.send(sock, {**msg, "secret": protocol.read_secret(paths.secret)})
        while True:
            ans = protocol.recv(sock)
            if ans.get("t") not in ("wait", "err", "out"):
                return ans
            if ans.get("t") in ("wait", "err"):
                print(str(ans.get("d", "")), end="", file=sys.stderr, flush=True)
    except (OSError, EOFError, protocol.ProtocolError):
        return None
    finally:
        sock.close()
