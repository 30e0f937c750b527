"""Parallel efficiency, cold builds, side by side and interleaved (A B A B) in one run: N cpu graphs with `--jobs 1`
and `--jobs 2` against an equal-work serial script; N Neuron graphs `--jobs 2` against `--jobs 1`; a real Dask
cluster on 127.0.0.1 with 2 workers against 1 and against the local executor at the same parallelism. Prints wall
times, ratios, each run's CPU seconds (its process and every process it waited for: workers, actions, compilers; a
figure the machine's other load barely moves, unlike the wall), each build's worker utilisation (from its --profile)
and the load averages around every run.

The 2-core CPU bound (cpu_bound): a run's CPU seconds cannot take less wall than prefix + (CPU - prefix) / cores,
where the prefix (process start, loading, planning, the workers' torch import, and materialising and stopping after
the last action: one process at a time) is read from the build's profile. A build at ~1.0 of its bound keeps every
core busy, so only less CPU work makes it faster; the 1-worker run's bound is the best any schedule of its work can
reach here (its wall / that bound: the largest speed-up 2 workers could show without doing less work). The CPU is
the build's own processes for --batch local builds (all children of this process), the whole machine's (/proc/stat)
for Dask clusters and build servers (quiet machine only). Each build's CPU seconds by action kind come from its
profile (the workers measure every action's process and its compilers).

    .venv/bin/python benchmarks/parallel_bench.py --section cpu --graphs 4 --rounds 2     # a few minutes each
    .venv/bin/python benchmarks/parallel_bench.py --section cpu --graphs 8 --rounds 1
    .venv/bin/python benchmarks/parallel_bench.py --section neuron --graphs 12 --rounds 2
    .venv/bin/python benchmarks/parallel_bench.py --section dask --graphs 4 --rounds 1    # cpu graphs on the farm
    .venv/bin/python benchmarks/parallel_bench.py --section dask --workload neuron --graphs 12 --rounds 1

The dask section runs each cluster size twice by default (--pin both): unpinned (every Dask worker may use both
cores of this 2-core machine, so one worker already gets the whole machine and two cannot double it) and pinned
(Dask worker i on core i: each worker stands for a one-core machine, as a farm's worker stands for a machine; its
thread budget is then 1 whether the cluster has 1 or 2 workers). The client and the Dask scheduler are not pinned
and share the cores with the workers in both.

Cold clusters by default (--farm cold: a fresh cluster and fresh farm scratch dir per run, so every run imports
torch and builds the precompiled headers). --farm long-lived (or both) adds runs labelled "long-lived": each cluster
first runs an untimed build of another vocab (nothing of it can be reused but the workers' warm processes and the
host's headers), then the timed build, both through one build server (one workspace, one cache dir); the local runs
of that variant do the same with the local executor (the server's warm workers and the cache's headers), so N=1,
N=2 and local start from the same kind of warm state, client side included. Production farms are long-lived; CI jobs on a fresh machine are cold.

A "graph" is one bucket of the example llama (vocab 32,000 + a per-run offset below 1,100, hidden 128, 2 layers:
the same work in every run and every invocation; before 2026-12-01 the offset was 10-500,000, so the weights, which
the build writes, hashes and moves but the script does not, varied 500x between invocations): for cpu a trace +
an AOTInductor compile; for Neuron (trn2) a trace + the HLO lowering + the compile step (flags; no neuronx-cc here).

Equal work on both sides of the cpu comparison:
- the script compiles with the inductor configs of neuronbuild's cpu toolchain (constants not packaged in the .so,
  -march/simdlen of the pinned ISA, dynamic threads, no line tables, neuronbuild.toolchains.compile.inductor_configs)
  under the toolchain's own ISA pinning, for the ISA `isa = "native"` resolves to;
- fresh inductor state for every run: the script gets a fresh TORCHINDUCTOR_CACHE_DIR and TMPDIR (precompiled
  headers); a build gets a fresh cache directory, which holds its workers' TMPDIR and so inductor's working dir and
  precompiled headers. Every run has its own vocab size, so no run can hit another's caches;
- OMP_NUM_THREADS=1 on both sides (neuronbuild's action environment sets it).
The script is `export + aoti_compile_and_package` per bucket in one process; what neuronbuild does beyond that (the
program saved and loaded back between trace and compile, the canonical package rewrite, constants.safetensors, the
build system: loading, planning, worker processes, sandboxes, storing into the CAS, neuronbuild-out/) is on its side.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import random
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DASK = str(Path(sys.executable).parent / "dask")
LONG = ", long-lived"  # the label of runs on a farm (or a local build server) warmed by an earlier build
SEQS = [8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256]  # one bucket (graph) per length, batch 1

BUILD = """
neuron_model(name = "llama", srcs = ["llama.py"], entry = "llama:build_model",
             config = {{"vocab": {vocab}, "hidden": 128, "layers": 2, "heads": 4}},
             inputs = {{"input_ids": "int64[batch, seq]"}})
