"""`explain` names exactly the changed field for exactly the affected actions; `plan`/`build --dry-run` match a build."""

from __future__ import annotations

import re
import shutil
from importlib import metadata
from pathlib import Path

import pytest
from helpers import run_cli
from introspect_ws import (
    cli_json,
    copy_ws,
    edit,
    tiny_built_fixture,  # noqa: F401  (registers the session fixture `tiny_built`)
)


def _explain(ws: Path, cache: Path, *extra: str) -> dict[str, list[str]]:
    """description -> change texts, for every action explain says would execute."""
    out = cli_json(["explain", "--cache-dir", str(cache), *extra], ws)
    return {a["description"]: [c["text"] for c in a["changes"]] for a in out["execute"]}


def test_nothing_to_explain_after_a_build(tiny_built: tuple[Path, Path]) -> None:
    ws, cache = tiny_built
    assert _explain(ws, cache) == {}
    proc = run_cli(["explain", "--cache-dir", str(cache)], ws)
    assert "nothing would execute: all 7 actions are cached" in proc.stdout


def test_opt_level_edit_names_the_option_on_the_compiles_only(tiny_built: tuple[Path, Path], tmp_path: Path) -> None:
    ws, cache = tiny_built
    ws = copy_ws(ws, tmp_path / "ws")
    edit(ws / "m/BUILD", "opt_level = 2", "opt_level = 3")
    assert _explain(ws, cache) == {
        "Compile //m:tiny_trn2 [batch=1, seq=8] for trn2": ["options.opt_level: 2 -> 3"],
        "Compile //m:tiny_trn2 [batch=1, seq=16] for trn2": ["options.opt_level: 2 -> 3"],
    }
    text = run_cli(["explain", "--cache-dir", str(cache)], ws).stdout
    assert "  options.opt_level: 2 -> 3" in text and "2 of 7 actions would execute (5 cached)" in text


def test_bucket_edit_names_the_bucket_on_that_buckets_actions(tiny_built: tuple[Path, Path], tmp_path: Path) -> None:
    ws, cache = tiny_built
    ws = copy_ws(ws, tmp_path / "ws")
    edit(ws / "m/BUILD", '"seq": [8, 16]', '"seq": [8, 32]')
    assert _explain(ws, cache) == {
        "Trace //m:tiny [batch=1, seq=32]": ["bucket: seq 16 -> 32"],
        "Lower //m:tiny [batch=1, seq=32]": ["bucket: seq 16 -> 32"],
        "Compile //m:tiny_trn2 [batch=1, seq=32] for trn2": ["bucket: seq 16 -> 32"],
    }
    out = cli_json(["explain", "--cache-dir", str(cache)], ws)
    assert {a["compared_bucket"] for a in out["execute"]} == {"batch=1, seq=16"}


def test_model_source_edit_names_the_file_on_every_action_of_the_model(tiny_built: tuple[Path, Path],
                                                                       tmp_path: Path) -> None:
    ws, cache = tiny_built
    ws = copy_ws(ws, tmp_path / "ws")
    (ws / "m/llama.py").write_text((ws / "m/llama.py").read_text() + "\n# an edit\n")
    got = _explain(ws, cache)
    assert sorted(got) == sorted([
        "Weights //m:tiny", "Trace //m:tiny [batch=1, seq=8]", "Trace //m:tiny [batch=1, seq=16]",
        "Lower //m:tiny [batch=1, seq=8]", "Lower //m:tiny [batch=1, seq=16]",
        "Compile //m:tiny_trn2 [batch=1, seq=8] for trn2", "Compile //m:tiny_trn2 [batch=1, seq=16] for trn2",
    ])
    assert set(map(tuple, got.values())) == {("src m/llama.py: changed",)}


def test_torch_version_change_names_the_toolchain_on_every_action(tiny_built: tuple[Path, Path]) -> None:
    ws, cache = tiny_built
    torch_version = metadata.version("torch")
    got = _explain(ws, cache, "--toolchain", "torch=2.14.1")
    assert len(got) == 7  # the weights action too: it builds the module with torch
    assert set(map(tuple, got.values())) == {(f"toolchain torch: {torch_version} -> 2.14.1",)}


def test_new_target_has_no_previous_result(tiny_built: tuple[Path, Path], tmp_path: Path) -> None:
    ws, cache = tiny_built
    ws = copy_ws(ws, tmp_path / "ws")
    with open(ws / "m/BUILD", "a") as f:
        f.write('neuron_target(name = "inf2", platform = "inf2")\n'
                'neuron_compile(name = "tiny_inf2", model = ":tiny", buckets = [":b"], target = ":inf2")\n')
    out = cli_json(["explain", "--cache-dir", str(cache)], ws)
    assert {(a["description"], a["reason"]) for a in out["execute"]} == {
        ("Compile //m:tiny_inf2 [batch=1, seq=8] for inf2", "new"),
        ("Compile //m:tiny_inf2 [batch=1, seq=16] for inf2", "new"),
    }


