"""What the server keeps between commands: warm worker pools (torch and inductor imported) and the load and digest
caches in memory; and what it forgets before each command so nothing it keeps can be stale."""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

from neuronbuild.execution import local_executor
from neuronbuild.execution.pool import WorkerPool

# Process-wide memoised functions must not outlive a command (the host ISA, the C++ compiler's and neuronx-cc's
# versions depend on the client's environment and files): a batch build computes them afresh, so the server does
# too. Kept: what the server stamp covers, so a change replaces the server (server/protocol.server_stamp):
# neuronbuild's own code (self_stamp.code_stamp, computed once per process), and the Python distributions (stat
# keys of every sys.path entry).
_KEEP_CACHED = {"neuronbuild.analysis.toolchain_versions.package_version",
                "neuronbuild.analysis.toolchain_versions._packages_distributions"}


class KeptPool(WorkerPool):
    """A worker pool whose idle workers survive the end of a build (the next build of this server reuses them)."""

    def shutdown(self) -> None:
        if self.busy:  # an unfinished action (a failure without --keep-going): end it as a batch build would
            super().shutdown()


class WarmState:
    """The kept pools (one per pool configuration; only the latest is kept) and in-memory load caches."""

    def __init__(self) -> None:
        self._pool_key: str | None = None
        self._pool: KeptPool | None = None
        self._umask = 0o022  # the umask of the command that made the kept pool (its processes inherit it)
        self.pending = 0  # commands since the last collection
        # Warm workers (with torch imported: ~1.3 GB after `make example`) are released after this long without a
        # command; the server itself stays until --max-idle-secs. NEURONBUILD_WORKERS_IDLE_SECS (in the environment
        # of the client that starts the server) overrides it.
        self.workers_idle_s = _workers_idle_secs()
        # The pool a command that made none named (local_executor.want_workers): its args, kwargs and the command's
        # umask; made and warmed once the answer is sent (warm_in_background), then forgotten.
        self._wanted: tuple[tuple[Any, ...], dict[str, Any], int] | None = None

    def _pool_factory(self, *args: Any, **kwargs: Any) -> WorkerPool:
        key = json.dumps([args, kwargs], sort_keys=True, default=str)
        if self._pool is not None and self._pool_key == key and self._scratch_intact():
            return self._pool
        if self._pool is not None:
            self._pool.shutdown()
            WorkerPool.shutdown(self._pool)
        self._pool, self._pool_key = KeptPool(*args, **kwargs), key
        self._umask = os.umask(0o077)  # (during the command: the client's)
        os.umask(self._umask)
        env = args[1] if len(args) > 1 else kwargs.get("env") or {}
        self._sentinel = _scratch_sentinel(env.get("TMPDIR"))
        return self._pool

    _sentinel: str | None = None

    def _scratch_intact(self) -> bool:
        """Whether nothing the kept workers may rely on in the compiler scratch (TMPDIR: inductor's precompiled header
        and caches, which a warm worker remembers in memory) can have been removed since the pool was made, by
        `cache gc` in another process. The sentinel carries the oldest mtime found in the scratch then: gc removes
        files older than its grace period, so whatever it removed of those files, it removed the sentinel too."""
        return self._sentinel is None or os.path.exists(self._sentinel)

    # Commands run back to back (an edit loop) skip the collection (at 100,000 graphs a full one takes seconds: a
    # command arriving meanwhile would wait); it is made once the server has idled for IDLE_GC_S, or after GC_EVERY
    # commands in a row, so memory stays bounded.
    IDLE_GC_S = 5.0
    GC_EVERY = 8

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Around one command: fresh memoised toolchain facts, kept pools, load caches and analysis memos."""
        from neuronbuild import incremental

        forget_memoised()
        local_executor.pool_factory = self._pool_factory
        self._wanted = None
        local_executor.pool_wanted = self._want_pool if self._pool is None else None
        incremental.keep_in_memory(True)
        try:
            yield
        finally:
            local_executor.pool_factory = WorkerPool
            local_executor.pool_wanted = None
            gc.freeze()  # what the command keeps (memos) is not scanned by the collections of the next one
            self.pending += 1

    def collect(self) -> None:
        """Between commands, when nobody waits: write the on-disk load and digest caches (for batch commands and the
        next server) and collect what the commands left behind (analysis freezes its objects: unfreeze them first,
        since the previous commands' action graphs may only now be garbage, and they hold reference cycles)."""
        from neuronbuild import incremental

        incremental.flush_saves()
        gc.unfreeze()
        gc.collect()
        gc.freeze()
        self.pending = 0

    def worker_pids(self) -> list[int]:
        """The kept pool's processes: its workers and its zygote."""
        pool = self._pool  # (read once: `info` asks from another thread while the main one may release it)
        return pool.pids() if pool is not None else []

    def release_workers(self) -> bool:
        """Stop the kept pool's workers and zygote (the next build starts them again); whether there were any."""
        if self._pool is None:
            return False
        self.close()
        return True

    def _want_pool(self, *args: Any, **kwargs: Any) -> None:
        umask = os.umask(0o077)  # (during the command: the client's)
        os.umask(umask)
        self._wanted = (args, kwargs, umask)

    def warm_in_background(self) -> list[int]:
        """After a command's answer was sent: start the processes of a kept pool that has none (a build whose actions
        were all cached made it without starting any), so the next build, the first edit's, finds them warm. With a
        zygote only the zygote starts (it imports torch in its own process; the workers are forked from it when tasks
        come). A command that made no pool but named the one a build would make (a build answered from its no-op
        stamp, a plan, a query: local_executor.want_workers) has that pool made now, with the command's umask, and
        warmed the same way. Returns the pids started (none when there is no such pool or nothing could start)."""
        wanted, self._wanted = self._wanted, None
        if self._pool is None and wanted is not None:
            args, kwargs, umask = wanted
            old = os.umask(umask)
            try:
                self._pool_factory(*args, **kwargs)
            finally:
                os.umask(old)
        pool = self._pool
        if pool is None or pool.pids() or not self._scratch_intact():
            return []
        old = os.umask(self._umask)  # the processes the build would have started: with the client's umask
        try:
            pool.warm(pool.size)
        finally:
            os.umask(old)
        return pool.pids()

    def describe(self) -> dict[str, Any]:
        from neuronbuild import incremental

        return {"worker_pool_size": self._pool.size if self._pool is not None else 0,
                "load_caches": incremental.kept_count(), **incremental.memo_stats()}

    def close(self) -> None:
        if self._pool is not None:
            WorkerPool.shutdown(self._pool)
            self._pool = None
        if self._sentinel is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._sentinel)
            self._sentinel = None


