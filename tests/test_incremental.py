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
    """(kind, label, bucket) of each executed action, from the progress lines."""
    return [(m.group(1), m.group(2), m.group(3))
            for m in re.finditer(r"^\[\d+/\d+\] (Trace|Compile) (//\S+) \[([^\]]+)\]", stderr, re.M)]


def _build(ws: Path, cache: Path, target: str = "//models:llama_trn2") -> list[tuple[str, str, str]]:
    proc = run_cli(["build", target, "--jobs", "2", "--cache-dir", str(cache)], ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return _executed(proc.stderr)


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
    assert sorted(k for k, _l, _b in ran) == ["Compile"] * 4
    assert {b for _k, _l, b in ran} == {"context: batch=1, seq=32", "context: batch=4, seq=32", "token: batch=1",
                                        "token: batch=4"}


def test_editing_model_source_reruns_all_of_that_models_actions(built_example, cache_dir: Path,  # type: ignore[no-untyped-def]
                                                                tmp_path: Path) -> None:
    ws = copy_example(tmp_path / "ws")
    # an hf_causal_lm's "source" is its config (the wrapper module ships with neuronbuild)
    _edit(ws / "models/BUILD", '"max_position_embeddings": 128', '"max_position_embeddings": 256')
    ran = _build(ws, cache_dir)
    assert sorted(k for k, _l, _b in ran) == ["Compile"] * 4 + ["Trace"] * 4
    assert {lbl for k, lbl, _b in ran if k == "Trace"} == {"//models:llama"}


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
