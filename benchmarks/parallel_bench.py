"""Cold builds of N traces + N AOTInductor compiles: a hand-written serial script (bare, and with neuronbuild's
toolchain steps) against `neuronbuild build --jobs 1` and `--jobs 2`, in one run; prints wall times and ratios.

    .venv/bin/python benchmarks/parallel_bench.py                          # 6 buckets: ~5-15 minutes on 2 cores
    .venv/bin/python benchmarks/parallel_bench.py --batch 1 --seq 32,64    # 2 buckets: a few minutes

Equal work on both sides:
- the same inductor configs as neuronbuild's cpu toolchain (neuronbuild/toolchains/compile.py: constants not packaged
  in the .so, -march/simdlen of the pinned ISA, dynamic threads, no line tables) and the same pinned vector ISA (the
  toolchain's own pinning context manager), for the ISA `isa = "native"` resolves to on this machine;
- fresh inductor state for every run: the script gets a fresh TORCHINDUCTOR_CACHE_DIR and TMPDIR (precompiled
  headers); neuronbuild gets a fresh cache directory (its workers' TMPDIR) and, because its cpu toolchain always
  compiles in the fixed per-machine /tmp/neuronbuild-inductor, runs in a private mount namespace with an empty
  directory bind-mounted there (needs root and util-linux `unshare`; without them the script says so and
  neuronbuild's side may find that directory warm). Every run also gets its own vocab size (1000 + a per-run
  offset), so no run can hit another's inductor caches; the graphs differ only in the embedding's row count;
- OMP_NUM_THREADS=1 on both sides (neuronbuild's action environment sets it).

Two script variants:
- bare: torch.export + aoti_compile_and_package per bucket, one process;
- with neuronbuild's toolchain steps: also what neuronbuild's actions do beyond that: the traced program saved and
  loaded back (the trace -> compile hand-off), the canonical package rewrite and constants.safetensors (the toolchain's
  compile_cpu itself), and BLAKE3 over every output. What remains on neuronbuild's side is the build system proper:
  loading and planning, worker processes, sandboxes, storing into the CAS with fsync, records and neuronbuild-out/.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NB_INDUCTOR = "/tmp/neuronbuild-inductor"  # neuronbuild.toolchains.compile.INDUCTOR_CACHE_DIR's parent

BUILD = """
neuron_model(name = "llama", srcs = ["llama.py"], entry = "llama:build_model",
             config = {{"vocab": {vocab}, "hidden": 128, "layers": 2, "heads": 4}},
             inputs = {{"input_ids": "int64[batch, seq]"}})
neuron_buckets(name = "b", dims = {{"batch": {batch}, "seq": {seq}}})
neuron_target(name = "cpu", platform = "cpu", isa = "{isa}")
neuron_compile(name = "llama_cpu", model = ":llama", buckets = [":b"], target = ":cpu")
"""

# The script a user would write without a build system: one process, export then AOTInductor per bucket, in turn.
SCRIPT = """
import sys, time
import torch
sys.path.insert(0, sys.argv[1])
from llama import build_model
from torch._inductor import aoti_compile_and_package
from neuronbuild.toolchains.compile import ISA_TARGETS, _pinned_vec_isa

vocab, out, isa, mode = int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
target = ISA_TARGETS[isa]
# Kept equal to neuronbuild.toolchains.compile.compile_cpu's inductor_configs.
configs = {{"cpp.march": target.march, "cpp.simdlen": target.simdlen, "cpp.dynamic_threads": True,
           "aot_inductor.package_constants_in_so": False, "aot_inductor.enable_line_tables": False}}
