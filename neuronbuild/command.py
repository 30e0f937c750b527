"""One command's own state, as an object (issue #45): its argv, environment, working directory, output streams, umask
and the typed NEURONBUILD_* config read once from that environment (envvars.Config).

The CLI entry makes one for a batch command (`Command.batch`: this process's), the build server one from its client's
message (`Command.from_message`), and either runs the command inside `cmd.active()`, which makes it `current()` (and
its config envvars.current()) for the command's code. Commands take what they need from it: paths given on the command
line are resolved against `cmd.cwd` (`cmd.path`), output goes to `cmd.out`/`cmd.err`. The build context carries it
(context.make_context), and with it the bundle signing key (`--signing-key`, else $NEURONBUILD_SIGNING_KEY), which
reaches packaging as an argument, never through the process environment."""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from neuronbuild import envvars, streams
from neuronbuild.atomic import current_umask


class Stream(Protocol):
    """Where a command's output goes: sys.stdout/err of a batch command, a socket stream of a server one."""

    def write(self, s: str, /) -> int: ...

    def flush(self) -> None: ...

    def isatty(self) -> bool: ...


@dataclass(frozen=True)
class Command:
    argv: tuple[str, ...]
    env: Mapping[str, str]
    cwd: Path
    out: Stream = field(repr=False)
    err: Stream = field(repr=False)
    umask: int = 0o022
    config: envvars.Config = field(default=None, repr=False)  # type: ignore[assignment]  # (made from env)
    # Where its builds get worker pools (execution/local_executor.Pools): None, a fresh pool per build (batch); the
    # build server's session (server/warm.py WarmState), which keeps one across commands
    pools: Any = field(default=None, repr=False, compare=False)
    # What its loads and plans keep in memory (incremental.Session): None, nothing (batch); the build server's
    # session, which keeps the load caches and the analysis engine across commands
    session: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.config is None:
            object.__setattr__(self, "config", envvars.Config.of(self.env))

    @classmethod
    def batch(cls, argv: Sequence[str]) -> Command:
        """A command run in this process: its environment, cwd, umask and standard streams."""
        return cls(tuple(argv), dict(os.environ), Path(os.getcwd()), sys.stdout, sys.stderr, current_umask())

    @classmethod
    def from_message(cls, msg: Mapping[str, Any], out: Stream, err: Stream, pools: Any = None,
                     session: Any = None) -> Command:
        """A command a build server runs for a client (server/protocol.py's command message)."""
        umask = msg.get("umask")
        return cls(tuple(str(a) for a in msg.get("argv") or []),
                   {str(k): str(v) for k, v in (msg.get("env") or {}).items()},
                   Path(str(msg.get("cwd") or "/")), out, err, umask & 0o777 if isinstance(umask, int) else 0o022,
                   pools=pools, session=session)

    def path(self, p: str | os.PathLike[str]) -> Path:
        """A path given by the user: ~ expanded (the command's $HOME), relative ones against the command's directory,
        made absolute."""
        text = os.fspath(p)
        home = self.env.get("HOME")
        if home and (text == "~" or text.startswith("~/")):
            text = home + text[1:]
        q = Path(text).expanduser()
        return Path(os.path.normpath(self.cwd / q)) if not q.is_absolute() else q

    def in_directory(self, directory: str) -> Command:
        """This command as if started in `directory` (-C)."""
        return replace(self, cwd=self.path(directory))

    def with_env(self, changes: Mapping[str, str | None]) -> Command:
        """This command with its environment changed (None: removed) and its config read again from it."""
        config = self.config.with_env(changes)
        return replace(self, env=config.env, config=config)

    def mode(self, base: int = 0o666) -> int:
        """The mode a file the command creates gets (`base` less the command's umask)."""
        return base & ~self.umask

    def signing_key(self, flag: str | None) -> Path | None:
        """The key bundles are signed with: `flag` (--signing-key), else $NEURONBUILD_SIGNING_KEY; absolute."""
        given = flag or self.config.text("NEURONBUILD_SIGNING_KEY")
        return Path(os.path.realpath(self.path(given))) if given else None

    @contextlib.contextmanager
    def active(self) -> Iterator[Command]:
        """Runs the code inside as this command: current() is it, envvars.current() its config."""
        token = _current.set(self)
        try:
            with envvars.using(self.config), streams.using(self.out, self.err):
                yield self
        finally:
            _current.reset(token)


_current: contextvars.ContextVar[Command | None] = contextvars.ContextVar("neuronbuild_command", default=None)


def current() -> Command:
    """The running command; outside one (library use, tests calling a command's code), this process as a command."""
    cmd = _current.get()
    return cmd if cmd is not None else Command.batch(sys.argv[1:])
