"""What the server keeps between commands: warm worker pools (torch and inductor imported) and its session (the load
caches and the analysis engine in memory: incremental.Session), each handed to a command in its Command (`pools`,
`session`); and what it warms after a command's answer, while no command waits (WarmState.warm_in_background,
background_steps). Nothing else outlives a command: what a command learns of its environment (a compiler's version,
the host's ISA level) is kept with its Command's config (envvars.fact), which the next command does not see."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import tempfile
import time
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

from neuronbuild import envvars
from neuronbuild.errors import UserInputError
from neuronbuild.execution.pool import WorkerPool
from neuronbuild.execution.resources import rss_kib
from neuronbuild.plugin_api.actions import provider_name


class KeptPool(WorkerPool):
    """A worker pool whose idle workers survive the end of a build (the next build of this server reuses them)."""

    def shutdown(self) -> None:
        if self.busy:  # an unfinished action (a failure without --keep-going): end it as a batch build would
            super().shutdown()


class WarmState:
    """The kept pools (one per pool configuration; only the latest is kept) and in-memory load caches."""

    def __init__(self, record: Path | None = None) -> None:
        from neuronbuild.incremental import Session

        self.session = Session()  # (each command's Command.session)
        self._pool_key: str | None = None
        self._scratch: Path | None = None  # the kept pool's working dir (the cache's scratch) and its logs dir
        self._logs: Path | None = None
        # The toolchain warm-ups the last analysed plan's steps need, per cache scratch dir (a JSON file in the output
        # base, so a fresh server whose first command is answered from its no-op stamp knows them too)
        self._record = record
        self._planned: Any = None  # the action graph the last command planned (read by background_steps)
        self._seq = 0  # warm-ups sent between commands
        self._pool: KeptPool | None = None
        self.pending = 0  # commands since the last collection
        # Warm workers (with torch imported: ~1.3 GB after `make example`) are released after this long without a
        # command; the server itself stays until --max-idle-secs. NEURONBUILD_WORKERS_IDLE_SECS (in the environment
        # of the client that starts the server) overrides it.
        self.workers_idle_s = _env_secs("NEURONBUILD_WORKERS_IDLE_SECS", 300.0)
        # The background warm-up after an answer starts once no command came for this long, so a script's commands
        # back to back do not share the machine with it (NEURONBUILD_WARM_GRACE_SECS, read the same way).
        self.warm_grace_s = _env_secs("NEURONBUILD_WARM_GRACE_SECS", 0.5)
        # The pool a command that made none named (local_executor.want_workers): its args and kwargs; made and warmed
        # once the answer is sent (warm_in_background), then forgotten.
        self._wanted: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        self.wanting = False  # (local_executor.Pools: listened to while a command runs and no pool is kept)

    def _pool_factory(self, *args: Any, **kwargs: Any) -> WorkerPool:
        key = json.dumps([args, kwargs], sort_keys=True, default=str)
        if self._pool is not None and self._pool_key == key and self._scratch_intact():
            return self._pool
        if self._pool is not None:
            self._pool.shutdown()
            WorkerPool.shutdown(self._pool)
        self._pool, self._pool_key = KeptPool(*args, **kwargs), key
        env = args[1] if len(args) > 1 else kwargs.get("env") or {}
        self._sentinel = _scratch_sentinel(env.get("TMPDIR"))
        self._scratch = Path(args[2]) if len(args) > 2 else None
        self._logs = Path(args[3]).parent if len(args) > 3 and args[3] is not None else None
        return self._pool

    _sentinel: str | None = None

    def _scratch_intact(self) -> bool:
        """Whether nothing the kept workers may rely on in the compiler scratch (TMPDIR: inductor's precompiled header
        and caches, which a warm worker remembers in memory) can have been removed since the pool was made, by
        `cache gc` in another process. The sentinel carries the oldest mtime found in the scratch then: gc removes
        files older than its grace period, so whatever it removed of those files, it removed the sentinel too."""
        return self._sentinel is None or os.path.exists(self._sentinel)

    # The garbage commands leave is collected when due (collect_due). A full collection scans every object the
    # server keeps, while a command leaves little garbage: at 100,000 graphs ~4.9 M kept objects (2-9 s to scan; a
    # command arriving meanwhile waits, whether it came back to back or after an idle pause) against ~9,000 objects
    # and ~9 MiB of garbage per re-plan. So a quick collection is made once the server has idled for IDLE_GC_S, and
    # between commands (back to back: a script's) or a slow one only once memory grew.
    IDLE_GC_S = 5.0
    GC_QUICK_S = 0.2  # a collection at most this long counts as quick
    GC_QUICK_OBJECTS = 500_000  # before the first one: fewer kept (frozen) objects than this (~0.1 s to scan)
    GC_GROWTH = 0.25  # ... or else once the RSS grew by this share since the last collection
    GC_GROWTH_MIN_KIB = 128 * 1024  # (and by at least this much)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Around one command (its Command carries the kept pool and session): what it planned, for the warm-up."""
        before = {id(ag) for ag in self.session.last_plans()}
        self._wanted = None
        self.wanting = self._pool is None  # (commands name the pool they would make: warmed once answered)
        try:
            yield
        finally:
            self.wanting = False
            planned = next((ag for ag in self.session.last_plans() if id(ag) not in before), None)
            if planned is not None:  # (else the last plan's, until a background warm-up takes it)
                self._planned = planned
            gc.freeze()  # what the command keeps (memos) is not scanned by the collections of the next one
            self.pending += 1
            if not self.rss_after_gc_kib:  # (no collection yet: growth counts from the end of the first command)
                self.rss_after_gc_kib = rss_kib()

    def idle(self) -> None:
        """The server idled for IDLE_GC_S after commands: write the on-disk load and digest caches (for batch commands
        and the next server), and collect if due."""
        if self.collect_due(idle=True):
            self.collect()  # (writes them first)
        else:
            self.session.flush_saves()
        self.pending = 0

    def collect(self) -> None:
        """Collect what the commands left behind (analysis freezes its objects: unfreeze them first, since the previous
        commands' action graphs may only now be garbage, and they hold reference cycles)."""
        self.session.flush_saves()
        start = time.perf_counter()
        gc.unfreeze()
        found = gc.collect()
        gc.freeze()
        self.pending = 0
        self.last_gc_s = time.perf_counter() - start
        self.rss_after_gc_kib = rss_kib()
        print(f"{time.strftime('%H:%M:%S')} collected {found} unreachable objects in {self.last_gc_s:.2f} s "
              f"(rss {self.rss_after_gc_kib // 1024} MiB)", flush=True)

    last_gc_s: float | None = None  # how long the last collection took (None: none yet)
    rss_after_gc_kib = 0  # the server's RSS after it, or before any, at the end of its first command (0: none yet)

    def collect_due(self, idle: bool = False, rss: int | None = None) -> bool:
        """Whether to collect now (a command arriving meanwhile waits for it): while collections are quick (the last
        one took <= GC_QUICK_S; before the first: while fewer than GC_QUICK_OBJECTS objects are kept), when the server
        idles; otherwise (between commands back to back, or a slow one) only once the RSS grew by GC_GROWTH since the
        last (at least GC_GROWTH_MIN_KIB; before the first, since the end of the first command: what a cold start
        builds is kept, not growth). Memory stays bounded either way, and neither a script's commands back to back
        nor a pause to edit makes a command wait for a collection that finds little (at 1,000 graphs a quick one took
        0.5-0.8 s beside the background warm-up; at 100,000 graphs a full one takes seconds)."""
        if not self.pending:
            return False
        now = rss_kib() if rss is None else rss
        if now - self.rss_after_gc_kib >= max(self.GC_GROWTH_MIN_KIB, self.GC_GROWTH * self.rss_after_gc_kib):
            return True
        if not idle:
            return False
        # (counting the kept objects walks them all: 0.26 s for 5.2 M at 100,000 graphs, so only when it decides)
        return (gc.get_freeze_count() < self.GC_QUICK_OBJECTS if self.last_gc_s is None
                else self.last_gc_s <= self.GC_QUICK_S)

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

    def want(self, *args: Any, **kwargs: Any) -> None:
        """A command that made no pool names the one a build would make (local_executor.want_workers; while
        `wanting`)."""
        if self.wanting:
            self._wanted = (args, kwargs)

    def make(self, *args: Any, **kwargs: Any) -> WorkerPool:
        """A build's pool (local_executor.Pools): the kept one when made with the same arguments."""
        return self._pool_factory(*args, **kwargs)

    def warm_in_background(self) -> list[int]:
        """After a command's answer was sent: start the processes of a kept pool that has none (a build whose actions
        were all cached made it without starting any), so the next build, the first edit's, finds them warm. With a
        zygote only the zygote starts (it imports torch in its own process; the workers are forked from it when tasks
        come). A command that made no pool but named the one a build would make (a build answered from its no-op
        stamp, a plan, a query: local_executor.want_workers) has that pool made now, and
        warmed the same way. Returns the pids started (none when there is no such pool or nothing could start)."""
        wanted, self._wanted = self._wanted, None
        if self._pool is None and wanted is not None:
            args, kwargs = wanted
            self._pool_factory(*args, **kwargs)
        pool = self._pool
        if pool is None or pool.pids() or not self._scratch_intact():
            return []
        pool.warm(pool.size)  # (with the server's umask: its starting client's, as the build's would be)
        return pool.pids()

    # A step of background_steps does at most this many actions' warm-up keys (a command arriving meanwhile waits for
    # one step at most: ~10 ms)
    STEP_ACTIONS = 5000
    BACKGROUND_S = 600.0  # the zygote's imports and the warm-ups get this long at most (then the steps end)

    def background_steps(self) -> Generator[float, None, None]:
        """After a command's answer (and warm_in_background): the rest of what the first edit's build would pay and
        later ones do not, done in small steps by the server's main thread while no command waits (each yields the
        seconds to wait before the next; a command arriving ends it, and its own answer starts a new one). First, in
        the server, the modules a build imports (_BUILD_IMPORTS: ~1 s after a first command answered from its no-op
        stamp, which imports almost nothing). Once the zygote has imported: the workers are forked, the toolchain warm-ups the last analysed plan's steps need (its
        action graph's, else those recorded for this cache by an earlier plan: `warm_ups_wanted`) run in the zygote
        (toolchain code only, never model code: worker.run_warm_up, as a build's warm-up pseudo-actions do), then
        the idle workers are replaced by forks that inherit them (pool.settle). Nothing of it reaches a build's
        results: a build's own warm-up still runs and finds the work done."""
        from neuronbuild.plugin_api.toolchain import WARM_UP

        pool = self._pool
        if pool is None or self._scratch is None or not self._scratch_intact():
            return
        for name in _BUILD_IMPORTS:  # (while the zygote imports torch)
            _import(name)
            yield 0.0
        wanted: dict[str, dict[str, Any]] = {}
        planned, self._planned = self._planned, None
        if planned is not None:
            for _ in _warm_ups_of(planned, wanted, self.STEP_ACTIONS):
                yield 0.0
            self._save_record(wanted)
        else:
            wanted = self._load_record()
        give_up = time.monotonic() + self.BACKGROUND_S  # (a start that hangs is the next build's to report)
        while pool.zygote_ready() is False and time.monotonic() < give_up:  # importing torch (seconds)
            yield 0.05
        if not pool.zygote_ready() or pool is not self._pool:
            return
        pool.warm(pool.size)  # the forks (ms each): a build arriving during the warm-ups finds its workers
        held = pool.zygote_keys()
        work = Path(tempfile.mkdtemp(dir=self._scratch, prefix="warm-between-"))
        try:
            sent = []
            for key, spec in wanted.items():
                if key in held:
                    continue
                self._seq += 1
                io = work / str(self._seq)
                (io / "in").mkdir(parents=True)
                (io / "out").mkdir()
                name = provider_name(spec)
                log = (self._logs or work) / "warm_up" / f"between-{name}-{self._seq % 4}.log"
                log.parent.mkdir(parents=True, exist_ok=True)
                log.write_text(f"# warm up {name} between commands (build server)\n", encoding="utf-8")
                msg = {"kind": WARM_UP, "spec": {k: v for k, v in spec.items() if k != "versions"},
                       "inputs": str(io / "in"), "outputs": str(io / "out"), "log": str(log),
                       "expect": dict(spec["versions"])}
                if pool.warm_up_between(f"between-{self._seq}", msg):
                    sent.append(name)
            if sent:
                print(f"{time.strftime('%H:%M:%S')} toolchain warm-ups in the zygote in the background "
                      f"({', '.join(sent)})", flush=True)
            while True:
                if pool.settle() or time.monotonic() >= give_up:
                    break
                yield 0.05
            if pool is self._pool:
                print(f"{time.strftime('%H:%M:%S')} background warm-up done (toolchain warm-ups held: "
                      f"{len(pool.zygote_keys())}; pids {' '.join(map(str, pool.pids()))})", flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def _load_record(self) -> dict[str, dict[str, Any]]:
        """The warm-ups an earlier plan of the kept pool's cache recorded (none if unreadable: only a speed-up)."""
        if self._record is None or self._scratch is None:
            return {}
        try:
            data = json.loads(self._record.read_text(encoding="utf-8"))
            got = data.get(str(self._scratch)) or {}
            return {str(k): dict(v) for k, v in got.items() if isinstance(v, dict) and provider_name(v) and
                    {"step", "key", "versions"} <= v.keys() and isinstance(v["versions"], dict)}
        except (OSError, ValueError, AttributeError):
            return {}

    def _save_record(self, wanted: dict[str, dict[str, Any]]) -> None:
        """Record the last plan's warm-ups for the kept pool's cache (for a later server's no-op first command)."""
        if self._record is None or self._scratch is None:
            return
        from neuronbuild.atomic import atomic_write_bytes

        try:
            data = json.loads(self._record.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            data = {}
        if not isinstance(data, dict) or data.get(str(self._scratch)) == wanted:
            return
        data = {k: v for k, v in data.items() if k != str(self._scratch)}
        data[str(self._scratch)] = wanted  # (the most recent last; a few caches at most are kept)
        data = dict(list(data.items())[-8:])
        with contextlib.suppress(OSError):
            atomic_write_bytes(self._record, json.dumps(data, sort_keys=False).encode(), durable=False)

    def describe(self) -> dict[str, Any]:
        return {"worker_pool_size": self._pool.size if self._pool is not None else 0, **self.session.stats()}

    def close(self) -> None:
        if self._pool is not None:
            WorkerPool.shutdown(self._pool)
            self._pool = None
        if self._sentinel is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._sentinel)
            self._sentinel = None


# What a build imports in the server beyond what a no-op answer does (networkx alone is ~0.3-0.7 s), one per step,
# the heaviest first; and the plug-ins (the rule kinds and toolchains every analysis needs).
_BUILD_IMPORTS = ("networkx", "neuronbuild.analysis.planner", "neuronbuild.build", "neuronbuild.report.invocation",
                  "neuronbuild.cache.tiered", "neuronbuild.execution.profile", "neuronbuild.plugins")


def _import(name: str) -> None:
    import importlib

    with contextlib.suppress(Exception):  # (a broken import is the command's to report)
        mod = importlib.import_module(name)
        if name == "neuronbuild.plugins":
            mod.toolchains()


def _warm_ups_of(ag: Any, out: dict[str, dict[str, Any]], step: int) -> Iterator[None]:
    """Fill `out` with the warm-ups the plan's steps need ({warm key: its spec (toolchain.warm_up_spec) and "versions"}:
    the versions of the first step needing it, which the zygote checks as it checks a step's), as scheduler.warm_ups
    would for warm-ups run apart; yields every `step` actions."""
    from neuronbuild import plugins
    from neuronbuild.execution.worker import warm_key
    from neuronbuild.plugin_api.toolchain import warm_up_spec

    providers = plugins.step_providers()
    for i, a in enumerate(ag.actions.values()):
        if i and i % step == 0:
            yield
        spec = warm_up_spec(providers, a.spec)
        if spec is not None:
            out.setdefault(warm_key(spec), {**spec, "versions": dict(a.versions)})


def _env_secs(name: str, default: float) -> float:
    """Seconds from the environment variable `name` (of the client that started the server): a positive number, else
    `default`."""
    try:
        value = envvars.current().seconds(name)
    except UserInputError:
        value = default
    return value if 0 < value < float("inf") else default


def _scratch_sentinel(tmpdir: str | None) -> str | None:
    """Create the compiler scratch's sentinel for a new pool (see WarmState._scratch_intact); None if it cannot be."""
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
