"""Worker processes: the warm worker's main loop, which forks one confined child per action to run it."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Mapping, Sequence
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from neuronbuild.atomic import atomic_write_bytes, umask_mode
from neuronbuild.execution import channel, confine_ns, limits
from neuronbuild.execution.confine import (
    Policy,
    confine,
    explain_denied,
    first_violation,
    installation_roots,
    policy_for,
    set_dumpable,
)
from neuronbuild.execution.sandbox import foreign_entry, private_dirs, read_only_dir
from neuronbuild.platforms import SHARED_TMP_VAR
from neuronbuild.plugin_api.actions import provider_name
from neuronbuild.plugin_api.toolchain import WARM_UP, StepDirs, is_warm_up, warm_up_spec

HOST = socket.gethostname()

# The first lines of an error kept in results and summaries (the full text is in the action's log), and at most
# ERROR_CHARS of them; an action's log keeps at most MAX_LOG_BYTES (its end, where failures are).
ERROR_LINES = 5
ERROR_CHARS = 2000
MAX_LOG_BYTES = 16 << 20


@contextlib.contextmanager
def _redirect_fds(log_path: str) -> Iterator[None]:
    """Send fd 1 and 2 (Python and C++ compiler output alike) to the action's log."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
        os.close(fd)


# Control characters but newline and tab (C0, DEL, C1): an error message comes from model code and reaches the user's
# terminal; an escape sequence there could rewrite what was printed, set the title or the clipboard (OSC 52).
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def first_lines(msg: str, n: int = ERROR_LINES, cap: int = ERROR_CHARS) -> str:
    """The first `n` non-empty lines of an error, at most `cap` characters (saying so when cut), with control
    characters shown escaped (`\\x1b`), never sent to a terminal as they are."""
    msg = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", msg.replace("\r\n", "\n"))
    head = msg[: cap * 2]
    lines = [ln.rstrip() for ln in head.strip().splitlines() if ln.strip()]
    out = "\n".join(lines[:n])
    if len(out) > cap or len(msg) > len(head):
        out = out[:cap] + f" [... message cut at {cap} characters of {len(msg)}; the full text is in the log]"
    return out


def cap_log(log_path: str, limit: int = MAX_LOG_BYTES) -> None:
    """Keep only the last `limit` bytes of an action's log, with a first line saying how much was dropped."""
    try:
        size = os.path.getsize(log_path)
        if size <= limit:
            return
        with open(log_path, "rb") as f:
            f.seek(size - limit)
            tail = f.read(limit)
        note = f"[neuronbuild: log cut to its last {limit} bytes (the cap); {size - limit} earlier bytes dropped]\n"
        atomic_write_bytes(log_path, note.encode() + tail, durable=False, mode=umask_mode())
    except OSError:
        pass


def _reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets VmHWM, so each action's peak is measured on its own."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_rss_mb() -> float:
    """The action's peak resident MB: its process's (VmHWM), or the largest of the processes it started and waited
    for (a compiler: g++, neuronx-cc) when that was larger, so the estimate its memory limit scales from (#49)
    covers the compiler too. (A forked action process starts with no children's usage.)"""
    import resource

    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024.0
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return max(int(line.split()[1]) / 1024.0, kids)
    except (OSError, ValueError, IndexError):
        pass
    return max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, kids)


def toolchain_mismatch(expect: Mapping[str, str]) -> str | None:
    """Why this process cannot produce what an action's fingerprint promises (the versions it records of Python, torch
    and the C++ compiler differ from this worker's), or None. A farm worker with another toolchain must refuse rather
    than store an artifact under a fingerprint that names other versions."""
    from neuronbuild import plugins
    from neuronbuild.plugin_api.toolchain import trace_toolchain

    here = trace_toolchain()
    for settings in plugins.tool_settings():  # each toolchain's components this worker has (e.g. its C++ compiler)
        here.update(settings.worker_versions(expect))
    diffs = [f"{k} {here[k]} here, the action needs {expect[k]}" for k in sorted(here) if k in expect
             and str(expect[k]) != here[k]]
    if not diffs:
        return None
    return f"this worker's toolchain does not match the action's fingerprint: {'; '.join(diffs)} (on {HOST})"


def run_action(kind: str, spec: dict[str, Any], inputs: str, outputs: str, log_path: str,
               expect: Mapping[str, str] | None = None, policy: Policy | None = None,
               notes: Sequence[str] = ()) -> dict[str, Any]:
    """Run an action's step (a trace, a weights action, a toolchain's step: `kind` is informational, the spec names
    its step provider and step) in this process, after checking this worker's toolchain against `expect` (the
    versions in the action's fingerprint) and, with a `policy`, confining this process to it for good (so: only in
    a per-action child, see run_isolated). Returns {"ok", "metadata"|"error", "duration_s", "pid", "peak_rss_mb"}."""
    start = time.perf_counter()
    mismatch = toolchain_mismatch(expect or {})
    if mismatch is not None:
        return {"ok": False, "error": mismatch, "duration_s": 0.0, "pid": os.getpid(), "peak_rss_mb": 0.0,
                "host": HOST}
    _reset_peak_rss()
    cwd = os.getcwd()
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    try:
        with _redirect_fds(log_path):
            for note in notes:  # what of its confinement this machine does not give the action
                print(f"neuronbuild: {note}", file=sys.stderr)
            if policy is not None:
                why = confine(policy)
                if why is not None:
                    print(f"neuronbuild: {why}; only Python-level file checks apply to this action", file=sys.stderr)
            os.chdir(inputs)
            try:  # every kind alike: the step provider its spec names runs it (a toolchain, or the core's trace)
                from neuronbuild import plugins

                meta = plugins.run_step(spec, Path(inputs), Path(outputs))
            finally:
                os.chdir(cwd)
        violation = first_violation() if policy is not None else None
        if violation is not None:  # the model's code caught the PermissionError: the action fails all the same
            return {"ok": False, "error": first_lines(f"PermissionError: {violation}"),
                    "duration_s": time.perf_counter() - start, "pid": os.getpid(), "peak_rss_mb": peak_rss_mb()}
        return {"ok": True, "metadata": meta, "duration_s": time.perf_counter() - start, "pid": os.getpid(),
                "peak_rss_mb": peak_rss_mb()}
    except (Exception, SystemExit) as e:  # noqa: BLE001 - every failure is reported as the action's failure
        # (SystemExit too: model code calling sys.exit() fails its action with a message and a log, not its process)
        from neuronbuild.toolchains.errors import ToolchainError, source_frame, workspace_paths

        with open(log_path, "a", encoding="utf-8") as log:
            traceback.print_exc(file=log)
        text = workspace_paths(str(e), inputs)  # paths as the user knows them: vision/cnn.py, not the sandbox's
        msg = text if isinstance(e, ToolchainError) else f"{type(e).__name__}: {text}"
        at = "" if isinstance(e, ToolchainError) else source_frame(e, inputs)
        if at:
            first, nl, rest = msg.partition("\n")
            msg = f"{first} (at {at}){nl}{rest}"
        denied = None
        if policy is not None:
            violation = first_violation()
            denied = f"PermissionError: {violation}" if violation is not None else None
            if denied is None:
                why = explain_denied(_root_cause(e), policy)
                denied = f"PermissionError: {why}" if why else None
        if denied is not None:
            msg = denied + "\n" + text
        elif isinstance(e, FileNotFoundError) and e.filename:
            msg = (f"{type(e).__name__}: the action read {e.filename!r}, which is not among its declared inputs "
                   "(the sandbox holds only those): declare it in the neuron_model's `data` (non-Python files) or "
                   "`srcs`/`deps` (Python)\n" + text)
        return {"ok": False, "error": first_lines(msg) or type(e).__name__,
                "duration_s": time.perf_counter() - start, "pid": os.getpid(), "peak_rss_mb": peak_rss_mb()}


