"""The only module that touches starlark-go: one interpreter per file set, run on one dedicated thread.

Sharp edges handled here (see ../shared/notes/starlark-go.md): natives are kept referenced for the interpreter's life,
`get`/`pop` are never called with defaults, print callbacks cannot raise, and every call runs off the main thread.
The binding truncates a string at its first NUL when it converts it to Python (`"b" + ("%c" % 0) + "junk"` arrives as
`"b"`) and overflows the Go stack (a fatal crash) converting a value that contains itself. So natives are registered
under reserved `__nb_raw_` names, and the names user code calls are Starlark closures (`_GUARD`) that first take one
`repr()` of the arguments (it escapes a NUL as `\\x00` and writes a cycle as `[...]`/`{...}`) and search it; only on
a match do they hand the reprs (which hold no NUL) to `_scan_repr`, which tells a real NUL or cycle from a string that
merely spells one and raises naming the argument (reported at the caller's line). Cost: see
benchmarks/load_guard_bench.py. Names starting with `__nb_` are reserved for this (RESERVED_PREFIX; the loader refuses
them in BUILD and .bzl files).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import queue
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, TypeVar

from neuronbuild import envvars, streams
from neuronbuild.errors import EXIT_BAD_INPUT, Location, UserInputError

T = TypeVar("T")
_FRAME_RE = re.compile(r"^\s+(.+):(\d+):(\d+): in (.+)$")
RESERVED_PREFIX = "__nb_"  # names user code may not use: the raw natives and the guard's helpers
GUARD_FILE = "<neuronbuild>"  # the filename of the guard's frames, dropped from backtraces

# One closure factory, a lambda (compiled once per interpreter: each def, comprehension or statement more costs ~10 us
# per BUILD file). The fast path is two reprs and two searches ("..." covers both cycle markers); the slow path hands
# the reprs to _scan_repr (through __nb_check) and calls the native only if nothing is wrong.
_GUARD = """
def __nb_wrap(f):
    return lambda *a, **k: f(*a, **k) if not ("\\\\x00" in repr((a, k)) or "..." in repr((a, k))) else __nb_check(repr(a), repr(k)) or f(*a, **k)
"""
# A Starlark repr, token by token: a string literal (with its escapes), a cycle marker, punctuation, or anything else.
_REPR_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[\.\.\.\]|\{\.\.\.\}|[\[\]{}(),:]|[^"\[\]{}(),:]+', re.S)
_NUL_ESCAPE = re.compile(r"\\(x00|u0000|U00000000|.)", re.S)


class GuardError(Exception):
    """An argument that cannot cross into Python intact (a NUL in a string, a value that contains itself)."""


def _scan_repr(r: str, keyed: bool) -> tuple[str, str] | None:
    """What is wrong with a value whose Starlark repr is r: (where, problem) for a NUL in a string or a cycle, None
    when nothing is. r is the repr of the call's arguments: a tuple (where = "argument N") or, when `keyed`, the
    keyword dict (where = "attribute 'name'")."""
    depth, index, key, expect_key = 0, 1, "", False
    for m in _REPR_TOKEN.finditer(r):
        tok = m.group(0)
        if tok in ("(", "[", "{"):
            depth += 1
            expect_key = keyed and depth == 1
        elif tok in (")", "]", "}"):
            depth -= 1
        elif tok == "," and depth == 1:
            index += 1
            expect_key = keyed
        elif tok.startswith('"'):
            if expect_key:
                key, expect_key = tok[1:-1], False
            if any(len(e) > 1 for e in _NUL_ESCAPE.findall(tok)):  # escapes read in order: "\\x00" is no NUL
                return (f"attribute '{key}'" if keyed else f"argument {index}",
                        "NUL character in a string (starlark-go would silently truncate it)")
        elif tok in ("[...]", "{...}"):
            return (f"attribute '{key}'" if keyed else f"argument {index}", "value contains itself")
    return None


@dataclass(frozen=True)
class Frame:
    """One frame of a Starlark backtrace."""

    path: str
    line: int
    col: int
    function: str


class StarlarkFailure(Exception):
    """A Starlark syntax, resolve or evaluation error, with the location of its innermost user frame."""

    def __init__(self, message: str, path: str, line: int, col: int, frames: tuple[Frame, ...] = ()) -> None:
        super().__init__(message)
        self.message = message
        self.path = path
        self.line = line
        self.col = col
        self.frames = frames


_queue: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], Future[Any]]] | None = None
_queue_lock = threading.Lock()


def _serve(q: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], Future[Any]]]) -> None:
    while True:
        fn, args, fut = q.get()
        if not fut.set_running_or_notify_cancel():
            continue
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
            fut.set_exception(e)


# Memory. starlark-go 1.0.1 has no allocation limit (a 100-byte BUILD file looping over ever larger lists reached
# 3.1 GB) and its evaluation cannot be interrupted. So the waiting caller watches this process's anonymous memory
# (where the Go heap lives) while a file is evaluated: growth past the per-file budget fails the load with a located
# error (the file being evaluated), the evaluation is abandoned (the process must end: the batch command does as it
# reports the error, the build server after the command), and a runaway that reaches twice the budget before then
# ends the process at once.
BUDGET_ENV = "NEURONBUILD_STARLARK_MEMORY_MB"
DEFAULT_BUDGET_MB = 1024
_evaluating: tuple[int, str] | None = None  # (a number per evaluation, its file) while the Starlark thread runs one
_evaluations = 0


def memory_budget() -> int:
    """The per-file Starlark memory budget in bytes ($NEURONBUILD_STARLARK_MEMORY_MB, default 1024 MiB)."""
    try:
        mb = envvars.current().integer(BUDGET_ENV)
    except UserInputError:
        mb = DEFAULT_BUDGET_MB
    return max(16, mb) << 20


def _anon_bytes() -> int:
    """This process's resident anonymous memory (resident minus file-backed and shared pages), in bytes."""
    try:
        with open("/proc/self/statm", "rb") as f:
            fields = f.read().split()
        return (int(fields[1]) - int(fields[2])) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class StarlarkMemoryError(UserInputError):
    """A file whose evaluation outgrew the per-file memory budget (exit 2, located at the file)."""


