"""Per-action limits, on by default: processes and threads, memory, wall-clock time (#49).

What a build asks for (`LimitSettings`, from --action-pids, --action-memory and --action-timeout) becomes, per action,
an `ActionLimits` (`for_action`): the timeout and memory scaled from the action's estimate (analysis/estimate.py),
each with where it came from and how to change it. The worker enforces the first two (worker.run_isolated):

- where the host lets it make a cgroup (`ActionCgroup`: cgroup v1's `pids` and `memory` hierarchies, or a cgroup v2
  whose controllers are delegated to the worker's), the kernel does: `pids.max` refuses the fork or thread past the
  limit, `memory.limit_in_bytes` (v2 `memory.max`) reclaims and then OOM-kills inside the action only; the worker
  reads `pids.events` and the OOM-kill count while the action runs and ends it at the first refusal or kill;
- else the worker watches (`Watch`): every POLL_S it counts the tasks of the action's tree and sums their
  proportional anonymous memory (`Pss_Anon`, so pages an action shares with its warm worker count by half), and ends
  the action past a limit; for a non-root user its init also sets RLIMIT_NPROC in the action's own user namespace
  (where it binds: the kernel counts that namespace's processes of the uid; it does not bind root).

The pool enforces the timeout (pool.WorkerPool.wait). Exceeding a limit fails the action with one message naming the
limit, its value, where it came from and the flag that raises it (`exceeded`)."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from neuronbuild.execution.confine_ns import write_once
from neuronbuild.execution.resources import host_ram_mb

# The automatic wall-clock limit: TIMEOUT_FACTOR times the action's estimate, at least the kind's minimum.
TIMEOUT_FACTOR = 10.0
MIN_TIMEOUT_S = {"trace": 900.0, "weights": 900.0}
MIN_STEP_TIMEOUT_S = 3600.0  # a toolchain's step (neuronx-cc on a large model takes long)
# The automatic memory limit: MEMORY_FACTOR times the action's peak estimate, at least MIN_MEMORY_MB, at most
# MAX_MEMORY_SHARE of the machine's RAM (but never below the minimum).
MEMORY_FACTOR = 3.0
MIN_MEMORY_MB = 2048.0
MAX_MEMORY_SHARE = 0.9
# While nothing was recorded for an action (its peak estimate is a default: a first compile of a large model may need
# many times it), its limit is at least this share of the machine's RAM; once a run is recorded, MEMORY_FACTOR x that.
UNRECORDED_MEMORY_SHARE = 0.5
# The automatic process/thread limit: PIDS_PER_CORE per core, at least MIN_PIDS (torch's and the compilers' thread
# pools, inductor's compile workers, g++ and neuronx-cc's processes fit many times over).
MIN_PIDS = 1024
PIDS_PER_CORE = 16
# Processes of the action's tree that are not the action's (its namespace's init, the outside child).
OVERHEAD_PIDS = 2
POLL_S = 0.25
# Set to 0 (tests) to leave cgroups aside and use the watch: the fallback of hosts that offer none.
CGROUPS_VAR = "NEURONBUILD_ACTION_CGROUPS"


@dataclass(frozen=True)
class LimitSettings:
    """What the build asks for. None: automatic (scaled by `*_scale`); 0: no limit; else the value."""

    timeout_s: float | None = None
    timeout_scale: float = 1.0
    memory_mb: float | None = None
    memory_scale: float = 1.0
    pids: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"timeout_s": self.timeout_s, "timeout_scale": self.timeout_scale, "memory_mb": self.memory_mb,
                "memory_scale": self.memory_scale, "pids": self.pids}


@dataclass(frozen=True)
class ActionLimits:
    """One action's limits (0: none) and, for each, where it came from (stated by `explain` and in failures)."""

    timeout_s: float
    timeout_source: str
    memory_mb: int
    memory_source: str
    pids: int
    pids_source: str

    def message(self) -> dict[str, Any]:
        """What the worker needs of them (the timeout is the pool's)."""
        return {"pids": self.pids, "pids_source": self.pids_source, "memory_mb": self.memory_mb,
                "memory_source": self.memory_source, "cgroups": os.environ.get(CGROUPS_VAR, "1") != "0"}

    def describe(self) -> str:
        t = f"{self.timeout_s:g} s ({self.timeout_source})" if self.timeout_s else f"none ({self.timeout_source})"
        m = f"{self.memory_mb} MiB ({self.memory_source})" if self.memory_mb else f"none ({self.memory_source})"
        p = f"{self.pids} ({self.pids_source})" if self.pids else f"none ({self.pids_source})"
        return f"timeout {t}; memory {m}; processes and threads {p}"


