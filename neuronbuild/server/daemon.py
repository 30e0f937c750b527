"""The server process: accepts commands on the workspace's Unix socket and runs them one at a time in its main thread,
each as a command.Command made from its client's message (argv, environment, directory, umask) with a stream of output
back, never by changing the process's environment, directory or standard streams; keeps warm state (server/warm.py)
between them."""

from __future__ import annotations

import contextlib
import io
import json
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Generator
from pathlib import Path
from typing import Any

from neuronbuild import after_answer
from neuronbuild.atomic import atomic_write_bytes
from neuronbuild.errors import EXIT_BUILD_FAILED, EXIT_OK
from neuronbuild.execution.resources import rss_kib
from neuronbuild.server import protocol


class Outbox:
    """A command's output on its way to the client: writes are batched (consecutive text of one stream merged, in
    order across stdout and stderr) and sent by its thread every FLUSH_S or as soon as BATCH_BYTES are pending, so a
    command printing 100,000 lines sends a few hundred frames, not 200,000, while progress still reaches the terminal
    promptly."""

    FLUSH_S = 0.05
    BATCH_BYTES = 256 << 10
    # Text queued at most: a batch is sent by the Outbox's thread while the command goes on (a 7 MB `plan` matrix
    # reaches the client while the server computes the summary below it); a writer finding more queued than this
    # sends it itself, at the client's pace, so memory stays bounded
    MAX_PENDING = 32 << 20

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._lock = threading.Lock()
        self._frames: list[tuple[str, list[str]]] = []
        self._pending = 0
        self.broken = False
        self._stop = threading.Event()
        self._kick = threading.Event()  # a batch is pending: the thread sends it now
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def write(self, kind: str, s: str) -> None:
        with self._lock:
            if self._frames and self._frames[-1][0] == kind:
                self._frames[-1][1].append(s)  # joined when sent (no quadratic string building)
            else:
                self._frames.append((kind, [s]))
            self._pending += len(s)
            if self._pending >= self.MAX_PENDING:
                self._send_locked()
            elif self._pending >= self.BATCH_BYTES:
                self._kick.set()

    def flush(self) -> None:
        with self._lock:
            self._send_locked()

    # Text per frame at most (one write can be 100 MB: `plan --output json` at 100,000 graphs); encoded (UTF-8 and
    # JSON escapes, at most 12 bytes a character) it stays well below protocol.MAX_FRAME, which the client enforces.
    FRAME_CHARS = 1 << 20

    def _send_locked(self) -> None:
        frames, self._frames, self._pending = self._frames, [], 0
        step = self.FRAME_CHARS
        for kind, parts in frames:
            text = "".join(parts)
            for i in range(0, max(len(text), 1), step):
                if self.broken:
                    return
                try:
                    protocol.send(self._sock, {"t": kind, "d": text[i:i + step]})
                except OSError:
                    self.broken = True

    def _run(self) -> None:
        while not self._stop.is_set():
            self._kick.wait(self.FLUSH_S)
            self._kick.clear()
            self.flush()

    def close(self) -> None:
        self._stop.set()
        self._kick.set()
        self._thread.join()
        self.flush()


class SocketStream(io.TextIOBase):
    """sys.stdout/sys.stderr of a command: text goes to the client through the command's Outbox (lost quietly if
    the client hung up)."""

    def __init__(self, outbox: Outbox, kind: str, tty: bool) -> None:
        self._outbox, self._kind, self._tty = outbox, kind, tty

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return self._tty

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    def write(self, s: str) -> int:
        if s:
            self._outbox.write(self._kind, s)
        return len(s)

    def flush(self) -> None:
        self._outbox.flush()

    def fileno(self) -> int:
        raise io.UnsupportedOperation("a server stream has no file descriptor")