neuron_buckets(name = "b", dims = {{"batch": [1], "seq": {seq}}})
neuron_target(name = "cpu", platform = "cpu", isa = "{isa}")
neuron_target(name = "trn2", platform = "trn2")
neuron_compile(name = "llama_cpu", model = ":llama", buckets = [":b"], target = ":cpu")
neuron_compile(name = "llama_trn2", model = ":llama", buckets = [":b"], target = ":trn2")
"""

# The script a user would write without a build system: one process, export then AOTInductor per bucket, in turn.
SCRIPT = """
import sys
import torch
sys.path.insert(0, sys.argv[1])
from llama import build_model
from torch._inductor import aoti_compile_and_package
from neuronbuild.toolchains.compile import ISA_TARGETS, _pinned_vec_isa, inductor_configs

vocab, out, isa = int(sys.argv[2]), sys.argv[3], sys.argv[4]
target = ISA_TARGETS[isa]
torch.manual_seed(0)
model = build_model({{"vocab": vocab, "hidden": 128, "layers": 2, "heads": 4}}).eval()
for seq in {seq}:
    x = torch.zeros((1, seq), dtype=torch.int64)
    with torch.no_grad():
        ep = torch.export.export(model, (x,), strict=False)
    with _pinned_vec_isa(target), torch.no_grad():
        aoti_compile_and_package(ep, package_path=f"{{out}}/s{{seq}}.pt2", inductor_configs=inductor_configs(target))
"""


def _machine_cpu() -> float:
    """CPU seconds every core of this machine has spent busy so far (/proc/stat: user, nice, system, irq, softirq,
    steal; not idle or iowait): a run's delta counts every process that ran meanwhile (the build, its workers, a Dask
    cluster's processes, and anything else: read it on a quiet machine)."""
    with open("/proc/stat", encoding="ascii") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    busy = sum(v[:8]) - v[3] - v[4]  # guest time (v[8:]) is already in user and nice
    return busy / os.sysconf("SC_CLK_TCK")


def cpu_bound(prefix: float, busy: float, cores: int) -> float:
    """The shortest wall `busy` CPU seconds allow on `cores` cores when the first `prefix` seconds (process start,
    loading, planning, the workers' torch import, and after the last action materialising and shutting down: one
    process at a time) keep one core busy: prefix + (busy - prefix) / cores. A build near its bound keeps every core
    busy; only less CPU work (or a shorter prefix) makes it faster."""
    return prefix + max(0.0, busy - prefix) / cores


