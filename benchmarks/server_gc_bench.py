"""When the build server collects garbage, and whether a command waits for it (issue #27).

One checkout at a time (its own server and cache), on a generated workspace: a cold `plan //...`, then `--back` warm
re-plans back to back after one BUILD edit each (an edit loop), then `--paused` more each after a pause of `--pause`
seconds (a user editing). Prints each command's client wall and the server log's own time for it: a command that
waited for a collection shows a wall seconds above its log time.

    .venv/bin/python benchmarks/server_gc_bench.py --graphs 100000 --baseline /work/other/.venv/bin/python
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gen_monorepo  # noqa: E402


def run_side(label: str, python: Path, ws: Path, edited: Path, work: Path, back: int, paused: int,
             pause: float) -> None:
    binary = python.parent / "neuronbuild"
    env = {k: v for k, v in os.environ.items() if k != "NEURONBUILD_NO_SERVER"}
    env["NEURONBUILD_OUTPUT_USER_ROOT"] = str(work / f"root-{label.replace(' ', '-')}")
    cache = work / f"cache-{label.replace(' ', '-')}"
    shutil.rmtree(cache, ignore_errors=True)
    shutil.rmtree(env["NEURONBUILD_OUTPUT_USER_ROOT"], ignore_errors=True)  # (a fresh server log: this run's only)
    size = [1000]
    server_pid = [0]
    cpus: list[float] = []

    def server_cpu() -> float:
        """The server's CPU seconds so far (user + system, /proc), 0.0 when not known."""
        try:
            fields = Path(f"/proc/{server_pid[0]}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return 0.0

    def plan() -> float:
        c = server_cpu()
        t = time.perf_counter()
        p = subprocess.run([str(binary), "plan", "//...", "--cache-dir", str(cache)], cwd=ws, env=env,
                           capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"{label}: plan failed: {p.stderr[-2000:]}")
        wall = time.perf_counter() - t
        if server_pid[0]:
            cpus.append(server_cpu() - c)
        else:
            info = subprocess.run([str(binary), "info", "--output", "json"], cwd=ws, env=env, capture_output=True,
                                  text=True)
            m = re.search(r'"pid": (\d+)', info.stdout)
            server_pid[0] = int(m.group(1)) if m else 0
        return wall

    def edit() -> None:
        size[0] += 1
        edited.write_text(re.sub(r'"batch": \[([0-9, ]*?)(\d+)\]', lambda m: f'"batch": [{m.group(1)}{size[0]}]',
                                 edited.read_text()))

    cold = plan()
    walls = []
    for i in range(back + paused):
        if i >= back:
            time.sleep(pause)
        edit()
        walls.append(plan())
    info = subprocess.run([str(binary), "info", "--output", "json"], cwd=ws, env=env, capture_output=True, text=True)
    log = ""
    m = re.search(r'"log": "([^"]+)"', info.stdout)
    if m:
        log = Path(m.group(1)).read_text(errors="replace")
    logged = [float(x) for x in re.findall(r" -> -?\d+ in ([0-9.]+) s", log)][1:]
    collections = re.findall(r"collected (\d+) unreachable objects in ([0-9.]+) s", log)
    rss = re.search(r'"rss_kib": (\d+)', info.stdout)
    subprocess.run([str(binary), "shutdown"], cwd=ws, env=env, capture_output=True)
    waited = [w - t for w, t in zip(walls, logged, strict=False)]
    print(f"\n### {label} ({python})")
    print(f"cold plan {cold:.2f} s; load {os.getloadavg()[0]:.2f}")
    print("back to back, client wall: " + " ".join(f"{w:.2f}" for w in walls[:back]))
    print(f"after a {pause:g} s pause, client wall: " + " ".join(f"{w:.2f}" for w in walls[back:]))
    print("server log per command: " + " ".join(f"{t:.2f}" for t in logged))
    if walls[:back] and logged:
        print(f"**warm re-plan back to back: median client wall {statistics.median(walls[1:back] or walls):.2f} s, "
              f"server log median {statistics.median(logged[1:back] or logged[:1]):.2f} s, server CPU median "
              f"{statistics.median(cpus[1:back] or cpus or [0.0]):.2f} s (the first after the cold start left out); "
              f"the first after the cold start: {logged[0]:.2f} s (server log), {cpus[0] if cpus else 0.0:.2f} s "
              f"CPU**")
    print("server CPU per command: " + " ".join(f"{c:.2f}" for c in cpus))
    print(f"**waited beyond the server's own time: median {statistics.median(waited):.2f} s, max {max(waited):.2f} s**")
    print(f"collections logged (objects, s): {collections or 'none logged (this checkout does not log them)'}")
    print(f"server RSS at the end: {int(rss.group(1)) // 1024 if rss else '?'} MiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--graphs", type=int, default=100_000)
    ap.add_argument("--buckets", type=int, default=4)
    ap.add_argument("--compiles", type=int, default=5)
    ap.add_argument("--back", type=int, default=10, help="warm re-plans back to back")
    ap.add_argument("--paused", type=int, default=3, help="then this many, each after --pause seconds")
    ap.add_argument("--pause", type=float, default=7.0)
    ap.add_argument("--baseline", action="append", default=[], help="another checkout's venv python (run after)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/server_gc_bench"))
    args = ap.parse_args()
    ws = args.workdir / f"ws{args.graphs}"
    n = gen_monorepo.generate(ws, args.graphs, args.buckets, args.compiles)
    edited = ws / gen_monorepo.package_name(n // 2) / "BUILD"
    print(f"## server collections: {args.graphs} graphs ({n} packages), {args.back} re-plans back to back, "
          f"{args.paused} after {args.pause:g} s pauses; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    for i, py in enumerate([sys.executable, *args.baseline]):
        run_side("this checkout" if i == 0 else f"baseline {i}", Path(py), ws, edited, args.workdir,
                 args.back, args.paused, args.pause)


if __name__ == "__main__":
    main()
