"""The zygote: one warm process (torch and the toolchains imported) from which a pool's workers are forked, so N
workers pay one import instead of N (like Android's zygote or multiprocessing's forkserver with preload).

The pool starts it (Zygote) like a worker, in its own session; it imports what every worker imports
(worker.prepare_process), then waits for requests on a Unix seqpacket socket: "fork" (with the new worker's two pipe
ends attached) forks a worker that runs worker.main_forked: it starts its own session, so the pool ends it and its
compilers as a group, as it does a spawned worker; "warm" runs a toolchain warm-up (worker.run_warm_up: toolchain
code, never model code) in the zygote itself, so every worker forked afterwards inherits it (the pool then replaces
idle workers that lack it). The zygote runs no model code and no step, and its warm-ups join their threads before
they return, so it is single-threaded whenever it forks: it checks that (/proc/self/task) before every fork and
refuses otherwise, and the pool then spawns a fresh worker instead. Every action still runs in its own confined fork
of its worker (worker.run_isolated).

The zygote is the forked workers' parent: it reaps them and reports each exit status to the pool ("exit"), which
cannot wait for a process it did not start. The pool watches each worker's exit with a pidfd (Linux >= 5.3; without
pidfds the pool does not use a zygote). The zygote exits when the pool closes the socket or its parent dies."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

_BOOT = ("import os, sys; sys.path[:] = [p for p in sys.path if os.path.isabs(p)]; "
         "sys.path.insert(0, sys.argv[1]); "
         "from neuronbuild.execution.zygote import main; main(int(sys.argv[2]))")
_MAX_MSG = 1 << 20
# How long the pool waits for the zygote's exit report of a worker it saw exit (the report follows the reap).
_EXIT_REPORT_S = 2.0


def spawn(boot: str, args: list[str], fds: tuple[int, ...], env: dict[str, str], cwd: Path,
          stderr_path: Path | None) -> subprocess.Popen[bytes]:
    """`python -P -s -c boot *args` (a worker, or the zygote) in its own session, passed `fds`; its output appended to
    `stderr_path` (None: discarded)."""
    cwd.mkdir(parents=True, exist_ok=True)
    err: Any = subprocess.DEVNULL
    if stderr_path is not None:
        stderr_path.parent.mkdir(parents=True, exist_ok=True)
        err = open(stderr_path, "ab")  # noqa: SIM115 - handed to the child
    try:
        return subprocess.Popen([sys.executable, "-P", "-s", "-c", boot, *args], pass_fds=fds, env=env, cwd=cwd,
                                start_new_session=True, stdin=subprocess.DEVNULL, stdout=err, stderr=err)
    finally:
        if err is not subprocess.DEVNULL:
            err.close()


def supported() -> bool:
    """Pidfds (Linux >= 5.3) and fd passing: what the pool needs to use forked workers."""
    if not hasattr(os, "pidfd_open") or not hasattr(socket, "send_fds"):
        return False
    try:
        fd = os.pidfd_open(os.getpid())
    except OSError:
        return False
    os.close(fd)
    return True


def threads_now() -> int:
    """Threads of this process (1 when it is safe to fork: a fork copies only the calling thread)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1 if sys.platform == "linux" else 0


