"""Work a command leaves for after its answer: in the build server, what the user does not wait for (the invocation
record and its page, the no-op stamp) runs once the command's exit code is sent and before the server reads its next
command (server/daemon.py calls `run`; the server runs one command at a time), so the next command finds it done. In
batch mode (and wherever nothing calls `run`) it runs in place, at once. The warnings that work prints (a record that
could not be written) would reach only the server's log: they are kept, and the next command shows them (`carried`).
Imports nothing beyond typing: the no-op fast path uses it."""

from __future__ import annotations

import contextvars
import sys
import time
import traceback
from collections.abc import Callable, Generator
from typing import Any

from neuronbuild import streams

_deferring = False
_pending: list[tuple[contextvars.Context, Callable[[], object]]] = []  # (the command's context, the task)
_when_idle: list[Callable[[], object]] = []  # what may wait until the server idles (when_idle)
_carried: list[str] = []  # warnings of the work done after the last answer, for the next command to show (at most 20)


class _Tee:
    """stderr while that work runs: written through to the server's log, and kept."""

    def __init__(self, log: Any) -> None:
        self.log = log
        self.text: list[str] = []

    def write(self, s: str) -> int:
        self.text.append(s)
        return self.log.write(s)

    def flush(self) -> None:
        self.log.flush()


def defer(on: bool) -> None:
    """Whether `later` defers (the build server, for its commands: incremental.keep_in_memory). Turning it off runs
    what is pending."""
    global _deferring
    if not on:
        run()
    _deferring = on


def later(fn: Callable[[], object]) -> None:
    """Run `fn` after the answer (deferring), else now. Deferred, it runs in the command's context (its environment and
    config: the no-op stamp it writes is the one the command checked), its output kept for the next command (run)."""
    if _deferring:
        _pending.append((contextvars.copy_context(), fn))
    else:
        fn()


def when_idle(fn: Callable[[], object]) -> None:
    """Run `fn` once the build server idles (deferring: its background steps after an answer, `idle_steps`), else now.
    For what nobody waits for and the next command does not read (a page's renderer): a script's commands back to back
    do not share the machine with it."""
    if _deferring:
        _when_idle.append(fn)
    else:
        fn()


def idle_steps() -> Generator[float, None, None]:
    """Run what waits for the server to idle, one task per step (the server's background steps; a command arriving
    ends them, and what is left waits for the next idle time)."""
    while _when_idle:
        fn = _when_idle.pop(0)
        try:
            fn()
        except Exception:  # noqa: BLE001 - a page not rendered costs a page, never the server
            traceback.print_exc(file=sys.stderr)
        yield 0.0


def _in_streams(tee: _Tee, fn: Callable[[], object]) -> None:
    # the command's answer was sent: what the task writes goes to the server's log and is kept (what it warns is
    # carried to the next command)
    with streams.using(sys.stdout, tee):
        fn()


def run() -> None:
    """Run what the last command left, in order; a failure is printed (the server's log) and the rest still run. The
    time it took is logged (stdout: the server's log)."""
    if not _pending:
        return
    start = time.perf_counter()
    n = len(_pending)
    tee = _Tee(sys.stderr)
    while _pending:
        ctx, fn = _pending.pop(0)
        try:
            ctx.run(_in_streams, tee, fn)  # (in its command's context: its environment and config)
        except Exception as e:  # noqa: BLE001 - a record or a stamp not written costs a page or a speed-up only
            traceback.print_exc(file=tee.log)
            tee.text.append(f"warning: {type(e).__name__}: {e} (the build server's log has its traceback)\n")
    _carried.extend(ln for ln in "".join(tee.text).splitlines() if ln.startswith("warning: "))
    del _carried[:-20]
    print(f"{time.strftime('%H:%M:%S')} after the answer: {n} task(s) in {time.perf_counter() - start:.2f} s",
          flush=True)


def carried() -> list[str]:
    """The warnings of the work done after the last answer (each once), worded for the next command's stderr."""
    out = [f"warning: after the previous command's answer: {ln[len('warning: '):]}" for ln in _carried]
    _carried.clear()
    return out