class Server:
    def __init__(self, config: dict[str, Any]) -> None:
        self.output_base = Path(config["output_base"])
        self.socket_path = Path(config["socket"])
        self.stamp = str(config["stamp"])
        self.max_idle = int(config["opts"]["max_idle_secs"])
        self.opts = config["opts"]
        self.workspace = str(config.get("workspace") or "")
        self.started = time.time()
        self.commands = 0
        self.queue: queue.Queue[tuple[socket.socket, dict[str, Any]]] = queue.Queue()
        self.busy = threading.Event()
        self.stopping = False
        self.main_thread = threading.get_ident()
        self.cancel_armed = threading.Event()
        self.cancel_lock = threading.Lock()
        from neuronbuild.server.warm import WarmState

        self.warm = WarmState(self.output_base / "warm-ups.json")
        self.background: Generator[float, None, None] | None = None  # the rest of the warm-up after the last answer (warm.py)
        self.secret = ""  # (serve makes it)

    # -- socket side (acceptor thread) ----------------------------------------------------------------------------
    def listen(self) -> socket.socket:
        protocol.private_dir(self.output_base)
        protocol.private_dir(self.socket_path.parent)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket itself: user read/write only
        try:
            s.bind(str(self.socket_path))
        finally:
            os.umask(old)
        os.chmod(self.socket_path, 0o600)
        s.listen(16)
        return s

    def accept_loop(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=self._first_message, args=(conn,), daemon=True).start()

    def _first_message(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(30)
            msg = protocol.recv(conn)
            conn.settimeout(None)
        except (OSError, EOFError, protocol.ProtocolError):
            conn.close()
            return
        kind = msg.get("type")
        if not protocol.same_secret(msg.get("secret"), self.secret):  # not a client that can read the secret file
            conn.close()
            return
        if kind == "command" and (why := protocol.command_error(msg)) is not None:
            with contextlib.suppress(OSError):
                protocol.send(conn, {"t": "err", "d": f"neuronbuild: error: a malformed command ({why})\n"})
                protocol.send(conn, {"t": "exit", "code": 2})
            conn.close()
            return
        if kind == "info":
            with contextlib.suppress(OSError):
                protocol.send(conn, {"t": "info", **self.info()})
            conn.close()
            return
        if kind not in ("command", "shutdown"):
            conn.close()
            return
        if kind == "command" and (self.busy.is_set() or not self.queue.empty()):
            with contextlib.suppress(OSError):
                protocol.send(conn, {"t": "err", "d": "neuronbuild: another command is running in the server; "
                                                      "waiting\n"})
        self.queue.put((conn, msg))

    def info(self) -> dict[str, Any]:
        workers = self.warm.worker_pids()
        return {"pid": os.getpid(), "uptime_s": round(time.time() - self.started, 1), "commands": self.commands,
                "busy": self.busy.is_set(), "rss_kib": rss_kib(), "workers": len(workers), "worker_pids": workers,
                "workers_rss_kib": sum(rss_kib(p) for p in workers), "max_idle_secs": self.max_idle,
                "workers_idle_secs": self.warm.workers_idle_s,
                "output_base": str(self.output_base), "socket": str(self.socket_path),
                "log": str(self.output_base / "server.log"), "stamp": self.stamp,
                "kept": self.warm.describe()}

    # -- command side (main thread) -------------------------------------------------------------------------------
    def serve(self) -> None:
        self.secret = protocol.new_secret(str(self.output_base / "server.secret"))  # before clients can connect
        listener = self.listen()
        info = {"pid": os.getpid(), "stamp": self.stamp, "socket": str(self.socket_path), "started": self.started,
                "opts": self.opts}
        atomic_write_bytes(self.output_base / "server.json", json.dumps(info).encode(), durable=False)
        threading.Thread(target=self.accept_loop, args=(listener,), daemon=True).start()
        print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} server {os.getpid()} listening on {self.socket_path}",
              flush=True)
        try:
            idle_since = time.monotonic()
            while not self.stopping:
                left = self.max_idle - (time.monotonic() - idle_since)
                if left <= 0:
                    print(f"idle for {self.max_idle} s: exiting", flush=True)
                    break
                if not self._still_wanted():
                    print("the workspace or the output base is gone: exiting", flush=True)
                    break
                wait = min(left, self.warm.IDLE_GC_S if self.warm.pending else 5.0)
                if self.warm.worker_pids():  # (released on time, not up to 5 s late)
                    wait = min(wait, max(0.1, self.warm.workers_idle_s - (time.monotonic() - idle_since)))
                if self.background is not None:
                    wait = min(wait, self.background_wait)
                try:
                    conn, msg = self.queue.get(timeout=wait) if wait > 0 else self.queue.get_nowait()
                except queue.Empty:
                    idle_workers = time.monotonic() - idle_since >= self.warm.workers_idle_s
                    if self.background is not None and not idle_workers:
                        self._background_step()
                        continue
                    self._end_background()  # (idle for workers_idle_s: what it warms is released below)
                    if self.warm.pending:
                        self.warm.idle()  # (a command arriving during a collection waits for it: collect_due)
                    if idle_workers and self.warm.release_workers():
                        print(f"idle for {self.warm.workers_idle_s:g} s: warm workers released", flush=True)
                    continue
                except KeyboardInterrupt:  # a late cancel that arrived after its command ended
                    continue
                self._end_background()
                try:
                    self.handle(conn, msg)
                except KeyboardInterrupt:
                    pass
                idle_since = time.monotonic()
        finally:
            self.cleanup(listener)

    def _still_wanted(self) -> bool:
        """A server whose workspace was deleted (a test's temporary directory) or whose socket or output base was
        removed can never be reached again: it exits instead of idling for hours."""
        marker = os.path.join(self.workspace, "WORKSPACE.neuronbuild") if self.workspace else None
        return (marker is None or os.path.isfile(marker)) and self.output_base.is_dir() and \
            self.socket_path.exists()

    def cleanup(self, listener: socket.socket) -> None:
        with contextlib.suppress(OSError):
            listener.close()
        while True:  # commands still waiting: their clients start a new server once this one is gone
            try:
                conn, msg = self.queue.get_nowait()
            except queue.Empty:
                break
            with conn, contextlib.suppress(OSError):
                protocol.send(conn, {"t": "exit", "code": EXIT_OK, "pid": os.getpid()} if msg.get("type") ==
                              "shutdown" else {"t": "mismatch", "pid": os.getpid(), "stopping": True})
        with contextlib.suppress(OSError):
            if json.loads((self.output_base / "server.json").read_text()).get("pid") == os.getpid():
                (self.output_base / "server.json").unlink()
                self.socket_path.unlink()
                (self.output_base / "server.secret").unlink()
        self._end_background()
        for _ in after_answer.idle_steps():  # (pages the server had not idled for yet)
            pass
        self.warm.close()
        print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} server {os.getpid()} stopped", flush=True)

    def handle(self, conn: socket.socket, msg: dict[str, Any]) -> None:
        with conn:
            if msg.get("type") == "shutdown":
                self.stopping = True
                print(f"shutdown requested by a client (pid {msg.get('pid', '?')}): exiting", flush=True)
                with contextlib.suppress(OSError):
                    protocol.send(conn, {"t": "exit", "code": EXIT_OK, "pid": os.getpid()})
                return
            if msg.get("stamp") != self.stamp:
                # Another neuronbuild version or other startup options: this server steps aside.
                self.stopping = True
                with contextlib.suppress(OSError):
                    protocol.send(conn, {"t": "mismatch", "pid": os.getpid()})
                print("a client with another version or other startup options: exiting", flush=True)
                return
            self.busy.set()
            try:
                code = self.run_command(conn, msg)
            finally:
                self.busy.clear()
            with contextlib.suppress(OSError):
                protocol.send(conn, {"t": "exit", "code": code})
                conn.shutdown(socket.SHUT_RDWR)  # wakes the client watcher blocked in recv
            after_answer.run()  # the command's record, page and no-op stamp: before the next command is read
            if _starlark_stuck():  # a cancelled endless Starlark loop holds the Starlark thread: start afresh
                print("a cancelled Starlark evaluation never ended: exiting (the next command starts a new server)",
                      flush=True)
                self.stopping = True
            if self.warm.collect_due():
                self.warm.collect()  # else when the server idles (serve)
            if not self.stopping:
                self._warm_after_answer()

    def _warm_after_answer(self) -> None:
        """The answer is sent: once no command came for warm_grace_s (a script's commands back to back are not slowed
        by it), start the warm workers a build made without starting (all its actions cached), while the user reads
        the answer, so the first edit's build is as fast as later ones; then, step by step while no command waits
        (serve), the rest of the warm-up (WarmState.background_steps: the workers' forks and the toolchain warm-ups).
        Released after workers_idle_s idle."""
        self.background, self.background_wait = self._warm_steps(), 0.0

    def _warm_steps(self) -> Generator[float, None, None]:
        yield self.warm.warm_grace_s
        yield from after_answer.idle_steps()  # (the answers' pages)
        try:
            pids = self.warm.warm_in_background()
        except Exception:  # noqa: BLE001 - a worker that cannot start fails the next build, not the server
            traceback.print_exc()
            return
        if pids:
            print(f"{time.strftime('%H:%M:%S')} warm workers starting in the background (pids "
                  f"{' '.join(map(str, pids))})", flush=True)
        yield from self.warm.background_steps()

    background_wait = 0.0  # seconds before the background warm-up's next step

    def _background_step(self) -> None:
        """One step of the background warm-up (milliseconds: a command arriving waits for one at most)."""
        assert self.background is not None
        try:
            self.background_wait = next(self.background)
        except StopIteration:
            self.background = None
        except Exception:  # noqa: BLE001 - a failed warm-up costs the next build its speed-up, never the server
            traceback.print_exc()
            self.background = None

    def _end_background(self) -> None:
        """A command arrived: the background warm-up's remaining steps are dropped (its answer starts a new one; a
        toolchain warm-up already running in the zygote finishes there, and the build's own finds it done)."""
        if self.background is not None:
            with contextlib.suppress(Exception):
                self.background.close()
            self.background = None

    def run_command(self, conn: socket.socket, msg: dict[str, Any]) -> int:
        from neuronbuild import cli
        from neuronbuild.command import Command

        self.commands += 1
        tty = msg.get("tty") or [False, False]
        outbox = Outbox(conn)
        out = SocketStream(outbox, "out", bool(tty[0]))
        err = SocketStream(outbox, "err", bool(tty[1]))
        done = threading.Event()
        watcher = threading.Thread(target=self._watch_client, args=(conn, done), daemon=True)
        argv = [str(a) for a in msg.get("argv") or []]
        t0 = time.perf_counter()
        code = EXIT_BUILD_FAILED
        try:
            for line in after_answer.carried():  # (what the last command's record or stamp could not do)
                err.write(line + "\n")
            self.cancel_armed.set()
            watcher.start()
            with self.warm.active():
                code = cli._main(argv, Command.from_message(msg, out, err, self.warm, self.warm.session))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else EXIT_BUILD_FAILED
        except KeyboardInterrupt:
            code = 8
        except Exception:  # noqa: BLE001 - a bug in a command must not end the server
            sys.stderr.write(traceback.format_exc())  # (the server's log)
            err.write("neuronbuild: internal error in the build server (see its log; --batch runs without it)\n")
            code = EXIT_BUILD_FAILED
        finally:
            with self.cancel_lock:
                self.cancel_armed.clear()
                done.set()
            outbox.close()  # everything the command wrote is sent before its exit code
        print(f"{time.strftime('%H:%M:%S')} {' '.join(argv)[:200]} -> {code} in {time.perf_counter() - t0:.2f} s "
              f"(rss {rss_kib() // 1024} MiB)", flush=True)
        return int(code)

    def _watch_client(self, conn: socket.socket, done: threading.Event) -> None:
        """A cancel request, or the client hanging up, interrupts the running command (as Ctrl-C does a batch one)."""
        while not done.is_set():
            try:
                msg = protocol.recv(conn)
            except (OSError, EOFError, protocol.ProtocolError):
                self._cancel(done)  # the client is gone (killed, or its third Ctrl-C): nobody waits for the result
                return
            if msg.get("type") == "cancel":
                self._cancel(done)

    def _cancel(self, done: threading.Event) -> None:
        with self.cancel_lock:
            if self.cancel_armed.is_set() and not done.is_set():
                signal.pthread_kill(self.main_thread, signal.SIGINT)


def _starlark_stuck() -> bool:
    adapter = sys.modules.get("neuronbuild.loading.starlark_adapter")  # (not imported when nothing was evaluated)
    return bool(adapter is not None and adapter.starlark_thread_stuck())


def main(config_json: str) -> None:
    config = json.loads(config_json)
    # (the umask stays the starting client's, which is in the server's stamp: a client with another one replaces the
    # server; the server's own files are private by their modes and the 0700 output base)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    after_answer.defer(True)  # (a server process: what the user does not wait for runs after each answer)
    server = Server(config)
    try:
        server.serve()
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        raise SystemExit(EXIT_BUILD_FAILED) from None
    if _starlark_stuck():  # the spinning thread must not hold up the interpreter's exit
        sys.stdout.flush()
        os._exit(0)
