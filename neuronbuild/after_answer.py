"""Work a command leaves for after its answer: in the build server, what the user does not wait for (the invocation
record and its page, the no-op stamp) runs once the command's exit code is sent and before the server reads its next
command (server/daemon.py calls `run`; the server runs one command at a time), so the next command finds it done. In
batch mode (and wherever nothing calls `run`) it runs in place, at once. Imports nothing: the no-op fast path uses it."""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable

_deferring = False
_pending: list[Callable[[], object]] = []


def defer(on: bool) -> None:
    """Whether `later` defers (the build server, for its commands: incremental.keep_in_memory). Turning it off runs
    what is pending."""
    global _deferring
    if not on:
        run()
    _deferring = on


def later(fn: Callable[[], object]) -> None:
    """Run `fn` after the answer (deferring), else now."""
    if _deferring:
        _pending.append(fn)
    else:
        fn()


def run() -> None:
    """Run what the last command left, in order; a failure is printed (the server's log) and the rest still run. The
    time it took is logged (stdout: the server's log)."""
    if not _pending:
        return
    start = time.perf_counter()
    n = len(_pending)
    while _pending:
        fn = _pending.pop(0)
        try:
            fn()
        except Exception:  # noqa: BLE001 - a record or a stamp not written costs a page or a speed-up, never the server
            traceback.print_exc(file=sys.stderr)
    print(f"{time.strftime('%H:%M:%S')} after the answer: {n} task(s) in {time.perf_counter() - start:.2f} s",
          flush=True)