def _root_cause(e: BaseException) -> BaseException:
    """The innermost exception (toolchains wrap the OSError a confined open raised)."""
    seen = 0
    while seen < 20:
        nxt = e.__cause__ or e.__context__
        if nxt is None:
            return e
        e, seen = nxt, seen + 1
    return e


_PR_SET_PDEATHSIG = 1


def action_policy(msg: Mapping[str, Any], env: Mapping[str, str], installation: tuple[str, ...]) -> Policy:
    """The confinement of the action `msg` describes: its sandbox and log writable; the installation, its step's
    dirs and the sandbox's read-only sibling (big source files linked there: execution/sandbox.py) readable."""
    dirs = step_dirs(msg["spec"])
    ro = read_only_dir(msg["inputs"])
    return policy_for(msg["inputs"], msg["outputs"], env, msg["spec"], installation, [msg["log"], *dirs.write],
                      [*dirs.read, *([str(ro)] if ro.is_dir() else [])])


def run_isolated(msg: Mapping[str, Any], installation: tuple[str, ...], defer: bool = False) -> dict[str, Any]:
    """Run one action in a child forked from this (warm, model-free) worker and confined to its sandbox: whatever the
    model's code changes in the interpreter (monkeypatches, sys.modules, audit hooks) ends with the child. The child's
    death (a crash, os._exit, the OOM killer) fails the action as a worker death (retried with --retries).

    The action runs as pid 2 of its own pid and mount namespaces, forked by the namespace's init (pid 1, which runs
    no model code: `_init`), which mounts a private /proc and the sandbox's read-only sibling read-only first; the
    action sees no process but its own and the init. When it ends, the init exits with its status (a signal as 128 +
    its number) and the kernel kills whatever it left. As root the init is this worker's own child (the worker
    unshares the pid namespace for that one fork: confine_ns.pid_ns_for_children): two forks of the worker per action
    (one fewer than through an outside child); this worker's wait4 gives the action's end (the init's code, decoded)
    and CPU time. Otherwise (a non-root user: a user namespace) the child outside the namespace enters it
    (confine_ns.enter), forks the init and ends as it did (confine_ns.reraise). Where namespaces are refused, the
    outside child runs the action itself (as before; its log says so).

    As root the namespace's init and the action's process are *prepared*: forked, their namespaces, private /proc,
    /dev/shm and network made, before the action is known (`prepare`; the worker's loop makes the next one while it
    idles, between sending a result and receiving the next action), and dispatching the action is one message (JSON
    data) to the waiting init (`_dispatch`). Without a prepared process this makes one now, so every action as root
    runs the same way. A prepared init kills and reaps whatever the action left in its namespace and reports that
    (with the action's exit code and CPU seconds) before its own exit, whose teardown (a copy of the worker's address
    space) then runs beside the next steps: with `defer` (the worker's loop) it is reaped later (reap_deferred: after
    the result is sent), else before this returns."""
    prep = _take_prepared(installation)
    if prep is None:
        return _run_isolated_now(msg, installation)
    res = _dispatch(prep, msg, installation)
    if not defer:
        reap_deferred()
    return res