class _Watch:
    """The waiting caller's view of memory: the reading at its last look, and the evaluation (and the reading just
    before it began) it is measuring. One /proc read per look (every 50 ms), none per file: a file that ends between
    two looks is never measured (it cannot allocate much in 50 ms), and a file's baseline is the look before it."""

    __slots__ = ("last", "evaluation", "base")

    def __init__(self) -> None:
        self.last = _anon_bytes()
        self.evaluation = -1
        self.base = 0

    def check(self, fut: Future[Any]) -> None:
        """Raise StarlarkMemoryError when the file being evaluated has grown this process past its budget."""
        current = _evaluating
        now = _anon_bytes()
        if current is not None and current[0] != self.evaluation:
            self.evaluation, self.base = current[0], self.last
        self.last = now
        if current is None or now - self.base <= (budget := memory_budget()):
            return
        _reap_if_runaway(fut, self.base, budget)
        raise StarlarkMemoryError(
            f"evaluating {current[1]} used more than {budget >> 20} MiB of memory (the per-file Starlark budget, "
            f"${BUDGET_ENV}); is a loop building ever larger values?", Location(current[1]))


def _reap_if_runaway(fut: Future[Any], start: int, budget: int) -> None:
    """While the abandoned evaluation runs on, end this process if it reaches twice the budget (it cannot be stopped
    otherwise; the caller reports the error and exits, or the server ends after the command, normally sooner)."""
    def watch() -> None:
        while not fut.done():
            if _anon_bytes() - start > 2 * budget:
                with contextlib.suppress(OSError):
                    os.write(2, b"neuronbuild: a Starlark evaluation over its memory budget kept allocating: exiting\n")
                os._exit(EXIT_BAD_INPUT)
            time.sleep(0.02)

    threading.Thread(target=watch, name="starlark-reaper", daemon=True).start()


def run_on_starlark_thread(fn: Callable[..., T], *args: Any) -> T:
    """Run fn on the dedicated Starlark thread (main-thread calls are ~20x slower with this binding).

    The thread is a daemon and the wait is interruptible: Starlark code that never ends (starlark-go 1.0.1 has no CPU
    limit) cannot be stopped, but Ctrl-C/SIGTERM still end the caller at once and the process exits without joining
    the thread (a ThreadPoolExecutor would join it at exit, forever)."""
    global _queue
    with _queue_lock:
        if _queue is None:
            _queue = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(_queue,), name="starlark", daemon=True).start()
    fut: Future[T] = Future()
    watch = _Watch()
    # in the caller's context: a BUILD file's print() goes to the command's stream, settings are the command's
    _queue.put((contextvars.copy_context().run, (fn, *args), fut))
    try:
        while True:
            # Poll: a process-directed signal may be taken by one of the Go runtime's threads, whose handler only sets
            # Python's flag; an untimed wait would never wake to run the handler (seen: 1 Ctrl-C in 10 ignored).
            try:
                return fut.result(timeout=0.05)
            except FutureTimeout:
                watch.check(fut)
    except BaseException:
        if not fut.cancel() and not fut.done():  # already running: it cannot be stopped, and holds the thread
            _abandoned.append(fut)
        raise


