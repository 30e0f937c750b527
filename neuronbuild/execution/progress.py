"""Build progress for people: a live display on a terminal (rich), one line per event otherwise; --quiet, --verbose."""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from typing import IO, Any

from neuronbuild import envvars, streams
from neuronbuild.execution import events as ev
from neuronbuild.execution.events import BuildEvent

QUIET, NORMAL, VERBOSE = 0, 1, 2


class _Tally:
    """Counts and estimates shared by both displays."""

    def __init__(self) -> None:
        self.to_execute = 0
        self.done = 0
        self.executed = 0
        self.reused = 0
        self.cached = 0
        self.failed = 0
        self.jobs = 1
        self.estimate: dict[str, float] = {}
        self.running: dict[str, tuple[str, float, str]] = {}  # fingerprint -> (description, start, worker)
        # Sent to a farm beyond its threads (queued on a Dask worker, oldest first): each is counted as running from
        # when a running action ends (a thread freed), not from when it was sent
        self.queued: dict[str, tuple[str, float, str]] = {}
        self.finished: set[str] = set()
        self.errors: dict[tuple[str, str, str], str] = {}  # (kind, label, error_key) -> the first failure's description

    def update(self, e: BuildEvent) -> None:
        f = e.fields
        if e.kind == ev.BUILD_STARTED:
            self.to_execute = int(f["to_execute"])
            self.cached = int(f["cached"])
            self.jobs = max(1, int(f["jobs"]))
            self.estimate = {p["fingerprint"]: float(p["estimate_s"]) for p in f.get("plan", [])}
        elif e.kind == ev.ACTION_STARTED:
            self.jobs = max(1, int(f.get("slots", self.jobs)))  # workers may join (or leave) a farm mid-build
            (self.queued if f.get("queued") else self.running)[f["fingerprint"]] = (
                f["description"], e.time, f.get("worker", ""))
            self._promote(e.time)
        elif e.kind == ev.ACTION_FINISHED:
            self._ended(f["fingerprint"], e.time)
            self.finished.add(f["fingerprint"])
            self.done += 1
            self.executed += 1
        elif e.kind == ev.ACTION_CACHED and (f.get("by_other_build") or f.get("cutoff")):
            self.finished.add(f["fingerprint"])
            self.done += 1
            self.reused += 1
        elif e.kind == ev.ACTION_FAILED:
            self._ended(f["fingerprint"], e.time)
            if not f.get("will_retry"):
                self.finished.add(f["fingerprint"])
                self.failed += 1
                self.errors.setdefault(_failure_key(f), f["description"])
        elif e.kind == ev.ACTION_SKIPPED:
            self._ended(f["fingerprint"], e.time)
            self.finished.add(f["fingerprint"])

    def _ended(self, fp: str, now: float) -> None:
        self.running.pop(fp, None)
        self.queued.pop(fp, None)
        self._promote(now)

    def _promote(self, now: float) -> None:
        """A freed thread takes the oldest queued task (which one it really takes is the farm's; the count is right)."""
        while self.queued and len(self.running) < self.jobs:
            fp = next(iter(self.queued))
            desc, _sent, worker = self.queued.pop(fp)
            self.running[fp] = (desc, now, worker)

    def eta_s(self, now: float) -> float:
        """Remaining estimated work spread over the workers (recorded durations, else per-kind estimates)."""
        left = 0.0
        for fp, est in self.estimate.items():
            if fp in self.finished:
                continue
            if fp in self.running:
                left += remaining_s(est, now - self.running[fp][1])
            else:
                left += est
        return left / self.jobs

    def fraction(self, now: float) -> float:
        """How much of the work to execute is done, by estimated seconds (by count when nothing is estimated)."""
        total = sum(self.estimate.values())
        if total <= 0:
            return self.done / self.to_execute if self.to_execute else 1.0
        return min(1.0, max(0.0, 1.0 - self.eta_s(now) * self.jobs / total))


BAR_WIDTH = 24


def progress_bar(fraction: float, width: int = BAR_WIDTH) -> str:
    """A text bar: `━━━━━━━━━───────────────` for 1/3 (full cells, then the rest)."""
    full = int(round(max(0.0, min(1.0, fraction)) * width))
    return "━" * full + "─" * (width - full)


OVERRUN_FACTOR = 0.25  # an action past its estimate is assumed to need a quarter of its elapsed time more


def remaining_s(estimate: float, elapsed: float) -> float:
    """Expected seconds left of a running action: what its estimate leaves, but never less than OVERRUN_FACTOR of its
    elapsed time, so an action running past its estimate keeps the ETA moving instead of freezing it at 0:00."""
    return max(estimate - elapsed, OVERRUN_FACTOR * elapsed)


def _fmt_s(s: float) -> str:
    s = int(round(s))
    return f"{s // 60}:{s % 60:02d}"


