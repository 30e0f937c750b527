"""Production start: deploy a bundle, open it strictly in a fresh process without compilers, run every bucket.

Also: strict open failing on a missing graph and on a graph built with other options, the bucket router's padding,
the lenient eager fallback, and that neuronbuild.runtime imports without the build-side dependencies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, copy_example, run_cli

BUNDLE = Path("neuronbuild-out/models/release.tar.zst")
HF = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128, "eos_token_id": 2,
      "bos_token_id": 1, "pad_token_id": 0}
MODEL_SPEC = {"package": "models", "srcs": [], "entry": "neuronbuild.toolchains.hf_causal_lm:context",
              "config": {"model_type": "llama", "hf": HF, "max_seq": 64}, "weights": "models/llama.safetensors",
              "seed": 0}
RANGES = {"slot": (0, 64), "position_ids": (0, 64)}  # the token graph's cache slot and position (max_seq = 64)
COMPILERS = ("g++", "gcc", "c++", "cc", "clang", "clang++")

STRICT_SCRIPT = r"""
import json, logging, sys, time
import torch
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from neuronbuild.runtime import open_cache
t = time.perf_counter()
cache = open_cache(sys.argv[1])  # strict and required labels from NEURONBUILD_STRICT / NEURONBUILD_REQUIRE
open_ms = (time.perf_counter() - t) * 1000
inputs = torch.load(sys.argv[2])
outputs = {}
for key, x in inputs.items():
    label, graph, bucket = key.split("|")
    model = cache.model(label).family(graph)
    assert model.route(*x).bucket_name == bucket, (key, model.route(*x))
    outputs[key] = model(*x)
torch.save(outputs, sys.argv[3])
c = cache.counters
print(json.dumps({"hit": c.hit, "miss": c.miss, "error": c.error, "save": c.save, "eager": c.eager,
                  "emulated": c.emulated, "open_ms": open_ms}))
"""


@pytest.fixture(scope="module")
def deployed(built_example, tmp_path_factory: pytest.TempPathFactory) -> Path:  # type: ignore[no-untyped-def]
    ws, _ = built_example
    dest = tmp_path_factory.mktemp("serve") / "cache"
    proc = run_cli(["deploy", str(ws / BUNDLE), "--dest", str(dest)], ws)  # (other tests use its alias --cache-dir)
    assert proc.returncode == 0, proc.stderr
    return dest


def _eager(ws: Path, graph: str = "context"):  # type: ignore[no-untyped-def]
    from neuronbuild.toolchains.model_import import build_eager_model

    return build_eager_model(dict(MODEL_SPEC) | {"entry": f"neuronbuild.toolchains.hf_causal_lm:{graph}"}, ws)


def _fake_compilers(d: Path) -> tuple[Path, Path]:
    """A bin dir whose C/C++ compilers only record that they were run (and fail)."""
    d.mkdir(parents=True, exist_ok=True)
    log = d / "compiler-calls.log"
    for name in COMPILERS:
        p = d / name
        p.write_text(f"#!/bin/sh\necho \"{name} $*\" >> '{log}'\nexit 1\n")
        p.chmod(0o755)
    return d, log


def test_strict_start_in_a_fresh_process_hits_every_bucket_without_compiling(
        built_example, deployed: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import torch

    from neuronbuild.toolchains.model_import import example_inputs

    ws, _ = built_example
    manifest = json.loads((ws / "neuronbuild-out/models/release.manifest.json").read_text())
    inputs = {f"{g['label']}|{g['graph']}|{g['bucket_name']}": example_inputs(
        g["inputs"], g["bucket"], seed=11, config=HF, ranges=RANGES) for g in manifest["graphs"]}
    torch.save(inputs, tmp_path / "inputs.pt")
    (tmp_path / "strict.py").write_text(STRICT_SCRIPT)
    bindir, calls = _fake_compilers(tmp_path / "bin")
    env = dict(os.environ)
    # Only the fake compilers and the venv on PATH: not even /usr/bin, where the real ones live.
    env.update({"PATH": f"{bindir}:{os.path.dirname(sys.executable)}", "CXX": str(bindir / "g++"),
                "CC": str(bindir / "gcc"), "NEURONBUILD_STRICT": "1",
                "NEURONBUILD_REQUIRE": "//models:llama_cpu,//models:llama_trn2",
                # no Neuron device here: the trn2 graphs run their HLO on XLA:CPU, counted as emulated, not hits
                "NEURONBUILD_EMULATE": "xla-cpu", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
                "TMPDIR": str(tmp_path)})
    proc = subprocess.run([sys.executable, str(tmp_path / "strict.py"), str(deployed), str(tmp_path / "inputs.pt"),
                           str(tmp_path / "outputs.pt")], env=env, capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (stats["hit"], stats["miss"], stats["error"], stats["save"], stats["eager"], stats["emulated"]) == (
        4, 0, 0, 0, 0, 4)
    assert "hit=4 miss=0 error=0 save=0 eager_calls=0 emulated=4" in proc.stderr  # logged at start
    assert not calls.exists(), calls.read_text()  # no compiler was even attempted
    # nothing was compiled into inductor's cache dir either
    assert not [p for p in (tmp_path / "inductor").rglob("*") if p.is_file()]
    outputs = torch.load(tmp_path / "outputs.pt")
    models = {g: _eager(ws, g) for g in ("context", "token")}
    tol = {g["label"]: g["tolerance"] for g in manifest["graphs"]}
    for key, x in inputs.items():
        with torch.no_grad():
            ref = models[key.split("|")[1]](*x)
        for name, want in ref.items():
            out = outputs[key][name]
            assert out.shape == want.shape
            assert float((out - want).abs().max()) <= tol[key.split("|")[0]], (key, name)


def test_strict_open_names_a_missing_graph(deployed: Path) -> None:
    from neuronbuild.runtime import open_cache

    with pytest.raises(RuntimeError) as e:
        open_cache(deployed, strict=True, require=["//models:llama_cpu", "//models:llama_tiny_cpu"])
    msg = str(e.value)
    assert "1 problem(s)" in msg and "//models:llama_tiny_cpu: not deployed" in msg
    assert "llama_cpu [" not in msg  # the deployed one is fine


def test_strict_open_names_the_differing_field_of_a_near_entry(built_example, cache_dir: Path, deployed: Path,
                                                               tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The app expects llama_trn2 built with :base options (a lock from another build); the deployed one's context
    graphs used :context_opts (-O1)."""
    from neuronbuild.runtime import open_cache

    ws = copy_example(tmp_path / "variant")
    build = ws / "models" / "BUILD"
    text = build.read_text()
    old = 'options = {"context": ":context_opts", "token": ":token_opts"}'
    assert old in text
    build.write_text(text.replace(old, 'options = ":base"')
                     + '\nneuron_bundle(name = "variant", srcs = [":llama_trn2"])\n')
    proc = run_cli(["build", "//models:variant", "--cache-dir", str(cache_dir)], ws)
    assert proc.returncode == 0, proc.stderr
    assert "2 executed" in proc.stdout  # the 2 context graphs' trn2 compiles; traces and lowerings are cached
    lock = ws / "neuronbuild-out/models/variant.manifest.json"
    with pytest.raises(RuntimeError) as e:
        open_cache(deployed, strict=True, expect=lock, require=["//models:llama_trn2"])
    msg = str(e.value)
    assert "//models:llama_trn2 [context: batch=4, seq=32]: missing" in msg
    assert "options.opt_level differs (expected 2, deployed 1)" in msg
    # the token graphs were built with the same options: found as expected (only this host's lack of a device shows)
    assert "llama_trn2 [token: batch=4]: missing" not in msg and "llama_trn2 [token: batch=4]: target.platform" in msg
    # Lenient mode opens, logs it, and serves the graph from eager when given a fallback.
    import torch

    cache = open_cache(deployed, strict=False, expect=lock, require=["//models:llama_trn2"],
                       eager={"//models:llama_trn2": _eager(built_example[0])})
    x = torch.zeros(4, 32, dtype=torch.int64)
    out = cache.model("//models:llama_trn2").family("context")(x, torch.ones_like(x))
    assert out["logits"].shape == (4, 512)
    c = cache.counters
    assert (c.hit, c.miss, c.eager) == (0, 1, 1)