torch.manual_seed(0)
model = build_model({{"vocab": vocab, "hidden": 128, "layers": 2, "heads": 4}}).eval()
for batch in {batch}:
    for seq in {seq}:
        x = torch.zeros((batch, seq), dtype=torch.int64)
        with torch.no_grad():
            ep = torch.export.export(model, (x,), strict=False)
        if mode == "bare":
            with _pinned_vec_isa(target), torch.no_grad():
                aoti_compile_and_package(ep, package_path=f"{{out}}/b{{batch}}_s{{seq}}.pt2", inductor_configs=configs)
            continue
        import blake3
        from pathlib import Path
        from neuronbuild.toolchains.compile import compile_cpu
        from neuronbuild.toolchains.trace import load_program, program_bytes
        d = Path(out) / f"b{{batch}}_s{{seq}}"
        d.mkdir()
        (d / "program.pt2").write_bytes(program_bytes(ep))
        compile_cpu(load_program(d / "program.pt2"), (x,), isa, {{}}, d)
        for f in sorted(d.iterdir()):
            blake3.blake3(f.read_bytes()).hexdigest()
"""


def _isolated(cmd: list[str], fresh: Path) -> list[str]:
    """cmd in a private mount namespace where NB_INDUCTOR is the directory `fresh` (other processes still see theirs)."""
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            f'mount --bind "{fresh}" "{NB_INDUCTOR}" && exec "$@"', "sh", *cmd]


def _can_isolate(root: Path) -> bool:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    Path(NB_INDUCTOR).mkdir(parents=True, exist_ok=True)
    probe = root / "probe"
    probe.mkdir()
    (probe / "marker").write_text("")
    seen = subprocess.run(_isolated(["ls", "-A", NB_INDUCTOR], probe), capture_output=True, text=True)
    return seen.returncode == 0 and seen.stdout.split() == ["marker"]


def _workspace(root: Path, vocab: int, batch: list[int], seq: list[int], isa: str) -> Path:
    ws = root / f"ws-{vocab}"
    (ws / "models").mkdir(parents=True)
    (ws / "WORKSPACE.neuronbuild").write_text("")
    shutil.copyfile(REPO / "examples/models/llama.py", ws / "models/llama.py")
    (ws / "models/BUILD").write_text(BUILD.format(vocab=vocab, batch=batch, seq=seq, isa=isa))
    return ws


def _fresh(root: Path, name: str) -> Path:
    d = root / name
    d.mkdir()
    return d


def _neuronbuild(root: Path, vocab: int, jobs: int, batch: list[int], seq: list[int], isa: str,
                 isolate: bool) -> float:
    ws = _workspace(root, vocab, batch, seq, isa)
    n = 2 * len(batch) * len(seq)
    cmd = [sys.executable, "-m", "neuronbuild", "build", "//models:llama_cpu", "--jobs", str(jobs),
           "--cache-dir", str(root / f"cache-{vocab}"), "--profile", str(root / f"profile-jobs{jobs}.json")]
    if isolate:
        cmd = _isolated(cmd, _fresh(root, f"nb-inductor-{vocab}"))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ws, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t
    if proc.returncode != 0 or f"{n} actions: {n} executed" not in proc.stdout:
        sys.exit(f"neuronbuild --jobs {jobs} failed:\n{proc.stdout}\n{proc.stderr}")
    return wall


def _busy(profile: Path) -> str:
    """Per worker track of a --profile file: seconds inside action slices, and the span of the build's actions."""
    events = json.loads(profile.read_text())["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"}
    slices = [e for e in events if e.get("ph") == "X" and e.get("cat") == "action"]
    if not slices:
        return "no action slices"
    span = (max(e["ts"] + e["dur"] for e in slices) - min(e["ts"] for e in slices)) / 1e6
    busy: dict[int, list[float]] = {}
    for e in slices:
        busy.setdefault(e["tid"], []).append(e["dur"] / 1e6)
    return ", ".join(f"{names.get(t, t)} busy {sum(d):.1f} s ({len(d)} actions)" for t, d in sorted(busy.items())) \
        + f" of a {span:.1f} s span from the first action's start to the last one's end"