def _run_isolated_now(msg: Mapping[str, Any], installation: tuple[str, ...]) -> dict[str, Any]:
    """run_isolated where no action process can be prepared (a non-root user: the outside child enters a user
    namespace; or namespaces refused): every process forked for this action, after it is known."""
    policy = action_policy(msg, dict(os.environ), installation)
    lim: Mapping[str, Any] = msg["limits"] if isinstance(msg.get("limits"), Mapping) else {}
    want_pids, want_mb = int(lim.get("pids") or 0), int(lim.get("memory_mb") or 0)
    cg, no_cg = limits.ActionCgroup.make(want_pids, want_mb, lim.get("cgroups") is not False)
    if no_cg is not None:
        msg = {**msg, "limit_notes": [f"no cgroup for this action's limits ({no_cg}); its worker counts its processes "
                                      f"and memory every {limits.POLL_S:g} s instead"]}
    r, w = os.pipe()
    worker_pid = os.getpid()
    freeze_for_fork()
    in_ns = confine_ns.pid_ns_for_children() is None  # (root) this fork is pid 1 of the action's namespace
    seen_as = _proc_pid() if in_ns else 0  # this worker's pid as /proc numbers it
    try:
        pid = os.fork()
    finally:
        if in_ns and os.getpid() == worker_pid and (why := confine_ns.own_pid_ns()) is not None:
            print(f"neuronbuild: worker {worker_pid} cannot fork into its own pid namespace again ({why}); it exits",
                  file=sys.stderr, flush=True)
            os._exit(70)  # (never seen) its next forks would fail: the pool replaces it
    if pid == 0:  # the namespace's init (in_ns), else the action's outside process
        code = 70
        try:
            if cg is not None:
                cg.join()  # (first: every process the action starts is in its cgroups)
            if not in_ns:
                set_dumpable(True)  # the worker is not (confine.set_dumpable); the namespaces' maps use /proc/self
            os.close(r)
            close_inherited_fds(keep=(w,))  # the worker's pipes to the build process, its pidfds: not the model's
            null = os.open(os.devnull, os.O_RDWR)  # nor the worker's log (run_action sends 1 and 2 to the action's)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            os.close(null)
            if in_ns:
                _die_with_parent(worker_pid, check=False)
                if seen_as and _proc_pid(ppid=True) != seen_as:  # the worker died before the line above
                    os._exit(70)
                why = confine_ns.enter_mounts()
                os._exit(_init(msg, policy, w, None if why is None else
                               f"no private mounts ({why}); this action may read other processes' cmdline, comm, "
                               "stat and status, what it leaves in /dev/shm outlives it, and the linked big inputs "
                               "are protected against writes only (Landlock)"))
            _die_with_parent(worker_pid)
            why = confine_ns.enter()
            if why is not None:  # the kernel or the container refuses namespaces: this process runs the action
                _run_child(msg, policy, w, worker_pid,
                           [f"no pid namespace for this action ({why}); it may read other processes' cmdline, comm, "
                            "stat and status, and what it forks is ended by its worker",
                            *(msg.get("limit_notes") or ())])
            set_dumpable(False)  # (the init inherits this; the action's process turns it back on)
            outside = os.getpid()
            init = os.fork()
            if init == 0:  # pid 1 of the action's namespaces
                _die_with_parent(outside, check=False)
                os._exit(_init(msg, policy, w))
            os.close(w)
            _pid, status = os.waitpid(init, 0)
            ended = os.waitstatus_to_exitcode(status)
            confine_ns.reraise(128 - ended if ended < 0 else ended)
        except BaseException:  # noqa: BLE001 - reported as a death by the parent
            code = 70
        finally:
            os._exit(code)
    os.close(w)
    return _collect(pid, r, cg, lim, in_ns)


def _collect(pid: int, r: int, cg: limits.ActionCgroup | None, lim: Mapping[str, Any], in_ns: bool,
             done: int = -1) -> dict[str, Any]:
    """Wait for the action forked as `pid` (its result on the pipe `r`, which this closes) within its limits `lim`
    (its cgroups `cg`, else this worker's watch), reap it and return its result. `done` (a prepared init's report
    pipe, closed here): after a result, the init's word that its namespace is empty (with the action's exit code
    and CPU seconds) stands for its exit; the init, still exiting, is reaped by reap_deferred."""
    want_pids, want_mb = int(lim.get("pids") or 0), int(lim.get("memory_mb") or 0)
    conn = Connection(r, writable=False)
    pidfd: int | None = None
    with contextlib.suppress(AttributeError, OSError):
        pidfd = os.pidfd_open(pid)
    res: dict[str, Any] | None = None
    bad: str | None = None
    started = time.perf_counter()
    have = cg.dirs if cg is not None else {}
    watch = limits.Watch(pid, 0 if "pids" in have else want_pids, 0 if "memory" in have else want_mb)
    watching = bool(have) or bool(watch.pids or watch.memory_mb)
    hit: tuple[str, str] | None = None  # (the limit exceeded, how it was seen)
    try:
        handles: list[Any] = [conn] if pidfd is None else [conn, pidfd]
        while True:
            ready = wait(handles, limits.POLL_S if watching else None)
            if not ready:
                hit = _limit_hit(cg, watch)
                if hit is not None:
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)  # (its namespace, and so every process it started, ends with it)
                    break
                continue
            if conn in ready or conn.poll(0):
                try:
                    res = action_result(channel.recv(conn, MAX_RESULT_BYTES))
                except (EOFError, OSError):
                    pass
                except channel.BadMessage as e:  # model code wrote to its result pipe: the action fails
                    bad = f"the action's process sent {e} as its result"
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
                break
            if pidfd is not None and pidfd in ready:
                break
    finally:
        conn.close()
        if pidfd is not None:
            os.close(pidfd)
    early: dict[str, Any] | None = None
    if done >= 0:
        if res is not None and hit is None and bad is None:
            early = _done_report(done)  # (closes it)
        else:
            os.close(done)
    if early is not None:
        _DEFERRED.append(pid)
        status, cpu = 0, float(early["cpu_s"])  # (status: read only without a result)
    else:
        _pid, status, usage = os.wait4(pid, 0)
        cpu = usage.ru_utime + usage.ru_stime
    if hit is None and cg is not None:
        hit = _limit_hit(cg, None)  # (refused or OOM-killed near its end: the action failed all the same)
    if cg is not None:
        cg.remove()
    if hit is not None:
        res = {"ok": False, "error": limits.exceeded(hit[0], lim, hit[1]),
               "duration_s": time.perf_counter() - started, "limit": hit[0]}
    elif bad is not None:
        res = {"ok": False, "error": bad, "duration_s": 0.0}
    elif res is None:
        code = os.waitstatus_to_exitcode(status)  # (res is None: never an early report)
        if in_ns and code > 128 and confine_ns.signal_of(code):  # the init's code for the action's death by a signal
            code = -confine_ns.signal_of(code)
        res = {"ok": False, "worker_died": True, "error": death_message(code), "duration_s": 0.0}
    # The action's CPU seconds: its process and every process it waited for (compilers), whatever the cores.
    res["cpu_s"] = round(cpu, 3)
    res["action_pid"] = pid
    res["pid"] = os.getpid()
    return res


# Prepared action processes (run_isolated, as root): the init of a fresh pid namespace and the action's process,
# forked and set up before the action is known, waiting for it.
PREPARED_VAR = "NEURONBUILD_PREPARED_ACTIONS"  # "0": fork every action's processes when it is dispatched (A/B)
_NO_MOUNTS = ("no private mounts ({}); this action may read other processes' cmdline, comm, stat and status, what it "
              "leaves in /dev/shm outlives it, and the linked big inputs are protected against writes only (Landlock)")