def event_line(e: BuildEvent, t: _Tally, level: int) -> str | None:
    """The plain-text line for an event at a verbosity level, or None."""
    f = e.fields
    k = e.kind
    if k == ev.ACTION_FAILED:
        if f.get("will_retry"):
            return f"RETRY: {f['description']}: {_first(f['error'])} (attempt {f['attempt'] + 1})"
        first = t.errors.get(_failure_key(f))
        if first is not None and first != f["description"]:  # one message per distinct error, not per bucket
            return f"FAILED: {f['description']}: the same error as {first} (log: {f['log']})"
        return f"FAILED: {f['description']}: {_first(f['error'])} (log: {f['log']})"
    if level < NORMAL:
        return None
    if k == ev.BUILD_STARTED and f["to_execute"]:
        return (f"{f['total_actions']} actions: {f['cached']} cached, executing {f['to_execute']} "
                f"with {f['jobs']} {f['executor']} worker{'s' if f['jobs'] != 1 else ''}")
    if k == ev.ACTION_FINISHED:
        extra = f", {f['worker']}, peak {f['peak_rss_mb']:.0f} MB" if level >= VERBOSE else ""
        if f.get("skipped"):
            return f"[{t.done}/{t.to_execute}] {f['description']}: skipped ({f['skipped']}{extra})"
        return f"[{t.done}/{t.to_execute}] {f['description']} ({f['duration_s']:.1f} s{extra})"
    if k == ev.ACTION_CACHED and f.get("cutoff"):
        return f"[{t.done}/{t.to_execute}] {f['description']} ({f['cutoff']}: result reused)"
    if k == ev.ACTION_CACHED and f.get("by_other_build"):
        return f"[{t.done}/{t.to_execute}] {f['description']} (result of a concurrent build)"
    if level < VERBOSE:
        return None
    if k == ev.ACTION_CACHED:
        return f"CACHED: {f['description']}"
    if k == ev.ACTION_STARTED and f.get("queued"):
        return f"QUEUED: {f['description']} on {f['worker']} (attempt {f['attempt']}; starts when a worker thread frees)"
    if k == ev.ACTION_STARTED:
        pid = f" pid {f['pid']}" if f.get("pid") else ""
        return f"START: {f['description']} on {f['worker']}{pid} (attempt {f['attempt']})"
    if k == ev.ACTION_WAITING:
        return f"WAITING: {f['description']} (a concurrent build is running it)"
    if k == ev.ACTION_SKIPPED:
        return f"NOT RUN: {f['description']} (an input failed or the build stopped)"
    if k == ev.WARM_UP_FINISHED:
        m = f.get("metadata") or {}
        what = f"{m['built']} of {len(m['headers'])} precompiled headers built" if "headers" in m else "done"
        return (f"WARM-UP: {f['description']} on {f['worker']} ({f['duration_s']:.1f} s, "
                + (f"{what})" if f["ok"] else f"failed: {_first(f['error'])})"))
    return None


def error_key(error: str) -> str:
    """An error's message with its numbers left out: the same mistake hit at several buckets (whose sizes the
    message may quote) has one key."""
    return _NUMBERS.sub("#", error.strip())


_NUMBERS = re.compile(r"\d+")


def _failure_key(f: Mapping[str, Any]) -> tuple[str, str, str]:
    return str(f.get("kind", "")), str(f.get("label", "")), error_key(str(f.get("error", "")))


def _first(error: str) -> str:
    lines = error.strip().splitlines()
    return lines[0] if lines else "(no message)"


class PlainProgress:
    """One line per event (CI logs, pipes)."""

    def __init__(self, level: int = NORMAL, stream: IO[str] | None = None) -> None:
        self.level = level
        self.stream = stream or streams.err()
        self.tally = _Tally()

    def on_event(self, e: BuildEvent) -> None:
        self.tally.update(e)
        line = event_line(e, self.tally, self.level)
        if line is not None:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        pass


class RichProgress:
    """A live display: [done/total], counts, ETA and each running action with its elapsed time."""

    def __init__(self, level: int = NORMAL) -> None:
        from rich.console import Console
        from rich.live import Live

        self.level = level
        self.tally = _Tally()
        self.console = Console(file=streams.err(), _environ=dict(envvars.environ()))  # (the command's TERM, COLUMNS)
        self._live: Any = Live(self, console=self.console, refresh_per_second=4, transient=True)
        self._started = False

    def __rich__(self) -> Any:
        from rich.table import Table
        from rich.text import Text

        t = self.tally
        now = time.time()
        grid = Table.grid(padding=(0, 2))
        head = Text.assemble((f"[{t.done}/{t.to_execute}]", "bold"), f" executed {t.executed}, cached {t.cached}")
        if t.reused:
            head.append(f" (+{t.reused} from a concurrent build)")
        if t.failed:
            head.append(f", failed {t.failed}", style="bold red")
        frac = t.fraction(now)
        head.append("  ")
        head.append(progress_bar(frac), style="green")
        head.append(f" {100 * frac:3.0f}%  ETA {_fmt_s(t.eta_s(now))}")
        grid.add_row(head, "", "")
        for desc, start, worker in sorted(t.running.values(), key=lambda r: r[1]):
            grid.add_row(Text("  " + desc), Text(f"{now - start:5.1f} s", style="cyan"), Text(worker, style="dim"))
        if t.queued:
            grid.add_row(Text(f"  + {len(t.queued)} queued on the farm's workers", style="dim"), "", "")
        return grid

    def on_event(self, e: BuildEvent) -> None:
        self.tally.update(e)
        if e.kind == ev.BUILD_STARTED and e.fields["to_execute"] and not self._started:
            self._started = True
            self._live.start()
        line = event_line(e, self.tally, self.level)
        if line is not None:
            style = "red" if line.startswith("FAILED") else ("yellow" if line.startswith("RETRY") else None)
            self.console.print(line, style=style, highlight=False, markup=False)
        if e.kind == ev.BUILD_FINISHED:
            self.close()

    def close(self) -> None:
        if self._started:
            self._started = False
            self._live.stop()


def make_progress(level: int) -> PlainProgress | RichProgress:
    """Rich on a terminal (unless --quiet), plain lines otherwise."""
    if streams.err().isatty() and level >= NORMAL:
        return RichProgress(level)
    return PlainProgress(level)
