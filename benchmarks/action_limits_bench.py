"""What per-action limits cost (#49), side by side in one run: a bare fork + exit + wait (an action's floor), the same
with the action's pids and memory cgroups made, joined, checked and removed (execution/limits.ActionCgroup: the path
where the host offers cgroups), and one check of the worker's watch over a process tree (the fallback, run 4 times a
second while an action runs). Wall and CPU milliseconds per action; run as root where cgroups are writable.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/action_limits_bench.py [N]
"""

from __future__ import annotations

import os
import resource
import sys
import time

from neuronbuild.execution import limits


def _cpu() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def bare(n: int) -> tuple[float, float]:
    t, c = time.perf_counter(), _cpu()
    for _ in range(n):
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
    return (time.perf_counter() - t) / n * 1000, (_cpu() - c) / n * 1000


def with_cgroups(n: int) -> tuple[float, float] | str:
    t, c = time.perf_counter(), _cpu()
    for _ in range(n):
        cg, why = limits.ActionCgroup.make(1024, 2048)
        if cg is None:
            return f"no cgroup here ({why})"
        pid = os.fork()
        if pid == 0:
            cg.join()
            os._exit(0)
        os.waitpid(pid, 0)
        cg.exceeded()
        cg.remove()
    return (time.perf_counter() - t) / n * 1000, (_cpu() - c) / n * 1000


def watch_check(n: int) -> tuple[float, float]:
    w = limits.Watch(os.getpid(), 1024, 2048)
    t, c = time.perf_counter(), _cpu()
    for _ in range(n):
        w.exceeded()
    return (time.perf_counter() - t) / n * 1000, (_cpu() - c) / n * 1000


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    print(f"enforced here by: {limits.host_offers()}; {n} runs each")
    for name, fn in (("fork + exit + wait (bare)", bare), ("the same in its own pids + memory cgroups", with_cgroups),
                     ("one watch check (fallback; this process)", watch_check)):
        r = fn(n)
        print(f"{name:45s} " + (r if isinstance(r, str) else f"{r[0]:7.2f} ms wall  {r[1]:6.2f} ms CPU"))


if __name__ == "__main__":
    main()
