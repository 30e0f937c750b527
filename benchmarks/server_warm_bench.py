"""The first edit's build after a cached build through the build server: workers warmed in the background once the
cached build answered, vs workers cold (released by NEURONBUILD_WORKERS_IDLE_SECS before the edit, as every first
edit was before the background warm-up).

Per round, both ways side by side (cold first), each in a fresh workspace (gen_monorepo: one package, 1 trace,
2 lowerings, 2 compiles) with a fresh server: `--batch build` fills the shared cache, a server `build` (with events,
so it takes the full path, not the no-op stamp) has everything cached, PAUSE s pass, a comment is added to the model
source, and the edit's `build` through the server is timed (client wall). Prints each build's wall and the medians.

    .venv/bin/python benchmarks/server_warm_bench.py [--rounds N] [--workdir DIR] [--first events|noop|plan]

--first picks the fresh server's first command (all cached); each run also times a second edit's build right after
the first (a later edit, workers warm from the first).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import gen_monorepo  # noqa: E402

PAUSE = 8.0  # long enough for the zygote's torch import, and for a 2 s idle release


def _run(args: list[str], ws: Path, env: dict[str, str]) -> tuple[float, str]:
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "neuronbuild", *args], cwd=ws, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return time.perf_counter() - t, p.stdout


def one(base: Path, cache: Path, warm: bool, first: str = "events") -> tuple[float, int, float]:
    """The first edit's build wall, the warm processes `info` counted before it, and a second (later) edit's build
    wall right after it. `first`: the fresh server's first command: a build with events (the full path, all cached),
    `noop` (a build answered from its no-op stamp) or `plan`."""
    ws = base / f"ws-{'warm' if warm else 'cold'}-{time.time_ns()}"
    gen_monorepo.generate(ws, 2, 1, 2)
    env = {**os.environ, "NEURONBUILD_NO_SERVER": "", "NEURONBUILD_OUTPUT_USER_ROOT": str(base / "ob"),
           "NEURONBUILD_WORKERS_IDLE_SECS": "300" if warm else "2"}
    build = ["build", "//...", "--jobs", "2", "--cache-dir", str(cache)]
    try:
        _run(["--batch", *build], ws, env)
        if first == "events":
            _run([*build, "--build-event-json-file", str(ws / "events.jsonl")], ws, env)  # a fresh server, all cached
        else:
            _run(build, ws, env)  # a server's build writes the no-op stamp for this environment
            _run(["shutdown"], ws, env)
            _run(build if first == "noop" else ["plan", *build[1:]], ws, env)  # the fresh server's first command
        time.sleep(PAUSE)
        workers = int(json.loads(_run(["info", "--output", "json"], ws, env)[1])["workers"])
        model = ws / gen_monorepo.package_name(0) / "model.py"
        model.write_text(model.read_text() + f"\n# edit {time.time_ns()}\n")
        wall, _ = _run(build, ws, env)
        model.write_text(model.read_text() + f"\n# edit {time.time_ns()}\n")
        later, _ = _run(build, ws, env)
    finally:
        subprocess.run([sys.executable, "-m", "neuronbuild", "shutdown"], cwd=ws, env=env, capture_output=True)
    return wall, workers, later


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--first", choices=("events", "noop", "plan"), default="events",
                    help="the fresh server's first command (all cached): a build with events (the full path), a build "
                         "answered from its no-op stamp, or a plan")
    args = ap.parse_args()
    base = Path(args.workdir or tempfile.mkdtemp(prefix="server-warm-bench-"))
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    cache = base / "cache"
    walls: dict[bool, list[float]] = {False: [], True: []}
    laters: dict[bool, list[float]] = {False: [], True: []}
    print(f"first command of the fresh server: {args.first}; load average {os.getloadavg()[0]:.1f}", flush=True)
    try:
        for r in range(args.rounds):
            for warm in (False, True):
                wall, workers, later = one(base, cache, warm, args.first)
                walls[warm].append(wall)
                laters[warm].append(later)
                print(f"round {r + 1} {'warm' if warm else 'cold'}: warm processes before the edit {workers}, "
                      f"first edit's build {wall:.2f} s, the next edit's {later:.2f} s (load average "
                      f"{os.getloadavg()[0]:.1f})", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    cold, warm_m = statistics.median(walls[False]), statistics.median(walls[True])
    print(f"median first edit's build: cold workers {cold:.2f} s, warmed in the background {warm_m:.2f} s "
          f"({cold - warm_m:.2f} s less); the next edit's build: {statistics.median(laters[False]):.2f} s / "
          f"{statistics.median(laters[True]):.2f} s")


if __name__ == "__main__":
    main()