def _script(root: Path, vocab: int, mode: str, batch: list[int], seq: list[int], isa: str, isolate: bool) -> float:
    ws = _workspace(root, vocab, batch, seq, isa)
    out, tmp = _fresh(root, f"script-out-{vocab}"), _fresh(root, f"script-tmp-{vocab}")
    env = dict(os.environ, TMPDIR=str(tmp), TORCHINDUCTOR_CACHE_DIR=str(tmp / "inductor"), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-c", SCRIPT.format(batch=batch, seq=seq), str(ws / "models"), str(vocab), str(out), isa,
           mode]
    if isolate:  # compile_cpu (the "steps" variant) compiles in neuronbuild's fixed inductor directory
        cmd = _isolated(cmd, _fresh(root, f"script-inductor-{vocab}"))
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    made = list(out.glob("*.pt2")) if mode == "bare" else list(out.glob("*/model.pt2"))
    if proc.returncode != 0 or len(made) != len(batch) * len(seq):
        sys.exit(f"the serial script ({mode}) failed:\n{proc.stdout}\n{proc.stderr}")
    return wall


def _warm_page_cache() -> float:
    """Untimed: import torch once and read its C++ headers, so the first timed run does not pay for a cold page cache
    (the precompiled-header build reads thousands of headers) and the runs' order does not bias the ratios."""
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, torch._inductor"], check=True)
    spec = importlib.util.find_spec("torch")
    assert spec is not None and spec.origin is not None
    include = Path(spec.origin).parent / "include"
    for f in include.rglob("*"):
        if f.is_file():
            f.read_bytes()
    return time.perf_counter() - t


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=_ints, default=[1, 4], help="batch sizes (default 1,4)")
    ap.add_argument("--seq", type=_ints, default=[32, 64, 128], help="sequence lengths (default 32,64,128)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory (profiles, outputs)")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from neuronbuild.platforms import resolve_isa

    isa = resolve_isa("native")
    root = Path(tempfile.mkdtemp(prefix="neuronbuild-bench-"))
    isolate = _can_isolate(root)
    if not isolate:
        print(f"note: cannot give neuronbuild a fresh {NB_INDUCTOR} (needs root and unshare): its side may be warm")
    base = 1000 + random.randrange(1, 50_000) * 5
    load0 = os.getloadavg()[0]
    n = len(args.batch) * len(args.seq)
    print(f"{n} buckets (batch {args.batch} x seq {args.seq}), isa {isa}; {n} traces + {n} AOTInductor compiles, cold",
          flush=True)
    print(f"warm-up (untimed for the ratios): import torch, read its headers: {_warm_page_cache():.1f} s", flush=True)
    try:
        bare = _script(root, base, "bare", args.batch, args.seq, isa, isolate)
        print(f"serial script, bare                 {bare:7.1f} s", flush=True)
        steps = _script(root, base + 1, "steps", args.batch, args.seq, isa, isolate)
        print(f"serial script + toolchain steps     {steps:7.1f} s", flush=True)
        j1 = _neuronbuild(root, base + 2, 1, args.batch, args.seq, isa, isolate)
        print(f"neuronbuild build --jobs 1          {j1:7.1f} s", flush=True)
        j2 = _neuronbuild(root, base + 3, 2, args.batch, args.seq, isa, isolate)
        print(f"neuronbuild build --jobs 2          {j2:7.1f} s", flush=True)
        busy = {jobs: _busy(root / f"profile-jobs{jobs}.json") for jobs in (1, 2)}
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(f"\n{os.cpu_count()} cores; load average {load0:.1f} before, {os.getloadavg()[0]:.1f} after; "
          f"fresh inductor dirs on both sides: {'yes' if isolate else 'NO'}")
    print("| run | wall | / bare script | / script + toolchain steps |")
    print("|---|---|---|---|")
    for name, w in (("serial script, bare", bare), ("serial script + toolchain steps", steps),
                    ("`neuronbuild build --jobs 1`", j1), ("`neuronbuild build --jobs 2`", j2)):
        print(f"| {name} | {w:.1f} s | {w / bare:.2f} | {w / steps:.2f} |")
    print("goals: --jobs 1 <= 1.0x and --jobs 2 <= 0.45x of the serial script")
    for jobs in (1, 2):
        print(f"--jobs {jobs} profile: {busy[jobs]}")
    if args.keep:
        print(f"kept {root}")


if __name__ == "__main__":
    main()
