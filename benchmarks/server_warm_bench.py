"""The first edit's build after a cached build through the build server: the background warm-up once the first
command answered (the build's imports, the workers' forks, the toolchain warm-ups in the zygote: server/warm.py) vs
workers cold (released by NEURONBUILD_WORKERS_IDLE_SECS before the edit) and, with --baseline, vs another checkout's
code (its Python runs its neuronbuild: /work/main/.venv/bin/python), interleaved.

Per round, each way side by side, each in a fresh workspace (gen_monorepo: one package, 1 trace, 2 lowerings,
2 compiles) with a fresh server: `--batch build` fills the shared cache, the fresh server's first command (all cached)
answers, PAUSE s pass, a comment is added to the model source, and the edit's `build` through the server is timed
(client wall), then a second edit's build right after it (a later edit: the figure to match). Prints each build's wall,
the seconds from the first command's answer until the server logged its background warm-up done, and the medians.

    .venv/bin/python benchmarks/server_warm_bench.py [--rounds N] [--workdir DIR] [--first events|noop|plan]
        [--pause S] [--baseline PYTHON] [--during]

--during: a `plan` is sent right after the first command's answer (while the warm-up runs) and timed, so a command
arriving during the warm-up is measured against the baseline's (which warms less); the edits' builds then follow.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import bytecode  # noqa: E402
import gen_monorepo  # noqa: E402


def _run(py: str, args: list[str], ws: Path, env: dict[str, str]) -> tuple[float, str]:
    t = time.perf_counter()
    p = subprocess.run([py, "-m", "neuronbuild", *args], cwd=ws, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return time.perf_counter() - t, p.stdout


def one(base: Path, cache: Path, way: str, py: str, first: str = "events", pause: float = 20.0,
        during: bool = False) -> dict[str, float]:
    """One run: {"first": the first edit's build wall, "next": the next edit's, "workers": the warm processes `info`
    counted before the edit, "done": seconds from the answer until the warm-up was logged done (-1: never),
    "during": the plan sent right after the answer (with `during`)}. `way`: warm, cold (workers released before the
    edit) or base (the baseline's code, warm). `first`: the fresh server's first command: a build with events (the full
    path, all cached), `noop` (a build answered from its no-op stamp) or `plan`."""
    ws = base / f"ws-{way}-{time.time_ns()}"
    gen_monorepo.generate(ws, 2, 1, 2)
    env = {**os.environ, "NEURONBUILD_NO_SERVER": "", "NEURONBUILD_OUTPUT_USER_ROOT": str(base / f"ob-{way}"),
           "NEURONBUILD_WORKERS_IDLE_SECS": "2" if way == "cold" else "300"}
    build = ["build", "//...", "--jobs", "2", "--cache-dir", str(cache)]
    out: dict[str, float] = {}
    try:
        _run(py, ["--batch", *build], ws, env)
        if first == "events":
            _run(py, [*build, "--build-event-json-file", str(ws / "events.jsonl")], ws, env)  # a fresh server
        else:
            _run(py, build, ws, env)  # a server's build writes the no-op stamp for this environment
            _run(py, ["shutdown"], ws, env)
            _run(py, build if first == "noop" else ["plan", *build[1:]], ws, env)  # the fresh server's first command
        answered = time.time()
        if during:
            out["during"] = _run(py, ["plan", *build[1:]], ws, env)[0]
        time.sleep(pause)
        info = json.loads(_run(py, ["info", "--output", "json"], ws, env)[1])
        out["workers"] = int(info["workers"])
        out["done"] = _done_after(Path(info["log"]), int(info["pid"]), answered)
        model = ws / gen_monorepo.package_name(0) / "model.py"
        model.write_text(model.read_text() + f"\n# edit {time.time_ns()}\n")
        out["first"], _ = _run(py, build, ws, env)
        model.write_text(model.read_text() + f"\n# edit {time.time_ns()}\n")
        out["next"], _ = _run(py, build, ws, env)
    finally:
        subprocess.run([py, "-m", "neuronbuild", "shutdown"], cwd=ws, env=env, capture_output=True)
    return out


def _done_after(log: Path, pid: int, answered: float) -> float:
    """Seconds from the first command's answer until this server logged its background warm-up done (-1: not)."""
    try:
        lines = log.read_text().splitlines()
    except OSError:
        return -1.0
    start = max((i for i, ln in enumerate(lines) if f"server {pid} listening" in ln), default=0)
    for ln in lines[start:]:
        m = re.match(r"(\d\d):(\d\d):(\d\d) background warm-up done", ln)
        if m:
            day = time.strftime("%Y-%m-%d", time.localtime(answered))
            at = time.mktime(time.strptime(f"{day} {ln[:8]}", "%Y-%m-%d %H:%M:%S"))
            return max(0.0, at - answered)
    return -1.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--first", choices=("events", "noop", "plan"), default="events",
                    help="the fresh server's first command (all cached): a build with events (the full path), a build "
                         "answered from its no-op stamp, or a plan")
    ap.add_argument("--pause", type=float, default=20.0,
                    help="seconds between the first command's answer and the edit (the zygote imports torch meanwhile:"
                         " ~5 s on an idle machine, 10 s and more on a loaded one)")
    ap.add_argument("--baseline", default=None, help="another checkout's Python (runs its neuronbuild), interleaved")
    ap.add_argument("--no-cold", action="store_true", help="skip the cold-workers way")
    ap.add_argument("--during", action="store_true", help="time a plan sent right after the first command's answer")
    args = ap.parse_args()
    bytecode.ensure(sys.executable, *([args.baseline] if args.baseline else []))
    base = Path(args.workdir or tempfile.mkdtemp(prefix="server-warm-bench-"))
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    ways = ([] if args.no_cold else ["cold"]) + (["base"] if args.baseline else []) + ["warm"]
    runs: dict[str, list[dict[str, float]]] = {w: [] for w in ways}
    print(f"first command of the fresh server: {args.first}; pause {args.pause:g} s; load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    try:
        for r in range(args.rounds):
            for way in ways:
                py = args.baseline if way == "base" else sys.executable
                cache = base / f"cache-{way}"  # (each way its own cache: the baseline may write another format)
                res = one(base, cache, way, str(py), args.first, args.pause, args.during)
                runs[way].append(res)
                during = f", plan during the warm-up {res['during']:.2f} s" if "during" in res else ""
                print(f"round {r + 1} {way}: warm processes before the edit {res['workers']:g}, warm-up done "
                      f"{res['done']:.0f} s after the answer{during}, first edit's build {res['first']:.2f} s, the "
                      f"next edit's {res['next']:.2f} s (load average {os.getloadavg()[0]:.1f})", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    for way in ways:
        med = {k: statistics.median(r[k] for r in runs[way]) for k in ("first", "next")}
        during = f", plan during the warm-up {statistics.median(r['during'] for r in runs[way]):.2f} s" \
            if args.during else ""
        print(f"median {way}: first edit's build {med['first']:.2f} s, the next edit's {med['next']:.2f} s "
              f"(first / next {med['first'] / med['next']:.2f}){during}")


if __name__ == "__main__":
    main()
