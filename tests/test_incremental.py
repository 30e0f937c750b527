"""Incremental rebuilds: an edit re-runs exactly the actions whose inputs it changed."""

from __future__ import annotations

import marshal
import re
import sys
from pathlib import Path

from helpers import REPO, copy_example, run_cli

sys.path.insert(0, str(REPO / "benchmarks"))
import gen_monorepo  # noqa: E402


def _executed(stderr: str) -> list[tuple[str, str, str]]:
    """(kind, label, bucket) of each action that ran (Trace, Lower, Compile, ...), from the progress lines: every
    `[done/total] Kind //label [bucket]` line, whether the action executed or early cutoff reused its result."""
    return [(m.group(1), m.group(2), m.group(3) or "")  # a weights action is the model's: no bucket
            for m in re.finditer(r"^\[\d+/\d+\] (\w+) (//\S+)(?: \[([^\]]+)\])?", stderr, re.M)]


def _build(ws: Path, cache: Path, *targets: str) -> list[tuple[str, str, str]]:
    proc = run_cli(["build", *(targets or ["//models:llama_trn2"]), "--jobs", "2", "--cache-dir", str(cache)], ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ran = _executed(proc.stderr)
    assert re.search(rf"\b{len(ran)} executed\b", proc.stdout + proc.stderr), proc.stdout + proc.stderr  # all parsed
    return ran


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


def test_editing_one_bucket_list_reruns_only_that_buckets_actions(built_example, cache_dir: Path,  # type: ignore[no-untyped-def]
                                                                  tmp_path: Path) -> None:
    ws = copy_example(tmp_path / "ws")
    _edit(ws / "models/BUILD", "context_lengths = [32]", "context_lengths = [16]")  # the context buckets only
    ran = _build(ws, cache_dir)
    assert sorted(ran) == sorted([
        ("Trace", "//models:llama", "context: batch=1, seq=16"), ("Trace", "//models:llama", "context: batch=4, seq=16"),
        ("Lower", "//models:llama", "context: batch=1, seq=16"), ("Lower", "//models:llama", "context: batch=4, seq=16"),
        ("Compile", "//models:llama_trn2", "context: batch=1, seq=16"),
        ("Compile", "//models:llama_trn2", "context: batch=4, seq=16"),
    ])


def test_editing_only_options_recompiles_without_retracing(built_example, cache_dir: Path,  # type: ignore[no-untyped-def]
                                                           tmp_path: Path) -> None:
    ws = copy_example(tmp_path / "ws")
    # overridden by :context_opts and :token_opts
    _edit(ws / "models/BUILD", 'name = "base", model_type = "transformer"',
          'name = "base", model_type = "transformer", opt_level = 3')
    assert _build(ws, cache_dir) == []  # the effective options did not change
    _edit(ws / "models/BUILD", 'model_type = "transformer"', 'model_type = "generic"')
    ran = _build(ws, cache_dir)
    assert sorted(k for k, _l, _b in ran) == ["Compile"] * 4  # no Trace, no Lower (model_type is not a lowering option)
    assert {b for _k, _l, b in ran} == {"context: batch=1, seq=32", "context: batch=4, seq=32", "token: batch=1",
                                        "token: batch=4"}


def test_editing_model_source_reruns_all_of_that_models_actions(built_example, cache_dir: Path,  # type: ignore[no-untyped-def]
                                                                tmp_path: Path) -> None:
    ws = copy_example(tmp_path / "ws")
    # models/llama.py is //models:llama_tiny's source (tools/defs.bzl); //models:llama (an hf_causal_lm: no sources,
    # its wrapper ships with neuronbuild) does not read it. A changed constant: a new graph, so the compile reruns
    # too (a comment would be cut off after the trace: same program).
    _edit(ws / "models/llama.py", "eps: float = 1e-5", "eps: float = 1e-6")
    ran = _build(ws, cache_dir, "//models:llama_tiny_cpu", "//models:llama_trn2")
    assert sorted(ran) == [("Compile", "//models:llama_tiny_cpu", "batch=4, seq=1"),
                           ("Trace", "//models:llama_tiny", "batch=4, seq=1"),
                           ("Weights", "//models:llama_tiny", "")]  # the module's state is its source's too


def test_a_plan_leaves_the_model_sources_digests_for_the_next_process(tmp_path: Path) -> None:
    """An unchanged source is never read again by a new process: its digest (made when analysis reads the model,
    after loading) is in the on-disk digest cache when a batch command ends."""
    ws, cache = tmp_path / "ws", tmp_path / "cache"
    gen_monorepo.generate(ws, 2, 1, 2)  # one package: its model.py is read by analysis only
    proc = run_cli(["plan", "//...", "--cache-dir", str(cache)], ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (state,) = (cache / "v1" / "state").glob("digests-*.marshal")
    entries = marshal.loads(state.read_bytes())["entries"]
    source = str((ws / gen_monorepo.package_name(0) / "model.py").resolve())
    assert source in entries and str((ws / gen_monorepo.package_name(0) / "BUILD").resolve()) in entries
