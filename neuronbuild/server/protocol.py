"""Where a workspace's server lives (output base, socket, info file), its identity stamp and the wire format.

Imported by the thin client, which a no-op through the server is mostly made of: only built-in modules (not json,
pathlib, typing, socket, hashlib or struct: each costs milliseconds to import; frames are JSON made and read by json's
C accelerator `_json` directly, the same text json.dumps makes, with json itself as the fallback)."""

from __future__ import annotations

import os
import sys

from neuronbuild import envvars
from neuronbuild.self_stamp import checkout_dir, code_stamp

try:  # CPython's built-in SHA-256 (hashlib imports OpenSSL's binding first: milliseconds)
    from _sha2 import sha256  # type: ignore[import-not-found]  # Python >= 3.12
except ImportError:
    try:
        from _sha256 import sha256  # type: ignore[import-not-found,no-redef]
    except ImportError:
        from hashlib import sha256  # type: ignore[assignment]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from _socket import socket  # (socket.socket is a subclass)
    from collections.abc import Callable
    from pathlib import Path
    from typing import Any

DEFAULT_MAX_IDLE_SECS = 3 * 3600
MAX_FRAME = 64 << 20  # a frame larger than this is a protocol error
_LEN_SIZE = 4  # big-endian frame length
# Commands the client hands to the server; every other command runs in the client (they are cheap or local).
SERVER_COMMANDS = ("build", "plan", "explain", "query")


class ProtocolError(Exception):
    """The other side sent something that is not a frame of this protocol (or hung up mid-frame)."""


def _no_default(o: object) -> object:
    raise TypeError(f"a {type(o).__name__} is not JSON serializable")


def _codec() -> tuple[Callable[[Any], str], Callable[[Any], str], Callable[[str], Any]]:
    """(compact JSON, compact JSON with sorted keys, parse): json's C encoder and scanner, called as json.dumps and
    json.loads call them (importing json imports re, enum and more: most of a no-op client's imports)."""
    try:
        import _json

        class _Decoding:  # what the C scanner reads of a json.JSONDecoder
            strict = True
            object_hook = object_pairs_hook = None
            parse_float, parse_int = float, int

            @staticmethod
            def parse_constant(name: str) -> float:
                return float(name.replace("Infinity", "inf"))

        scan = _json.make_scanner(_Decoding())  # type: ignore[arg-type]  # (reads these attributes)
        encoders = [_json.make_encoder(None, _no_default, _json.encode_basestring_ascii, None, ":", ",", sort, False,
                                       True) for sort in (False, True)]

        def dumps(o: Any) -> str:
            return "".join(encoders[0](o, 0))

        def dumps_sorted(o: Any) -> str:
            return "".join(encoders[1](o, 0))

        def loads(text: str) -> Any:
            try:
                obj, end = scan(text, 0)
            except StopIteration:
                raise ValueError("not JSON") from None
            if end != len(text):
                raise ValueError("extra data after the JSON value")
            return obj

        if dumps({"b": [1, "\u00e9", True, None], "a": 1.5}) == '{"b":[1,"\\u00e9",true,null],"a":1.5}' and \
                dumps_sorted({"b": 1, "a": 2}) == '{"a":2,"b":1}' and loads('{"a":[1,"\\u00e9",null]}') == \
                {"a": [1, "\u00e9", None]}:
            return dumps, dumps_sorted, loads
    except (ImportError, AttributeError, TypeError, ValueError):
        pass
    import json

    return (lambda o: json.dumps(o, separators=(",", ":")),
            lambda o: json.dumps(o, separators=(",", ":"), sort_keys=True), json.loads)


dumps, dumps_sorted, loads = _codec()


class StartupOptions:
    """Options fixed for a server's life (Bazel's startup options): a command asking for others replaces it."""

    __slots__ = ("output_user_root", "max_idle_secs")

    def __init__(self, output_user_root: str, max_idle_secs: int = DEFAULT_MAX_IDLE_SECS) -> None:
        self.output_user_root = output_user_root
        self.max_idle_secs = max_idle_secs

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StartupOptions) and self.to_json() == other.to_json()

    def __hash__(self) -> int:
        return hash((self.output_user_root, self.max_idle_secs))

    def to_json(self) -> dict[str, Any]:
        return {"output_user_root": self.output_user_root, "max_idle_secs": self.max_idle_secs}


