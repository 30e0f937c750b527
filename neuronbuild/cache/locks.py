"""Lock files that work across machines on a shared filesystem (NFS/FSx): link()-created, heartbeated, stale-breakable.

flock is not reliable over NFS, so a claim on a shared tier is a file created atomically with link(2) (which fails if
the name exists, on every NFS version) and holding its owner (host, pid, token). The owner refreshes its mtime every
HEARTBEAT_S seconds from a background thread. A waiter breaks a lock when its owner is a dead process on the same host,
or when it has watched the lock's mtime stay unchanged for STALE_S seconds of its own monotonic clock (no clock skew
between machines involved), or when the mtime is older than STALE_S + MAX_SKEW_S by the wall clock."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from neuronbuild import envvars, jsondata


def heartbeat_s() -> float:
    return envvars.current().seconds("NEURONBUILD_LOCK_HEARTBEAT_S")


def stale_s() -> float:
    return envvars.current().seconds("NEURONBUILD_LOCK_STALE_S")
MAX_SKEW_S = 300.0
HOST = socket.gethostname()


@dataclass(frozen=True)
class Owner:
    """Who holds a lock file."""

    host: str
    pid: int
    token: str
    started: float

    def to_json(self) -> bytes:
        return json.dumps({"host": self.host, "pid": self.pid, "token": self.token, "started": self.started}).encode()

    @staticmethod
    def from_json(data: bytes) -> Owner | None:
        try:
            d = jsondata.loads(data)
            return Owner(str(d["host"]), int(d["pid"]), str(d["token"]), float(d["started"]))
        except (ValueError, KeyError, TypeError):
            return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_owner(path: Path) -> Owner | None:
    try:
        return Owner.from_json(path.read_bytes())
    except OSError:
        return None


class _Heartbeat:
    """One daemon thread per process refreshing the mtime of every lock file it holds."""

    def __init__(self) -> None:
        self._held: dict[Path, str] = {}
        self._mu = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, path: Path, token: str) -> None:
        with self._mu:
            self._held[path] = token
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="neuronbuild-lock-heartbeat", daemon=True)
                self._thread.start()

    def remove(self, path: Path) -> None:
        with self._mu:
            self._held.pop(path, None)

    def _run(self) -> None:
        while True:
            time.sleep(heartbeat_s())
            with self._mu:
                held = list(self._held.items())
            for path, token in held:
                owner = read_owner(path)
                if owner is None or owner.token != token:
                    self.remove(path)  # broken by someone else: stop refreshing it
                    continue
                with contextlib.suppress(OSError):
                    os.utime(path)


_HEARTBEAT = _Heartbeat()


class LockFile:
    """A held lock file; release() removes it if this process still owns it."""

    def __init__(self, path: Path, token: str) -> None:
        self.path = path
        self.token = token
        self._held = True

    def release(self) -> None:
        if not self._held:
            return
        self._held = False
        _HEARTBEAT.remove(self.path)
        owner = read_owner(self.path)
        if owner is not None and owner.token == self.token:
            with contextlib.suppress(OSError):
                os.unlink(self.path)


class LockDir:
    """Lock files named <dir>/<key>.lock; remembers what it has seen to detect stale ones without trusting clocks."""

    def __init__(self, directory: Path, tmp: Path) -> None:
        self.dir = directory
        self.tmp = tmp
        self._seen: dict[str, tuple[float, int, str]] = {}  # key -> (first seen monotonic, mtime_ns, token)

    def path(self, key: str) -> Path:
        return self.dir / f"{key}.lock"

    def try_acquire(self, key: str) -> LockFile | None:
        """The lock for `key`, or None while a live owner holds it."""
        path = self.path(key)
        for _attempt in range(2):
            got = self._create(path)
            if got is not None:
                self._seen.pop(key, None)
                return got
            if not self._break_if_stale(key, path):
                return None
        return None

    def _create(self, path: Path) -> LockFile | None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.tmp.mkdir(parents=True, exist_ok=True)
        owner = Owner(HOST, os.getpid(), uuid.uuid4().hex, time.time())
        tmp = self.tmp / f".lock-{owner.token}"
        # Not synced (#53: an fsync per claim was on every action's dispatch): the owner is read by live processes
        # (the page cache; on NFS close() sends it to the server before the link below names it); after a crash
        # every claim is stale whatever a crash left of it (read_owner: None for a cut file; then the stale timers).
        with open(tmp, "wb") as f:
            f.write(owner.to_json())
        try:
            os.link(tmp, path)  # atomic, fails if the lock exists (also over NFS)
        except FileExistsError:
            return None
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        _HEARTBEAT.add(path, owner.token)
        return LockFile(path, owner.token)

    def is_stale(self, key: str, path: Path) -> tuple[bool, Owner | None]:
        try:
            st = path.stat()
        except FileNotFoundError:
            return True, None
        owner = read_owner(path)
        token = owner.token if owner else ""
        now = time.monotonic()
        first, mtime, seen_token = self._seen.get(key, (now, st.st_mtime_ns, token))
        if mtime != st.st_mtime_ns or seen_token != token:
            first = now  # the owner is alive (heartbeat) or it changed hands
        self._seen[key] = (first, st.st_mtime_ns, token)
        if owner is not None and owner.host == HOST and not _pid_alive(owner.pid):
            return True, owner
        if now - first >= stale_s():
            return True, owner
        if time.time() - st.st_mtime > stale_s() + MAX_SKEW_S:
            return True, owner
        return False, owner

    def _break_if_stale(self, key: str, path: Path) -> bool:
        stale, owner = self.is_stale(key, path)
        if not stale:
            return False
        aside = path.with_name(f"{path.name}.broken-{uuid.uuid4().hex}")
        try:
            os.rename(path, aside)  # only one breaker wins the rename
        except FileNotFoundError:
            return True
        except OSError:
            return False
        moved = read_owner(aside)
        if owner is not None and (moved is None or moved.token != owner.token):
            # We moved a lock that was re-created after our check: put it back if its name is still free.
            with contextlib.suppress(OSError):
                os.link(aside, path)
            with contextlib.suppress(OSError):
                os.unlink(aside)
            return False
        with contextlib.suppress(OSError):
            os.unlink(aside)
        self._seen.pop(key, None)
        return True
