"""Runs an ActionGraph: skips actions whose fingerprint is cached, executes the rest in dependency order, stores results."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neuronbuild.analysis.actions import Action
from neuronbuild.analysis.planner import ActionGraph
from neuronbuild.cache.action_cache import ActionResult, OutputRef
from neuronbuild.cache.local import LocalCache
from neuronbuild.execution import sandbox as sandboxes


@dataclass(frozen=True)
class Failure:
    """A failed action: what it was, the first line of its error and its full log."""

    action: Action
    error: str
    log: Path


@dataclass(frozen=True)
class BuildResult:
    """What a build did: executed and cached action fingerprints, failures, wall time."""

    total: int
    executed: tuple[str, ...] = ()
    cached: tuple[str, ...] = ()
    failures: tuple[Failure, ...] = field(default=())
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        s = (f"{self.total} actions: {len(self.executed)} executed, {len(self.cached)} cached "
             f"({self.wall_s:.1f} s)")
        if self.failures:
            s += f", {len(self.failures)} failed"
        return s


def needed_actions(ag: ActionGraph, cache: LocalCache) -> tuple[list[Action], list[str]]:
    """Actions to execute (in topological order) and those satisfied from the cache.

    A producer is only needed when one of its consumers must run: a cached compile never forces its trace."""
    order = ag.topological()
    cached: set[str] = set()
    for a in order:
        if cache.lookup(a.fingerprint) is not None:
            cached.add(a.fingerprint)
    need: set[str] = set()
    for a in reversed(order):
        if a.fingerprint in cached:
            continue
        consumers = list(ag.graph.successors(a.fingerprint))
        if not consumers or any(c in need for c in consumers):
            need.add(a.fingerprint)
    return [a for a in order if a.fingerprint in need], [a.fingerprint for a in order if a.fingerprint in cached]


class Scheduler:
    """Dispatches missing actions to an executor as their inputs become available."""

    def __init__(self, root: Path, cache: LocalCache, executor: Any, keep_going: bool = False,
                 report: Callable[[str], None] | None = None) -> None:
        self.root = root
        self.cache = cache
        self.executor = executor
        self.keep_going = keep_going
        self.report = report or (lambda msg: print(msg, file=sys.stderr, flush=True))

    def run(self, ag: ActionGraph) -> BuildResult:
        start = time.perf_counter()
        todo, cached = needed_actions(ag, self.cache)
        if not todo:
            return BuildResult(len(ag.actions), (), tuple(cached), (), time.perf_counter() - start)
        waiting = {a.fingerprint: a for a in todo}
        done: set[str] = set(cached)
        executed: list[str] = []
        failures: list[Failure] = []
        running: dict[Future[dict[str, Any]], tuple[Action, sandboxes.Sandbox, Path]] = {}
        total = len(todo)
        stop = False
        try:
            while waiting or running:
                if not stop:
                    for fp, a in list(waiting.items()):
                        if all(d in done for d in a.deps):
                            del waiting[fp]
                            self._start(a, running, failures)
                            if failures and not self.keep_going:
                                stop = True
                                break
                if not running:
                    break
                finished, _ = wait(list(running), return_when=FIRST_COMPLETED)
                for fut in finished:
                    a, sb, log = running.pop(fut)
                    try:
                        res = fut.result()
                    except Exception as e:  # noqa: BLE001 - a dead worker fails its action only
                        res = {"ok": False, "error": f"worker process failed: {type(e).__name__}: {e}",
                               "duration_s": 0.0}
                    if res.get("ok"):
                        self._store(a, sb, res)
                        done.add(a.fingerprint)
                        executed.append(a.fingerprint)
                        self.report(f"[{len(executed)}/{total}] {a.describe()} ({res['duration_s']:.1f} s)")
                    else:
                        failures.append(Failure(a, str(res.get("error")), log))
                        self.report(f"FAILED: {a.describe()}: {res.get('error')} (log: {log})")
                        if not self.keep_going:
                            stop = True
                    sb.remove()
                if stop:
                    waiting.clear()
        finally:
            for _a, sb, _log in running.values():
                sb.remove()
        return BuildResult(len(ag.actions), tuple(executed), tuple(cached), tuple(failures),
                           time.perf_counter() - start)

    def _start(self, a: Action, running: dict[Future[dict[str, Any]], tuple[Action, sandboxes.Sandbox, Path]],
               failures: list[Failure]) -> None:
        log = self.cache.logs / a.fingerprint[:2] / f"{a.fingerprint}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(f"# {a.describe()}\n# fingerprint {a.fingerprint}\n", encoding="utf-8")
        try:
            sb = sandboxes.prepare(a, self.root, self.cache)
        except (sandboxes.InputChanged, OSError) as e:
            failures.append(Failure(a, str(e), log))
            self.report(f"FAILED: {a.describe()}: {e}")
            return
        spec = json.loads(json.dumps(a.spec))
        fut = self.executor.submit(a.kind, spec, str(sb.inputs), str(sb.outputs), str(log))
        running[fut] = (a, sb, log)

    def _store(self, a: Action, sb: sandboxes.Sandbox, res: dict[str, Any]) -> None:
        outputs: dict[str, OutputRef] = {}
        for name in a.outputs:
            p = sb.outputs / name
            if not p.is_file():
                raise RuntimeError(f"{a.describe()} did not produce its declared output '{name}'")
            digest, size = self.cache.blobs.put_file(p)
            outputs[name] = OutputRef(digest, size)
        self.cache.actions.put(ActionResult(a.fingerprint, a.identity, outputs, a.record, float(res["duration_s"]),
                                            res.get("metadata") or {}, time.time()))