class Prepared:
    """A prepared action process: `pid`, this worker's child, is pid 1 of its own pid namespace (its mount and
    network namespaces, private /proc and /dev/shm made) and has forked the action's process (pid 2), which waits;
    both are in the cgroups `cg` (made without limits: _dispatch sets the action's). The init reads the action's
    message from `msg_w`; the action's process writes its result to `res_r`. `state` is what this worker held when
    it forked them (a process prepared before a warm-up or an import here lacks it: it is discarded)."""

    def __init__(self, pid: int, msg_w: int, res_r: int, cg: limits.ActionCgroup | None, no_cg: str | None,
                 installation: tuple[str, ...], state: tuple[int, int], done_r: int = -1) -> None:
        self.pid, self.msg_w, self.res_r, self.cg, self.no_cg = pid, msg_w, res_r, cg, no_cg
        self.installation, self.state = installation, state
        self.done_r = done_r  # the init's report that its namespace is empty (_end_namespace), before it exits


_PREPARED: list[Prepared] = []  # at most one, this worker's
_CHANGES = [0]  # warm-ups run in this process (a prepared process forked before one lacks it)


def _worker_state() -> tuple[int, int]:
    return len(sys.modules), _CHANGES[0]


def prepare(installation: tuple[str, ...]) -> Prepared | None:
    """Fork the next action's processes ahead of demand (the worker's loop calls this while it idles), or None where
    they cannot be prepared: a non-root user (its namespaces need a user namespace, which the outside child enters
    after the fork: run_isolated's other path), namespaces refused, or ${PREPARED_VAR}=0. Idempotent."""
    if _PREPARED:
        if _PREPARED[0].state == _worker_state() and _PREPARED[0].installation == installation:
            return _PREPARED[0]
        discard_prepared()
    if os.environ.get(PREPARED_VAR) == "0" or os.getuid() != 0:
        return None
    worker_pid = os.getpid()
    if confine_ns.pid_ns_for_children() is not None:  # (remembered: not tried again by this worker)
        return None
    cg, no_cg = limits.ActionCgroup.make(0, 0, True, ahead=True)
    freeze_for_fork()
    seen_as = _proc_pid()  # this worker's pid as /proc numbers it
    msg_r, msg_w = os.pipe()
    res_r, res_w = os.pipe()
    done_r, done_w = os.pipe()
    try:
        pid = os.fork()
    finally:
        if os.getpid() == worker_pid and (why := confine_ns.own_pid_ns()) is not None:
            print(f"neuronbuild: worker {worker_pid} cannot fork into its own pid namespace again ({why}); it exits",
                  file=sys.stderr, flush=True)
            os._exit(70)  # (never seen) its next forks would fail: the pool replaces it
    if pid == 0:  # pid 1 of the next action's namespaces
        code = 70
        try:
            if cg is not None:
                cg.join()  # (first: every process the action starts is in its cgroups)
            close_inherited_fds(keep=(msg_r, res_w, done_w))  # the worker's pipes, its pidfds: not the model's
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            os.close(null)
            _die_with_parent(worker_pid, check=False)
            if seen_as and _proc_pid(ppid=True) != seen_as:  # the worker died before the line above
                os._exit(70)
            why = confine_ns.enter_mounts()
            code = _prepared_init(msg_r, res_w, installation, None if why is None else _NO_MOUNTS.format(why),
                                  done_w)
        except BaseException:  # noqa: BLE001 - reported as a death by the worker
            code = 70
        finally:
            os._exit(code)
    os.close(msg_r)
    os.close(res_w)
    os.close(done_w)
    prep = Prepared(pid, msg_w, res_r, cg, no_cg, installation, _worker_state(), done_r)
    _PREPARED.append(prep)
    return prep