def test_dry_run_matches_the_following_build(tiny_built: tuple[Path, Path], tmp_path: Path) -> None:
    ws, cache0 = tiny_built
    cache = tmp_path / "cache"
    shutil.copytree(cache0, cache)  # builds below must not change the shared fixture's history
    ws = copy_ws(ws, tmp_path / "ws")
    edit(ws / "m/BUILD", '"seq": [8, 16]', '"seq": [8, 32]')
    edit(ws / "m/BUILD", "opt_level = 2", "opt_level = 1")
    planned = cli_json(["plan", "--cache-dir", str(cache)], ws)
    dry = run_cli(["build", "--dry-run", "--cache-dir", str(cache)], ws)
    assert dry.returncode == 0
    text = run_cli(["plan", "--cache-dir", str(cache)], ws).stdout
    assert dry.stdout == text
    assert "7 actions: 4 to execute, 3 cached" in text  # seq=32: trace, lower, compile; seq=8: the compile only
    # the limits every executed action gets, and how to change them (#49)
    assert re.search(r"limits per executed action .*at most \d+ processes and threads, memory 3x .*--action-timeout",
                     text), text
    assert re.search(r"batch=1, seq=32\s+build\s+build\s+\d+\.\d s", text)  # estimated from the fixture's durations
    assert re.search(r"batch=1, seq=8\s+cached\s+build", text)
    assert cli_json(["plan", "--cache-dir", str(cache)], ws) == planned  # the dry run ran and stored nothing
    proc = run_cli(["build", "--jobs", "2", "--cache-dir", str(cache)], ws)
    assert proc.returncode == 0, proc.stderr
    ran = re.findall(r"^\[\d+/\d+\] (.*?)(?: \(\d+\.\d s\)|: skipped \(no neuronx-cc\))$", proc.stderr, re.M)
    assert sorted(ran) == sorted(a["description"] for a in planned["execute"])
    assert f"{planned['total']} actions: {len(planned['execute'])} executed, {len(planned['cached'])} cached" \
        in proc.stdout
    assert planned["estimate"]["unknown"] == 0 and planned["estimate"]["serial_s"] > 0
    assert _explain(ws, cache) == {}


def test_upgrade_impact_reports_invalidated_fingerprints_and_time(tiny_built: tuple[Path, Path]) -> None:
    ws, cache = tiny_built
    out = cli_json(["upgrade-impact", "--toolchain", "torch=2.14.1", "--cache-dir", str(cache)], ws)
    (target,) = out["targets"]
    assert target["label"] == "//m:tiny_trn2" and target["actions"] == 7 and target["changed"] == 7
    assert all(i["cached_now"] and (i["estimate_s"] > 0 or i["estimate_source"] == "skipped (no neuronx-cc)")
               for i in target["invalidated"])  # (compiles without neuronx-cc write only compile_flags.json)
    assert all(i["new_fingerprint"] != i["fingerprint"] for i in target["invalidated"])
    assert out["total"]["estimate_s"] == pytest.approx(sum(i["estimate_s"] for i in target["invalidated"]), abs=0.01)
    # A cpu-only component changes nothing for a trn2 target.
    none = cli_json(["upgrade-impact", "--toolchain", "cxx=g++ 99", "--cache-dir", str(cache)], ws)
    assert none["total"]["changed"] == 0
    bad = run_cli(["upgrade-impact", "--toolchain", "tensorflow=2", "--cache-dir", str(cache)], ws)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "unknown component" in bad.stderr


def test_change_lines_for_each_kind_of_field() -> None:
    from neuronbuild.analysis.explain import describe_change, diff

    old = {"model": {"srcs": {"m/a.py": "1", "m/c.py": "4"}, "weights": None}, "options": {"model_type": None},
           "bucket": {"batch": 1, "seq": 512}, "toolchain": {"torch": "2.13.0"}, "target": {"isa": "x86-64-v4"}}
    new = {"model": {"srcs": {"m/a.py": "2", "m/b.py": "3"}, "weights": {"path": "m/w.safetensors", "digest": "d"}},
           "options": {"model_type": "transformer"}, "bucket": {"batch": 1, "seq": 1024},
           "toolchain": {"torch": "2.14.1"}, "target": {"isa": "x86-64-v3"}, "env": {"NEURON_CC_FLAGS": "-O3"}}
    assert [describe_change(p, o, n, new) for p, o, n in diff(old, new)] == [
        "bucket: seq 512 -> 1024",
        "env NEURON_CC_FLAGS: (unset) -> set",
        "src m/a.py: changed", "src m/b.py: added", "src m/c.py: removed",
        "weights: (none) -> m/w.safetensors",
        "options.model_type: (none) -> transformer",
        "target.isa: x86-64-v4 -> x86-64-v3",
        "toolchain torch: 2.13.0 -> 2.14.1",
    ]
    changed_weights = {"model": {"weights": {"path": "m/w.safetensors", "digest": "e"}}}
    assert [describe_change(p, o, n, changed_weights) for p, o, n in diff(new, changed_weights)
            if p[0] == "model" and p[1] == "weights"] == ["weights m/w.safetensors: changed"]


@pytest.mark.parametrize("cmd", [["plan"], ["explain"], ["upgrade-impact", "--toolchain", "torch=2.14.1"]])
def test_introspection_never_imports_torch(tiny_built: tuple[Path, Path], cmd: list[str]) -> None:
    ws, cache = tiny_built
    proc = run_cli([*cmd, "--cache-dir", str(cache)], ws, python_flags=("-X", "importtime"))
    assert proc.returncode == 0, proc.stderr
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "neuronbuild.analysis.planner" in imported
    heavy = ("torch", "jax", "jaxlib", "torchax")  # the Neuron lowering's packages are worker-side only too
    assert not {m for m in imported if m in heavy or m.startswith(tuple(f"{h}." for h in heavy))}