def _children_cpu() -> float:
    """CPU seconds (user + system) of this process's waited-for children and their descendants so far."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


class Bench:
    def __init__(self, root: Path, isa: str, seqs: list[int]) -> None:
        self.root = root
        self.isa = isa
        self.seqs = seqs
        self.vocab = 32_000 + random.randrange(1, 1_000)  # +1 per run: no run can hit another's caches
        self.notes: list[str] = []
        self.cores = len(os.sched_getaffinity(0))
        self.last: tuple[float, float] = (0.0, 0.0)  # the last build's (CPU seconds, its CPU bound)
        self.figures: dict[str, list[tuple[float, float]]] = {}  # run name -> (CPU seconds, CPU bound) per round

    def _next(self) -> int:
        self.vocab += 1
        return self.vocab

    def workspace(self, vocab: int) -> Path:
        ws = self.root / f"ws-{vocab}"
        (ws / "models").mkdir(parents=True)
        (ws / "WORKSPACE.neuronbuild").write_text("")
        shutil.copyfile(REPO / "examples/models/llama.py", ws / "models/llama.py")
        (ws / "models/BUILD").write_text(BUILD.format(vocab=vocab, seq=self.seqs, isa=self.isa))
        return ws

    def script(self) -> tuple[float, str]:
        vocab = self._next()
        ws = self.workspace(vocab)
        out, tmp = self.root / f"script-out-{vocab}", self.root / f"script-tmp-{vocab}"
        out.mkdir()
        tmp.mkdir()
        env = dict(os.environ, TMPDIR=str(tmp), TORCHINDUCTOR_CACHE_DIR=str(tmp / "inductor"), OMP_NUM_THREADS="1",
                   PYTHONPATH=str(REPO))
        t, cpu, busy = time.perf_counter(), _children_cpu(), _machine_cpu()
        proc = subprocess.run([sys.executable, "-c", SCRIPT.format(seq=self.seqs), str(ws / "models"), str(vocab),
                               str(out), self.isa], env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t
        busy = _machine_cpu() - busy
        used = _children_cpu() - cpu
        self.last = (used, 0.0)
        if proc.returncode != 0 or len(list(out.glob("*.pt2"))) != len(self.seqs):
            sys.exit(f"the serial script failed:\n{proc.stdout}\n{proc.stderr}")
        return wall, f"cpu {used:.1f} s (machine {busy:.1f} s)"

    def build(self, target: str, *flags: str, code: Path = REPO, ws: Path | None = None, cache: Path | None = None,
              batch: bool = True) -> tuple[float, str]:
        """A cold build with the neuronbuild in `code` (a checkout: its package runs the build and its workers). With
        `ws`, in that workspace (its BUILD rewritten for this run's vocab); `cache`: that cache dir instead of a fresh
        one; `batch=False`: through the workspace's build server (started by the first such build, kept after)."""
        vocab = self._next()
        if ws is None:
            ws = self.workspace(vocab)
        else:
            (ws / "models/BUILD").write_text(BUILD.format(vocab=vocab, seq=self.seqs, isa=self.isa))
        profile = self.root / f"profile-{vocab}.json"
        # --batch: a cold build in this process, as a CI job runs it (a build server would outlive the run and keep
        # its warm workers; docs/server.md).
        cmd = [sys.executable, "-m", "neuronbuild", *(["--batch"] if batch else []), "build", f"//models:{target}",
               "--cache-dir", str(cache or self.root / f"cache-{vocab}"), "--profile", str(profile), *flags]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        if code != REPO:
            env["PYTHONPATH"] = str(code)
        t, cpu, busy = time.perf_counter(), _children_cpu(), _machine_cpu()
        proc = subprocess.run(cmd, cwd=ws, capture_output=True, text=True, env=env)
        wall = time.perf_counter() - t
        busy = _machine_cpu() - busy
        if proc.returncode != 0 or " 0 cached" not in proc.stdout:
            sys.exit(f"neuronbuild {' '.join(flags)} failed:\n{proc.stdout}\n{proc.stderr}")
        # The build's processes: its workers, their actions and compilers (all waited for by the time it exits);
        # not a Dask cluster's (those are not the build's children).
        # The bound counts the build's own processes where they are all this process's children (a --batch local
        # build), else every process on the machine (a Dask cluster's, a build server's: read it on a quiet machine).
        own = "dask" not in flags and batch
        if own:
            busy = _children_cpu() - cpu
        data = json.loads(profile.read_text())
        bound = cpu_bound(prefix_s(data, wall), busy, self.cores)
        self.last = (busy, bound)
        return wall, (f"{'cpu' if own else 'machine cpu'} {busy:.1f} s, {self.cores}-core bound {bound:.1f} s "
                      f"(wall / bound {wall / bound:.2f}); " + utilisation(data, wall))


def prefix_s(data: dict[str, Any], wall: float) -> float:
    """A build's seconds before its first action could start or after its scheduler ended (see cpu_bound)."""
    other = data.get("otherData", {})
    return wall - float(other.get("wall_s", 0)) + float(other.get("first_dispatch_s", 0))


def utilisation(data: dict[str, Any], wall: float) -> str:
    """The build's utilisation (its profile's otherData), each worker's busy seconds, and the process's wall outside
    the scheduler (start, loading, planning, materialising, shutting workers down)."""
    other = data.get("otherData", {})
    names = {e["tid"]: e["args"]["name"] for e in data["traceEvents"]
             if e.get("ph") == "M" and e["name"] == "thread_name"}
    busy: dict[str, float] = {}
    by_kind: dict[str, list[float]] = {}
    cpu_by_kind: dict[str, float] = {}  # CPU seconds of each kind's processes and their compilers (local builds)
    beyond: list[float] = []  # per action: dispatch to result, minus the action's own time in its worker
    stores: list[float] = []  # per action: the scheduler storing its outputs (after the freed worker's next dispatch)
    for e in data["traceEvents"]:
        if e.get("ph") == "X" and e.get("cat") in ("action", "warm_up"):
            w = names.get(e["tid"], str(e["tid"]))
            busy[w] = busy.get(w, 0.0) + e["dur"] / 1e6
            kind = e["name"].split()[0].lower()
            by_kind.setdefault(kind, []).append(float(e["args"]["duration_s"]))
            cpu_by_kind[kind] = cpu_by_kind.get(kind, 0.0) + float(e["args"].get("cpu_s") or 0.0)
            if e.get("cat") == "action" and e["args"].get("ok"):
                beyond.append(e["dur"] / 1e6 - float(e["args"]["duration_s"]))
        elif e.get("ph") == "X" and e.get("name") == "store outputs":
            stores.append(e["dur"] / 1e6)
    per = ", ".join(f"{w.rsplit(' ', 1)[0][-22:]} {s:.0f} s" for w, s in sorted(busy.items()))
    per += "; in-worker s: " + ", ".join(f"{k} {'/'.join(f'{d:.0f}' for d in ds)}" for k, ds in sorted(by_kind.items()))
    if any(cpu_by_kind.values()):
        per += "; cpu s by kind: " + ", ".join(f"{k} {c:.1f}" for k, c in sorted(cpu_by_kind.items()))
    if beyond:
        per += (f"; per action: {sum(beyond) / len(beyond):.3f} s beyond its own time (dispatch to result), storing "
                f"{sum(stores) / max(1, len(stores)):.3f} s")
    return (f"outside the scheduler {wall - float(other.get('wall_s', 0)):.1f} s; "
            f"util {float(other.get('utilisation', 0)):.2f} (actions only {float(other.get('action_utilisation', 0)):.2f}"
            f", warm-up {float(other.get('warm_up_s', 0)):.0f} s, first dispatch at "
            f"{float(other.get('first_dispatch_s', 0)):.1f} s; {per})")


def _shutdown_server(ws: Path, code: Path = REPO) -> None:
    """Stop the workspace's build server (started by a build with the neuronbuild in `code`)."""
    env = dict(os.environ, **({"PYTHONPATH": str(code)} if code != REPO else {}))
    subprocess.run([sys.executable, "-m", "neuronbuild", "shutdown"], cwd=ws, capture_output=True, env=env)


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def interleave(runs: list[tuple[str, Callable[[], tuple[float, str]]]], rounds: int,
               bench: Bench | None = None) -> dict[str, list[float]]:
    """Each run once per round, in the same order (A B A B ...); prints every run with the load around it. With
    `bench`, each run's (machine CPU, CPU bound) is kept in bench.figures."""
    walls: dict[str, list[float]] = {name: [] for name, _ in runs}
    for r in range(rounds):
        for name, fn in runs:
            before = _load()
            wall, note = fn()
            walls[name].append(wall)
            if bench is not None:
                bench.figures.setdefault(name, []).append(bench.last)
            print(f"  round {r + 1}: {name:<34} {wall:7.1f} s   load {before} -> {_load()}   {note}", flush=True)
    return walls


def table(walls: dict[str, list[float]], base: str, goals: dict[str, str]) -> None:
    b = sum(walls[base]) / len(walls[base])
    print(f"| run | wall per round | mean | / {base} | goal |")
    print("|---|---|---|---|---|")
    for name, ws in walls.items():
        mean = sum(ws) / len(ws)
        print(f"| {name} | {', '.join(f'{w:.1f}' for w in ws)} s | {mean:.1f} s | {mean / b:.2f} | "
              f"{goals.get(name, '')} |")


def bounds(bench: Bench, walls: dict[str, list[float]], one: str, two: str, base: str | None = None) -> None:
    """What the machine's cores allow: `one` (a 1-worker run)'s CPU work in a wall of cpu_bound on this machine's
    cores is the best any schedule of that work can do here (for `two`, the 2-worker run, a speed-up over `one` of at
    most one's wall / that bound); and how near `two` came to its own bound (its CPU work, which may be more)."""
    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs)

    w1, w2 = mean(walls[one]), mean(walls[two])
    c1, b1 = (mean([f[i] for f in bench.figures[one]]) for i in (0, 1))
    c2, b2 = (mean([f[i] for f in bench.figures[two]]) for i in (0, 1))
    vs = ""
    if base is not None:
        wb = mean(walls[base])
        vs = f" = {b1 / wb:.2f} of {base}'s wall"
    print(f"{bench.cores}-core CPU bound: {one} did {c1:.1f} s of CPU, which {bench.cores} cores run in no "
          f"less than {b1:.1f} s{vs} (at most {w1 / b1:.2f}x over its {w1:.1f} s); {two} did {c2:.1f} s "
          f"({c2 - c1:+.1f} s), bound {b2:.1f} s, wall {w2:.1f} s = {w2 / b2:.2f} of its bound")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def dask_cluster(root: Path, n: int, pin: bool = False, code: Path = REPO) -> Iterator[str]:
    """`dask scheduler` + n single-thread `dask worker` processes, every listener on 127.0.0.1. With `pin`, worker i
    runs on core i only (its warm processes and compilers inherit that): each Dask worker stands for a one-core
    machine, so its thread budget is 1 (neuronbuild counts the cores a process may run on) whether 1 or 2 workers
    run; the scheduler and the client are not pinned. `code`: the checkout whose neuronbuild the workers run."""
    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    logs = root / f"dask-{port}"
    logs.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(logs / "tmp"))  # fresh farm scratch (headers) per cluster
    if code != REPO:
        env["PYTHONPATH"] = str(code)
    (logs / "tmp").mkdir()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        loopback = ["--host", "127.0.0.1", "--dashboard-address", "127.0.0.1:0"]
        specs = [("scheduler", ["scheduler", "--port", str(port), *loopback])]
        specs += [(f"w{i}", ["worker", address, *loopback, "--nthreads", "1", "--no-nanny", "--memory-limit", "0",
                             "--name", f"w{i}"]) for i in range(n)]
        cores = sorted(os.sched_getaffinity(0))
        for i, (name, args) in enumerate(specs):
            # taskset, not a preexec_fn: this process runs Dask client threads by the second cluster.
            pinned = ["taskset", "-c", str(cores[(i - 1) % len(cores)])] if pin and i > 0 else []
            with open(logs / f"{name}.log", "wb") as log:
                procs.append(subprocess.Popen([*pinned, DASK, *args], stdout=log, stderr=subprocess.STDOUT,
                                              env=env, cwd=logs))
        from distributed import Client

        with Client(address, timeout="60s") as c:
            c.wait_for_workers(n, timeout=120)
        yield address
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


