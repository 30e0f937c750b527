"""A toolchain and a rule kind added in one module plus one registration each ($NEURONBUILD_PLUGINS) ship like
built-in ones: their graphs build, validate against eager, go into a release bundle, deploy, and load strictly in the
runtime (tests/plugins/portable_toolchain.py: platform "cpu-portable", AOTInductor packages for the x86-64 baseline;
tests/plugins/portable_kind.py: `portable_compile`, compiling for it without a neuron_target)."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import MODEL_SRC, run_cli, write_ws

PLUGIN_ENV = {"NEURONBUILD_PLUGINS": "portable_toolchain,portable_kind",
              "NEURONBUILD_PLUGIN_PATH": str(Path(__file__).resolve().parent / "plugins")}

BUILD = """
neuron_model(name = "tiny", srcs = ["llama.py"], entry = "llama:build_model",
             config = {"vocab": 64, "hidden": 16, "layers": 1, "heads": 2},
             inputs = {"input_ids": "int64[batch, seq]"})
neuron_buckets(name = "b", dims = {"batch": [1], "seq": [8]})
neuron_target(name = "portable", platform = "cpu-portable")
compiler_options(name = "opts", opt_level = 3)
neuron_compile(name = "tiny_portable", model = ":tiny", buckets = [":b"], target = ":portable", options = ":opts")
portable_compile(name = "tiny_kind", model = ":tiny", buckets = [":b"])
neuron_bundle(name = "release", srcs = [":tiny_portable", ":tiny_kind"])
"""


def test_an_out_of_tree_toolchain_and_kind_build_validate_bundle_deploy_and_load_strictly(tmp_path: Path) -> None:
    ws = write_ws(tmp_path / "ws", {"m/llama.py": MODEL_SRC, "m/BUILD": BUILD})
    cache = ["--cache-dir", str(tmp_path / "cache")]
    built = run_cli(["build", *cache, "--jobs", "1"], ws, PLUGIN_ENV)
    assert built.returncode == 0, built.stdout + built.stderr
    assert "for cpu-portable/x86-64" in built.stderr, built.stderr
    # opt_level is a neuronx-cc option: this toolchain does not declare it, so it is left out and said so.
    assert "toolchain 'portable' (cpu-portable/x86-64) ignores option opt_level" in built.stderr, built.stderr
    out = ws / "neuronbuild-out" / "m"
    manifest = json.loads((out / "tiny_portable" / "manifest.json").read_text())
    assert manifest["platform"] == "cpu-portable" and manifest["options"] == {"auto_cast": "none"}, manifest

    # Both compile targets share the weights and the trace, and their compile records are equal (same toolchain,
    # platform, bucket, and options: opt_level is not one the toolchain reads): one compile action serves both.
    assert "3 actions: 3 executed" in built.stdout, built.stdout
    validated = run_cli(["validate", *cache, "//m:release"], ws, PLUGIN_ENV)
    assert validated.returncode == 0, validated.stdout + validated.stderr
    assert "//m:tiny_kind" in validated.stdout + validated.stderr, validated.stdout + validated.stderr

    bundle = out / "release.tar.zst"
    assert bundle.is_file(), sorted(p.name for p in out.iterdir())
    serve = tmp_path / "serve"
    deployed = run_cli(["deploy", str(bundle), "--dest", str(serve)], ws)  # deploying needs no plug-in
    assert deployed.returncode == 0, deployed.stderr

    import torch

    from neuronbuild.runtime import open_cache

    rt = open_cache(serve, strict=True, require=["//m:tiny_portable", "//m:tiny_kind"])
    x = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    outs = []
    for label in ("//m:tiny_portable", "//m:tiny_kind"):
        model = rt.model(label)
        assert model.route(x).bucket_name == "batch1_seq8"
        y = model(x)
        logits = y if isinstance(y, torch.Tensor) else next(iter(y.values())) if isinstance(y, dict) else y[0]
        assert logits.shape[:2] == (1, 8) and bool(torch.isfinite(logits).all())
        outs.append(logits)
    assert torch.equal(outs[0], outs[1])  # the same graph, however it was declared
    assert rt.counters.hit == 2 and rt.counters.miss == 0 and rt.counters.eager == 0