def test_router_pads_to_the_smallest_bucket_and_unpads(built_example, deployed: Path) -> None:  # type: ignore[no-untyped-def]
    import torch

    from neuronbuild.runtime import NoBucketFits, open_cache

    cache = open_cache(deployed, strict=True, require=["//models:llama_cpu"])
    model = cache.model("//models:llama_cpu").family("context")
    eager = _eager(built_example[0])
    gen = torch.Generator().manual_seed(5)
    for shape, bucket in (((1, 32), "context_batch1_seq32"), ((3, 32), "context_batch4_seq32"),
                          ((2, 32), "context_batch4_seq32")):
        x = torch.randint(0, 512, shape, generator=gen)
        mask = torch.ones_like(x)
        assert model.route(x, mask).bucket_name == bucket
        out = model(x, mask)  # batch padded, outputs un-padded along the dims declared to follow batch
        with torch.no_grad():
            ref = eager(x, mask)
        for name in ("logits", "kv"):
            assert out[name].shape == ref[name].shape
            assert float((out[name] - ref[name]).abs().max()) < 1e-4
    with pytest.raises(NoBucketFits, match="no bucket fits batch=2, seq=50"):
        model(torch.zeros(2, 50, dtype=torch.int64), torch.ones(2, 50, dtype=torch.int64))
    assert cache.counters.hit == 4 and cache.counters.miss == 0  # strict: all 4 graphs loaded at open


def test_runtime_imports_without_build_dependencies_or_torch() -> None:
    code = ("import sys\n"
            "for m in ('blake3', 'networkx', 'starlark', 'starlark_go', 'jinja2', 'zstandard'): sys.modules[m] = None\n"
            "import neuronbuild.runtime as r\n"
            "assert callable(r.open_cache)\n"
            "heavy = [m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'neuronbuild.loading', "
            "'neuronbuild.cache', 'neuronbuild.execution'))]\n"
            "assert not heavy, heavy\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_a_batch_larger_than_the_largest_bucket_runs_in_bucket_sized_chunks(built_example, deployed: Path) -> None:  # type: ignore[no-untyped-def]
    import torch

    from neuronbuild.runtime import NoBucketFits, open_cache

    cache = open_cache(deployed, strict=True, require=["//models:llama_cpu"])
    model = cache.model("//models:llama_cpu").family("context")  # buckets: batch 1 and 4, seq 32
    x = torch.randint(0, 512, (6, 32), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(x)
    out = model(x, mask)  # the default: chunks of 4 and 2 (padded to 4), outputs concatenated along batch
    with torch.no_grad():
        ref = _eager(built_example[0])(x, mask)
    for name in ("logits", "kv"):
        assert out[name].shape == ref[name].shape, name
        assert float((out[name] - ref[name]).abs().max()) < 1e-4, name
    with pytest.raises(NoBucketFits, match="no bucket fits batch=6, seq=32"):
        model(x, mask, split=False)
