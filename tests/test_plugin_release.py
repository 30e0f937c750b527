"""A toolchain and a rule kind added in one module plus one registration each ($NEURONBUILD_PLUGINS) ship like
built-in ones: their graphs build, validate against eager, go into a release bundle, deploy, and load strictly in the
runtime (tests/plugins/portable_toolchain.py: platform "cpu-portable", AOTInductor packages for the x86-64 baseline in an
artifact format of its own, which the runtime loads through the loader that module registers;
tests/plugins/portable_kind.py: `portable_compile`, compiling for it without a neuron_target). The toolchain's module
declares a command-line flag of its own too (--portable-release), which reaches its fingerprints only."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from helpers import MODEL_SRC, run_cli, write_ws

# A strict open of the deployed release in a fresh process (the serving one): which loader ran each graph, and the
# logits of both labels.
SERVE = r"""
import json, sys
import torch
from neuronbuild.runtime import open_cache
rt = open_cache(sys.argv[1], strict=True, require=["//m:tiny_portable", "//m:tiny_kind"])
x = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
outs = []
for label in ("//m:tiny_portable", "//m:tiny_kind"):
    model = rt.model(label)
    assert model.route(x).bucket_name == "batch1_seq8"
    y = model(x)
    outs.append(y if isinstance(y, torch.Tensor) else next(iter(y.values())) if isinstance(y, dict) else y[0])
import portable_toolchain
print(json.dumps({"loaded": sorted(portable_toolchain.LOADED), "shape": list(outs[0].shape),
                  "finite": all(bool(torch.isfinite(o).all()) for o in outs), "equal": torch.equal(outs[0], outs[1]),
                  "counters": [rt.counters.hit, rt.counters.miss, rt.counters.eager]}))
"""

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
    # The plug-in's own flag (declared in its module: no core file names it), here from the workspace's rc file:
    # its value enters its compile records only, so the compile would run again, the trace and weights would not.
    (ws / ".neuronbuildrc").write_text("plan --portable-release r2\n")
    planned = run_cli(["plan", *cache], ws, PLUGIN_ENV)
    assert planned.returncode == 0 and "3 actions: 1 to execute, 2 cached" in planned.stdout, \
        planned.stdout + planned.stderr
    (ws / ".neuronbuildrc").unlink()
    bad = run_cli(["plan", *cache, "--portable-release", "r 2"], ws, PLUGIN_ENV)
    assert bad.returncode == 2 and "--portable-release: 'r 2' is not a release name" in bad.stderr, bad.stderr
    helped = run_cli(["build", "--help"], ws, PLUGIN_ENV)
    assert "--portable-release NAME" in helped.stdout and "--neuronx-cc PATH" in helped.stdout, helped.stdout
    validated = run_cli(["validate", *cache, "//m:release"], ws, PLUGIN_ENV)
    assert validated.returncode == 0, validated.stdout + validated.stderr
    assert "//m:tiny_kind" in validated.stdout + validated.stderr, validated.stdout + validated.stderr

    bundle = out / "release.tar.zst"
    assert bundle.is_file(), sorted(p.name for p in out.iterdir())
    assert manifest["artifact_format"] == "aoti-x86-64", manifest
    serve = tmp_path / "serve"
    # Deploying needs no plug-in, but without it nothing here knows how to load (or check) the toolchain's format.
    deployed = run_cli(["deploy", str(bundle), "--dest", str(serve)], ws)
    assert deployed.returncode == 0, deployed.stderr
    assert "no runtime loader for artifact format 'aoti-x86-64'" in deployed.stderr, deployed.stderr

    def serve_strictly(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        import os

        return subprocess.run([sys.executable, "-c", SERVE, str(serve)], capture_output=True, text=True, timeout=600,
                              env={**os.environ, **env}, cwd=tmp_path)

    refused = serve_strictly({})  # a serving process without the plug-in: a strict open refuses, naming the format
    assert refused.returncode != 0 and "no runtime loader for artifact format 'aoti-x86-64'" in refused.stderr, \
        refused.stderr[-2000:]
    served = serve_strictly(PLUGIN_ENV)  # with it: the plug-in's loader loads both labels' graphs
    assert served.returncode == 0, served.stderr[-4000:]
    got = json.loads(served.stdout.splitlines()[-1])
    # Both labels' graphs (equal records: one fingerprint, deployed once) went through the plug-in's loader.
    assert len(got["loaded"]) == 2 and all(s.endswith("@batch1_seq8") for s in got["loaded"]), got
    assert got["shape"][:2] == [1, 8] and got["finite"], got
    assert got["equal"], got  # the same graph, however it was declared
    assert got["counters"] == [2, 0, 0], got  # two hits, no miss, nothing eager