def _warm_page_cache() -> float:
    """Untimed: import torch once and read its C++ headers, so the first timed run does not pay for a cold page cache
    (the precompiled-header build reads thousands of headers) and the runs' order does not bias the ratios."""
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, torch._inductor"], check=True)
    spec = importlib.util.find_spec("torch")
    assert spec is not None and spec.origin is not None
    for f in (Path(spec.origin).parent / "include").rglob("*"):
        if f.is_file():
            f.read_bytes()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--section", choices=("cpu", "neuron", "dask"), default="cpu")
    ap.add_argument("--graphs", type=int, default=4, help=f"graphs (buckets), at most {len(SEQS)} (default 4)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2: A B A B)")
    ap.add_argument("--workload", choices=("cpu", "neuron"), default="cpu", help="what the dask section builds")
    ap.add_argument("--pin", choices=("no", "yes", "both"), default="both",
                    help="dask section: unpinned clusters, clusters with each worker pinned to its own core (one "
                         "machine per worker), or both (default)")
    ap.add_argument("--farm", choices=("cold", "long-lived", "both"), default="cold",
                    help="dask section: cold clusters (fresh workers and headers per run; default), long-lived ones "
                         "(each cluster, and each local build server + cache, warmed by an untimed build of another "
                         "vocab before the timed build), or both")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory (profiles, outputs)")
    ap.add_argument("--baseline", type=Path, metavar="CHECKOUT",
                    help="also build with the neuronbuild of another checkout (e.g. a worktree of main), interleaved "
                         "with this one's runs in every round (the dask section: its clusters run that checkout too)")
    args = ap.parse_args()
    if not 1 <= args.graphs <= len(SEQS):
        ap.error(f"--graphs must be 1..{len(SEQS)}")
    if args.baseline is not None and not (args.baseline / "neuronbuild" / "__init__.py").is_file():
        ap.error(f"--baseline: {args.baseline} is not a neuronbuild checkout (no neuronbuild/__init__.py)")
    sys.path.insert(0, str(REPO))
    from neuronbuild.platforms import resolve_isa

    isa = resolve_isa("native")
    root = Path(tempfile.mkdtemp(prefix="neuronbuild-bench-"))
    bench = Bench(root, isa, SEQS[: args.graphs])
    n = args.graphs
    print(f"{os.cpu_count()} cores, isa {isa}, load average (1/5/15 min) {_load()} at start; {n} graphs "
          f"(batch 1, seq {bench.seqs}), cold, {args.rounds} interleaved round(s)", flush=True)
    print(f"untimed warm-up (import torch, read its headers): {_warm_page_cache():.1f} s", flush=True)
    try:
        base = args.baseline.resolve() if args.baseline else None

        def builds(target: str) -> list[tuple[str, Callable[[], tuple[float, str]]]]:
            runs: list[tuple[str, Callable[[], tuple[float, str]]]] = []
            for jobs in ("1", "2"):
                runs.append((f"neuronbuild build --jobs {jobs}", lambda j=jobs: bench.build(target, "--jobs", j)))
                if base is not None:
                    runs.append((f"baseline build --jobs {jobs}",
                                 lambda j=jobs: bench.build(target, "--jobs", j, code=base)))
            return runs

        if base is not None:
            print(f"baseline: the neuronbuild in {base} (its runs interleaved with this checkout's)", flush=True)
        if args.section == "cpu":
            walls = interleave([("serial script", bench.script), *builds("llama_cpu")], args.rounds, bench)
            table(walls, "serial script", {"neuronbuild build --jobs 1": "<= 1.0", "neuronbuild build --jobs 2":
                                           "<= 0.55"})
            bounds(bench, walls, "neuronbuild build --jobs 1", "neuronbuild build --jobs 2", "serial script")
        elif args.section == "neuron":
            walls = interleave(builds("llama_trn2"), args.rounds, bench)
            table(walls, "neuronbuild build --jobs 1", {"neuronbuild build --jobs 2": "<= 0.556 (>= 1.8x)"})
            bounds(bench, walls, "neuronbuild build --jobs 1", "neuronbuild build --jobs 2")
            if base is not None:
                j1, j2 = (sum(walls[f"baseline build --jobs {j}"]) / args.rounds for j in ("1", "2"))
                print(f"baseline --jobs 2 / its --jobs 1: {j2 / j1:.2f} ({j1 / j2:.2f}x)")
        else:
            target = f"llama_{args.workload if args.workload == 'cpu' else 'trn2'}"

            def farm(k: int, pin: bool = False, long_lived: bool = False,
                     code: Path = REPO) -> Callable[[], tuple[float, str]]:
                def run() -> tuple[float, str]:
                    with dask_cluster(root, k, pin, code) as address:
                        shared = root / f"shared-{bench.vocab + 1}"
                        shared.mkdir()
                        flags = ("--executor", "dask", "--scheduler", address, "--remote-cache", str(shared))
                        if not long_lived:
                            return bench.build(target, *flags, code=code)
                        # Untimed: the farm's earlier build (another vocab: nothing to reuse but the workers' warm
                        # processes and the host's headers), through a build server as the local runs of this
                        # variant (so the client side is warm alike: its loading and planning).
                        vocab = bench.vocab + 1
                        ws, cache = bench.workspace(vocab), root / f"cache-ll-{vocab}"
                        try:
                            bench.build(target, *flags, ws=ws, cache=cache, batch=False, code=code)
                            return bench.build(target, *flags, ws=ws, cache=cache, batch=False, code=code)
                        finally:
                            _shutdown_server(ws, code)
                return run

            def local_long_lived(jobs: str, code: Path = REPO) -> Callable[[], tuple[float, str]]:
                """The local counterpart of a long-lived farm: a build server (warm workers, the zygote's warm-ups)
                and a cache (headers in its toolchain-tmp) warmed by an untimed build of another vocab."""
                def run() -> tuple[float, str]:
                    vocab = bench.vocab + 1
                    ws, cache = bench.workspace(vocab), root / f"cache-ll-{vocab}"
                    try:
                        bench.build(target, "--jobs", jobs, ws=ws, cache=cache, batch=False, code=code)  # untimed
                        return bench.build(target, "--jobs", jobs, ws=ws, cache=cache, batch=False, code=code)
                    finally:
                        _shutdown_server(ws, code)
                return run

            lifetimes = {"cold": [""], "long-lived": [LONG], "both": ["", LONG]}[args.farm]
            if LONG in lifetimes:
                print("long-lived runs: an untimed build of another vocab, then the timed build, both through one "
                      "build server and cache dir, on one Dask cluster (N=1, N=2) or the local executor alike",
                      flush=True)
            # With --baseline every run is repeated with the other checkout (its client, workers and build
            # server), right after this checkout's, labelled "baseline ...".
            codes = [("", REPO)] + ([("baseline ", base)] if base is not None else [])
            runs = []
            for life in lifetimes:
                ll = life == LONG
                for who, code in codes:
                    if args.pin in ("no", "both"):
                        runs += [(f"{who}dask, 1 worker{life}", farm(1, False, ll, code)),
                                 (f"{who}dask, 2 workers{life}", farm(2, False, ll, code))]
                    if args.pin in ("yes", "both"):
                        runs += [(f"{who}dask, 1 worker, pinned{life}", farm(1, True, ll, code)),
                                 (f"{who}dask, 2 workers, pinned{life}", farm(2, True, ll, code))]
                    if ll:
                        runs += [(f"{who}local --jobs 1{life}", local_long_lived("1", code)),
                                 (f"{who}local --jobs 2{life}", local_long_lived("2", code))]
                    else:
                        runs += [(f"{who}local --jobs 1", lambda c=code: bench.build(target, "--jobs", "1", code=c)),
                                 (f"{who}local --jobs 2", lambda c=code: bench.build(target, "--jobs", "2", code=c))]
            walls = interleave(runs, args.rounds, bench)
            table(walls, "local --jobs 1" if "" in lifetimes else f"local --jobs 1{LONG}", {})

            def mean(k: str) -> float:
                return sum(walls[k]) / len(walls[k])

            for who, _code in codes:
                for life in lifetimes:
                    for pin in ("", ", pinned"):
                        tag = pin + life
                        if f"{who}dask, 1 worker{tag}" in walls:
                            d1, d2 = mean(f"{who}dask, 1 worker{tag}"), mean(f"{who}dask, 2 workers{tag}")
                            l1, l2 = mean(f"{who}local --jobs 1{life}"), mean(f"{who}local --jobs 2{life}")
                            print(f"{who}dask{tag or ' (unpinned)'}: wall 2 workers / 1 worker {d2 / d1:.2f} "
                                  f"(speed-up {d1 / d2:.2f}x, goal >= 1.8x); 2 workers / local --jobs 2{life} "
                                  f"{d2 / l2:.2f} (goal <= 1.1); 1 worker / local --jobs 1{life} {d1 / l1:.2f}; "
                                  f"local speed-up {l1 / l2:.2f}x")
                            bounds(bench, walls, f"{who}dask, 1 worker{tag}", f"{who}dask, 2 workers{tag}")
                            if not pin:
                                bounds(bench, walls, f"{who}local --jobs 1{life}", f"{who}local --jobs 2{life}")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"kept {root}")
    print(f"load average at end {_load()}")


if __name__ == "__main__":
    main()
