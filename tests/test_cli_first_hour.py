"""What a new user meets in the first hour, through the real CLI in subprocesses: help and --version, quiet broken
pipes, patterns that select nothing, near-name suggestions, flag checks before the no-op fast path, the summary after
a failure, where outputs went, exact output directories, the neuronx-cc note, validate's output, and cache accounting
of everything on disk."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, copy_example, run_cli, write_ws

NO_CC = {"NEURONX_CC": ""}
MODEL = '''
import os
import time

import torch


class M(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.emb = torch.nn.Embedding(100, n)
        self.lin = torch.nn.Linear(n, n)

    def forward(self, x):
        return self.lin(self.emb(x)).relu()


def build(config):
    gate = config.get("gate")
    while gate and os.path.exists(gate):
        time.sleep(0.05)
    return M(config["n"])


def broken(config):
    raise RuntimeError("this model is broken on purpose")
'''
LONG_DIM = "sequence_length_of_the_prompt"
TINY_BUILD = f'''
neuron_model(name = "tiny", srcs = ["m.py"], entry = "m:build", config = {{"n": 8}},
             inputs = {{"x": "int64[batch, {LONG_DIM}]"}})
neuron_buckets(name = "bk", dims = {{"batch": [1], "{LONG_DIM}": [4]}})
neuron_target(name = "trn2", platform = "trn2")
neuron_compile(name = "tiny_trn2", model = ":tiny", buckets = [":bk"], target = ":trn2", tolerance = 0.05)
'''


def _nb(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run_cli(args, cwd, {**NO_CC, **(env or {})})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, subprocess.CompletedProcess[str]]:
    """A one-graph trn2 workspace built once (a real trace + CPU-compile), its own cache, and that build's output."""
    root = tmp_path_factory.mktemp("tiny")
    ws = write_ws(root / "ws", {"m/BUILD": TINY_BUILD, "m/m.py": MODEL})
    cache = root / "cache"
    proc = _nb(["build", "--jobs", "1", "--cache-dir", str(cache)], ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return ws, cache, proc


# -- help, version, pipes --------------------------------------------------------------------------------------------
def test_bare_neuronbuild_prints_help_with_every_command(tmp_path: Path) -> None:
    proc = run_cli([], tmp_path)
    assert proc.returncode == 2
    for cmd in ("build", "plan", "explain", "query", "deploy", "verify", "validate", "cache", "clean", "completion"):
        assert re.search(rf"^\s+{cmd}\s", proc.stdout, re.M), (cmd, proc.stdout)
    assert ".neuronbuildrc" in proc.stdout and "-C DIR" in proc.stdout


def test_version_names_the_versions_builds_depend_on() -> None:
    from importlib import metadata

    from neuronbuild import __version__

    for argv in (["--version"], ["version"]):
        proc = run_cli(argv, REPO)
        assert proc.returncode == 0, proc.stderr
        first, deps = proc.stdout.splitlines()
        assert first == f"neuronbuild {__version__}"
        for dist in ("torch", "transformers", "jax"):
            assert f"{dist} {metadata.version(dist)}" in deps, (dist, deps)


def test_a_mistyped_command_choice_or_flag_gets_the_nearest_one(tmp_path: Path) -> None:
    cases = [(["buidl"], "did you mean 'build'?"), (["cache", "stast"], "did you mean 'stats'?"),
             (["build", "--executor", "dsk"], "did you mean 'dask'?"), (["build", "--jbos", "2"], "did you mean --jobs?"),
             (["build", "--batch"], "--batch is a startup option: write it before the command")]
    for argv, hint in cases:
        proc = run_cli(argv, tmp_path)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and hint in proc.stderr, (argv, proc.stderr)
    proc = run_cli(["frobnicate"], tmp_path)
    assert proc.returncode == 2 and "did you mean" not in proc.stderr


def test_a_mistyped_flag_is_refused_before_a_build_server_starts(tmp_path: Path) -> None:
    ws = write_ws(tmp_path / "ws", {"BUILD": ""})
    root = tmp_path / "servers"
    env = {"NEURONBUILD_NO_SERVER": ""}
    for argv in (["build", "--jbos", "2"], ["plan", "--batch"]):
        proc = run_cli(["--output-user-root", str(root), *argv], ws, env)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "unrecognized arguments" in proc.stderr
        assert "starting the build server" not in proc.stderr and not root.exists(), proc.stderr


def test_piping_query_to_head_exits_quietly() -> None:
    cmd = f"set -o pipefail; {sys.executable} -m neuronbuild query //... --output json | head -1"
    proc = subprocess.run(["bash", "-c", cmd], cwd=REPO / "examples", capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "[\n" and proc.stderr == ""


# -- patterns --------------------------------------------------------------------------------------------------------
def _patterns_ws(root: Path) -> Path:
    model = 'neuron_model(name = "mod", srcs = ["m.py"], entry = "m:build", inputs = {"x": "int64[batch, seq]"})\n'
    return write_ws(root, {
        "opts/BUILD": 'compiler_options(name = "base", opt_level = 2)\n',
        "empty/BUILD": "# nothing yet\n",
        "man/BUILD": model + 'neuron_buckets(name = "bk", shapes = [{"batch": 1, "seq": 4}])\n'
                             'neuron_target(name = "trn2", platform = "trn2")\n'
                             'neuron_compile(name = "c", model = ":mod", buckets = [":bk"], target = ":trn2", '
                             'tags = ["manual"])\n',
        "nobk/BUILD": model + 'neuron_target(name = "trn2", platform = "trn2")\n'
                              'neuron_compile(name = "c", model = ":mod", buckets = [], target = ":trn2")\n',
        "man/m.py": "def build(config):\n    pass\n", "nobk/m.py": "def build(config):\n    pass\n",
    })


@pytest.mark.parametrize("pattern,warning", [
    ("//opts:all", "pattern '//opts:all' selects nothing buildable (only compiler_options"),
    ("//man/...", "pattern '//man/...' builds nothing: its buildable targets are all tagged manual"),
    ("//nobk:c", "//nobk:c has no buckets (buckets = []): it builds nothing"),
])
def test_patterns_that_select_nothing_buildable_warn(tmp_path: Path, pattern: str, warning: str) -> None:
    ws = _patterns_ws(tmp_path / "ws")
    for attempt in range(2):  # the second run is a would-be no-op: it must warn again
        proc = _nb(["build", pattern, "--cache-dir", str(tmp_path / "cache")], ws)
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr.count(warning) == 1, (attempt, proc.stderr)
        assert "0 actions" in proc.stdout


def test_a_pattern_matching_no_target_fails(tmp_path: Path) -> None:
    ws = _patterns_ws(tmp_path / "ws")
    proc = _nb(["build", "//empty:all", "--cache-dir", str(tmp_path / "cache")], ws)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "error: pattern '//empty:all' matches no targets (its BUILD files declare none)\n"


def test_a_misspelt_target_or_package_gets_the_nearest_names() -> None:
    ex = REPO / "examples"
    proc = run_cli(["build", "//models:lama_trn2"], ex)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "no such target '//models:lama_trn2'" in proc.stderr and "did you mean //models:llama_trn2" in proc.stderr
    proc = run_cli(["plan", "//modles/..."], ex)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "did you mean //models/..." in proc.stderr


def test_set_operator_without_spaces_gets_a_hint() -> None:
    proc = run_cli(["query", "kind(neuron_compile, //...)-//models:llama_cpu"], REPO / "examples")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "set operators need spaces around them: '... - //models:llama_cpu'" in proc.stderr


# -- flags, summary, outputs -----------------------------------------------------------------------------------------
def test_flags_are_checked_before_the_no_op_fast_path(tiny) -> None:  # type: ignore[no-untyped-def]
    ws, cache, _ = tiny
    again = _nb(["build", "--cache-dir", str(cache)], ws)
    assert again.returncode == 0 and "0 executed" in again.stdout
    for bad in (["--local-ram", "lots"], ["--neuronx-cc-timeout", "0"], ["--action-env", "1BAD"], ["--jobs", "0"]):
        proc = _nb(["build", "--cache-dir", str(cache), *bad], ws)
        assert proc.returncode == 2, (bad, proc.stdout, proc.stderr)
        assert proc.stdout == "" and proc.stderr.count("\n") == 1 and "error:" in proc.stderr, (bad, proc.stderr)


def test_the_summary_accounts_for_every_action_after_a_failure(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    gate.write_text("")  # the `slow` trace waits while this exists: it is certainly running when `bad` fails
    models = {"bad": ("broken", {"n": 8}), "slow": ("build", {"n": 8, "gate": str(gate)}),
              "ok": ("build", {"n": 8})}
    lines = ['neuron_buckets(name = "bk", shapes = [{"batch": 1, "seq": 4}])',
             'neuron_target(name = "trn2", platform = "trn2")']
    for name, (entry, config) in models.items():
        lines.append(f'neuron_model(name = "{name}", srcs = ["m.py"], entry = "m:{entry}", '
                     f'config = {json.dumps(config)}, inputs = {{"x": "int64[batch, seq]"}})')
        lines.append(f'neuron_compile(name = "{name}_trn2", model = ":{name}", buckets = [":bk"], target = ":trn2")')
    ws = write_ws(tmp_path / "ws", {"pkg/BUILD": "\n".join(lines) + "\n", "pkg/m.py": MODEL})
    events = tmp_path / "events.jsonl"
    proc = _nb(["build", "--jobs", "3", "--cache-dir", str(tmp_path / "cache"), "--build-event-json-file",
                str(events)], ws)
    assert proc.returncode == 1
    summary = proc.stdout.splitlines()[0]
    m = re.match(r"(\d+) actions: (\d+) executed, (\d+) cached \([\d.]+ s\), (.*)$", summary)
    assert m is not None, summary
    counts = {"executed": int(m.group(2)), "cached": int(m.group(3))}
    for part in m.group(4).split(", "):
        n, what = part.split(" ", 1)
        counts[what.split(" (")[0]] = int(n)
    total = int(m.group(1))  # per model: weights, trace, lowering, compile
    assert total == 12 and sum(counts.values()) == total, (summary, counts)
    # bad's factory fails in its weights action and its trace, whichever ends first stops the build: the compile (and
    # after a failed trace, the lowering) did not run because an input failed.
    assert counts["failed"] == 1 and counts["not run"] in (1, 2), (summary, counts)
    assert counts["stopped"] >= 1  # slow's trace (and ok's, if it had not finished): stopped, not "an input failed"
    assert "--keep-going" in summary
    finished = [json.loads(ln) for ln in events.read_text().splitlines() if '"build_finished"' in ln][-1]
    assert finished["executed"] + finished["cached"] + finished["failed"] + finished["skipped"] + \
        finished["stopped"] + finished["not_started"] == total
    assert re.search(r"FAILED (Trace|Weights) //pkg:bad", proc.stderr), proc.stderr


def test_the_summary_says_where_outputs_went(built_example) -> None:  # type: ignore[no-untyped-def]
    ws, proc = built_example
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("Outputs in "))
    assert line.startswith(f"Outputs in {ws / 'neuronbuild-out'}: ")
    assert "models/llama_cpu/" in line


def test_a_target_dir_holds_exactly_its_current_outputs(built_example, cache_dir: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ws = copy_example(tmp_path / "ws")
    first = run_cli(["build", "//models:llama_cpu", "--cache-dir", str(cache_dir)], ws)
    assert first.returncode == 0, first.stderr
    out = ws / "neuronbuild-out/models/llama_cpu"
    graphs = {"context_batch1_seq32", "context_batch4_seq32", "token_batch1", "token_batch4"}
    assert {p.name for p in out.iterdir()} == {"manifest.json"} | graphs
    (out / "token_batch1" / "model.neff").write_bytes(b"an old NEFF")  # e.g. from when neuronx-cc was configured
    (out / "batch8_seq64").mkdir()
    (out / "batch8_seq64" / "model.pt2").write_bytes(b"a removed bucket")
    build = ws / "models/BUILD"
    old = 'buckets = {"context": [":serve_context"], "token": [":serve_token"]},\n    target = ":cpu"'
    assert old in build.read_text()
    build.write_text(build.read_text().replace(old, old.replace('":serve_token"', '":tok1"'))
                     + '\nneuron_buckets(name = "tok1", shapes = [{"batch": 1}])\n')
    proc = run_cli(["build", "//models:llama_cpu", "--cache-dir", str(cache_dir)], ws)
    assert proc.returncode == 0 and "0 executed" in proc.stdout, proc.stdout + proc.stderr
    assert {p.name for p in out.iterdir()} == {"manifest.json"} | graphs - {"token_batch4"}
    assert {p.name for p in (out / "token_batch1").iterdir()} == {"model.pt2", "constants.safetensors",
                                                                  "program_constants.safetensors"}
    manifest = json.loads((out / "manifest.json").read_text())
    assert [b["name"] for b in manifest["buckets"]] == ["context_batch1_seq32", "context_batch4_seq32", "token_batch1"]


# -- neuronx-cc note, validate ---------------------------------------------------------------------------------------
NOTE = "NEFFs were not produced"


def test_the_neuronx_cc_note_comes_once_from_a_build_that_made_neuron_graphs(tiny) -> None:  # type: ignore[no-untyped-def]
    ws, cache, first = tiny
    assert "4 executed" in first.stdout and first.stderr.count(NOTE) == 1  # weights, trace, lowering, compile
    for args in (["build"], ["build", "--verbose"], ["plan"], ["explain"], ["build", "--dry-run"]):
        proc = _nb([*args, "--cache-dir", str(cache)], ws)
        assert proc.returncode == 0 and NOTE not in proc.stderr, (args, proc.stderr)


def test_validate_shows_progress_and_its_columns_fit_long_bucket_names(tiny) -> None:  # type: ignore[no-untyped-def]
    ws, cache, _ = tiny
    proc = _nb(["validate", "--cache-dir", str(cache)], ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr.startswith("validating 1 graph(s) of 1 target(s)")
    header, row = proc.stdout.splitlines()[:2]
    bucket = f"batch1_{LONG_DIM}4"
    assert bucket in row
    for col, value in (("bucket", bucket), ("platform", "trn2*")):
        assert header.index(col) == row.index(value), (header, row)
    assert header.index("result") == row.index("ok")
    assert len(row.split()) == 7  # every column stays separate


# -- cache accounting ------------------------------------------------------------------------------------------------
def _on_disk(d: Path) -> int:
    return sum(os.lstat(os.path.join(p, n)).st_blocks * 512 for p, ds, fs in os.walk(d) for n in ds + fs)


def test_cache_stats_and_gc_cover_the_compiler_scratch_dir(tiny, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ws, cache0, _ = tiny
    cache = tmp_path / "cache"
    shutil.copytree(cache0, cache, symlinks=True)
    scratch = cache / "v1" / "toolchain-tmp" / "torchinductor_user" / "ab"
    scratch.mkdir(parents=True, exist_ok=True)
    big = scratch / "precompiled.h.gch"
    big.write_bytes(os.urandom(8 << 20))
    old = time.time() - 7200
    os.utime(big, (old, old))
    stats = _nb(["cache", "stats", "--cache-dir", str(cache)], ws)
    assert stats.returncode == 0, stats.stderr
    m = re.search(r"on disk ([\d.]+) MiB in all .*compiler scratch \(toolchain-tmp\) ([\d.]+) MiB", stats.stdout)
    assert m is not None, stats.stdout
    assert abs(float(m.group(1)) * (1 << 20) - _on_disk(cache)) < (1 << 20)  # what du would say
    assert float(m.group(2)) >= 8.0
    cap = 2 << 20
    gc = _nb(["cache", "gc", "--max-size", "2M", "--cache-dir", str(cache)], ws,
             {"NEURONBUILD_CACHE_GC_GRACE_S": "600"})
    assert gc.returncode == 0 and "of it compiler scratch" in gc.stdout, gc.stdout
    assert not big.exists() and _on_disk(cache) <= cap
    again = _nb(["build", "--cache-dir", str(cache)], ws)  # the workspace's entries were kept
    assert again.returncode == 0 and "0 executed" in again.stdout


# -- the README's claims ---------------------------------------------------------------------------------------------
def _plan_counts(args: list[str], ws: Path, cache: Path) -> tuple[int, int, int]:
    proc = _nb(["plan", *args, "--cache-dir", str(cache)], ws)
    assert proc.returncode == 0, proc.stderr
    assert "warning" not in proc.stderr, proc.stderr  # the shipped example and an init workspace warn of nothing
    m = re.search(r"^(\d+) actions: (\d+) to execute, (\d+) cached", proc.stdout, re.M)
    assert m, proc.stdout
    return int(m[1]), int(m[2]), int(m[3])


def test_the_readme_quick_start_counts_are_what_plan_says(tmp_path: Path) -> None:
    readme = (REPO / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("## Concepts", 1)[0]
    said = [tuple(int(n) for n in m) for m in re.findall(r"(\d+) actions: (\d+) executed, (\d+) cached", quick)]
    assert len(said) == 3, said  # llama_cpu, llama_cpu again, llama_trn2
    ws, cache = copy_example(tmp_path / "ws"), tmp_path / "cache"
    cpu, _, _ = _plan_counts(["//models:llama_cpu"], ws, cache)
    trn2, _, _ = _plan_counts(["//models:llama_trn2"], ws, cache)
    both, _, _ = _plan_counts(["//models:llama_cpu", "//models:llama_trn2"], ws, cache)
    new_for_trn2 = both - cpu  # what llama_trn2 executes after llama_cpu was built
    assert said == [(cpu, cpu, 0), (cpu, 0, cpu), (trn2, new_for_trn2, trn2 - new_for_trn2)], quick
    init_said = re.search(r"neuronbuild build\s+# (\d+) actions; outputs", quick)
    assert init_said, quick
    proc = _nb(["init", "new"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert _plan_counts([], tmp_path / "new", cache)[0] == int(init_said[1])