_AUTO = re.compile(r"^auto(?:\*(?P<scale>\d*\.?\d+))?$", re.I)


def _auto_scale(text: str) -> float | None:
    m = _AUTO.match(text.strip().replace(" ", ""))
    if not m:
        return None
    scale = float(m.group("scale")) if m.group("scale") else 1.0
    return scale if scale > 0 else None


def parse_timeout(text: str) -> tuple[float | None, float]:
    """--action-timeout: 'auto' or 'auto*0.5' (scaled from each action's estimate), 0 (none) or seconds ->
    (seconds or None for automatic, scale). ValueError on anything else."""
    scale = _auto_scale(text)
    if scale is not None:
        return None, scale
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not v >= 0 or v == float("inf"):
        raise ValueError(f"--action-timeout: expected auto, auto*FACTOR, 0 (no limit) or a positive number of "
                         f"seconds, got {text!r}")
    return v, 1.0


_SIZE = re.compile(r"^(?P<num>\d+(?:\.\d+)?)(?P<unit>[kmgt]?)(?:i?b)?$", re.I)


def parse_memory(text: str) -> tuple[float | None, float]:
    """--action-memory: 'auto' or 'auto*2' (from each action's peak estimate), 0 (none), or a size: MB, 512M, 8G ->
    (MB or None for automatic, scale). ValueError on anything else."""
    scale = _auto_scale(text)
    if scale is not None:
        return None, scale
    m = _SIZE.match(text.strip().replace(" ", ""))
    if not m:
        raise ValueError(f"--action-memory: expected auto, auto*FACTOR, 0 (no limit) or a size like 4096 (MB), "
                         f"512M or 8G, got {text!r}")
    mb = float(m.group("num")) * {"": 1, "k": 1 / 1024, "m": 1, "g": 1024, "t": 1 << 20}[m.group("unit").lower()]
    if 0 < mb < 16:
        raise ValueError(f"--action-memory must be 0 (no limit) or at least 16 MB, got {text!r}")
    return mb, 1.0


def parse_pids(text: str) -> int | None:
    """--action-pids: 'auto', 0 (none) or how many processes and threads an action may have at once."""
    if text.strip().lower() == "auto":
        return None
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0 or 0 < n < 8:
        raise ValueError(f"--action-pids: expected auto, 0 (no limit) or a number of processes and threads of at "
                         f"least 8, got {text!r}")
    return n


def _scaled(scale: float) -> str:
    return "" if scale == 1.0 else f", scaled by auto*{scale:g}"


def auto_pids() -> int:
    return max(MIN_PIDS, PIDS_PER_CORE * (os.cpu_count() or 1))


def defaults_line() -> str:
    """The automatic limits in one line (what `plan` states; `explain` gives each action's own)."""
    trace = MIN_TIMEOUT_S["trace"]
    return (f"limits per executed action (automatic; `explain` shows each one's): at most {auto_pids()} "
            f"processes and threads, memory {MEMORY_FACTOR:g}x its peak estimate (at least {MIN_MEMORY_MB:.0f} MB), "
            f"time {TIMEOUT_FACTOR:g}x its estimate (at least {trace:.0f} s for a trace, {MIN_STEP_TIMEOUT_S:.0f} s "
            f"for a compile step); enforced by {host_offers()}; --action-pids, --action-memory and "
            "--action-timeout change them")


