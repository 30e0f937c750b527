"""The cpu toolchain's per-machine warm-up (inductor's precompiled headers), with real torch compiles: built once in
the pool's zygote beside the traces and reused by the compiles of that build and of later builds; concurrent warm-ups build
each header once; headers are keyed by ISA; inductor's working files stay under the cache's per-user scratch dir."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import REPO, run_cli, write_ws

MODEL = '''
import torch


class M(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.emb = torch.nn.Embedding(50, n)
        self.lin = torch.nn.Linear(n, n)

    def forward(self, x):
        return self.lin(self.emb(x)).relu()


def build(config):
    return M(config["n"])
'''

BUILD = '''
neuron_model(name = "m", srcs = ["m.py"], entry = "m:build", config = {{"n": {n}}}, inputs = {{"x": "int64[batch, seq]"}})
neuron_buckets(name = "b", dims = {{"batch": [1], "seq": [4, 8]}})
neuron_target(name = "cpu", platform = "cpu", isa = "native")
neuron_compile(name = "m_cpu", model = ":m", buckets = [":b"], target = ":cpu")
'''


def _ws(root: Path, n: int) -> Path:
    return write_ws(root, {"pkg/m.py": MODEL, "pkg/BUILD": BUILD.format(n=n)})


def _events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _headers(cache: Path) -> dict[str, tuple[int, int]]:
    """Every precompiled header in the cache's header dir (beside its scratch dir): name -> (inode, mtime_ns)."""
    found = (cache / "v1" / "toolchain-headers").glob("**/*.gch")
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in found}


@pytest.fixture(scope="module")
def built_j2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, subprocess.CompletedProcess[str], Path]:
    """One cold `--jobs 2` build (shared by the tests below): its workspace, cache, process and directory (events1.jsonl,
    p1.json)."""
    tmp_path = tmp_path_factory.mktemp("warm-j2")
    cache = tmp_path / "cache"
    ws = _ws(tmp_path / "ws1", 16)
    proc = run_cli(["build", "//pkg:m_cpu", "--jobs", "2", "--cache-dir", str(cache), "--build-event-json-file",
                    str(tmp_path / "events1.jsonl"), "--profile", str(tmp_path / "p1.json"), "--verbose"], ws)
    return ws, cache, proc, tmp_path


def test_one_worker_warms_the_headers_beside_the_traces_and_every_compile_reuses_them(
        built_j2: tuple[Path, Path, subprocess.CompletedProcess[str], Path], tmp_path: Path) -> None:
    _ws1, cache, proc, first = built_j2
    ev_file = first / "events1.jsonl"
    assert proc.returncode == 0, proc.stdout + proc.stderr
    events = _events(ev_file)
    (started,) = [e for e in events if e["event"] == "warm_up_started"]
    (warm,) = [e for e in events if e["event"] == "warm_up_finished"]
    assert warm["ok"] and warm["toolchain"] == "aoti" and warm["metadata"]["built"] == 2, warm
    assert "WARM-UP: Warm up aoti for cpu/" in proc.stderr + proc.stdout
    # It ran beside the traces: a trace started on another worker before the warm-up ended, and the warm-up was
    # sent before any compile.
    starts = [e for e in events if e["event"] == "action_started"]
    assert any(e["kind"] == "trace" and e["worker"] != warm["worker"] and e["time"] < warm["time"] for e in starts)
    assert all(started["time"] <= e["time"] for e in starts if e["kind"] == "compile")
    # Exactly the warmed headers exist, untouched since the warm-up ended: no compile built one of its own.
    headers = _headers(cache)
    assert sorted(headers) == sorted(h + ".gch" for h in warm["metadata"]["headers"])
    assert all(mtime <= warm["time"] * 1e9 for _ino, mtime in headers.values())
    assert sum(1 for e in events if e["event"] == "action_finished" and e["kind"] == "compile") == 2
    other = json.loads((first / "p1.json").read_text())["otherData"]
    assert 0.0 < float(other["utilisation"]) <= 1.0 and float(other["warm_up_s"]) > 0.0
    # CPU seconds: the warm-up's include its compilers (building the headers is seconds of g++), and the profile's
    # total is every action's and warm-up's.
    assert warm["cpu_s"] > 1.0, warm
    done = [e for e in events if e["event"] == "action_finished"]
    assert abs(float(other["cpu_s"]) - warm["cpu_s"] - sum(e["cpu_s"] for e in done)) < 0.01, (other, done)
    # Inductor's working files were each compile's (and the warm-up's) own, and are gone: none is left in the
    # scratch dir every action may write (a later compile would build a source a model changed there).
    left = [p for p in (cache / "v1").rglob("*") if p.name.endswith((".cpp", ".wrapper.so"))]
    assert left == [], left

    # A later build (other graphs) with the same cache: the warm-up finds them, and nothing rebuilds them.
    ev_file2 = tmp_path / "events2.jsonl"
    proc = run_cli(["build", "//pkg:m_cpu", "--jobs", "2", "--cache-dir", str(cache), "--build-event-json-file",
                    str(ev_file2)], _ws(tmp_path / "ws2", 24))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (warm2,) = [e for e in _events(ev_file2) if e["event"] == "warm_up_finished"]
    assert warm2["ok"] and warm2["metadata"]["built"] == 0 and warm2["metadata"]["headers"] == \
        warm["metadata"]["headers"]
    assert _headers(cache) == headers