def discard_prepared() -> None:
    """End the prepared action process (the worker changed since it was forked, or stops): kill its init (the
    kernel then kills the waiting action's process), reap it, remove its cgroups."""
    while _PREPARED:
        prep = _PREPARED.pop()
        with contextlib.suppress(OSError):
            os.kill(prep.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(prep.pid, 0)
        for fd in (prep.msg_w, prep.res_r, prep.done_r):
            with contextlib.suppress(OSError):
                os.close(fd)
        if prep.cg is not None:
            prep.cg.remove()


def _take_prepared(installation: tuple[str, ...]) -> Prepared | None:
    """The prepared action process (made now when there is none), taken: it will run the next action."""
    prep = prepare(installation)
    if prep is not None:
        _PREPARED.remove(prep)
    return prep


def _private_namespaces(mounts: bool) -> list[str]:
    """In a new namespace's init: the private network namespace and, when `mounts`, a private /proc and /dev/shm set
    up; a note for each that could not be, saying what the action then shares."""
    notes = []
    if (why := confine_ns.private_net()) is not None:
        notes.append(f"no private network namespace ({why}); this action shares the machine's network and sees "
                     "its sockets in /proc/net")
    if mounts:
        if (why := confine_ns.private_proc()) is not None:
            notes.append(f"no private /proc ({why}); this action may read other processes' cmdline, comm, stat and "
                         "status")
        if (why := confine_ns.private_shm()) is not None:
            notes.append(f"no private /dev/shm ({why}); what this action leaves there outlives it")
    return notes


def _prepared_init(msg_r: int, res_w: int, installation: tuple[str, ...], no_mounts: str | None,
                   done_w: int = -1) -> int:
    """The prepared namespace's init (pid 1; runs no model code): what _init does before it knows the action (a
    network namespace, a private /proc and /dev/shm), the action's process forked (_prepared_child, waiting); then,
    once the action's message arrives, the sandbox's read-only sibling mounted read-only and the message passed on;
    reaps until the action's process ended. Returns the code to exit with (confine_ns.status_code); 70 when the
    worker closed the message pipe without an action (discarded)."""
    notes = [no_mounts] if no_mounts is not None else []
    notes += _private_namespaces(no_mounts is None)
    fwd_r, fwd_w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(fwd_w)
        os.close(msg_r)
        if done_w >= 0:
            os.close(done_w)  # (the init's report is the init's alone)
        _prepared_child(fwd_r, res_w, installation)
    os.close(fwd_r)
    os.close(res_w)
    try:
        msg = channel.recv(Connection(msg_r, writable=False))
    except (EOFError, OSError, channel.BadMessage):
        return 70
    if not isinstance(msg, dict):
        return 70
    notes += list(msg.get("limit_notes") or ())
    ro = read_only_dir(msg["inputs"])
    if no_mounts is None and ro.is_dir() and (why := confine_ns.read_only_bind(str(ro))) is not None:
        notes.append(f"{why}; the linked big inputs are protected against writes only (Landlock)")
    out = Connection(fwd_w, readable=False)
    channel.send(out, {"msg": msg, "notes": notes})
    out.close()
    code = confine_ns.init_wait(child)
    if done_w >= 0 and no_mounts is None and _end_namespace():
        import resource

        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        with contextlib.suppress(OSError):
            channel.send(Connection(done_w, readable=False),
                         {"code": code, "cpu_s": round(kids.ru_utime + kids.ru_stime, 3)})
    return code


def _end_namespace() -> bool:
    """In the prepared init (pid 1 of the action's pid namespace, its private /proc mounted), once the action's
    process ended: kill every process left in the namespace (kill(-1) from a namespace's init reaches all of them
    but itself) and reap them, until its /proc shows no process but this one. True then: nothing of the action runs
    or can run again (every process of it exited, its files closed), and the init may report so to the worker before
    its own exit (whose teardown of the worker's address space is then off the action's time). False when not sure
    (not pid 1, a /proc that is not the namespace's, processes still there after a few rounds): the worker then
    waits for the init's exit, as for an action forked at dispatch."""
    if os.getpid() != 1:  # (never as anything but a namespace's init: kill(-1) would reach the machine)
        return False
    for _ in range(20):
        with contextlib.suppress(OSError):
            os.kill(-1, signal.SIGKILL)
        while True:
            try:
                if os.waitpid(-1, 0)[0] <= 0:
                    break
            except ChildProcessError:
                break
            except InterruptedError:
                continue
        try:
            left = [p for p in os.listdir("/proc") if p.isdigit() and p != "1"]
        except OSError:
            return False
        if not left:
            return True
        time.sleep(0.005)  # (a process being re-parented to this init: reaped next round)
    return False


def _prepared_child(fwd_r: int, res_w: int, installation: tuple[str, ...]) -> None:
    """The prepared action's process (pid 2): waits for its action from the init, then runs it as _init's child does
    (_run_child: its own $HOME and $TMPDIR, confined to the action's policy). Never returns."""
    try:
        _die_with_parent(1)
        conn = Connection(fwd_r, writable=False)
        got = channel.recv(conn)
        conn.close()
        msg, notes = got["msg"], [str(n) for n in got["notes"]]
        policy = action_policy(msg, dict(os.environ), installation)
    except BaseException:  # noqa: BLE001 - discarded, or a broken message: reported as a death by the worker
        os._exit(70)
    _run_child(msg, policy, res_w, 1, notes)


def _dispatch(prep: Prepared, msg: Mapping[str, Any], installation: tuple[str, ...]) -> dict[str, Any]:
    """Run the action `msg` in the prepared process `prep` (taken): its limits set on the prepared cgroups (else
    this worker watches), the message sent to the waiting init, then as run_isolated (_collect)."""
    lim: Mapping[str, Any] = msg["limits"] if isinstance(msg.get("limits"), Mapping) else {}
    want_pids, want_mb = int(lim.get("pids") or 0), int(lim.get("memory_mb") or 0)
    cg, no_cg = prep.cg, prep.no_cg
    if cg is not None:
        if lim.get("cgroups") is False:  # the build's watch-only setting: the prepared cgroup sets no limit
            cg.dirs, no_cg = {}, f"${limits.CGROUPS_VAR}=0"
        else:
            no_cg = cg.apply(want_pids, want_mb)
    if no_cg is not None and (want_pids or want_mb):
        msg = {**msg, "limit_notes": [f"no cgroup for this action's limits ({no_cg}); its worker counts its processes "
                                      f"and memory every {limits.POLL_S:g} s instead"]}
    out = Connection(prep.msg_w, readable=False)
    try:
        channel.send(out, msg)
    except OSError:  # (never seen) the prepared init is gone: it is reaped, and the action runs in a fresh one
        out.close()
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(prep.pid, 0)
        os.close(prep.res_r)
        os.close(prep.done_r)
        if cg is not None:
            cg.remove()
        return _run_isolated_now(msg, installation)
    out.close()
    return _collect(prep.pid, prep.res_r, cg, lim, True, prep.done_r)


def freeze_for_fork() -> None:
    """Before a fork for an action: this worker's young cyclic garbage collected, then every object it holds moved
    to the collector's permanent generation (gc.freeze), so no collection in the action's process walks them: a
    walk writes to each object's header, and so copies every page of the worker's heap into the action's process
    (copy-on-write), to be freed again when it exits, both on the action's time. Only in a worker process
    (`serve` sets FREEZE): a process that also runs other code (a test calling run_isolated) keeps its collector."""
    if FREEZE[0]:
        gc.collect(1)
        gc.freeze()


FREEZE = [False]


_DEFERRED: list[int] = []  # prepared inits that reported their namespace empty and are still exiting (reap_deferred)


def _done_report(done: int) -> dict[str, Any] | None:
    """The prepared init's report (_end_namespace) on the pipe `done` (closed here), or None (the init died or
    exited without one: then its exit is waited for). Waits for it or for the init's end, whichever comes first."""
    conn = Connection(done, writable=False)
    try:
        got = channel.recv(conn, 4096)
    except (EOFError, OSError, channel.BadMessage):
        return None
    finally:
        conn.close()
    if not isinstance(got, dict) or not isinstance(got.get("code"), int) or \
            not isinstance(got.get("cpu_s"), (int, float)):
        return None
    return got


def reap_deferred() -> None:
    """Reap the prepared inits whose actions' results were handed on before their exit ended (_collect)."""
    while _DEFERRED:
        pid = _DEFERRED.pop()
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, 0)


def _limit_hit(cg: limits.ActionCgroup | None, watch: limits.Watch | None) -> tuple[str, str] | None:
    """(which limit the running action exceeded, how it was seen), or None."""
    if cg is not None:
        what = cg.exceeded()
        if what is not None:
            return what, ("a fork or thread refused by its pids cgroup" if what == "pids" else
                          "a process OOM-killed in its memory cgroup")
    if watch is not None:
        what = watch.exceeded()
        if what is not None:
            return what, ("counted by its worker" if what == "pids" else
                          "its processes' proportional anonymous memory, measured by its worker")
    return None


