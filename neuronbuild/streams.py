"""Where the running command's output goes (command.Command.out/err), for every layer: `out()` and `err()`.

A batch command's are sys.stdout/sys.stderr; a build-server command's are the streams to its client. The command
layer makes them current (`using`, from Command.active()); outside a command (the server's own log, library use) they
are sys.stdout/sys.stderr. Code that hands work to a thread it keeps takes the streams along explicitly (the Starlark
thread prints a BUILD file's print() to the stream captured when the evaluation was made)."""

from __future__ import annotations

import contextvars
import sys

TYPE_CHECKING = False  # (not typing's: the build server's thin client stays light)
if TYPE_CHECKING:
    from typing import Any

_current: contextvars.ContextVar[tuple[Any, Any] | None] = contextvars.ContextVar("neuronbuild_streams", default=None)


def out() -> Any:
    """The running command's standard output (else sys.stdout)."""
    s = _current.get()
    return s[0] if s is not None else sys.stdout


def err() -> Any:
    """The running command's standard error (else sys.stderr)."""
    s = _current.get()
    return s[1] if s is not None else sys.stderr


class using:  # noqa: N801 - a context manager
    """`with using(out, err):` the code inside writes its output there."""

    def __init__(self, out: Any, err: Any) -> None:
        self.pair = (out, err)
        self._tokens: list[contextvars.Token[tuple[Any, Any] | None]] = []

    def __enter__(self) -> None:
        self._tokens.append(_current.set(self.pair))

    def __exit__(self, *exc: object) -> None:
        _current.reset(self._tokens.pop())