def _workers_idle_secs() -> float:
    raw = os.environ.get("NEURONBUILD_WORKERS_IDLE_SECS") or ""
    try:
        value = float(raw) if raw else 300.0
    except ValueError:
        value = 300.0
    return value if value > 0 else 300.0


def _scratch_sentinel(tmpdir: str | None) -> str | None:
    """Create the compiler scratch's sentinel for a new pool (see WarmState._scratch_intact); None if it cannot be."""
    import time

    if not tmpdir or not os.path.isdir(tmpdir):
        return None
    oldest = time.time()
    for dirpath, _dirs, files in os.walk(tmpdir):
        for n in files:
            with contextlib.suppress(OSError):
                oldest = min(oldest, os.lstat(os.path.join(dirpath, n)).st_mtime)
    path = os.path.join(tmpdir, f".neuronbuild-server-{os.getpid()}")
    try:
        with open(path, "w"):
            pass
        os.utime(path, (oldest, oldest))
    except OSError:
        return None
    return path


def forget_memoised() -> None:
    for name, mod in list(sys.modules.items()):
        if not name.startswith("neuronbuild.") or mod is None:
            continue
        for attr, fn in list(vars(mod).items()):
            if callable(getattr(fn, "cache_clear", None)) and getattr(fn, "__module__", None) == name and \
                    f"{name}.{attr}" not in _KEEP_CACHED and isinstance(fn, functools._lru_cache_wrapper):
                fn.cache_clear()
