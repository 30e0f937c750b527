"""Per-action cost of running each action in a confined child forked from the warm worker, vs in the worker itself.

In one process set up as a worker is (action environment, toolchains and warm imports loaded, no model code), runs the
same real trace action (a tiny Linear model, torch.export) N times each way, side by side:
  forked:     worker.run_isolated: namespaces (pid, mount, private /proc; as root the worker's child is the
              namespace's init, which forks the action: two forks), Landlock + audit hook, run, report over a pipe,
              reap (what builds do); and the same without namespaces (as where the kernel refuses them: one fork),
              interleaved
  in-process: worker.run_action in this process (what workers did before: state leaks from one model to the next)
and a bare fork + exit + wait of this process. The forked runs go first, so the process forks before it ever ran a
torch op (as a worker does). Prints medians of wall and of CPU seconds (this process's and its children's: every
fork, exit and mount counted wherever it ran; far less moved by other load than the wall) per run, the first run of
each way apart (warm-up), and the overhead. `--repo DIR` runs another checkout's neuronbuild with this script (an A/B
against main: `--repo /work/main` with main's interpreter).

    .venv/bin/python benchmarks/fork_bench.py [--runs N] [--repo DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def cpu_now() -> float:
    """CPU seconds of this process and of the children it waited for."""
    return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))

MODEL = """import torch


def build(config):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
"""
BUILD = """neuron_model(name = "m", srcs = ["m.py"], entry = "m:build", inputs = {"x": "float32[b, 16]"})
neuron_buckets(name = "bk", shapes = [{"b": 2}])
neuron_target(name = "t", platform = "trn2")
neuron_compile(name = "c", model = ":m", buckets = [":bk"], target = ":t")
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--repo", type=Path, default=REPO, help="the checkout whose neuronbuild runs (default: this one)")
    args = ap.parse_args()
    sys.path.insert(0, str(args.repo.resolve()))
    tmp = Path(tempfile.mkdtemp(prefix="nb-fork-bench-"))
    try:
        ws = tmp / "ws"
        (ws / "pkg").mkdir(parents=True)
        (ws / "WORKSPACE.neuronbuild").write_text("")
        (ws / "pkg" / "BUILD").write_text(BUILD)
        (ws / "pkg" / "m.py").write_text(MODEL)
        os.chdir(ws)
        from neuronbuild.context import make_context
        from neuronbuild.execution import sandbox as sandboxes
        from neuronbuild.execution.env import action_environment

        ctx = make_context(cache_dir=str(tmp / "cache"))
        ag = ctx.plan(ctx.load(["//pkg:all"]))
        (trace,) = [a for a in ag.actions.values() if a.kind == "trace"]
        cache = ctx.open_cache()
        env = action_environment(cache.toolchain_tmp, cache.root / "home")
        os.environ.clear()
        os.environ.update(env)
        tempfile.tempdir = None  # as in a worker, whose environment has the action's TMPDIR from the start
        Path(env["TMPDIR"]).mkdir(parents=True, exist_ok=True)
        Path(env["HOME"]).mkdir(parents=True, exist_ok=True)

        from neuronbuild import plugins
        from neuronbuild.execution import worker
        from neuronbuild.execution.confine import installation_roots, landlock_abi

        t = time.perf_counter()
        import neuronbuild.toolchains.compile  # noqa: F401
        import neuronbuild.toolchains.trace  # noqa: F401

        plugins.toolchains()
        worker.warm_imports()
        warm_s = time.perf_counter() - t
        installation = installation_roots()
        worker.become_subreaper()

        from neuronbuild.execution import confine_ns

        enter = confine_ns.enter
        for_children = getattr(confine_ns, "pid_ns_for_children", None)  # (None: a checkout from before it)

        def one(forked: bool, namespaces: bool = True) -> tuple[float, float]:
            confine_ns.enter = enter if namespaces else (lambda: "off (fork_bench)")  # type: ignore[assignment]
            if for_children is not None:
                confine_ns.pid_ns_for_children = (  # type: ignore[assignment]
                    for_children if namespaces else (lambda: "off (fork_bench)"))
            sb = sandboxes.prepare(trace, ws, cache, tmp / "sandboxes")
            msg = {"kind": trace.kind, "spec": json.loads(json.dumps(trace.spec)), "inputs": str(sb.inputs),
                   "outputs": str(sb.outputs), "log": str(tmp / "log.txt"), "expect": dict(trace.versions)}
            start, cpu = time.perf_counter(), cpu_now()
            if forked:
                res = worker.run_isolated(msg, installation)
                worker.end_descendants()
            else:
                res = worker.run_action(msg["kind"], msg["spec"], msg["inputs"], msg["outputs"], msg["log"],
                                        msg["expect"])
            took, cpu = time.perf_counter() - start, cpu_now() - cpu
            sb.remove()
            if not res.get("ok"):
                raise SystemExit(f"the action failed: {res.get('error')}")
            return took, cpu

        bare: list[float] = []
        for _ in range(20):
            s = time.perf_counter()
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            os.waitpid(pid, 0)
            bare.append(time.perf_counter() - s)
        forked: list[tuple[float, float]] = []
        plain: list[tuple[float, float]] = []
        for _ in range(args.runs + 1):  # interleaved: the machine's load falls on both alike
            forked.append(one(True))
            plain.append(one(True, namespaces=False))
        confine_ns.enter = enter  # type: ignore[assignment]
        if for_children is not None:
            confine_ns.pid_ns_for_children = for_children  # type: ignore[assignment]
        inproc = [one(False) for _ in range(args.runs + 1)]

        def med(runs: list[tuple[float, float]], i: int) -> float:
            return statistics.median(r[i] for r in runs[1:])

        rss = next(ln.split()[1] for ln in Path("/proc/self/status").read_text().splitlines()
                   if ln.startswith("VmRSS:"))
        path = ("an outside child forks the init" if for_children is None or getattr(confine_ns, "_NO_PID_NS", None)
                else "the worker forks the init")
        print(f"neuronbuild from {args.repo.resolve()}; load {os.getloadavg()[0]:.1f}")
        print(f"worker warm-up (toolchains + warm imports): {warm_s:.2f} s; worker RSS {int(rss) // 1024} MB; "
              f"Landlock ABI {landlock_abi()}")
        print(f"bare fork+exit+wait of the warm worker: median {statistics.median(bare) * 1000:.1f} ms (20 runs)")
        print(f"{'trace action (tiny MLP)':<28}{'first':>10}{'median':>10}{'CPU med':>10}  (runs: {args.runs} after "
              "the first)")
        for name, runs in (("  forked (confined child)", forked), ("  forked, no namespaces", plain),
                           ("  in-process (old worker)", inproc)):
            print(f"{name:<28}{runs[0][0]:>9.3f}s{med(runs, 0):>9.3f}s{med(runs, 1):>9.3f}s")
        f_med, i_med, p_med = med(forked, 0), med(inproc, 0), med(plain, 0)
        print(f"per-action overhead of the fork: {(f_med - i_med) * 1000:+.0f} ms ({f_med / i_med:.2f}x); of the "
              f"namespaces (pid, mount, private /proc, the init): {(f_med - p_med) * 1000:+.0f} ms wall, "
              f"{(med(forked, 1) - med(plain, 1)) * 1000:+.0f} ms CPU ({path})")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