_abandoned: list[Future[Any]] = []  # evaluations whose caller gave up (Ctrl-C, a cancelled server command)


def starlark_thread_stuck() -> bool:
    """Whether an evaluation whose caller gave up still runs on the Starlark thread (an endless loop): every later
    evaluation in this process would wait behind it for ever, so a long-lived process (the build server) must end."""
    return any(not f.done() for f in _abandoned)


def _safe_print(prefix: str) -> Callable[[str], None]:
    def _print(msg: str) -> None:
        try:
            streams.err().write(f"DEBUG: {prefix}: {msg}\n")  # (the command's: run in its context)
        except Exception:  # noqa: BLE001 - a print callback must never raise
            pass

    return _print


@functools.lru_cache(maxsize=8)
def _guard_source(names: tuple[str, ...]) -> str:
    """_GUARD plus one statement binding every native's name to its guarded closure."""
    return _GUARD + ", ".join(names) + " = " + ", ".join(f"{RESERVED_PREFIX}wrap({RESERVED_PREFIX}raw_{n})"
                                                         for n in names) + ("," if len(names) == 1 else "") + "\n"


def parse_backtrace(text: str) -> tuple[Frame, ...]:
    frames = []
    for line in text.splitlines():
        m = _FRAME_RE.match(line)
        if m:
            frames.append(Frame(m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)))
    return tuple(frames)


class Interpreter:
    """A Starlark interpreter with registered natives. Use only on the Starlark thread."""

    def __init__(self, natives: dict[str, Callable[..., Any]], print_prefix: str) -> None:
        self._natives = dict(natives)  # strong references for the interpreter's whole life
        self._print = _safe_print(print_prefix)
        import starlark_go  # here, not at import: loading it starts Go runtime threads, and workers (which fork per
        # action and import this module through the plug-ins) must stay single-threaded

        self._guard_error: str | None = None
        self._sl = starlark_go.Starlark(print=self._print)
        if self._natives:
            raw: dict[str, Callable[..., Any]] = {f"{RESERVED_PREFIX}raw_{n}": fn for n, fn in self._natives.items()}
            raw[f"{RESERVED_PREFIX}check"] = self._check_fn = self._check  # referenced as long as the interpreter
            self._sl.set(**raw)
            self.exec(_guard_source(tuple(self._natives)), GUARD_FILE)

    def _check(self, args: str, kwargs: str) -> None:
        """The guard's slow path, given the reprs of the call's positional and keyword arguments: checked exactly;
        raises naming the first bad argument."""
        found = _scan_repr(args, False) or _scan_repr(kwargs, True)
        if found:
            self._guard_error = f"{found[0]}: {found[1]}"
            raise GuardError(self._guard_error)

    def names(self) -> list[str]:
        return list(self._sl.globals())

    def exec(self, source: str, filename: str) -> None:
        """Execute source; raise StarlarkFailure with file:line:col on any error."""
        import starlark_go

        global _evaluating, _evaluations
        self._guard_error = None
        _evaluations += 1
        _evaluating = (_evaluations, filename)
        try:
            self._sl.exec(source, filename=filename)
        except starlark_go.SyntaxError as e:
            raise StarlarkFailure(str(e.msg), str(e.filename), int(e.line), int(e.column)) from None
        except starlark_go.ResolveError as e:
            item = e.errors[0]
            raise StarlarkFailure(str(item.msg), filename, int(item.line), int(item.column)) from None
        except starlark_go.EvalError as e:
            frames = tuple(f for f in parse_backtrace(str(getattr(e, "backtrace", ""))) if f.path != GUARD_FILE)
            msg = str(e)
            tail = str(getattr(e, "backtrace", "")).strip().splitlines()
            if tail and tail[-1].startswith("Error"):
                msg = tail[-1].split(": ", 1)[1] if ": " in tail[-1] else tail[-1]
                if msg.startswith("fail: "):
                    msg = msg[len("fail: "):]
            if self._guard_error is not None:
                msg, self._guard_error = self._guard_error, None
            if frames:
                f = frames[-1]
                raise StarlarkFailure(msg, f.path, f.line, f.col, frames) from None
            raise StarlarkFailure(msg, str(e.filename), int(e.line), int(e.column)) from None
        except starlark_go.StarlarkError as e:
            raise StarlarkFailure(str(e), filename, 1, 1) from None
        finally:
            _evaluating = None
