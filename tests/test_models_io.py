"""Model inputs and outputs as users write them: input order kept everywhere, literal and named constant dims,
flattened named outputs un-padded only where they follow a padded bucket dim (one real cpu build, shared)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run_cli, write_ws

from neuronbuild.analysis.planner import plan
from neuronbuild.loading.target_graph import load_targets

# A decoder step with a stacked KV cache: cache [layers, batch, kv_heads, max_seq, head_dim]. Declared after `x`,
# so sorting input names (cache < x) would swap them; layers == 2 == the bucket's batch, so a router guessing from
# sizes cuts the layers dim when batch is padded.
KV_SRC = '''
import torch


class Step(torch.nn.Module):
    def __init__(self, hidden, layers):
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden)
        self.layers = layers

    def forward(self, x, cache):
        y = self.proj(x)
        new = cache * 0.5 + y.mean()
        return {"y": y, "state": {"cache": new, "norm": (y.abs().sum(dim=-1),)}}


def build(config):
    return Step(config["hidden"], config["layers"])
'''

KV_BUILD = '''
neuron_model(
    name = "step",
    srcs = ["step.py"],
    entry = "step:build",
    config = {"hidden": 8, "layers": 2},
    dims = {"layers": 2, "kv_heads": 2, "max_seq": 6, "head_dim": 4},
    inputs = {"x": "float32[batch, seq, 8]", "cache": "float32[layers, batch, kv_heads, max_seq, head_dim]"},
)
neuron_buckets(name = "b", shapes = [{"batch": 2, "seq": 3}])
neuron_target(name = "cpu", platform = "cpu", isa = "native")
neuron_compile(name = "step_cpu", model = ":step", buckets = [":b"], target = ":cpu")
neuron_bundle(name = "release", srcs = [":step_cpu"])
'''


def _ws(root: Path, build: str = KV_BUILD) -> Path:
    return write_ws(root, {"m/BUILD": build, "m/step.py": KV_SRC})


def _trace_fp(ws: Path) -> dict[str, str]:
    ag = plan(load_targets(ws, ["//m:step_cpu"]))
    return {a.describe(): fp for fp, a in ag.actions.items()}


def test_swapping_two_inputs_changes_every_graph_fingerprint_and_not_the_weights(tmp_path: Path) -> None:
    a = _ws(tmp_path / "a")
    swapped = KV_BUILD.replace(
        '"x": "float32[batch, seq, 8]", "cache": "float32[layers, batch, kv_heads, max_seq, head_dim]"',
        '"cache": "float32[layers, batch, kv_heads, max_seq, head_dim]", "x": "float32[batch, seq, 8]"')
    assert swapped != KV_BUILD
    b = _ws(tmp_path / "b", swapped)
    fa, fb = _trace_fp(a), _trace_fp(b)
    assert fa.keys() == fb.keys() and len(fa) == 3
    assert all(fa[k] != fb[k] for k in fa if not k.startswith("Weights"))
    assert fa["Weights //m:step"] == fb["Weights //m:step"]  # the model's state does not depend on its inputs
    ag = plan(load_targets(a, ["//m:step_cpu"]))
    trace = next(a for a in ag.actions.values() if a.kind == "trace")
    assert [name for name, _spec in trace.model["inputs"]] == ["x", "cache"]


def test_literal_and_named_constant_dims_are_sizes_not_bucket_dims(tmp_path: Path) -> None:
    ws = _ws(tmp_path / "ws")
    ag = plan(load_targets(ws, ["//m:step_cpu"]))
    ct = ag.compiles[0]
    assert [b.name for b, _fp in ct.buckets] == ["batch2_seq3"]  # constants never in bucket names
    trace = next(a for a in ag.actions.values() if a.kind == "trace")
    assert dict(trace.model["inputs"]) == {"x": {"dtype": "float32", "dims": ["batch", "seq", 8]},
                                           "cache": {"dtype": "float32", "dims": [2, "batch", 2, 6, 4]}}
    # A constant's value enters the fingerprint.
    other = _ws(tmp_path / "other", KV_BUILD.replace('"head_dim": 4', '"head_dim": 5'))
    assert _trace_fp(ws) != _trace_fp(other)


@pytest.mark.parametrize(("edit", "message"), [
    (('"float32[batch, seq, 8]"', '"float32[batch, seq, 0]"'), "literal dim 0 must be a positive int"),
    (('"head_dim": 4', '"head_dim": -4'), "dimension 'head_dim' must be a positive int"),
    (('"float32[batch, seq, 8]"', '"float32[batch, seq, 8x]"'), "must look like 'int64[batch, seq]'"),
    (('dims = {', 'input_ranges = {"x": [0, 3]}, dims = {'), "input 'x' is float32, not an integer input"),
])
def test_bad_dims_are_one_line_errors(tmp_path: Path, edit: tuple[str, str], message: str) -> None:
    ws = _ws(tmp_path / "ws", KV_BUILD.replace(*edit))
    proc = run_cli(["plan", "//m:step_cpu"], ws)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0, proc.stderr


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> tuple[Path, Path]:
    """//m:release built (one real cpu compile) and deployed."""
    ws = _ws(tmp_path_factory.mktemp("kv") / "ws")
    proc = run_cli(["build", "//m:release", "--cache-dir", str(cache_dir)], ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    dest = ws / "deployed"
    proc = run_cli(["deploy", str(ws / "neuronbuild-out/m/release.tar.zst"), "--cache-dir", str(dest)], ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return ws, dest


def test_manifest_keeps_input_order_and_records_named_outputs(built: tuple[Path, Path]) -> None:
    ws, _dest = built
    manifest = json.loads((ws / "neuronbuild-out/m/release.manifest.json").read_text())
    g = manifest["graphs"][0]
    assert [name for name, _spec in g["inputs"]] == ["x", "cache"]
    assert [(o["name"], o["follows"]) for o in g["outputs"]] == [
        ("y", ["batch", "seq", None]),
        ("state.cache", [None, "batch", None, None, None]),
        ("state.norm.0", ["batch", "seq"]),
    ]


RUN = '''
import sys
sys.modules["transformers"] = None  # the runtime never needs the model's packages
import torch
from neuronbuild.runtime import open_cache
model = open_cache(sys.argv[1], strict=True).model("//m:step_cpu")
args = torch.load(sys.argv[2])
out = model(*args)
torch.save({k: v for k, v in out.items()}, sys.argv[3])
print(list(out))
'''


def test_runtime_uses_declared_order_and_unpads_only_following_dims(built: tuple[Path, Path],
                                                                     tmp_path: Path) -> None:
    import torch

    from neuronbuild.toolchains.model_import import build_eager_model
    from neuronbuild.toolchains.outputs import flatten

    ws, dest = built
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 2, 8, generator=gen)  # batch 1 and seq 2: padded to the bucket (2, 3)
    cache = torch.randn(2, 1, 2, 6, 4, generator=gen)
    torch.save((x, cache), tmp_path / "in.pt")
    proc = subprocess.run([sys.executable, "-c", RUN, str(dest), str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['y', 'state.cache', 'state.norm.0']"
    out = torch.load(tmp_path / "out.pt")
    spec = {"package": "m", "entry": "step:build", "config": {"hidden": 8, "layers": 2}, "seed": 0, "weights": None}
    with torch.no_grad():
        ref = dict(flatten(build_eager_model(spec, ws)(x, cache)))
    assert out["state.cache"].shape == (2, 1, 2, 6, 4)  # layers kept although layers == padded batch
    assert out["y"].shape == (1, 2, 8) and out["state.norm.0"].shape == (1, 2)
    assert float((out["y"] - ref["y"]).abs().max()) < 1e-5
    assert float((out["state.norm.0"] - ref["state.norm.0"]).abs().max()) < 1e-4


def test_comment_only_edit_reruns_the_trace_only(built: tuple[Path, Path], cache_dir: Path, tmp_path: Path) -> None:
    """Early cutoff: the compile is keyed by the trace's output digest too. (Edits a copy of the built workspace:
    the module's other tests read the original, in any order.)"""
    ws = Path(shutil.copytree(built[0], tmp_path / "ws", ignore=shutil.ignore_patterns("deployed", "neuronbuild-out")))
    src = ws / "m/step.py"
    src.write_text(src.read_text().replace("def build(config):", "# How the model is built.\ndef build(config):"))
    before = run_cli(["explain", "//m:step_cpu", "--cache-dir", str(cache_dir)], ws)
    assert "src m/step.py: changed" in before.stdout, before.stdout
    assert "trace output unchanged" in before.stdout
    proc = run_cli(["build", "//m:step_cpu", "--cache-dir", str(cache_dir)], ws)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "3 actions: 2 executed, 1 cached" in out, out  # the trace and the weights action (its sources changed)
    assert "(trace output unchanged: result reused)" in out
    after = run_cli(["explain", "//m:step_cpu", "--cache-dir", str(cache_dir)], ws)
    assert "trace output unchanged: cached, the result of" in after.stdout, after.stdout
    again = run_cli(["build", "//m:step_cpu", "--cache-dir", str(cache_dir)], ws)
    assert again.returncode == 0 and "0 executed" in again.stdout + again.stderr
