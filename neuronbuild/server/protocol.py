"""Where a workspace's server lives (output base, socket, info file), its identity stamp and the wire format.

Imported by the thin client: only the standard library and neuronbuild's import-free modules."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import struct
import sys
from pathlib import Path
from typing import Any, NamedTuple

from neuronbuild.self_stamp import code_stamp

DEFAULT_MAX_IDLE_SECS = 3 * 3600
MAX_FRAME = 64 << 20  # a frame larger than this is a protocol error
_LEN = struct.Struct(">I")
# Commands the client hands to the server; every other command runs in the client (they are cheap or local).
SERVER_COMMANDS = ("build", "plan", "explain", "query")


class ProtocolError(Exception):
    """The other side sent something that is not a frame of this protocol (or hung up mid-frame)."""


class StartupOptions(NamedTuple):
    """Options fixed for a server's life (Bazel's startup options): a command asking for others replaces it."""

    output_user_root: str
    max_idle_secs: int = DEFAULT_MAX_IDLE_SECS

    def to_json(self) -> dict[str, Any]:
        return {"output_user_root": self.output_user_root, "max_idle_secs": self.max_idle_secs}


def default_output_user_root() -> str:
    env = os.environ.get("NEURONBUILD_OUTPUT_USER_ROOT")
    if env:
        return os.path.abspath(os.path.expanduser(env))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "neuronbuild-server")


class ServerPaths(NamedTuple):
    """The files of one workspace's server, all inside its output base (a directory only this user can enter)."""

    output_base: Path
    socket: Path

    @property
    def info(self) -> Path:
        return self.output_base / "server.json"

    @property
    def log(self) -> Path:
        return self.output_base / "server.log"

    @property
    def start_lock(self) -> Path:
        return self.output_base / "start.lock"


def server_paths(workspace_root: Path | str, output_user_root: str) -> ServerPaths:
    """One output base per workspace (per user root), as Bazel keys its output base by the workspace's path."""
    key = hashlib.sha256(str(workspace_root).encode()).hexdigest()[:16]
    base = Path(output_user_root) / key
    sock = base / "server.sock"
    if len(os.fsencode(sock)) > 100:  # sun_path holds 108 bytes: a deep output base gets a short socket path
        short = hashlib.sha256(str(base).encode()).hexdigest()[:16]
        sock = Path("/tmp") / f"neuronbuild-{os.getuid()}" / f"{short}.sock"
    return ServerPaths(base, sock)


def private_dir(d: Path) -> None:
    """Make `d` (and parents) and insist it is this user's and mode 0700: nobody else may reach the socket."""
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = os.lstat(d)
    if st.st_uid != os.geteuid():
        raise PermissionError(f"{d} belongs to another user: refusing to use it for the build server")
    if st.st_mode & 0o077:
        os.chmod(d, 0o700)


def server_stamp(opts: StartupOptions) -> str:
    """Who a server is: neuronbuild's code (version, format, every source file), the interpreter, its import path and
    the toolchain as the no-op stamp sees it (stat keys of sys.path entries and compilers: installing or upgrading
    torch changes them), plug-in settings and the startup options. A client whose stamp differs replaces the server,
    so nothing a server memoised about its environment outlives a change to it."""
    tools = []
    for p in _toolchain_paths():
        try:
            st = os.stat(p)
            tools.append([p, st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns])
        except OSError:
            tools.append([p])
    plugins = sorted((k, v) for k, v in os.environ.items() if k.startswith("NEURONBUILD_PLUGIN"))
    plugin_files = []
    for d in os.environ.get("NEURONBUILD_PLUGIN_PATH", "").split(os.pathsep):
        with contextlib.suppress(OSError), os.scandir(d or ".") as it:
            if d:
                plugin_files.extend(sorted([e.path, e.stat().st_mtime_ns, e.stat().st_size] for e in it
                                           if e.name.endswith(".py")))
    text = json.dumps({"code": code_stamp(), "python": sys.version, "exe": os.path.realpath(sys.executable),
                       "prefix": sys.prefix, "path": sys.path[1:], "tools": tools, "plugins": plugins,
                       "plugin_files": plugin_files, "opts": opts.to_json()}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _which(name: str) -> str | None:
    for d in os.environ.get("PATH", os.defpath).split(os.pathsep):
        p = os.path.join(d or ".", name)
        if os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    return None


def _toolchain_paths() -> list[str]:
    """noop.toolchain_paths without importing noop (and shutil): sys.path entries and the compilers on PATH."""
    out = [p for p in sys.path[1:] if p and os.path.isdir(p)]
    tools = ["g++", "c++", "neuronx-cc"] + [os.environ[v] for v in ("CXX", "CC") if os.environ.get(v)]
    for t in tools:
        found = t if os.sep in t and os.path.isfile(t) else _which(t)
        if found:
            out.append(os.path.realpath(found))
    return list(dict.fromkeys(out))


def find_workspace_root(start: str) -> str | None:
    """workspace.find_workspace's walk up to the marker, without importing it (the client stays small)."""
    d = os.path.realpath(start)
    while True:
        if os.path.isfile(os.path.join(d, "WORKSPACE.neuronbuild")):
            return d
        parent = os.path.dirname(d)
        if parent == d:
            return None
        d = parent


def send(sock: socket.socket, msg: dict[str, Any]) -> None:
    data = json.dumps(msg, separators=(",", ":")).encode()
    sock.sendall(_LEN.pack(len(data)) + data)


def _exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("connection closed")
        buf += chunk
    return bytes(buf)


def recv(sock: socket.socket) -> dict[str, Any]:
    """One message; EOFError when the other side hung up between messages."""
    (n,) = _LEN.unpack(_exact(sock, _LEN.size))
    if n > MAX_FRAME:
        raise ProtocolError(f"frame of {n} bytes")
    try:
        msg = json.loads(_exact(sock, n))
    except ValueError as e:
        raise ProtocolError(str(e)) from None
    if not isinstance(msg, dict):
        raise ProtocolError("not an object")
    return msg