def _die_with_parent(parent: int, check: bool = True) -> None:
    """This process is killed when its parent dies (PR_SET_PDEATHSIG); `check`: it exits now when `parent` died
    already (a namespace's init cannot tell: its parent is outside its pid namespace)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, 9, 0, 0, 0)
    if check and os.getppid() != parent:
        os._exit(70)


def _init(msg: Mapping[str, Any], policy: Policy, w: int, no_mounts: str | None = None) -> int:
    """The action's namespace's init (pid 1; runs no model code): a network namespace, a private /proc and /dev/shm, the sandbox's
    read-only sibling mounted read-only (none of them when `no_mounts` says why not), then the action's process (pid
    2: _run_child), reaping whatever ends until it has. Returns the code to exit with (confine_ns.status_code)."""
    notes = [no_mounts] if no_mounts is not None else []
    notes += list(msg.get("limit_notes") or ())
    lim: Mapping[str, Any] = msg["limits"] if isinstance(msg.get("limits"), Mapping) else {}
    limits.nproc_in_user_namespace(int(lim.get("pids") or 0))  # (a non-root user's: its own user namespace)
    notes += _private_namespaces(no_mounts is None)
    if no_mounts is None:
        ro = read_only_dir(msg["inputs"])
        if ro.is_dir() and (why := confine_ns.read_only_bind(str(ro))) is not None:
            notes.append(f"{why}; the linked big inputs are protected against writes only (Landlock)")
    child = os.fork()
    if child == 0:
        _run_child(msg, policy, w, 1, notes)
    os.close(w)
    return confine_ns.init_wait(child)


def _proc_pid(ppid: bool = False) -> int:
    """This process's pid (`ppid`: its parent's) as the machine's /proc numbers it (in a new pid namespace whose parent
    is outside it, getppid() says 0); read before a private /proc is mounted. 0 when unknown."""
    try:
        with open("/proc/self/stat", "rb") as f:
            head, tail = f.read().rsplit(b")", 1)
        return int(tail.split()[1] if ppid else head.split()[0])
    except (OSError, IndexError, ValueError):
        return 0


def _rebase_environ(shared: str | None, private: str) -> None:
    """Variables the worker's libraries derived from its shared $TMPDIR or $HOME (torch sets TORCHINDUCTOR_CACHE_DIR
    to <TMPDIR>/torchinductor_<user> on first use), and the path constants of the modules import_builtin_factory
    imported here (huggingface_hub's HF_HOME and caches), point at the same place in the action's private one."""
    if not shared or not os.path.isabs(shared):
        return
    prefix = shared.rstrip("/")
    for name, value in list(os.environ.items()):
        if name not in ("HOME", "TMPDIR", SHARED_TMP_VAR) and value.startswith(prefix + "/"):
            os.environ[name] = private + value[len(prefix):]
    for module in filter(None, map(sys.modules.get, _PRE_IMPORTED)):  # (import_builtin_factory's, imported here)
        with contextlib.suppress(TypeError):
            for name, value in list(vars(module).items()):
                if isinstance(value, str) and (value == prefix or value.startswith(prefix + "/")):
                    setattr(module, name, private + value[len(prefix):])


def _run_child(msg: Mapping[str, Any], policy: Policy, w: int, parent: int, notes: list[str]) -> None:
    """The action's process: its own $HOME and $TMPDIR (fresh, in its sandbox), then the action, confined; its result
    to the pipe `w`. Never returns."""
    code = 0
    try:
        set_dumpable(True)  # this process's own /proc stays its own (non-root: /proc/self/fd)
        _die_with_parent(parent)
        if os.environ.get("TMPDIR"):  # toolchains find the shared precompiled headers beside it (read-only)
            os.environ[SHARED_TMP_VAR] = os.environ["TMPDIR"]
        for var, d in zip(("HOME", "TMPDIR"), private_dirs(msg["inputs"]), strict=True):
            d.mkdir(mode=0o700, exist_ok=True)
            _rebase_environ(os.environ.get(var), str(d))
            os.environ[var] = str(d)  # (g++, neuronx-cc and every process it starts inherit them)
        import tempfile

        tempfile.tempdir = None  # the worker's choice (the shared scratch dir) is not this action's
        channel.send(Connection(w, readable=False), run_action(msg["kind"], msg["spec"], msg["inputs"],
                                                               msg["outputs"], msg["log"], msg.get("expect"), policy,
                                                               notes))
    except BaseException:  # noqa: BLE001 - reported as a death by the worker
        code = 70
    finally:
        os._exit(code)


# An action's result: its metadata (recorded in the action cache) and the first lines of an error.
MAX_RESULT_BYTES = 16 << 20
_RESULT_TYPES: dict[str, tuple[type, ...]] = {
    "ok": (bool,), "metadata": (dict,), "error": (str,), "duration_s": (int, float), "pid": (int,),
    "peak_rss_mb": (int, float), "host": (str,)}


def action_result(msg: Any) -> dict[str, Any]:
    """An action child's result as the worker passes it on: the known fields of the right types only (the child ran
    model code, which may have written its own message); anything else is channel.BadMessage."""
    if not isinstance(msg, dict) or not isinstance(msg.get("ok"), bool):
        raise channel.BadMessage("a message without a boolean 'ok'")
    out: dict[str, Any] = {}
    for key, types in _RESULT_TYPES.items():
        if key in msg:
            v = msg[key]
            if not isinstance(v, types) or (types != (bool,) and isinstance(v, bool)):
                raise channel.BadMessage(f"a message whose {key!r} is a {type(v).__name__}")
            out[key] = v
    if not out["ok"]:
        out["error"] = first_lines(str(out.get("error") or "")) or "the action failed"
    return out


def close_inherited_fds(keep: tuple[int, ...] = ()) -> None:
    """Close every descriptor of this (just forked) process but stdin, stdout, stderr and `keep`: the model's code
    must reach no pipe or socket of its worker (the worker's channel to the build process, the pool's pidfd)."""
    try:
        fds = sorted(int(n) for n in os.listdir("/proc/self/fd"))
    except OSError:
        fds = list(range(3, 1024))
    for fd in fds:
        if fd > 2 and fd not in keep:
            with contextlib.suppress(OSError):
                os.close(fd)


def step_dirs(spec: Mapping[str, Any]) -> StepDirs:
    """What the step `spec` may use besides its sandbox, as its step provider declares (StepProvider.step_dirs): the
    cpu toolchain's inductor working dir (writable) and precompiled headers (read-only: written by warm-ups, in this
    process). A step of a provider that declares none (the core's trace and weights) gets nothing more."""
    try:
        from neuronbuild import plugins

        provider = plugins.step_provider(spec)
        return provider.step_dirs(spec) if provider is not None else StepDirs()
    except Exception:  # noqa: BLE001 - a broken toolchain import is reported by the action itself
        return StepDirs()


_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Linux: orphaned descendants (a model's forked child whose parent exited) are re-parented to this worker
    instead of init, so end_descendants() still finds them."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def end_descendants(spare: Sequence[int] = ()) -> int:
    """Kill every process the last action left behind (orphans re-parented to this worker, a subreaper, and
    inductor's compile workers started in the action's process); reap them. Returns how many were killed."""
    import signal

    killed = 0
    for _ in range(50):  # killing a process re-parents its children to us: repeat until none is left
        victims = [c for c in limits.children(os.getpid()) if c not in spare]
        if not victims:
            break
        for c in victims:
            with contextlib.suppress(OSError):
                os.kill(c, signal.SIGKILL)
                killed += 1
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            try:
                pid, _status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0 and not any(os.path.exists(f"/proc/{c}") and not _is_zombie(c) for c in victims):
                break
            if pid == 0:
                time.sleep(0.01)
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    return killed


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return True


def _watch_parent(parent: int) -> None:
    """End this worker (and the compilers it started) when the process that started it dies."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            with contextlib.suppress(OSError):
                os.killpg(0, 9)
            os._exit(1)


def warm_imports() -> None:
    """Modules every action imports, imported once here so forked actions start warm. Importing must start no
    thread and run no torch op: a fork copies only the forking thread, and a used OpenMP pool breaks in the child.

    What every action needs (export, and saving or loading a program: ~0.1 s of CPU less in each forked action
    than importing them there), in the order an action would import them, and no more: the worker's start is on
    every build's critical path (no action runs before it). What one toolchain's steps import comes with its
    `prepare_worker` (prepare_process) and its warm-up, which runs in this process before the worker's first such step
    (run_warm_up, warm_before): the cpu toolchain's imports inductor's compile_fx (~0.7 s that a Neuron-only build
    never needs)."""
    import torch._dynamo  # noqa: F401
    import torch.export  # noqa: F401
    import torch.export._trace  # noqa: F401  (what torch.export.export imports first)
    import torch.export.pt2_archive._package  # noqa: F401  (what torch.export.save and load import first)


def prepare_process() -> tuple[str, ...]:
    """What a warm process does once before it runs anything: make its temp dirs, import torch and the toolchains
    (warm_imports; no model code, no thread, no torch op). Returns the installation's roots (confine.installation_roots),
    computed before any action could add to sys.path. Run by a spawned worker (main) and by the zygote, whose forked
    workers inherit all of it (zygote.py)."""
    set_dumpable(False)  # no action (another worker's) reads this process's environ, maps or memory
    for var in ("TMPDIR", "HOME"):
        if os.environ.get(var):
            Path(os.environ[var]).mkdir(parents=True, exist_ok=True)
    no_monitor_thread()
    with contextlib.suppress(Exception):  # a broken toolchain import is reported by the first action instead
        from neuronbuild import plugins

        for provider in plugins.step_providers().values():  # what each one's steps import (the core's trace first)
            with contextlib.suppress(Exception):
                provider.prepare_worker()
        warm_imports()
    return installation_roots()


def no_monitor_thread() -> None:
    """tqdm starts a monitor thread with its first progress bar (torch.fx's interpreter makes one while inductor's
    pattern tables are traced in the cpu warm-up) and keeps it: this process forks after warm-ups, and a fork copies
    only the forking thread, so no monitor (it only tunes how often bars redraw)."""
    with contextlib.suppress(Exception):
        import tqdm

        tqdm.tqdm.monitor_interval = 0


def main(read_fd: int, write_fd: int) -> None:
    """A worker's life: warm up (import torch and the toolchains once; no model code ever runs here), then run each
    action in a child forked from this warm, clean state (run_isolated) until told to stop.

    Started by pool.WorkerProcess in its own session with the action environment; messages are JSON (channel.py) over two
    pipes: in, {"kind", "spec", "inputs", "outputs", "log", "expect"} or None (stop); out, run_action's result."""
    for fd in (read_fd, write_fd):
        os.set_inheritable(fd, False)  # compilers started by the toolchain must not hold our pipes open
    conn_in = Connection(read_fd, writable=False)
    conn_out = Connection(write_fd, readable=False)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    become_subreaper()
    serve(conn_in, conn_out, prepare_process())


def main_forked(read_fd: int, write_fd: int, installation: tuple[str, ...], pool_pid: int,
                warmed: set[str] | None = None) -> None:
    """A worker forked from the zygote (already warm: prepare_process and the zygote's toolchain warm-ups, `warmed`,
    ran there): the same life as main's, minus the imports. Its parent is the zygote, so it watches the pool's
    process itself (a pidfd: exact, no polling)."""
    for fd in (read_fd, write_fd):
        os.set_inheritable(fd, False)
    conn_in = Connection(read_fd, writable=False)
    conn_out = Connection(write_fd, readable=False)
    try:
        pool_fd = os.pidfd_open(pool_pid)
    except OSError:  # the pool is gone already
        os._exit(1)
    threading.Thread(target=_watch_pidfd, args=(pool_fd,), daemon=True).start()
    become_subreaper()  # not inherited across fork
    serve(conn_in, conn_out, installation, set(warmed or ()))


def serve(conn_in: Connection, conn_out: Connection, installation: tuple[str, ...],
          warmed: set[str] | None = None) -> None:
    """The warm worker's loop: run each message (a toolchain warm-up in this process, an action in a confined fork)
    and send its result, with the keys of the warm-ups this process holds ("warmed"), until told to stop or the pool
    is gone."""
    warmed = set() if warmed is None else warmed  # toolchain warm-ups done in this process (their keys)
    FREEZE[0] = True
    channel.send(conn_out, {"ready": True, "pid": os.getpid()})
    prepare(installation)  # the first action's processes, while the build sends it
    while True:
        try:
            msg = channel.recv(conn_in)
        except (EOFError, OSError, channel.BadMessage):
            _exit_now()
        if msg is None:
            _exit_now()
        if is_warm_up(msg):
            discard_prepared()  # (forked before the warm-up: it would lack it)
            result = run_warm_up(msg, warmed)
        else:
            implicit = warm_before(msg, warmed)
            import_builtin_factory(msg)  # (a prepared process forked before an import here is made again)
            result = run_isolated(msg, installation, defer=True)
            if implicit is not None:
                result["duration_s"] = float(result.get("duration_s") or 0.0) + implicit
        end_descendants(spare=_DEFERRED)  # nothing an action started outlives it (its init: exiting, reaped below)
        if not is_warm_up(msg):
            result = _without_foreign_entries(msg, result)
        cap_log(msg["log"])
        result["warmed"] = sorted(warmed)
        channel.send(conn_out, result)
        reap_deferred()
        prepare(installation)  # the next action's processes, while the build stores this one's outputs


def _without_foreign_entries(msg: Mapping[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """`result`, failed when the ended action left a link (or a device, a fifo) among its outputs or in place of its
    log (sandbox.foreign_entry): nothing unconfined reads through it."""
    why = foreign_entry(msg["outputs"], msg["log"])
    if why is None or not result.get("ok"):
        return result
    return {**result, "ok": False, "metadata": {}, "error": f"the action left {why}: outputs must be files it wrote "
            "(model code is confined; nothing was cached)"}


def _watch_pidfd(pidfd: int) -> None:
    """End this worker (and the compilers it started) when the process behind `pidfd` (the pool's) exits."""
    import select

    while True:
        with contextlib.suppress(InterruptedError):
            if select.select([pidfd], [], [])[0]:
                break
    with contextlib.suppress(OSError):
        os.killpg(0, 9)
    os._exit(1)


def _exit_now() -> None:
    """Told to stop (or its build is gone), between actions: exit without the interpreter's teardown, which with torch,
    inductor and jax loaded is slow and the build would wait for it. Nothing is left to clean up: the
    last action's processes were ended and its log closed (and a prepared one is ended now)."""
    with contextlib.suppress(Exception):
        discard_prepared()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(0)




def run_warm_up(msg: Mapping[str, Any], warmed: set[str]) -> dict[str, Any]:
    """A toolchain's warm-up runs in this worker process itself, not in a forked child: toolchain code only (no model
    code, so no confinement), and what it leaves in memory (inductor's memo of the precompiled headers it checked,
    the compiler probes) is inherited by every action forked afterwards. Run only between actions: its threads (if
    any) are joined before it returns, so the next fork copies a single-threaded process."""
    before = _cpu_here()
    res = run_action(str(msg["kind"]), dict(msg["spec"]), str(msg["inputs"]), str(msg["outputs"]), str(msg["log"]),
                     msg.get("expect"), None)
    res["cpu_s"] = round(_cpu_here() - before, 3)
    _CHANGES[0] += 1  # (an action process prepared before it lacks what it left in memory)
    if res.get("ok"):
        warmed.add(warm_key(msg["spec"]))
    res["action_pid"] = os.getpid()
    return res


def _cpu_here() -> float:
    """CPU seconds of this thread and of the children this process has waited for (a warm-up's compilers; in a
    zygote also any worker it reaped meanwhile, rare while a build runs)."""
    import resource

    own = resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF))
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


# Modules import_builtin_factory imported in this worker (their names): _rebase_environ rebases their path constants.
_PRE_IMPORTED: list[str] = []


def import_builtin_factory(msg: Mapping[str, Any]) -> None:
    """When the action's model factory is a wrapper neuronbuild ships (model_import.BUILTIN_PREFIX, e.g. hf_causal_lm,
    whose import of transformers costs each forked action ~0.9 s of CPU), its module is imported here, in the worker,
    once: this action and every later one forked from here start with it. neuronbuild's own code, imported only (the
    factory runs in the action's process), starting no thread; a failed import is left to the action to report.
    What those modules derived from the worker's $HOME or $TMPDIR at import (huggingface_hub's cache paths) is
    rebased in each action's process to its own (_rebase_environ), as if imported there."""
    spec = msg.get("spec")
    model = spec.get("model") if isinstance(spec, Mapping) else None
    entry = model.get("entry") if isinstance(model, Mapping) else None
    if not isinstance(entry, str):
        return
    name = entry.partition(":")[0]
    from neuronbuild.toolchains.model_import import BUILTIN_PREFIX

    if name.startswith(BUILTIN_PREFIX) and name not in sys.modules:
        import importlib

        before = set(sys.modules)
        with contextlib.suppress(Exception):
            importlib.import_module(name)
        _PRE_IMPORTED.extend(sorted(set(sys.modules) - before))


def warm_key(spec: Mapping[str, Any]) -> str:
    """The identity of a warm-up (its step provider, a toolchain, and key) in a process's set of warm-ups done."""
    return json.dumps([provider_name(spec) or None, spec.get("key")], sort_keys=True, default=str)


def warm_before(msg: Mapping[str, Any], warmed: set[str]) -> float | None:
    """Before this worker's first toolchain step that has a warm-up key: that warm-up, in this process (run_warm_up),
    so this step and the later ones forked from here start with it done (with one worker there is no warm-up
    pseudo-action; with several, a worker that did not run it still fills its memo from the files on disk). Returns
    its seconds, or None when nothing ran. A failed warm-up is not the step's failure: the step builds what it needs."""
    from neuronbuild import plugins

    spec = msg.get("spec")
    w_spec = warm_up_spec(plugins.step_providers(), spec) if isinstance(spec, Mapping) else None
    if w_spec is None or warm_key(w_spec) in warmed:
        return None
    start = time.perf_counter()
    with open(str(msg["log"]), "a", encoding="utf-8") as log:
        log.write("# warm-up in the worker process before its first step of this kind\n")
    res = run_warm_up({**msg, "kind": WARM_UP, "spec": w_spec}, warmed)
    warmed.add(warm_key(w_spec))  # tried once per worker, failed or not
    seconds = time.perf_counter() - start
    with open(str(msg["log"]), "a", encoding="utf-8") as log:
        log.write(f"# warm-up {'done' if res.get('ok') else 'failed'} in {seconds:.1f} s: "
                  f"{json.dumps(res.get('metadata') if res.get('ok') else res.get('error'))}\n")
    return seconds


def death_message(returncode: int | None) -> str:
    """How a worker (or an action's process) ended, for the failure it leaves (from its exit status)."""
    if returncode is None:
        return "the worker process died (how is unknown: its exit status was not reported)"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        hint = " (out of memory, or killed by hand)" if name == "SIGKILL" else ""
        return f"the worker process died: killed by {name}{hint}"
    return f"the worker process died: exit status {returncode}"