def for_action(settings: LimitSettings, kind: str, toolchain: str | None, estimate_s: float, estimate_mb: float,
               attribute: tuple[float, str] | None = None, mb_recorded: bool = True) -> ActionLimits:
    """The limits of one action of `kind` (and `toolchain`: a step of it) estimated to take `estimate_s` seconds and
    `estimate_mb` MB at its peak (`mb_recorded`: from a recorded run, not a default); `attribute`: a target's own
    `timeout` (seconds, the attribute), which wins."""
    if attribute is not None and attribute[0] > 0:
        timeout, t_src = attribute[0], attribute[1]
    elif settings.timeout_s is None:
        what = f"a {toolchain} step" if toolchain and kind not in MIN_TIMEOUT_S else f"a {kind} action"
        floor = MIN_TIMEOUT_S.get(kind, MIN_STEP_TIMEOUT_S)
        timeout = round(max(floor, TIMEOUT_FACTOR * max(0.0, estimate_s)) * settings.timeout_scale, 1)
        t_src = (f"the default for {what}: {TIMEOUT_FACTOR:g} x its estimate of {estimate_s:.0f} s, at least "
                 f"{floor:g} s{_scaled(settings.timeout_scale)}; --action-timeout SECONDS changes it, 0: none")
    elif settings.timeout_s > 0:
        timeout, t_src = settings.timeout_s, "--action-timeout"
    else:
        timeout, t_src = 0.0, "--action-timeout 0"
    if settings.memory_mb is None:
        ram = host_ram_mb()
        cap = max(MIN_MEMORY_MB, MAX_MEMORY_SHARE * ram)
        floor = MIN_MEMORY_MB if mb_recorded else max(MIN_MEMORY_MB, UNRECORDED_MEMORY_SHARE * ram)
        mem = int(min(cap, max(floor, MEMORY_FACTOR * max(0.0, estimate_mb))) * settings.memory_scale)
        least = (f"{MIN_MEMORY_MB:.0f} MB" if mb_recorded else
                 f"{floor:.0f} MB ({UNRECORDED_MEMORY_SHARE:.0%} of RAM until a run of it is recorded)")
        m_src = (f"the default: {MEMORY_FACTOR:g} x its peak estimate of {estimate_mb:.0f} MB, at least {least}"
                 f"{_scaled(settings.memory_scale)}; --action-memory SIZE changes it, 0: none")
    elif settings.memory_mb > 0:
        mem, m_src = int(settings.memory_mb), f"--action-memory {settings.memory_mb:g}M"
    else:
        mem, m_src = 0, "--action-memory 0"
    if settings.pids is None:
        pids, p_src = auto_pids(), "the default; --action-pids N changes it, 0: none"
    elif settings.pids > 0:
        pids, p_src = settings.pids, f"--action-pids {settings.pids}"
    else:
        pids, p_src = 0, "--action-pids 0"
    return ActionLimits(timeout, t_src, max(0, mem), m_src, pids, p_src)


def exceeded(what: str, limits: Mapping[str, Any], how: str = "") -> str:
    """The failure of an action that went past its `what` ('pids' or 'memory') limit."""
    if what == "pids":
        return (f"the action exceeded its limit of {limits.get('pids')} processes and threads ({how or 'counted'}; "
                f"{limits.get('pids_source')}); it was ended with every process it started. Raise it with "
                "--action-pids N (0: no limit), on the command line or in .neuronbuildrc")
    return (f"the action exceeded its memory limit of {limits.get('memory_mb')} MiB ({how or 'measured'}; "
            f"{limits.get('memory_source')}); it was ended with every process it started. Raise it with "
            "--action-memory SIZE (e.g. 16G; 0: no limit), on the command line or in .neuronbuildrc")


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _field(text: str, name: str) -> int:
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == name:
            with contextlib.suppress(ValueError):
                return int(parts[1])
    return 0


def _own_cgroups() -> tuple[dict[str, str], str | None]:
    """({v1 controller: this process's directory in it}, this process's cgroup v2 directory or None), where mounted."""
    mounts: dict[str, str] = {}
    v2_mount = None
    for line in _read("/proc/self/mountinfo").splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, rest = left.split(), right.split()
        if len(fields) < 5 or len(rest) < 3:
            continue
        if rest[0] == "cgroup2" and v2_mount is None:
            v2_mount = fields[4]
        elif rest[0] == "cgroup":
            for opt in rest[2].split(","):
                if opt in ("pids", "memory"):
                    mounts.setdefault(opt, fields[4])
    v1: dict[str, str] = {}
    v2 = None
    for line in _read("/proc/self/cgroup").splitlines():
        hid, _, tail = line.partition(":")
        controllers, _, path = tail.partition(":")
        if hid == "0" and controllers == "" and v2_mount is not None:
            v2 = v2_mount + path.rstrip("/")
        for c in controllers.split(","):
            if c in mounts:
                v1[c] = mounts[c] + path.rstrip("/")
    return v1, v2


_SEQ = [0]
_STATE: dict[str, Any] = {}  # (per worker process) "none": why no cgroup can be made here (not tried again)
_LEFT: list[str] = []  # cgroups not yet empty when their action ended (removed before the next one is made)


