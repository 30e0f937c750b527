"""The example workspace built for real: artifacts load and match eager, rebuilds are no-ops without torch."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers import run_cli


def _manifest(ws: Path, target: str) -> dict:
    return json.loads((ws / "neuronbuild-out" / "models" / target / "manifest.json").read_text())


def test_build_all_executes_every_action_once(built_example) -> None:  # type: ignore[no-untyped-def]
    _ws, proc = built_example
    # 6 traces (5 llama buckets + 1 llama_tiny) shared by 8 compiles: the cpu target reuses trn2's traces; one
    # lowering per trn2 bucket.
    assert "19 actions: 19 executed, 0 cached" in proc.stdout
    traces = re.findall(r"\] Trace (//\S+) \[([^\]]+)\]", proc.stderr)
    assert len(traces) == len(set(traces)) == 6


def test_cpu_artifacts_load_run_and_match_eager(built_example) -> None:  # type: ignore[no-untyped-def]
    import torch

    from neuronbuild.runtime.aoti_loader import load_package
    from neuronbuild.toolchains.model_import import build_eager_model, example_inputs

    ws, _ = built_example
    m = _manifest(ws, "llama_cpu")
    assert m["platform"] == "cpu" and m["isa"].startswith("x86-64")
    assert [b["name"] for b in m["buckets"]] == ["batch1_seq128", "batch4_seq1"]
    cfg = {"vocab": 1000, "hidden": 128, "layers": 2, "heads": 4}
    model = build_eager_model({"package": "models", "srcs": ["models/llama.py"], "entry": "llama:build_model",
                               "config": cfg, "weights": None, "seed": 0}, ws)
    inputs = {"input_ids": {"dtype": "int64", "dims": ["batch", "seq"]}}
    for b in m["buckets"]:
        run = load_package(ws / "neuronbuild-out" / "models" / "llama_cpu" / b["outputs"]["model.pt2"]["path"])
        args = example_inputs(inputs, b["bucket"], seed=7, config=cfg)
        out = run(*args)
        out = out[0] if isinstance(out, (list, tuple)) else out
        with torch.no_grad():
            ref = model(*args)
        assert out.shape == ref.shape
        assert float((out - ref).abs().max()) < 1e-4


def test_weights_file_variant_uses_the_weights(built_example) -> None:  # type: ignore[no-untyped-def]
    import torch

    from neuronbuild.runtime.aoti_loader import load_package
    from neuronbuild.toolchains.model_import import build_eager_model, example_inputs

    ws, _ = built_example
    m = _manifest(ws, "llama_tiny_cpu")
    cfg = {"vocab": 1000, "hidden": 64, "layers": 1, "heads": 2}
    spec = {"package": "models", "srcs": ["models/llama.py"], "entry": "llama:build_model", "config": cfg,
            "weights": "models/llama_tiny.safetensors", "seed": 0}
    with_weights = build_eager_model(spec, ws)
    seeded = build_eager_model({**spec, "weights": None}, ws)
    b = m["buckets"][0]
    args = example_inputs({"input_ids": {"dtype": "int64", "dims": ["batch", "seq"]}}, b["bucket"], seed=3, config=cfg)
    out = load_package(ws / "neuronbuild-out/models/llama_tiny_cpu" / b["outputs"]["model.pt2"]["path"])(*args)
    out = out[0] if isinstance(out, (list, tuple)) else out
    with torch.no_grad():
        assert float((out - with_weights(*args)).abs().max()) < 1e-4
        assert float((out - seeded(*args)).abs().max()) > 1e-3


def test_trn2_outputs_carry_the_effective_options(built_example) -> None:  # type: ignore[no-untyped-def]
    from jax._src.lib import xla_client as xc

    from neuronbuild.runtime.hlo_proto import parse_hlo_module

    ws, _ = built_example
    m = _manifest(ws, "llama_trn2")
    assert m["platform"] == "trn2"
    # :fast deps on :base -> opt_level 1 (own value wins), model_type from base, auto_cast and flags from fast.
    assert m["options"] == {"opt_level": 1, "model_type": "transformer", "auto_cast": "matmult", "flags": ["--foo=1"]}
    assert len(m["buckets"]) == 5
    for b in m["buckets"]:
        d = ws / "neuronbuild-out/models/llama_trn2" / b["name"]
        argv = json.loads((d / "compile_flags.json").read_text())["argv"]
        assert argv[:9] == ["neuronx-cc", "compile", "model.hlo.pb", "--framework", "XLA", "--target", "trn2",
                            "--output", "model.neff"]
        assert argv[9:] == ["-O1", "--auto-cast", "matmult", "--auto-cast-type", "bf16", "--model-type",
                            "transformer", "--foo=1"]
        # auto_cast = matmult is in the module itself: every dot takes bf16 operands
        proto = (d / "model.hlo.pb").read_bytes()
        summary = parse_hlo_module(proto)
        assert summary.result.dtype == "tuple" and dict(summary.opcodes)["dot"] >= 8
        dots = [ln for ln in xc.XlaComputation(proto).as_hlo_text().splitlines() if " dot(" in ln]
        assert dots and all(" bf16[" in ln for ln in dots)
        params = json.loads((d / "params.json").read_text())["parameters"]
        assert params[-1]["name"] == "input_ids" and params[-1]["shape"] == [b["bucket"]["batch"], b["bucket"]["seq"]]


def test_noop_rebuild_runs_nothing_and_never_imports_torch(built_example, cache_dir: Path) -> None:  # type: ignore[no-untyped-def]
    ws, _ = built_example
    proc = run_cli(["build", "//models:llama_cpu", "--cache-dir", str(cache_dir)], ws, python_flags=("-X", "importtime"))
    assert proc.returncode == 0, proc.stderr
    assert "4 actions: 0 executed, 4 cached" in proc.stdout, proc.stdout
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "neuronbuild.cli" in imported  # the check itself works
    assert not {m for m in imported if m == "torch" or m.startswith("torch.")}


def test_outputs_are_restored_from_cache_when_deleted(built_example, cache_dir: Path) -> None:  # type: ignore[no-untyped-def]
    ws, _ = built_example
    art = ws / "neuronbuild-out/models/llama_trn2/batch4_seq1/model.hlo.pb"
    before = art.read_bytes()
    art.unlink()
    proc = run_cli(["build", "//models:llama_trn2", "--cache-dir", str(cache_dir)], ws)
    assert proc.returncode == 0 and " 0 executed" in proc.stdout
    assert art.read_bytes() == before


@pytest.mark.parametrize("pattern,expected", [("//models:all", "19 actions"), ("//models/...", "19 actions"),
                                               ("//tools/...", "0 actions"), ("//models:llama_trn2", "15 actions")])
def test_patterns_select_targets(built_example, cache_dir: Path, pattern: str, expected: str) -> None:  # type: ignore[no-untyped-def]
    ws, _ = built_example
    proc = run_cli(["build", pattern, "--cache-dir", str(cache_dir)], ws)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(expected), proc.stdout
