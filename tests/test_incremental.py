"""Incremental rebuilds: an edit re-runs exactly the actions whose inputs it changed."""

from __future__ import annotations

import re
from pathlib import Path

from helpers import copy_example, run_cli


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
    _edit(ws / "models/BUILD", '"seq": [128, 512]', '"seq": [128, 256]')
    ran = _build(ws, cache_dir)
    assert sorted(ran) == sorted([
        ("Trace", "//models:llama", "batch=1, seq=256"), ("Trace", "//models:llama", "batch=4, seq=256"),
        ("Compile", "//models:llama_trn2", "batch=1, seq=256"), ("Compile", "//models:llama_trn2", "batch=4, seq=256"),
    ])


def test_editing_only_options_recompiles_without_retracing(built_example, cache_dir: Path,  # type: ignore[no-untyped-def]
                                                           tmp_path: Path) -> None:
    ws = copy_example(tmp_path / "ws")
    _edit(ws / "models/BUILD", 'name = "base", opt_level = 2', 'name = "base", opt_level = 3')  # overridden by :fast
    assert _build(ws, cache_dir) == []  # the effective options did not change
    _edit(ws / "models/BUILD", 'model_type = "transformer"', 'model_type = "generic"')
    ran = _build(ws, cache_dir)
    assert sorted(k for k, _l, _b in ran) == ["Compile"] * 5
    assert {b for _k, _l, b in ran} == {"batch=1, seq=128", "batch=1, seq=512", "batch=4, seq=128",
                                        "batch=4, seq=512", "batch=4, seq=1"}


def test_editing_model_source_reruns_all_of_that_models_actions(built_example, cache_dir: Path,  # type: ignore[no-untyped-def]
                                                                tmp_path: Path) -> None:
    ws = copy_example(tmp_path / "ws")
    (ws / "models/llama.py").write_text((ws / "models/llama.py").read_text() + "\n# an edit\n")
    ran = _build(ws, cache_dir)
    assert sorted(k for k, _l, _b in ran) == ["Compile"] * 5 + ["Trace"] * 5
    assert {lbl for k, lbl, _b in ran if k == "Trace"} == {"//models:llama"}
