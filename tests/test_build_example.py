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
    # 5 traces (4 llama graphs: 2 context + 2 token buckets, + 1 llama_tiny) shared by 9 compiles: the cpu target
    # reuses trn2's traces; one lowering per trn2 graph; one weights action per model (2), shared by its graphs.
    assert "20 actions: 20 executed, 0 cached" in proc.stdout
    assert len(re.findall(r"\] Weights //\S+", proc.stderr)) == 2
    traces = re.findall(r"\] Trace (//\S+) \[([^\]]+)\]", proc.stderr)
    assert len(traces) == len(set(traces)) == 5


def test_cpu_artifacts_load_run_and_match_eager(built_example) -> None:  # type: ignore[no-untyped-def]
    import torch

    from neuronbuild.runtime.aoti_loader import load_package
    from neuronbuild.toolchains.model_import import build_eager_model, example_inputs

    ws, _ = built_example
    m = _manifest(ws, "llama_cpu")
    assert m["platform"] == "cpu" and m["isa"].startswith("x86-64")
    assert [b["name"] for b in m["buckets"]] == ["context_batch1_seq32", "context_batch4_seq32", "token_batch1",
                                                 "token_batch4"]
    trace = json.loads((ws / "neuronbuild-out/models/llama_cpu/manifest.json").read_text())
    assert {b["name"]: b.get("graph") for b in trace["buckets"]}["token_batch4"] == "token"
    cfg = {"model_type": "llama", "max_seq": 64, "hf": {
        "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128, "eos_token_id": 2,
        "bos_token_id": 1, "pad_token_id": 0}}
    kv = {"dtype": "float32", "dims": [2, 2, "batch", 2, 64, 16]}
    graphs = {
        "context": ("context", {"input_ids": {"dtype": "int64", "dims": ["batch", "seq"]},
                                "attention_mask": {"dtype": "int64", "dims": ["batch", "seq"]}}),
        "token": ("token", {"input_ids": {"dtype": "int64", "dims": ["batch", 1]},
                            "position_ids": {"dtype": "int64", "dims": ["batch", 1]},
                            "cache_mask": {"dtype": "int64", "dims": ["batch", 64]},
                            "slot": {"dtype": "int64", "dims": [1]}, "kv": kv}),
    }
    for b in m["buckets"]:
        entry, inputs = graphs[b["graph"]]
        model = build_eager_model({"package": "models", "srcs": [], "entry": f"neuronbuild.toolchains.hf_causal_lm:{entry}",
                                   "config": cfg, "weights": "models/llama.safetensors", "seed": 0}, ws)
        run = load_package(ws / "neuronbuild-out" / "models" / "llama_cpu" / b["outputs"]["model.pt2"]["path"])
        args = example_inputs(inputs, b["bucket"], seed=7, config=cfg["hf"], ranges={"slot": (0, 64),
                                                                                     "position_ids": (0, 64)})
        out = run(*args)
        with torch.no_grad():
            ref = model(*args)
        for got, (name, want) in zip(out, ref.items(), strict=True):
            assert got.shape == want.shape, name
            assert float((got - want).abs().max()) < 1e-4, name


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
    # Per graph family, as NxD Inference compiles LLMs: :context_opts (-O1) and :token_opts (-O2), both deps on
    # :base (model_type).
    assert len(m["buckets"]) == 4
    for b in m["buckets"]:
        level = {"context": 1, "token": 2}[b["graph"]]
        assert b["options"] == {"opt_level": level, "model_type": "transformer", "auto_cast": "none", "flags": []}
        d = ws / "neuronbuild-out/models/llama_trn2" / b["name"]
        argv = json.loads((d / "compile_flags.json").read_text())["argv"]
        assert argv[:9] == ["neuronx-cc", "compile", "model.hlo.pb", "--framework", "XLA", "--target", "trn2",
                            "--output", "model.neff"]
        assert argv[9:] == [f"-O{level}", "--auto-cast", "none", "--model-type", "transformer"]
        proto = (d / "model.hlo.pb").read_bytes()
        summary = parse_hlo_module(proto)
        assert summary.result.dtype == "tuple" and dict(summary.opcodes)["dot"] >= 8
        dots = [ln for ln in xc.XlaComputation(proto).as_hlo_text().splitlines() if " dot(" in ln]
        assert dots and all(" f32[" in ln for ln in dots)  # auto_cast none: fp32 matmuls
        params = json.loads((d / "params.json").read_text())["parameters"]
        last = "attention_mask" if b["graph"] == "context" else "kv"
        assert params[-1]["name"] == last and params[-1]["shape"][0 if last == "attention_mask" else 2] == \
            b["bucket"]["batch"]


def test_noop_rebuild_runs_nothing_and_never_imports_torch(built_example, cache_dir: Path) -> None:  # type: ignore[no-untyped-def]
    ws, _ = built_example
    proc = run_cli(["build", "//models:llama_cpu", "--cache-dir", str(cache_dir)], ws, python_flags=("-X", "importtime"))
    assert proc.returncode == 0, proc.stderr
    assert "9 actions: 0 executed, 9 cached" in proc.stdout, proc.stdout
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "neuronbuild.cli" in imported  # the check itself works
    heavy = ("torch", "jax", "jaxlib", "torchax")
    assert not {m for m in imported if m in heavy or m.startswith(tuple(f"{h}." for h in heavy))}


def test_outputs_are_restored_from_cache_when_deleted(built_example, cache_dir: Path) -> None:  # type: ignore[no-untyped-def]
    ws, _ = built_example
    art = ws / "neuronbuild-out/models/llama_trn2/token_batch4/model.hlo.pb"
    before = art.read_bytes()
    art.unlink()
    proc = run_cli(["build", "//models:llama_trn2", "--cache-dir", str(cache_dir)], ws)
    assert proc.returncode == 0 and " 0 executed" in proc.stdout
    assert art.read_bytes() == before


@pytest.mark.parametrize("pattern,expected", [("//models:all", "20 actions"), ("//models/...", "20 actions"),
                                               ("//tools/...", "0 actions"), ("//models:llama_trn2", "13 actions")])
def test_patterns_select_targets(built_example, cache_dir: Path, pattern: str, expected: str) -> None:  # type: ignore[no-untyped-def]
    ws, _ = built_example
    proc = run_cli(["build", pattern, "--cache-dir", str(cache_dir)], ws)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(expected), proc.stdout
