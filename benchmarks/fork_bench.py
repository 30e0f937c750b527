"""Per-action cost of running each action in a confined child forked from the warm worker, vs in the worker itself.

In one process set up as a worker is (action environment, toolchains and warm imports loaded, no model code), runs the
same real trace action (a tiny Linear model, torch.export) N times each way, side by side:
  forked:     worker.run_isolated: fork, namespaces (pid, mount, private /proc: a second fork, the namespace's init),
              Landlock + audit hook, run, report over a pipe, reap (what builds do); and the same without namespaces
              (as where the kernel refuses them), interleaved
  in-process: worker.run_action in this process (what workers did before: state leaks from one model to the next)
and a bare fork + exit + wait of this process. The forked runs go first, so the process forks before it ever ran a
torch op (as a worker does). Prints medians (first run of each way reported apart: warm-up) and the overhead.

    .venv/bin/python benchmarks/fork_bench.py [--runs N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

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
    args = ap.parse_args()
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

        def one(forked: bool, namespaces: bool = True) -> float:
            confine_ns.enter = enter if namespaces else (lambda: "off (fork_bench)")  # type: ignore[assignment]
            sb = sandboxes.prepare(trace, ws, cache, tmp / "sandboxes")
            msg = {"kind": trace.kind, "spec": json.loads(json.dumps(trace.spec)), "inputs": str(sb.inputs),
                   "outputs": str(sb.outputs), "log": str(tmp / "log.txt"), "expect": dict(trace.versions)}
            start = time.perf_counter()
            if forked:
                res = worker.run_isolated(msg, installation)
                worker.end_descendants()
            else:
                res = worker.run_action(msg["kind"], msg["spec"], msg["inputs"], msg["outputs"], msg["log"],
                                        msg["expect"])
            took = time.perf_counter() - start
            sb.remove()
            if not res.get("ok"):
                raise SystemExit(f"the action failed: {res.get('error')}")
            return took

        bare: list[float] = []
        for _ in range(20):
            s = time.perf_counter()
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            os.waitpid(pid, 0)
            bare.append(time.perf_counter() - s)
        forked, plain = [], []
        for _ in range(args.runs + 1):  # interleaved: the machine's load falls on both alike
            forked.append(one(True))
            plain.append(one(True, namespaces=False))
        confine_ns.enter = enter  # type: ignore[assignment]
        inproc = [one(False) for _ in range(args.runs + 1)]
        f_med, i_med = statistics.median(forked[1:]), statistics.median(inproc[1:])
        p_med = statistics.median(plain[1:])
        rss = next(ln.split()[1] for ln in Path("/proc/self/status").read_text().splitlines()
                   if ln.startswith("VmRSS:"))
        print(f"worker warm-up (toolchains + warm imports): {warm_s:.2f} s; worker RSS {int(rss) // 1024} MB; "
              f"Landlock ABI {landlock_abi()}")
        print(f"bare fork+exit+wait of the warm worker: median {statistics.median(bare) * 1000:.1f} ms (20 runs)")
        print(f"{'trace action (tiny MLP)':<28}{'first':>10}{'median':>10}  (runs: {args.runs} after the first)")
        print(f"{'  forked (confined child)':<28}{forked[0]:>9.3f}s{f_med:>9.3f}s")
        print(f"{'  forked, no namespaces':<28}{plain[0]:>9.3f}s{p_med:>9.3f}s")
        print(f"{'  in-process (old worker)':<28}{inproc[0]:>9.3f}s{i_med:>9.3f}s")
        print(f"per-action overhead of the fork: {(f_med - i_med) * 1000:+.0f} ms ({f_med / i_med:.2f}x); of the "
              f"namespaces (pid, mount, private /proc, the init's fork): {(f_med - p_med) * 1000:+.0f} ms")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
