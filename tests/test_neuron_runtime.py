"""The runtime never counts a Neuron graph run on the CPU as a hit: strict open without a Neuron device fails with a
clear message, a Neuron host without the Neuron runtime fails at load, and emulate="xla-cpu" runs the deployed HLO on
XLA:CPU, counted as emulated."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import run_cli

BUNDLE = Path("neuronbuild-out/models/release.tar.zst")
TRN2 = "//models:llama_trn2"
HF = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128, "eos_token_id": 2,
      "bos_token_id": 1, "pad_token_id": 0}
MODEL_SPEC = {"package": "models", "srcs": [], "entry": "neuronbuild.toolchains.hf_causal_lm:context",
              "config": {"model_type": "llama", "hf": HF, "max_seq": 64}, "weights": "models/llama.safetensors",
              "seed": 0}


@pytest.fixture(scope="module")
def deployed(built_example, tmp_path_factory: pytest.TempPathFactory) -> Path:  # type: ignore[no-untyped-def]
    ws, _ = built_example
    dest = tmp_path_factory.mktemp("neuron_serve") / "cache"
    proc = run_cli(["deploy", str(ws / BUNDLE), "--cache-dir", str(dest)], ws)
    assert proc.returncode == 0, proc.stderr
    return dest


def test_strict_open_without_a_neuron_device_fails_and_says_how_to_emulate(
        deployed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from neuronbuild.runtime import open_cache

    monkeypatch.delenv("NEURON_PLATFORM_TARGET_OVERRIDE", raising=False)
    monkeypatch.delenv("NEURONBUILD_EMULATE", raising=False)
    with pytest.raises(RuntimeError) as e:
        open_cache(deployed, strict=True, require=[TRN2])
    msg = str(e.value)
    assert "4 problem(s)" in msg and msg.count("target.platform differs (built for trn2, this host has no Neuron "
                                               "device; open_cache(..., emulate='xla-cpu')") == 4
    lenient = open_cache(deployed, strict=False, require=[TRN2])
    assert lenient.model(TRN2).bucket_fn("token_batch4") is None  # a miss, never a CPU run counted as a hit
    assert (lenient.counters.hit, lenient.counters.miss, lenient.counters.emulated) == (0, 1, 0)


def test_a_neuron_host_without_the_neuron_runtime_fails_at_load(deployed: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from neuronbuild.runtime import open_cache

    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")  # as on a trn2 host
    monkeypatch.delenv("NEURONBUILD_EMULATE", raising=False)
    with pytest.raises(RuntimeError, match=r"strict mode: //models:llama_trn2 .*no model.neff .*emulate='xla-cpu'"):
        open_cache(deployed, strict=True, require=[TRN2])


def test_emulated_graphs_run_the_hlo_on_xla_cpu_and_are_counted_apart(built_example, deployed: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from neuronbuild.runtime import open_cache
    from neuronbuild.toolchains.model_import import build_eager_model

    monkeypatch.delenv("NEURON_PLATFORM_TARGET_OVERRIDE", raising=False)
    with pytest.raises(ValueError, match="emulate must be one of xla-cpu"):
        open_cache(deployed, strict=True, require=[TRN2], emulate="cpu")
    cache = open_cache(deployed, strict=True, require=[TRN2], emulate="xla-cpu")
    assert (cache.counters.hit, cache.counters.emulated, cache.counters.error) == (0, 4, 0)
    eager = build_eager_model(dict(MODEL_SPEC), built_example[0])
    model = cache.model(TRN2).family("context")  # the context-encoding graphs: one input signature
    gen = torch.Generator().manual_seed(3)
    for shape, bucket in (((3, 32), "context_batch4_seq32"), ((1, 32), "context_batch1_seq32")):
        x = torch.randint(0, 512, shape, generator=gen)
        mask = torch.ones_like(x)
        assert model.route(x, mask).bucket_name == bucket
        out = model(x, mask)  # batch 3 padded to the 4 bucket and un-padded along the declared batch dims
        with torch.no_grad():
            ref = eager(x, mask)
        for name in ("logits", "kv"):
            assert out[name].shape == ref[name].shape
            assert float((out[name] - ref[name]).abs().max()) <= 1e-4  # fp32 module
    assert (cache.counters.hit, cache.counters.emulated) == (0, 4)
    monkeypatch.setenv("NEURONBUILD_EMULATE", "xla-cpu")  # the same through the environment, loaded lazily
    lazy = open_cache(deployed, strict=False)
    lazy.model(TRN2).family("context")(torch.zeros(4, 32, dtype=torch.int64), torch.ones(4, 32, dtype=torch.int64))
    assert (lazy.counters.hit, lazy.counters.emulated) == (0, 1)


def test_validate_runs_the_example_trn2_modules_on_xla_cpu(built_example, cache_dir: Path) -> None:  # type: ignore[no-untyped-def]
    ws, _ = built_example
    proc = run_cli(["validate", TRN2, "--cache-dir", str(cache_dir)], ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [ln.split() for ln in proc.stdout.splitlines() if ln.startswith(TRN2)]
    assert len(rows) == 4 and all(r[2] == "trn2*" and r[-1] == "ok" for r in rows), proc.stdout
    # auto_cast none: fp32 modules, within the default tolerance of 1e-4
    assert all(float(r[3]) <= float(r[5]) == 1e-4 for r in rows), proc.stdout
    assert "exact model.hlo.pb run on XLA:CPU" in proc.stdout
