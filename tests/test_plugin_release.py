"""A toolchain added in one module plus one registration ($NEURONBUILD_PLUGINS) ships like a built-in one: its graphs
build, validate against eager, go into a release bundle, deploy, and load strictly in the runtime (tests/plugins/
portable_toolchain.py: platform "cpu-portable", AOTInductor packages for the x86-64 baseline)."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import MODEL_SRC, run_cli, write_ws

PLUGIN_ENV = {"NEURONBUILD_PLUGINS": "portable_toolchain",
              "NEURONBUILD_PLUGIN_PATH": str(Path(__file__).resolve().parent / "plugins")}

BUILD = """
neuron_model(name = "tiny", srcs = ["llama.py"], entry = "llama:build_model",
             config = {"vocab": 64, "hidden": 16, "layers": 1, "heads": 2},
             inputs = {"input_ids": "int64[batch, seq]"})
neuron_buckets(name = "b", dims = {"batch": [1], "seq": [8]})
neuron_target(name = "portable", platform = "cpu-portable")
compiler_options(name = "opts", opt_level = 3)
neuron_compile(name = "tiny_portable", model = ":tiny", buckets = [":b"], target = ":portable", options = ":opts")
neuron_bundle(name = "release", srcs = [":tiny_portable"])
"""


def test_an_out_of_tree_toolchain_builds_validates_bundles_deploys_and_loads_strictly(tmp_path: Path) -> None:
    ws = write_ws(tmp_path / "ws", {"m/llama.py": MODEL_SRC, "m/BUILD": BUILD})
    cache = ["--cache-dir", str(tmp_path / "cache")]
    built = run_cli(["build", *cache, "--jobs", "1"], ws, PLUGIN_ENV)
    assert built.returncode == 0, built.stdout + built.stderr
    assert "for cpu-portable/x86-64" in built.stdout, built.stdout
    # opt_level is a neuronx-cc option: this toolchain does not declare it, so it is left out and said so.
    assert "toolchain 'portable' (cpu-portable/x86-64) ignores option opt_level" in built.stderr, built.stderr
    out = ws / "neuronbuild-out" / "m"
    manifest = json.loads((out / "tiny_portable" / "manifest.json").read_text())
    assert manifest["platform"] == "cpu-portable" and manifest["options"] == {"auto_cast": "none"}, manifest

    validated = run_cli(["validate", *cache, "//m:release"], ws, PLUGIN_ENV)
    assert validated.returncode == 0, validated.stdout + validated.stderr

    bundle = out / "release.tar.zst"
    assert bundle.is_file(), sorted(p.name for p in out.iterdir())
    serve = tmp_path / "serve"
    deployed = run_cli(["deploy", str(bundle), "--dest", str(serve)], ws)  # deploying needs no plug-in
    assert deployed.returncode == 0, deployed.stderr

    import torch

    from neuronbuild.runtime import open_cache

    rt = open_cache(serve, strict=True, require=["//m:tiny_portable"])
    model = rt.model("//m:tiny_portable")
    x = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    assert model.route(x).bucket_name == "batch1_seq8"
    y = model(x)
    logits = y if isinstance(y, torch.Tensor) else next(iter(y.values())) if isinstance(y, dict) else y[0]
    assert logits.shape[:2] == (1, 8) and bool(torch.isfinite(logits).all())
    assert rt.counters.hit == 1 and rt.counters.miss == 0 and rt.counters.eager == 0