def _packages(ws: Path) -> dict[str, bytes]:
    out = ws / "neuronbuild-out"
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_one_worker_warms_with_every_core_and_builds_the_same_bytes_as_one_core_per_worker(
        built_j2: tuple[Path, Path, subprocess.CompletedProcess[str], Path], tmp_path: Path) -> None:
    """--jobs 1 on a multi-core machine: the headers are warmed in the pool's zygote beside the one worker (which
    traces meanwhile), with the headers' compiles running at once, and every compile runs in a worker forked from the
    zygote afterwards (no worker warms up itself) and uses those headers; the packages are byte-identical to a
    --jobs 2 build (one core per worker, everything one at a time) in another cache."""
    from neuronbuild.platforms import host_cores

    ws, _cache, proc, _dir = built_j2  # the --jobs 2 build, one core per worker on this 2-core machine
    assert proc.returncode == 0, proc.stdout + proc.stderr
    two = _packages(ws)
    cache = tmp_path / "c1"
    ev_file = tmp_path / "events.jsonl"
    proc = run_cli(["build", "//pkg:m_cpu", "--jobs", "1", "--cache-dir", str(cache), "--build-event-json-file",
                    str(ev_file)], ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _packages(ws) == two and any(k.endswith("model.pt2") for k in two)
    events = _events(ev_file)
    (warm,) = [e for e in events if e["event"] == "warm_up_finished"]
    assert warm["worker"] == "zygote" and warm["ok"], warm
    meta = warm["metadata"]
    assert meta["built"] == 2 and meta["jobs"] == min(2, host_cores())
    starts = [e for e in events if e["event"] == "action_started"]
    assert any(e["kind"] == "trace" and e["time"] < warm["time"] for e in starts)  # beside the traces
    assert all(e["time"] >= warm["time"] for e in starts if e["kind"] == "compile")
    log_files = sorted((cache / "v1" / "logs").glob("*/*.log"))
    assert not [f for f in log_files if "# warm-up in the worker process" in f.read_text()]
    # The compiles found exactly those headers: none built one of its own (a header made with other flags, e.g. a
    # pool thread that missed inductor's config, would have a name of its own).
    assert sorted(_headers(cache)) == sorted(h + ".gch" for h in meta["headers"])


WARM = '''
import json, sys
from torch._inductor import cpp_builder
built = []
build = cpp_builder.CppBuilder.build
def counting(self):
    if self._precompiling:
        built.append(self.get_target_file_path())
    return build(self)
cpp_builder.CppBuilder.build = counting
sys.path.insert(0, sys.argv[1])
from neuronbuild.toolchains.cpu import warm_up
meta = warm_up({"isa": sys.argv[2]})
print(json.dumps({"built_here": len(built), **meta}))
'''


def _warm(tmp: Path, isa: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHINDUCTOR_")}
    env.update(TMPDIR=str(tmp), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-c", WARM, str(REPO), isa], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_concurrent_warm_ups_build_each_header_once_and_headers_are_keyed_by_isa(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    procs = [_warm(tmp, "x86-64-v3"), _warm(tmp, "x86-64-v3")]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=900)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sum(r["built_here"] for r in results) == 2  # two headers, built by one process or the other, once each
    assert results[0]["headers"] == results[1]["headers"]
    v3 = set(results[0]["headers"])
    # Another ISA gets headers of its own (its -march and ISA macros are in their names), never v3's.
    p = _warm(tmp, "x86-64-v2")
    out, err = p.communicate(timeout=900)
    assert p.returncode == 0, err
    v2 = json.loads(out.strip().splitlines()[-1])
    assert v2["built_here"] == 2 and not (set(v2["headers"]) & v3)


def test_on_dask_each_worker_warms_its_zygote_and_the_headers_are_built_once_per_host(tmp_path: Path) -> None:
    """dask-local: 2 LocalCluster workers on 127.0.0.1, one host: a warm-up per Dask worker, each in that worker's
    zygote; the headers are built once on the host (inductor's file lock: the second warm-up finds the first's) and
    both workers' compiles reuse them (in the toolchain scratch dir dask-local gives its workers: the cache's)."""
    cache = tmp_path / "cache"
    ev_file = tmp_path / "events.jsonl"
    proc = run_cli(["build", "//pkg:m_cpu", "--executor", "dask-local", "--jobs", "2", "--cache-dir", str(cache),
                    "--build-event-json-file", str(ev_file)], _ws(tmp_path / "ws", 16))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    events = _events(ev_file)
    warm = [e for e in events if e["event"] == "warm_up_finished"]
    workers = {e["worker"].split(" ")[0] for e in events if e["event"] == "action_finished"}
    assert len(warm) == 2 and {e["host"] for e in warm} == workers and len(workers) == 2, warm
    assert all(e["ok"] and e["worker"].startswith(f"zygote@{e['host']} ") for e in warm), warm
    headers = _headers(cache)
    assert all(sorted(headers) == sorted(h + ".gch" for h in e["metadata"]["headers"]) for e in warm)
    assert all(mtime <= min(e["time"] for e in warm) * 1e9 for _ino, mtime in headers.values())


def test_an_object_compiled_in_the_background_that_fails_fails_the_compile_with_the_compilers_message(
        tmp_path: Path) -> None:
    """With a thread budget of 2, the wrapper and kernel objects compile at once; a C++ error in either still reaches
    the compile (inductor's CppCompileError, with g++'s output) before the link runs, and nothing is left running."""
    code = r'''
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from torch._inductor.exc import CppCompileError
from neuronbuild.toolchains.compile import _ObjectCompiles
tmp = Path(sys.argv[2])
(tmp / "a.wrapper.cpp").write_text("int ok() { return 1; }\n")
(tmp / "b.kernel.cpp").write_text("int broken() { return undeclared_name; }\n")
(tmp / "build").mkdir()
objects = _ObjectCompiles(2)
for name in ("a.wrapper", "b.kernel"):
    line = f"g++ -c {tmp}/{name}.cpp -o {tmp}/{name}.o"
    assert objects.defer(line)
    objects.start(line, str(tmp / "build"))
assert not objects.defer(f"g++ {tmp}/a.wrapper.o -shared -o {tmp}/m.so")  # a link runs in the foreground
try:
    objects.drain()
except CppCompileError as e:
    print("ERROR", "undeclared_name" in str(e), (tmp / "a.wrapper.o").is_file(), len(objects.pending))
'''
    proc = subprocess.run([sys.executable, "-c", code, str(REPO), str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "ERROR True True 0" in proc.stdout, proc.stdout + proc.stderr