class ActionCgroup:
    """The cgroups of one action: made by the worker before it forks the action (`make`), joined by the forked
    process first thing (`join`: every process it starts is in them), checked while it runs (`exceeded`) and removed
    once it ended (`remove`)."""

    def __init__(self, dirs: dict[str, str], v2: bool) -> None:
        self.dirs = dirs  # {"pids"|"memory": directory} of the limits in force (checked by exceeded, peak_mb)
        self.v2 = v2
        self.made = set(dirs.values())  # every directory made (removed by remove)

    @classmethod
    def make(cls, pids: int, memory_mb: int, use: bool = True,
             ahead: bool = False) -> tuple[ActionCgroup | None, str | None]:
        """The action's cgroups with its limits (`pids` tasks, `memory_mb`; 0: not that one), or (None, why not).
        `use`: False when the build's ${CGROUPS_VAR} is 0 (the watch only). `ahead`: made for a prepared action
        process before its action (and so its limits) is known: both controllers, no limit yet (`apply` sets them
        when the action is dispatched; the prepared process joined them before it forked anything)."""
        if not pids and not memory_mb and not ahead:
            return None, None
        if not use:
            return None, f"${CGROUPS_VAR}=0"
        if _STATE.get("none"):
            return None, _STATE["none"]
        for d in list(_LEFT):
            with contextlib.suppress(OSError):
                os.rmdir(d)
                _LEFT.remove(d)
        _SEQ[0] += 1
        name = f"neuronbuild-{os.getpid()}-{_SEQ[0]}"
        v1, v2 = _own_cgroups()
        made: dict[str, str] = {}
        why = "no writable pids or memory cgroup"
        try:
            if v1:
                for ctl in ("pids", "memory"):
                    if ctl in v1 and (ahead or (pids if ctl == "pids" else memory_mb)):
                        _sweep(v1[ctl])
                        d = os.path.join(v1[ctl], name)
                        os.mkdir(d, 0o700)
                        made[ctl] = d
                cg = cls(made, False)
            elif v2 is not None:
                _sweep(v2)
                d = os.path.join(v2, name)
                os.mkdir(d, 0o700)
                made["pids"] = made["memory"] = d
                have = _read(os.path.join(d, "cgroup.controllers")).split()
                if "pids" not in have or "memory" not in have:
                    why = ("the cgroup v2 controllers pids and memory are not delegated to this process's cgroup "
                           f"({os.path.dirname(d)})")
                    raise OSError(why)
                cg = cls(made, True)
            else:
                raise OSError(why)
            cg.made = set(made.values())
            if not ahead:
                cg._set(pids, memory_mb)
            return cg, None
        except OSError as e:
            for d in set(made.values()):
                with contextlib.suppress(OSError):
                    os.rmdir(d)
            why = why if e.strerror is None else f"{why} ({e.strerror}{': ' + e.filename if e.filename else ''})"
            _STATE["none"] = why  # (not tried again by this worker)
            return None, why

    def _set(self, pids: int, memory_mb: int) -> None:
        if pids and "pids" in self.dirs:
            write_once(os.path.join(self.dirs["pids"], "pids.max"), str(pids + OVERHEAD_PIDS))
        elif "pids" in self.dirs and not self.v2:
            self.dirs.pop("pids")
        if memory_mb and "memory" in self.dirs:
            d = self.dirs["memory"]
            size = str(int(memory_mb) << 20)
            if self.v2:
                write_once(os.path.join(d, "memory.max"), size)
                with contextlib.suppress(OSError):
                    write_once(os.path.join(d, "memory.swap.max"), "0")
            else:
                write_once(os.path.join(d, "memory.limit_in_bytes"), size)
                with contextlib.suppress(OSError):  # (only with swap accounting)
                    write_once(os.path.join(d, "memory.memsw.limit_in_bytes"), size)

    def apply(self, pids: int, memory_mb: int) -> str | None:
        """A cgroup made `ahead`, once its action is known: its limits set (0: none), and only those checked by
        exceeded. None when done, else why not (then no limit of it is in force: the worker watches instead)."""
        want = {"pids": pids, "memory": memory_mb}
        self.dirs = {ctl: d for ctl, d in self.dirs.items() if want[ctl]}
        try:
            self._set(pids, memory_mb)
        except OSError as e:
            self.dirs = {}
            return f"setting the limits of a prepared cgroup ({e.strerror})"
        return None

    def join(self) -> None:
        """Move the calling process (just forked; nothing started yet) into the action's cgroups."""
        for d in sorted(self.made):
            write_once(os.path.join(d, "cgroup.procs"), "0")

    def exceeded(self) -> str | None:
        """'pids' when a fork or thread was refused for the limit, 'memory' when a process was OOM-killed for it."""
        d = self.dirs.get("pids")
        if d is not None and _field(_read(os.path.join(d, "pids.events")), "max") > 0:
            return "pids"
        d = self.dirs.get("memory")
        if d is not None:
            text = _read(os.path.join(d, "memory.events" if self.v2 else "memory.oom_control"))
            if _field(text, "oom_kill") > 0:
                return "memory"
        return None

    def peak_mb(self) -> float:
        d = self.dirs.get("memory")
        if d is None:
            return 0.0
        text = _read(os.path.join(d, "memory.peak" if self.v2 else "memory.max_usage_in_bytes")).strip()
        return int(text) / (1 << 20) if text.isdigit() else 0.0

    def remove(self) -> None:
        """Remove the cgroups (their processes are gone, or going: the kernel empties them asynchronously, so one still
        busy is removed before the worker makes its next, off the action's time; a killed worker's, by the next
        worker that makes one: _sweep)."""
        for d in self.made | set(self.dirs.values()):
            try:
                os.rmdir(d)
            except FileNotFoundError:
                pass
            except OSError:
                _LEFT.append(d)


