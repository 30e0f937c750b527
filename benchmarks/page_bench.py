"""What a build's invocation record and page cost (issue #27), this checkout against others side by side:

  render  CPU seconds (user + sys, of a child interpreter) of making the page of a recorded build, and of a no-op
          standing for it: the first no-op of a base (which renders the base's no-op skeleton) and a later one.
          Needs a store holding a build record (`--store DIR/invocations --base ID`: e.g. a generated workspace's
          build, or a plan of it); the no-op records it makes are removed afterwards.
  edit    through a warm build server per checkout (its own output user root, one shared cache): a BUILD edit whose
          actions are all cached, toggled back and forth, each checkout building after each toggle, interleaved;
          the client's wall and the server's log (its time per build; this checkout's "after the answer" time).

    python benchmarks/page_bench.py --sections render --store /tmp/x/invocations --base 2026... \
        --baseline /work/main/.venv/bin/python
    python benchmarks/page_bench.py --sections edit --ws /tmp/scale/ws200 --cache /tmp/scale/cache \
        --baseline /work/main/.venv/bin/python --rounds 6
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bytecode  # noqa: E402
import gen_monorepo  # noqa: E402

RENDER = ("import sys; from neuronbuild.report.invocation import render_stored; "
          "render_stored(sys.argv[1], sys.argv[2])")


def _child_cpu(cmd: list[str]) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def section_render(store: Path, base: str, pythons: list[tuple[str, str]], runs: int) -> None:
    rec = json.loads((store / f"{base}.json").read_text())
    print(f"\n## page CPU: {base} ({rec.get('total')} actions)")
    print("| checkout | full page | first no-op (skeleton made) | later no-op |")
    print("|---|---|---|---|")
    for name, py in pythons:
        made: list[Path] = []
        try:
            full = [_child_cpu([py, "-P", "-c", RENDER, str(store), base]) for _ in range(runs)]
            first, later = [], []
            for i in range(runs):
                (store / f"{base}.noop-page").unlink(missing_ok=True)
                ids = [f"29991231-0000{i:02d}-00{j}-0001" for j in range(2)]
                for inv_id in ids:
                    noop = {"format": 1, "id": inv_id, "command": "build", "argv": ["neuronbuild", "build"],
                            "patterns": rec.get("patterns"), "flags": {}, "workspace": rec.get("workspace"),
                            "cache_dir": rec.get("cache_dir"), "started": time.time(), "finished": time.time(),
                            "outcome": "ok", "exit_code": 0, "noop": True, "same_as": base, "executor": "",
                            "jobs": 0, "wall_s": 0.0, "total_s": 0.0, "cpu_s": 0.0, "busy_worker_s": 0.0,
                            "utilisation": 0.0, "peak_rss_mb": 0.0, "saved_s": 0.0, "total": rec.get("total"),
                            "counts": {"cached_local": rec.get("total")}, "actions": [], "compiles": [],
                            "slices": []}
                    (store / f"{inv_id}.json").write_text(json.dumps(noop))
                    made += [store / f"{inv_id}.json", store / f"{inv_id}.html"]
                first.append(_child_cpu([py, "-P", "-c", RENDER, str(store), ids[0]]))
                later.append(_child_cpu([py, "-P", "-c", RENDER, str(store), ids[1]]))
        finally:
            for p in made:
                p.unlink(missing_ok=True)
            (store / f"{base}.noop-page").unlink(missing_ok=True)
        print(f"| {name} | {statistics.median(full):.3f} s | {statistics.median(first):.3f} s | "
              f"{statistics.median(later):.3f} s |")


def section_edit(ws: Path, cache: Path, pythons: list[tuple[str, str]], rounds: int, workdir: Path) -> None:
    print(f"\n## warm server: a BUILD edit whose actions are all cached, toggled ({ws})")
    bins = {name: str(Path(py).parent / "neuronbuild") for name, py in pythons}
    bfile = ws / gen_monorepo.package_name(0) / "BUILD"
    orig = bfile.read_text()
    gen_monorepo.edit_one_bucket_list(ws, 0, 2, 57)
    edited = bfile.read_text()
    bfile.write_text(orig)

    def env(name: str) -> dict[str, str]:
        e = {k: v for k, v in os.environ.items() if k != "NEURONBUILD_NO_SERVER"}
        e["NEURONBUILD_OUTPUT_USER_ROOT"] = str(workdir / f"root-{re.sub(r'[^A-Za-z0-9]', '_', name)}")
        return e

    walls: dict[str, list[float]] = {n: [] for n in bins}
    try:
        for r in range(rounds + 1):  # round 0: starts the servers (and builds the edited state once)
            bfile.write_text(edited if r % 2 == 0 else orig)
            time.sleep(0.1)  # out of the racy window
            for name in (list(bins) if r % 2 == 0 else list(reversed(bins))):
                t = time.perf_counter()
                p = subprocess.run([bins[name], "build", "//...", "--cache-dir", str(cache)], cwd=ws, env=env(name),
                                   capture_output=True, text=True)
                if p.returncode != 0:
                    raise SystemExit(p.stdout + p.stderr)
                if r > 0:
                    walls[name].append(time.perf_counter() - t)
                time.sleep(1.0)  # (a user does not build again at once)
    finally:
        bfile.write_text(orig)
    print("| checkout | client wall (median) | server's time per build (its log, median) | after the answer |")
    print("|---|---|---|---|")
    for name in bins:
        info = subprocess.run([bins[name], "info", "--output", "json"], cwd=ws, env=env(name), capture_output=True,
                              text=True)
        log = Path(json.loads(info.stdout)["log"]).read_text(errors="replace")
        logged = [float(m.group(1)) for m in re.finditer(r" build //\.\.\. .*-> 0 in ([0-9.]+) s", log)][1:]
        after = [float(m.group(1)) for m in re.finditer(r"after the answer: \d+ task\(s\) in ([0-9.]+) s", log)][1:]
        subprocess.run([bins[name], "shutdown"], cwd=ws, env=env(name), capture_output=True)
        print(f"| {name} | {statistics.median(walls[name]):.3f} s | "
              f"{statistics.median(logged) if logged else float('nan'):.3f} s | "
              f"{f'{statistics.median(after):.3f} s' if after else '-'} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="render")
    ap.add_argument("--store", type=Path, help="an invocations directory (render)")
    ap.add_argument("--base", help="the id of a build (or plan) record in --store (render)")
    ap.add_argument("--ws", type=Path, help="a generated workspace, built with --cache (edit)")
    ap.add_argument("--cache", type=Path)
    ap.add_argument("--baseline", action="append", default=[], help="another checkout's venv Python (repeatable)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/page_bench"))
    a = ap.parse_args()
    bytecode.ensure(sys.executable, *a.baseline)
    pythons = [("this checkout", sys.executable)] + [(f"baseline {Path(b).parent.parent.parent}", b)
                                                     for b in a.baseline]
    print(f"# page_bench: load average {os.getloadavg()[0]:.1f} at start")
    sections = a.sections.split(",")
    if "render" in sections:
        section_render(a.store, a.base, pythons, a.runs)
    if "edit" in sections:
        section_edit(a.ws.resolve(), a.cache.resolve(), pythons, a.rounds, a.workdir)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
