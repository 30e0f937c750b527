"""When the build server collects garbage, and whether a command waits for it (issue #27).

One checkout at a time (its own server and cache), on a generated workspace: a cold `plan //...`, then `--back` warm
re-plans back to back after one BUILD edit each (an edit loop), then `--paused` more each after a pause of `--pause`
seconds (a user editing). Prints each command's client wall and the server log's own time for it: a command that
waited for a collection shows a wall seconds above its log time, and the server's CPU seconds for it (/proc).
`--in-process N` instead runs N warm re-plans in one process per checkout (the server's command loop without socket,
client or after-answer work), interleaved twice, and prints their CPU seconds.

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


# The server's command loop in one process (WarmState and cli._main, as server/daemon.py runs a command), without
# the socket, the client or the after-answer work: the CPU seconds of each warm re-plan alone.
_IN_PROCESS = """
import contextlib, io, os, re, sys, time
ws, cache, edited, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
os.environ["NEURONBUILD_NO_SERVER"] = "1"
os.chdir(ws)
from neuronbuild import cli
from neuronbuild.server.warm import WarmState
w = WarmState()
for i in range(n + 1):
    text = open(edited).read()
    open(edited, "w").write(re.sub(r'"batch": \\[([0-9, ]*?)(\\d+)\\]', lambda m: f'"batch": [{m.group(1)}{2000 + i}]', text))
    c = time.process_time()
    with contextlib.redirect_stdout(io.StringIO()), w.active():
        code = cli._main(["plan", "//...", "--cache-dir", cache])
    assert code == 0, code
    print(f"{time.process_time() - c:.2f}", flush=True)
"""


def run_in_process(label: str, python: Path, ws: Path, edited: Path, work: Path, n: int) -> list[float]:
    """CPU seconds of `n` warm re-plans after a cold one, each after one BUILD edit, in one process."""
    env = {k: v for k, v in os.environ.items() if k != "NEURONBUILD_NO_SERVER"}
    env["NEURONBUILD_OUTPUT_USER_ROOT"] = str(work / f"root-inproc-{label.replace(' ', '-')}")
    cache = work / f"cache-inproc-{label.replace(' ', '-')}"
    shutil.rmtree(cache, ignore_errors=True)
    p = subprocess.run([str(python), "-c", _IN_PROCESS, str(ws), str(cache), str(edited), str(n)], env=env,
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{label}: in-process re-plans failed: {p.stderr[-2000:]}")
    return [float(x) for x in p.stdout.split()[1:]]


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
    ap.add_argument("--in-process", type=int, default=0, metavar="N",
                    help="only N warm re-plans in one process per checkout, interleaved twice (CPU seconds)")
    args = ap.parse_args()
    ws = args.workdir / f"ws{args.graphs}"
    n = gen_monorepo.generate(ws, args.graphs, args.buckets, args.compiles)
    edited = ws / gen_monorepo.package_name(n // 2) / "BUILD"
    if args.in_process:
        print(f"## in-process warm re-plans: {args.graphs} graphs ({n} packages), {args.in_process} each after one "
              f"BUILD edit, CPU seconds; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
        for _round in range(2):
            for i, py in enumerate([sys.executable, *args.baseline]):
                label = "this checkout" if i == 0 else f"baseline {i}"
                cpu = run_in_process(label, Path(py), ws, edited, args.workdir, args.in_process)
                print(f"{label}: " + " ".join(f"{c:.2f}" for c in cpu) +
                      f" (median {statistics.median(cpu):.2f} s; load {os.getloadavg()[0]:.2f})", flush=True)
        return
    print(f"## server collections: {args.graphs} graphs ({n} packages), {args.back} re-plans back to back, "
          f"{args.paused} after {args.pause:g} s pauses; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    for i, py in enumerate([sys.executable, *args.baseline]):
        run_side("this checkout" if i == 0 else f"baseline {i}", Path(py), ws, edited, args.workdir,
                 args.back, args.paused, args.pause)


if __name__ == "__main__":
    main()