class Zygote:
    """The pool's handle on its zygote process: start it, ask it for forked workers, learn their exit statuses."""

    def __init__(self, pkg_parent: str, env: dict[str, str], cwd: Path, stderr_path: Path | None = None) -> None:
        self.sock, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            # "neuronbuild-worker-zygote": a search for the build's worker processes finds it too.
            self.proc = spawn(_BOOT, [pkg_parent, str(child.fileno()), "neuronbuild-worker-zygote"], (child.fileno(),),
                              env, cwd, stderr_path)
        finally:
            child.close()
        self.ready = False
        self.closed = False
        self._seq = 0  # fork requests sent (each answer names its request)
        self.codes: dict[int, int] = {}  # exit statuses of forked workers (os.waitstatus_to_exitcode), by pid
        self.keys: set[str] = set()  # the toolchain warm-ups done in the zygote (worker.warm_key), inherited by forks
        self.results: list[tuple[str, dict[str, Any]]] = []  # finished warm-ups not yet collected: (task id, result)
        self.warming: dict[str, float] = {}  # warm-ups running in the zygote: task id -> when sent

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return not self.closed and self.proc.poll() is None

    def _recv(self, timeout: float | None) -> dict[str, Any] | None:
        """One message within `timeout` seconds (None: none came); {"eof": True} when the zygote is gone."""
        try:
            if not select.select([self.sock], [], [], timeout)[0]:
                return None
            data = self.sock.recv(_MAX_MSG)
        except (OSError, ValueError):
            data = b""
        if not data:
            self.closed = True
            return {"eof": True}
        msg: dict[str, Any] = json.loads(data)
        if "exit" in msg:
            self.codes[int(msg["exit"])] = int(msg["code"])
        elif msg.get("ready"):
            self.ready = True
        elif "result" in msg:
            self.keys = set(msg.get("keys") or ())
            self.warming.pop(str(msg["task"]), None)
            self.results.append((str(msg["task"]), dict(msg["result"])))
        return msg

    def warm_up(self, task_id: str, msg: dict[str, Any]) -> bool:
        """Run a toolchain warm-up (a WARM_UP task message) in the zygote itself, so every worker forked afterwards
        inherits it; its result comes later (results, read by drain). False when the zygote is gone."""
        if not self.alive():
            return False
        try:
            self.sock.send(json.dumps({"op": "warm", "task": task_id, "msg": msg}).encode())
        except OSError:
            self.closed = True
            return False
        self.warming[task_id] = time.time()
        return True

    def drain(self) -> None:
        """Read the reports already sent (exit statuses)."""
        while not self.closed and self._recv(0) is not None:
            pass

    def fork(self, read_fd: int, write_fd: int, timeout: float) -> int | None:
        """A worker forked from the zygote that reads tasks from `read_fd` and writes results to `write_fd` (both
        handed over: the caller closes its copies); its pid, or None when the zygote cannot (gone, not single-
        threaded, or no answer within `timeout` seconds while still importing): the caller then spawns one."""
        if not self.alive():
            return None
        self._seq += 1
        try:
            socket.send_fds(self.sock, [json.dumps({"op": "fork", "id": self._seq}).encode()], [read_fd, write_fd])
        except OSError:
            self.closed = True
            return None
        deadline = time.monotonic() + timeout
        while True:
            msg = self._recv(max(0.0, deadline - time.monotonic()))
            if msg is None:
                if time.monotonic() >= deadline:
                    self.close()  # a zygote that does not answer is no use: spawn from now on
                    return None
                continue
            if msg.get("id") not in (None, self._seq):  # the answer to a fork whose caller was interrupted
                continue  # (that worker reads EOF on its pipe and exits)
            if msg.get("eof") or "error" in msg:
                return None
            if "forked" in msg:
                self.keys = set(msg.get("keys") or ())
                return int(msg["forked"])

    def exit_code(self, pid: int, wait_s: float = _EXIT_REPORT_S) -> int | None:
        """The exit status of forked worker `pid` (which has exited), from the zygote's report."""
        deadline = time.monotonic() + wait_s
        while pid not in self.codes and not self.closed:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._recv(left)
        return self.codes.pop(pid, None)

    def close(self) -> None:
        """End the zygote (its forked workers are ended by the pool, each as a group)."""
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.close()  # it ends the workers it forked (each group) and exits
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=1.0)
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


class ForkedProc:
    """A forked worker as the pool sees it, with the parts of subprocess.Popen the pool uses (pid, poll, wait, kill,
    returncode): its exit is seen through a pidfd, its status comes from the zygote's report."""

    def __init__(self, pid: int, zygote: Zygote) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.status_known = True  # False: it exited, but the zygote's report of how did not come
        self._zygote = zygote
        self._fd: int | None = None
        with contextlib.suppress(OSError):
            self._fd = os.pidfd_open(pid)

    def _exited(self, timeout: float | None) -> bool:
        if self._fd is None:
            return True  # gone before we could watch it
        return bool(select.select([self._fd], [], [], timeout)[0])

    def poll(self) -> int | None:
        if self.returncode is None and self._exited(0):
            code = self._zygote.exit_code(self.pid)
            self.status_known = code is not None
            self.returncode = code if code is not None else 255
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and not self._exited(timeout):
            raise subprocess.TimeoutExpired("forked worker", timeout or 0.0)
        code = self.poll()
        assert code is not None
        return code

    def kill(self) -> None:
        if self._fd is not None and self.returncode is None:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self._fd, signal.SIGKILL)

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None


def main(sock_fd: int) -> None:
    """The zygote's life (started by Zygote): import once, then fork workers on request and report their exits."""
    from neuronbuild.execution import worker

    os.set_inheritable(sock_fd, False)
    sock = socket.socket(fileno=sock_fd)
    parent = os.getppid()
    installation = worker.prepare_process()
    _send(sock, {"ready": True, "pid": os.getpid()})
    children: dict[int, int] = {}  # pidfd -> pid of each forked worker not yet reaped
    warmed: set[str] = set()  # the toolchain warm-ups done here (worker.warm_key)
    while True:
        try:
            ready: list[int] = select.select([sock.fileno(), *children], [], [], 1.0)[0]
        except InterruptedError:
            continue
        if os.getppid() != parent:  # the pool's process is gone: so is the reason to exist
            os._exit(0)
        for fd in ready:
            if fd != sock.fileno():
                _reap(sock, children, fd)
        if sock.fileno() in ready:
            try:
                data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MSG, 2)
            except OSError:
                data, fds = b"", []
            if not data:  # the pool closed its end: end the workers forked from here, then exit
                for pid in children.values():
                    with contextlib.suppress(OSError):
                        os.killpg(pid, signal.SIGKILL)
                os._exit(0)
            req = json.loads(data)
            if req.get("op") == "fork" and len(fds) == 2:
                _fork(sock, fds, installation, parent, children, warmed, req.get("id"))
            elif req.get("op") == "warm":
                _warm(sock, req, children, warmed)
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)