def _sweep(base: str) -> None:
    """Remove the cgroups a killed worker left under `base` (named after its pid, which no longer runs)."""
    with contextlib.suppress(OSError):
        for entry in os.listdir(base):
            parts = entry.split("-")
            if len(parts) == 3 and parts[0] == "neuronbuild" and parts[1].isdigit() and \
                    not os.path.exists(f"/proc/{parts[1]}"):
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.join(base, entry))


def tree(pid: int) -> list[int]:
    """`pid` and its descendants (as /proc shows them now)."""
    out: list[int] = []
    todo = [pid]
    while todo and len(out) < 100_000:
        out.append(todo.pop())
        todo += children(out[-1])
    return out


def children(pid: int) -> list[int]:
    """The processes `pid`'s threads started (as /proc shows them now)."""
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children", "rb") as f:
                out += [int(x) for x in f.read().split()]
    return out


def _tasks(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


def _pss_anon_kib(pid: int) -> int:
    text = _read(f"/proc/{pid}/smaps_rollup")
    for line in text.splitlines():
        if line.startswith("Pss_Anon:"):
            with contextlib.suppress(ValueError, IndexError):
                return int(line.split()[1])
    return 0


@dataclass
class Watch:
    """The fallback where no cgroup could be made: the worker counts the action tree's tasks and sums its
    proportional anonymous memory every POLL_S."""

    pid: int
    pids: int
    memory_mb: int

    def exceeded(self) -> str | None:
        procs = tree(self.pid)
        if self.pids and sum(map(_tasks, procs)) > self.pids + OVERHEAD_PIDS:
            return "pids"
        if self.memory_mb and sum(map(_pss_anon_kib, procs)) > self.memory_mb * 1024:
            return "memory"
        return None


def nproc_in_user_namespace(pids: int) -> None:
    """In a non-root action's own user namespace: RLIMIT_NPROC, which the kernel counts per user namespace, so it
    bounds the action's tasks (not root's: the kernel exempts it)."""
    import resource

    if pids and os.getuid() != 0:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NPROC, (pids + OVERHEAD_PIDS, pids + OVERHEAD_PIDS))


def host_offers() -> str:
    """What enforces the limits on this machine (for `explain` and the docs): the cgroups, or the watch."""
    if os.environ.get(CGROUPS_VAR, "1") == "0":
        return f"the worker's watch (${CGROUPS_VAR}=0)"
    v1, v2 = _own_cgroups()
    if v1:
        ok = [c for c, d in sorted(v1.items()) if os.access(d, os.W_OK)]
        if ok:
            return f"cgroup v1 ({', '.join(ok)})" + ("" if len(ok) == 2 else "; the worker's watch for the rest")
    if v2 is not None and os.access(v2, os.W_OK) and \
            {"pids", "memory"} <= set(_read(os.path.join(v2, "cgroup.subtree_control")).split()):
        return "cgroup v2 (pids, memory)"
    return "the worker's watch (no writable cgroup)"