def default_output_user_root() -> str:
    env = envvars.current().text("NEURONBUILD_OUTPUT_USER_ROOT")
    if env:
        return os.path.abspath(os.path.expanduser(env))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "neuronbuild-server")


class ServerPaths:
    """The files of one workspace's server, all inside its output base (a directory only this user can enter).
    Paths are strings (the client does not import pathlib)."""

    __slots__ = ("output_base", "socket")

    def __init__(self, output_base: str, socket: str) -> None:
        self.output_base = output_base
        self.socket = socket

    @property
    def info(self) -> str:
        return os.path.join(self.output_base, "server.json")

    @property
    def log(self) -> str:
        return os.path.join(self.output_base, "server.log")

    @property
    def start_lock(self) -> str:
        return os.path.join(self.output_base, "start.lock")

    @property
    def secret(self) -> str:
        """The running server's secret (0600, written before it listens): every request carries it, so a process
        that can reach the socket but not read this file (an action's, confined) cannot drive the server."""
        return os.path.join(self.output_base, "server.secret")


SECRET_BYTES = 32


def new_secret(paths_secret: str) -> str:
    """Make a fresh secret and write it (mode 0600, replacing any older one) for clients to read."""
    secret = os.urandom(SECRET_BYTES).hex()
    # Not atomic.atomic_writer: this module stays free of tempfile/pathlib imports (the no-op client imports it).
    # O_EXCL|O_NOFOLLOW on a pid-named temp in the 0700 output base, then a rename: the same guarantee.
    tmp = f"{paths_secret}.{os.getpid()}"
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, secret.encode())
    finally:
        os.close(fd)
    os.replace(tmp, paths_secret)
    return secret


