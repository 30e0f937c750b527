"""Per-action cost of running each action in a confined child forked from the warm worker, vs in the worker itself.

In one process set up as a worker is (action environment, toolchains and warm imports loaded, no model code), runs the
same real trace action (a tiny Linear model, torch.export) N times each way, side by side:
  prepared:   worker.run_isolated on an action process prepared beforehand (worker.prepare, #53: its namespace's
              init and the action's process forked and set up before the clock starts, as a worker does while it
              idles): dispatching is one message to the waiting init
  forked:     worker.run_isolated with every process forked at dispatch (${NEURONBUILD_PREPARED_ACTIONS}=0): namespaces (pid, mount, private /proc; as root the worker's child is the
              namespace's init, which forks the action: two forks), Landlock + audit hook, run, report over a pipe,
              reap (what builds do); and the same without namespaces (as where the kernel refuses them: one fork),
              interleaved
  in-process: worker.run_action in this process (what workers did before: state leaks from one model to the next)
and a bare fork + exit + wait of this process. The forked runs go first, so the process forks before it ever ran a
torch op (as a worker does). Prints medians of wall and of CPU seconds (this process's and its children's: every
fork, exit and mount counted wherever it ran; far less moved by other load than the wall) per run, the first run of
each way apart (warm-up), the action's own time (run_action's duration_s) and the rest: dispatch to result beyond
the action's own time, the per-action dispatch overhead of #53. `--repo DIR` runs another checkout's neuronbuild with this script (an A/B
against main: `--repo /work/main` with main's interpreter).

    .venv/bin/python benchmarks/fork_bench.py [--runs N] [--repo DIR] [--build N [--baseline main] [--build-only]]

`--build N` first runs whole builds side by side (see builds_side_by_side): per executed action, ready to started,
started to handed back and to stored beyond its own time, and the store, from each build's events.
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


BUILD_N = """neuron_model(name = "m", srcs = ["m.py"], entry = "m:build", inputs = {"x": "float32[b, 16]"})
neuron_buckets(name = "bk", shapes = [%s])
neuron_target(name = "t", platform = "trn2")
compiler_options(name = "o", opt_level = %d)
neuron_compile(name = "c", model = ":m", buckets = [":bk"], target = ":t", options = ":o")
"""


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def build_figures(events: Path, deps: dict[str, list[str]]) -> dict[str, list[float]]:
    """Per executed action of one build (its --build-event-json-file), in seconds: `gap`, ready to started (ready:
    its last input stored, or the build's start; and its worker free: the previous action on it handed back);
    `beyond`, started to handed back beyond its own time (duration_s); `store`, its outputs' store; `stored`,
    started to stored beyond its own time; `total`, ready to stored beyond its own time (the sum of both overheads,
    whatever an executor calls its start); for the tiny ones (own time under 0.1 s) `tiny_*` the same."""
    evs = [json.loads(line) for line in events.read_text().splitlines() if line.strip()]
    t0 = next(e["time"] for e in evs if e["event"] == "build_started")
    fp_desc = {e["fingerprint"]: e["description"] for e in evs if "description" in e and "fingerprint" in e}
    stored = {fp_desc[e["fingerprint"]]: e["start"] + e["duration_s"] for e in evs if e["event"] == "outputs_stored"}
    store_s = {fp_desc[e["fingerprint"]]: e["duration_s"] for e in evs if e["event"] == "outputs_stored"}
    started = {e["description"]: (e["time"], e["worker"]) for e in evs if e["event"] == "action_started"}
    out: dict[str, list[float]] = {}
    free: dict[str, float] = {}
    for e in sorted((e for e in evs if e["event"] == "action_finished"), key=lambda e: e["start"]):
        d = e["description"]
        _t, w = started[d]  # (a light step's start is when the build process ran it, not when it was queued)
        ready = max([t0, *(stored.get(x, t0) for x in deps.get(d, []))])
        figs = {"gap": e["start"] - max(ready, free.get(w, t0)), "beyond": e["end"] - e["start"] - e["duration_s"],
                "store": store_s[d], "stored": stored[d] - e["start"] - e["duration_s"],
                "total": stored[d] - max(ready, free.get(w, t0)) - e["duration_s"]}
        free[w] = e["end"]
        for k, v in figs.items():
            out.setdefault(k, []).append(v)
            if e["duration_s"] < 0.1:
                out.setdefault("tiny_" + k, []).append(v)
    return out


def builds_side_by_side(args: argparse.Namespace, tmp: Path) -> None:
    """`--build N`: whole builds of N buckets (a trace, a weights action, a Lower and a tiny Compile each), each in
    a fresh cache (`--batch`: no server), alternating this checkout (prepared action processes, group commits) and
    `--baseline REF` (git archive of REF, run with PYTHONPATH) or, without one, this checkout with
    NEURONBUILD_PREPARED_ACTIONS=0; per-action medians from their build events."""
    ws = tmp / "build-ws"
    (ws / "pkg").mkdir(parents=True)
    (ws / "WORKSPACE.neuronbuild").write_text("")
    shapes = ", ".join(f'{{"b": {b}}}' for b in range(1, args.build + 1))
    (ws / "pkg" / "BUILD").write_text(BUILD_N % (shapes, 2))
    (ws / "pkg" / "m.py").write_text(MODEL)
    import subprocess

    from neuronbuild.context import make_context

    cwd = os.getcwd()
    os.chdir(ws)
    ag = make_context(cache_dir=str(tmp / "plan-cache")).plan(make_context(cache_dir=str(tmp / "plan-cache")).load(
        ["//pkg:all"]))
    os.chdir(cwd)
    deps = {a.describe(): [ag.actions[d].describe() for d in a.deps] for a in ag.actions.values()}
    sides: list[tuple[str, dict[str, str]]] = [("this checkout", {})]
    if args.baseline:
        base = tmp / "baseline"
        base.mkdir()
        subprocess.run(f"git -C {REPO} archive {args.baseline} | tar -x -C {base}", shell=True, check=True)
        sides.append((f"{args.baseline} (git archive)", {"PYTHONPATH": str(base)}))
    else:
        sides.append(("this checkout, NEURONBUILD_PREPARED_ACTIONS=0", {"NEURONBUILD_PREPARED_ACTIONS": "0"}))
    figs: dict[str, dict[str, list[float]]] = {name: {} for name, _env in sides}
    walls: dict[str, list[float]] = {name: [] for name, _env in sides}
    edits: dict[str, list[tuple[float, float]]] = {name: [] for name, _env in sides}  # flags-only rebuild: wall, CPU
    for i in range(args.build_rounds):
        for name, extra in sides if i % 2 == 0 else sides[::-1]:
            cache, events = tmp / f"cache-{i}-{len(walls[name])}-{hash(name) & 0xffff}", tmp / "events.json"
            env = {**os.environ, **extra}
            start = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "neuronbuild", "--batch", "build", "//pkg:c", "--cache-dir",
                                   str(cache), "--build-event-json-file", str(events)], cwd=ws, env=env,
                                  capture_output=True, text=True)
            walls[name].append(time.perf_counter() - start)
            if proc.returncode != 0:
                raise SystemExit(f"the build failed ({name}):\n{proc.stderr}")
            for k, v in build_figures(events, deps).items():
                figs[name].setdefault(k, []).extend(v)
            for level in (1, 3):  # flags-only edits: every Compile again, nothing else (light steps, #53)
                (ws / "pkg" / "BUILD").write_text(BUILD_N % (shapes, level))
                cpu, start = cpu_now(), time.perf_counter()
                proc = subprocess.run([sys.executable, "-m", "neuronbuild", "--batch", "build", "//pkg:c",
                                       "--cache-dir", str(cache)], cwd=ws, env=env, capture_output=True, text=True)
                edits[name].append((time.perf_counter() - start, cpu_now() - cpu))
                if proc.returncode != 0 or f"{args.build} executed" not in proc.stdout + proc.stderr:
                    raise SystemExit(f"the flags-only rebuild did not run {args.build} compiles ({name}):\n"
                                     f"{proc.stdout}{proc.stderr}")
            (ws / "pkg" / "BUILD").write_text(BUILD_N % (shapes, 2))
            shutil.rmtree(cache, ignore_errors=True)
    n = len(deps)
    print(f"builds of {n} actions ({args.build} buckets: trace, Lower, tiny Compile each; the weights), fresh cache, "
          f"{args.build_rounds} rounds alternating; load {os.getloadavg()[0]:.1f}")
    print(f"{'per action, median ms':<48}{'ready->started':>15}{'->handed back':>14}{'store':>8}"
          f"{'->stored':>10}{'ready->stored':>14}{'build wall':>12}")
    print(f"{'':<48}{'':>15}{'beyond own':>14}{'':>8}{'beyond own':>10}{'beyond own':>14}")
    for name, _env in sides:
        f = figs[name]
        for label, pre in (("all", ""), ("tiny (own < 0.1 s)", "tiny_")):
            print(f"  {name + ', ' + label:<46}{_median(f.get(pre + 'gap', [])) * 1000:>15.1f}"
                  f"{_median(f.get(pre + 'beyond', [])) * 1000:>14.1f}{_median(f.get(pre + 'store', [])) * 1000:>8.1f}"
                  f"{_median(f.get(pre + 'stored', [])) * 1000:>10.1f}{_median(f.get(pre + 'total', [])) * 1000:>14.1f}"
                  f"{_median(walls[name]):>11.2f}s")
    print(f"flags-only rebuild ({args.build} Compiles run, the rest cached), median of {len(edits[sides[0][0]])}:")
    for name, _env in sides:
        print(f"  {name:<46} wall {_median([w for w, _c in edits[name]]):.3f} s, CPU (the build's process tree) "
              f"{_median([c for _w, c in edits[name]]):.3f} s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--repo", type=Path, default=REPO, help="the checkout whose neuronbuild runs (default: this one)")
    ap.add_argument("--build", type=int, default=0, metavar="N",
                    help="also whole builds of N buckets side by side (per-action dispatch and store, from events)")
    ap.add_argument("--build-rounds", type=int, default=2)
    ap.add_argument("--baseline", default="", metavar="REF",
                    help="with --build: the other side is REF of this repository (e.g. main), else this checkout "
                         "with NEURONBUILD_PREPARED_ACTIONS=0")
    ap.add_argument("--build-only", action="store_true", help="skip the in-process runs")
    args = ap.parse_args()
    sys.path.insert(0, str(args.repo.resolve()))
    tmp = Path(tempfile.mkdtemp(prefix="nb-fork-bench-"))
    try:
        if args.build:
            builds_side_by_side(args, tmp)
            if args.build_only:
                return
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
        if hasattr(worker, "FREEZE"):
            worker.FREEZE[0] = True  # (as in a worker's loop, serve)

        from neuronbuild.execution import confine_ns

        enter = confine_ns.enter
        for_children = getattr(confine_ns, "pid_ns_for_children", None)  # (None: a checkout from before it)

        can_prepare = hasattr(worker, "prepare")  # (a checkout from before #53: no prepared action processes)
        prepare_s: list[float] = []

        def one(forked: bool, namespaces: bool = True, prepared: bool = False) -> tuple[float, float, float]:
            """(wall, CPU, the action's own time) of one run, from dispatch to its result; a prepared run's
            processes are forked before the clock starts (as a worker does while it idles)."""
            confine_ns.enter = enter if namespaces else (lambda: "off (fork_bench)")  # type: ignore[assignment]
            if for_children is not None:
                confine_ns.pid_ns_for_children = (  # type: ignore[assignment]
                    for_children if namespaces else (lambda: "off (fork_bench)"))
            if can_prepare:
                os.environ[worker.PREPARED_VAR] = "1" if prepared else "0"
            sb = sandboxes.prepare(trace, ws, cache, tmp / "sandboxes")
            msg = {"kind": trace.kind, "spec": json.loads(json.dumps(trace.spec)), "inputs": str(sb.inputs),
                   "outputs": str(sb.outputs), "log": str(tmp / "log.txt"), "expect": dict(trace.versions)}
            if prepared:
                s = time.perf_counter()
                worker.prepare(installation)
                prepare_s.append(time.perf_counter() - s)
                time.sleep(0.05)  # (its init sets up meanwhile, as while the build stores the last action's outputs)
            start, cpu = time.perf_counter(), cpu_now()
            if forked:  # (defer: as the worker's loop, which hands the result on before the init's exit ended)
                res = worker.run_isolated(msg, installation, **({"defer": True} if can_prepare else {}))
            else:
                res = worker.run_action(msg["kind"], msg["spec"], msg["inputs"], msg["outputs"], msg["log"],
                                        msg["expect"])
            took = time.perf_counter() - start
            if forked:
                if can_prepare:
                    worker.reap_deferred()
                worker.end_descendants()
            cpu = cpu_now() - cpu  # (every process of the run reaped: its CPU counted)
            sb.remove()
            if not res.get("ok"):
                raise SystemExit(f"the action failed: {res.get('error')}")
            return took, cpu, float(res.get("duration_s") or 0.0)

        bare: list[float] = []
        for _ in range(20):
            s = time.perf_counter()
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            os.waitpid(pid, 0)
            bare.append(time.perf_counter() - s)
        forked: list[tuple[float, float, float]] = []
        plain: list[tuple[float, float, float]] = []
        ready: list[tuple[float, float, float]] = []
        for _ in range(args.runs + 1):  # interleaved: the machine's load falls on all alike
            forked.append(one(True))
            plain.append(one(True, namespaces=False))
            if can_prepare and os.getuid() == 0:
                ready.append(one(True, prepared=True))
        confine_ns.enter = enter  # type: ignore[assignment]
        if for_children is not None:
            confine_ns.pid_ns_for_children = for_children  # type: ignore[assignment]
        inproc = [one(False) for _ in range(args.runs + 1)]

        def med(runs: list[tuple[float, float, float]], i: int) -> float:
            if i == 3:  # beyond the action's own time
                return statistics.median(r[0] - r[2] for r in runs[1:])
            return statistics.median(r[i] for r in runs[1:])

        rss = next(ln.split()[1] for ln in Path("/proc/self/status").read_text().splitlines()
                   if ln.startswith("VmRSS:"))
        path = ("an outside child forks the init" if for_children is None or getattr(confine_ns, "_NO_PID_NS", None)
                else "the worker forks the init")
        print(f"neuronbuild from {args.repo.resolve()}; load {os.getloadavg()[0]:.1f}")
        print(f"worker warm-up (toolchains + warm imports): {warm_s:.2f} s; worker RSS {int(rss) // 1024} MB; "
              f"Landlock ABI {landlock_abi()}")
        print(f"bare fork+exit+wait of the warm worker: median {statistics.median(bare) * 1000:.1f} ms (20 runs)")
        print(f"{'trace action (tiny MLP)':<34}{'first':>9}{'median':>9}{'CPU med':>9}{'own med':>9}"
              f"{'beyond own':>12}  (runs: {args.runs} after the first)")
        rows = [("  forked at dispatch (confined)", forked), ("  forked at dispatch, no namespaces", plain)]
        if ready:
            rows.insert(0, ("  prepared (confined, #53)", ready))
        for name, runs in (*rows, ("  in-process (old worker)", inproc)):
            print(f"{name:<34}{runs[0][0]:>8.3f}s{med(runs, 0):>8.3f}s{med(runs, 1):>8.3f}s{med(runs, 2):>8.3f}s"
                  f"{med(runs, 3) * 1000:>9.1f} ms")
        if ready:
            print(f"dispatch overhead beyond the action's own time (median, dispatch to result): prepared "
                  f"{med(ready, 3) * 1000:.1f} ms, forked at dispatch {med(forked, 3) * 1000:.1f} ms "
                  f"({(med(forked, 3) - med(ready, 3)) * 1000:+.1f} ms); CPU per action {med(ready, 1):.3f} s vs "
                  f"{med(forked, 1):.3f} s; preparing (the worker's fork, off the critical path): median "
                  f"{statistics.median(prepare_s[1:]) * 1000:.1f} ms")
        f_med, i_med, p_med = med(forked, 0), med(inproc, 0), med(plain, 0)
        print(f"per-action overhead of the fork: {(f_med - i_med) * 1000:+.0f} ms ({f_med / i_med:.2f}x); of the "
              f"namespaces (pid, mount, private /proc, the init): {(f_med - p_med) * 1000:+.0f} ms wall, "
              f"{(med(forked, 1) - med(plain, 1)) * 1000:+.0f} ms CPU ({path})")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