def _send(sock: socket.socket, msg: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):
        sock.send(json.dumps(msg).encode())


def _reap(sock: socket.socket, children: dict[int, int], pidfd: int) -> None:
    pid = children.pop(pidfd)
    with contextlib.suppress(OSError):
        os.close(pidfd)
    try:
        _pid, status = os.waitpid(pid, 0)
    except ChildProcessError:
        return
    _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _warm(sock: socket.socket, req: dict[str, Any], children: dict[int, int], warmed: set[str]) -> None:
    """A toolchain warm-up in this process (worker.run_warm_up: toolchain code only, its threads joined before it
    returns). Workers that exit meanwhile are reaped and reported at once by _Reaper (a warm-up lasts seconds: a
    lowering's imports jax, a cpu one compiles headers; the pool waits only _EXIT_REPORT_S for a report)."""
    from neuronbuild.execution import worker

    msg = req["msg"]
    held = isinstance(msg.get("spec"), dict) and worker.warm_key(msg["spec"]) in warmed  # (done here before: a
    # warm-up between commands, or a build's)
    with _Reaper(sock, children):
        try:
            res = worker.run_warm_up(msg, warmed)
        except Exception as e:  # noqa: BLE001 - a warm-up's failure is reported, never the zygote's end
            res = {"ok": False, "error": f"{type(e).__name__}: {e}", "duration_s": 0.0}
    worker.cap_log(str(msg["log"]))
    res["action_pid"] = os.getpid()
    if held and isinstance(res.get("metadata"), dict):
        res["metadata"]["held_before"] = True  # (in the build's events: the build did not pay for it)
    try:
        data = json.dumps({"result": res, "task": req["task"], "keys": sorted(warmed)}, default=str).encode()
    except (TypeError, ValueError):
        data = json.dumps({"result": {"ok": res.get("ok", False), "duration_s": res.get("duration_s", 0.0),
                                      "error": str(res.get("error") or "")},
                           "task": req["task"], "keys": sorted(warmed)}).encode()
    with contextlib.suppress(OSError):
        sock.send(data)


class _Reaper:
    """While the zygote's one thread runs a warm-up: a thread that reaps the forked workers that exit and reports
    their exit status. It touches only `children` and the socket, which the warm-up does not, and is joined when the
    warm-up ends, so a fork (which needs a single-threaded zygote) never meets it."""

    def __init__(self, sock: socket.socket, children: dict[int, int]) -> None:
        self.sock, self.children = sock, children
        self._stop_r, self._stop_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name="neuronbuild-zygote-reaper", daemon=True)

    def __enter__(self) -> _Reaper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        os.write(self._stop_w, b"x")
        self._thread.join()
        os.close(self._stop_r)
        os.close(self._stop_w)

    def _run(self) -> None:
        while True:
            ready = select.select([self._stop_r, *self.children], [], [])[0]
            if self._stop_r in ready:
                return
            for fd in ready:
                _reap(self.sock, self.children, fd)


def _fork(sock: socket.socket, fds: list[int], installation: tuple[str, ...], parent: int,
          children: dict[int, int], warmed: set[str], req_id: Any = None) -> None:
    n = threads_now()
    deadline = time.monotonic() + 1.0
    while n != 1 and time.monotonic() < deadline:  # a joined thread's OS thread ends a moment after the join
        time.sleep(0.01)
        n = threads_now()
    if n != 1:  # a fork copies only this thread: whatever another one held (a lock) would stay held in the child
        _send(sock, {"error": f"the zygote has {n} threads; it forks only single-threaded", "id": req_id})
        return
    pid = os.fork()
    if pid == 0:  # the new worker
        try:
            sock.close()
            for fd in children:
                with contextlib.suppress(OSError):
                    os.close(fd)
            os.setsid()  # its own session: the pool ends it and its compilers as a group
            worker_main_forked(fds[0], fds[1], installation, parent, warmed)
        finally:
            os._exit(70)
    try:
        children[os.pidfd_open(pid)] = pid
    except OSError:
        pass  # reaped by the next fork's waitpid never: the pidfd is how we learn of its exit
    _send(sock, {"forked": pid, "keys": sorted(warmed), "id": req_id})


def worker_main_forked(read_fd: int, write_fd: int, installation: tuple[str, ...], pool_pid: int,
                       warmed: set[str]) -> None:
    from neuronbuild.execution.worker import main_forked

    main_forked(read_fd, write_fd, installation, pool_pid, warmed)
