"""The runtime never counts a Neuron graph run on the CPU as a hit: strict open without a Neuron device fails with a
clear message, a Neuron host without the Neuron runtime fails at load, and emulate="xla-cpu" runs the deployed HLO on
XLA:CPU, counted as emulated."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import run_cli

BUNDLE = Path("neuronbuild-out/models/release.tar.zst")
TRN2 = "//models:llama_trn2"
CFG = {"vocab": 1000, "hidden": 128, "layers": 2, "heads": 4}
MODEL_SPEC = {"package": "models", "srcs": ["models/llama.py"], "entry": "llama:build_model", "config": CFG,
              "weights": None, "seed": 0}


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
    assert "5 problem(s)" in msg and msg.count("target.platform differs (built for trn2, this host has no Neuron "
                                               "device; open_cache(..., emulate='xla-cpu')") == 5
    lenient = open_cache(deployed, strict=False, require=[TRN2])
    assert lenient.model(TRN2).bucket_fn("batch4_seq1") is None  # a miss, never a CPU run counted as a hit
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
    assert (cache.counters.hit, cache.counters.emulated, cache.counters.error) == (0, 5, 0)
    eager = build_eager_model(dict(MODEL_SPEC), built_example[0])
    model = cache.model(TRN2)
    gen = torch.Generator().manual_seed(3)
    for shape, bucket in (((4, 1), "batch4_seq1"), ((1, 100), "batch1_seq128")):
        x = torch.randint(0, 1000, shape, generator=gen)
        assert model.route(x).bucket_name == bucket
        out = model(x)
        with torch.no_grad():
            ref = eager(x)
        assert out.shape == ref.shape
        err = float((out - ref).abs().max())
        assert 0 < err <= 0.05  # auto_cast = matmult: bf16 matmuls in the module, within the target's tolerance
    assert (cache.counters.hit, cache.counters.emulated) == (0, 5)
    monkeypatch.setenv("NEURONBUILD_EMULATE", "xla-cpu")  # the same through the environment, loaded lazily
    lazy = open_cache(deployed, strict=False)
    lazy.model(TRN2)(torch.zeros(4, 1, dtype=torch.int64))
    assert (lazy.counters.hit, lazy.counters.emulated) == (0, 1)