def read_secret(paths_secret: str) -> str:
    """The server's secret, or "" when the file is missing, not this user's or readable by others."""
    try:
        fd = os.open(paths_secret, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return ""
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            return ""
        return os.read(fd, 256).decode("ascii", "replace").strip()
    finally:
        os.close(fd)


def same_secret(a: object, b: str) -> bool:
    import hmac

    return isinstance(a, str) and bool(b) and hmac.compare_digest(a.encode(), b.encode())


_MAX_ARGS, _MAX_ENV = 4096, 4096


def command_error(msg: dict[str, Any]) -> str | None:
    """Why a command request is malformed (each field's type and bounds), else None."""
    argv, env, cwd, tty = msg.get("argv"), msg.get("env"), msg.get("cwd"), msg.get("tty")
    if not isinstance(argv, list) or len(argv) > _MAX_ARGS or not all(isinstance(a, str) for a in argv):
        return "argv must be a list of strings"
    if not isinstance(cwd, str) or not os.path.isabs(cwd) or "\0" in cwd:
        return "cwd must be an absolute path"
    if not isinstance(env, dict) or len(env) > _MAX_ENV or not all(
            isinstance(k, str) and isinstance(v, str) and k and "=" not in k and "\0" not in k + v
            for k, v in env.items()):
        return "env must map names to strings"
    if not isinstance(tty, list) or len(tty) != 2 or not all(isinstance(t, bool) for t in tty):
        return "tty must be two booleans"
    if not isinstance(msg.get("stamp"), str) or not isinstance(msg.get("pid", 0), int):
        return "stamp must be a string and pid an integer"
    return None


def server_paths(workspace_root: Path | str, output_user_root: str) -> ServerPaths:
    """One output base per workspace (per user root), as Bazel keys its output base by the workspace's path."""
    key = sha256(str(workspace_root).encode()).hexdigest()[:16]
    base = os.path.join(output_user_root, key)
    sock = os.path.join(base, "server.sock")
    if len(os.fsencode(sock)) > 100:  # sun_path holds 108 bytes: a deep output base gets a short socket path
        short = sha256(base.encode()).hexdigest()[:16]
        sock = os.path.join("/tmp", f"neuronbuild-{os.getuid()}", f"{short}.sock")
    return ServerPaths(base, sock)


def private_dir(d: str | Path) -> None:
    """Make `d` (and parents) and insist it is this user's and mode 0700: nobody else may reach the socket."""
    os.makedirs(d, mode=0o700, exist_ok=True)
    st = os.lstat(d)
    if st.st_uid != os.geteuid():
        raise PermissionError(f"{d} belongs to another user: refusing to use it for the build server")
    if st.st_mode & 0o077:
        os.chmod(d, 0o700)


def server_stamp(opts: StartupOptions) -> str:
    """Who a server is: neuronbuild's code (version, format, every source file), the interpreter, its import path and
    the toolchain as the no-op stamp sees it (stat keys of sys.path entries and compilers: installing or upgrading
    torch changes them), plug-in settings, the startup options and the umask. A client whose stamp differs replaces the server,
    so nothing a server memoised about its environment outlives a change to it."""
    tools = []
    for p in _toolchain_paths():
        try:
            st = os.stat(p)
            tools.append([p, st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns])
        except OSError:
            tools.append([p])
    cfg = envvars.current()
    plugins = sorted((k, cfg.env[k]) for k in ("NEURONBUILD_PLUGINS", "NEURONBUILD_PLUGIN_PATH") if k in cfg.env)
    plugin_files = []
    for d in cfg.words("NEURONBUILD_PLUGIN_PATH"):
        if not d:
            continue
        try:
            with os.scandir(d) as it:
                plugin_files.extend(sorted([e.path, e.stat().st_mtime_ns, e.stat().st_size] for e in it
                                           if e.name.endswith(".py")))
        except OSError:
            pass
    # The umask: a server runs with the umask of the client that started it (what it writes for commands, and the
    # processes it starts, get it as a batch command's would), so a client with another umask replaces it rather
    # than the server changing its umask per command.
    umask = os.umask(0o077)
    os.umask(umask)
    text = dumps_sorted({"code": code_stamp(), "python": sys.version, "exe": os.path.realpath(sys.executable),
                         "prefix": sys.prefix, "path": sys.path[1:], "tools": tools, "plugins": plugins,
                         "plugin_files": plugin_files, "opts": opts.to_json(), "umask": umask})
    return sha256(text.encode()).hexdigest()


def _which(name: str) -> str | None:
    for d in os.environ.get("PATH", os.defpath).split(os.pathsep):
        p = os.path.join(d or ".", name)
        if os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    return None


def _toolchain_paths() -> list[str]:
    """noop.toolchain_paths without importing noop (and shutil): sys.path entries (but a checkout neuronbuild runs
    from: code_stamp covers its sources) and the executables the built-in toolchains' settings declare (their
    compilers), on PATH (plug-ins' settings are not imported here: the stamp covers the plug-in files)."""
    from neuronbuild.plugins import tool_files

    skip = checkout_dir()
    out = [p for p in sys.path[1:] if p and p != skip and os.path.isdir(p)]
    for t in tool_files(builtin_only=True):
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


def send(sock: socket, msg: dict[str, Any]) -> None:
    data = dumps(msg).encode()
    sock.sendall(len(data).to_bytes(_LEN_SIZE, "big") + data)


def _exact(sock: socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("connection closed")
        buf += chunk
    return bytes(buf)


def recv(sock: socket) -> dict[str, Any]:
    """One message; EOFError when the other side hung up between messages."""
    n = int.from_bytes(_exact(sock, _LEN_SIZE), "big")
    if n > MAX_FRAME:
        raise ProtocolError(f"frame of {n} bytes")
    try:
        msg = loads(_exact(sock, n).decode("utf-8"))
    except (ValueError, RecursionError) as e:  # (UnicodeDecodeError is a ValueError)
        raise ProtocolError(str(e)) from None
    if not isinstance(msg, dict):
        raise ProtocolError("not an object")
    return msg
