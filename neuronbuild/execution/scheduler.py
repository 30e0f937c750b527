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
from neuronbuild.cache.cas import CorruptBlob
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
    """Dispatches missing actions to an executor as their inputs become available.

    Before executing an action it takes the cache's claim on it; if another build holds the claim, it waits and
    then reuses that build's result, so concurrent builds execute each action once."""

    POLL_S = 0.2

    def __init__(self, root: Path, cache: LocalCache, executor: Any, keep_going: bool = False,
                 report: Callable[[str], None] | None = None) -> None:
        self.root = root
        self.cache = cache
        self.executor = executor
        self.keep_going = keep_going
        self.report = report or (lambda msg: print(msg, file=sys.stderr, flush=True))

    def run(self, ag: ActionGraph) -> BuildResult:
        start = time.perf_counter()
        todo, cached_list = needed_actions(ag, self.cache)
        cached = list(cached_list)
        if not todo:
            return BuildResult(len(ag.actions), (), tuple(cached), (), time.perf_counter() - start)
        waiting = {a.fingerprint: a for a in todo}
        done: set[str] = set(cached)
        executed: list[str] = []
        failures: list[Failure] = []
        running: dict[Future[dict[str, Any]], _Running] = {}
        total = len(todo)
        stop = False
        try:
            while waiting or running:
                blocked = False
                if not stop:
                    for fp, a in list(waiting.items()):
                        if not all(d in done for d in a.deps):
                            continue
                        if self.cache.lookup(fp) is not None:  # another build finished it meanwhile
                            del waiting[fp]
                            done.add(fp)
                            cached.append(fp)
                            continue
                        claim = self.cache.try_claim(fp)
                        if claim is None:
                            blocked = True  # another build is executing it: wait for its result
                            continue
                        if self.cache.lookup(fp) is not None:
                            claim.release()
                            del waiting[fp]
                            done.add(fp)
                            cached.append(fp)
                            continue
                        del waiting[fp]
                        started = self._start(a, claim)
                        if isinstance(started, Failure):
                            failures.append(started)
                            if not self.keep_going:
                                stop = True
                                break
                        else:
                            running[started.future] = started
                if stop:
                    waiting.clear()
                if not running:
                    if blocked or (waiting and any(all(d in done for d in a.deps) for a in waiting.values())):
                        time.sleep(self.POLL_S)
                        continue
                    break
                finished, _ = wait(list(running), timeout=self.POLL_S if blocked else None,
                                   return_when=FIRST_COMPLETED)
                for fut in finished:
                    r = running.pop(fut)
                    try:
                        res = fut.result()
                    except Exception as e:  # noqa: BLE001 - a dead worker fails its action only
                        res = {"ok": False, "error": f"worker process failed: {type(e).__name__}: {e}",
                               "duration_s": 0.0}
                    a = r.action
                    if res.get("ok"):
                        try:
                            self.cache.store_outputs(a.fingerprint, a.identity, a.record, r.sandbox.outputs,
                                                     a.outputs, float(res["duration_s"]), res.get("metadata") or {})
                        except OSError as e:
                            res = {"ok": False, "error": f"storing outputs failed: {e}"}
                    if res.get("ok"):
                        done.add(a.fingerprint)
                        executed.append(a.fingerprint)
                        self.report(f"[{len(executed)}/{total}] {a.describe()} ({res['duration_s']:.1f} s)")
                    else:
                        failures.append(Failure(a, str(res.get("error")), r.log))
                        self.cache.record_failure(a.fingerprint, a.identity, a.record, str(res.get("error")), r.log)
                        self.report(f"FAILED: {a.describe()}: {res.get('error')} (log: {r.log})")
                        if not self.keep_going:
                            stop = True
                    r.sandbox.remove()
                    r.claim.release()
                if stop:
                    waiting.clear()
        finally:
            for r in running.values():
                r.sandbox.remove()
                r.claim.release()
        return BuildResult(len(ag.actions), tuple(executed), tuple(cached), tuple(failures),
                           time.perf_counter() - start)

    def _start(self, a: Action, claim: Any) -> _Running | Failure:
        log = self.cache.logs / a.fingerprint[:2] / f"{a.fingerprint}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(f"# {a.describe()}\n# fingerprint {a.fingerprint}\n", encoding="utf-8")
        try:
            sb = sandboxes.prepare(a, self.root, self.cache)
        except (sandboxes.InputChanged, OSError, CorruptBlob) as e:
            claim.release()
            self.report(f"FAILED: {a.describe()}: {e}")
            return Failure(a, str(e), log)
        spec = json.loads(json.dumps(a.spec))
        fut = self.executor.submit(a.kind, spec, str(sb.inputs), str(sb.outputs), str(log))
        return _Running(a, sb, log, claim, fut)


@dataclass(frozen=True)
class _Running:
    action: Action
    sandbox: sandboxes.Sandbox
    log: Path
    claim: Any
    future: Future[dict[str, Any]]
