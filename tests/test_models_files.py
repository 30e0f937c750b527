"""What a model reads besides its sources: declared data files, a shared neuron_py_library, sharded weights from an
HF-style index.json with tied weights and a key prefix (one real cpu build, then validate from the workspace)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_cli, write_ws

LIB = '''
import torch


def head(width, vocab):
    return torch.nn.Linear(width, vocab, bias=False)
'''

MODEL = '''
import json
from pathlib import Path

import torch

from common import layers


class Tied(torch.nn.Module):
    def __init__(self, vocab, width):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.norm = torch.nn.LayerNorm(width)
        self.head = layers.head(width, vocab)
        self.head.weight = self.embed.weight  # tied: the files store it once


    def forward(self, ids):
        return self.head(self.norm(self.embed(ids)))


def build(config):
    cfg = json.loads((Path(__file__).parent / "config.json").read_text())  # a declared data file
    return Tied(cfg["vocab_size"], cfg["width"])
'''

BUILD = '''
neuron_model(
    name = "tied",
    srcs = ["tied.py"],
    entry = "tied:build",
    data = ["config.json"],
    deps = ["//common:layers"],
    weights = "weights/model.safetensors.index.json",
    weights_prefix = "wrapper.",
    inputs = {"ids": "int64[batch, 4]"},
    input_ranges = {"ids": [0, 50]},  # the vocabulary size lives in config.json, not in `config`
)
neuron_buckets(name = "b", shapes = [{"batch": 2}])
neuron_target(name = "cpu", platform = "cpu", isa = "native")
neuron_compile(name = "tied_cpu", model = ":tied", buckets = [":b"], target = ":cpu")
'''


def _write_weights(ws: Path, keys: dict[str, str]) -> dict[str, object]:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(7)
    tensors = {"wrapper.embed.weight": torch.randn(50, 8, generator=gen),
               "wrapper.norm.weight": torch.rand(8, generator=gen) + 0.5, "wrapper.norm.bias": torch.randn(8, generator=gen)}
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for k, shard in keys.items():
        shards.setdefault(shard, {})[k] = tensors[k]
    (ws / "m/weights").mkdir(parents=True, exist_ok=True)
    for shard, part in shards.items():
        save_file(part, str(ws / "m/weights" / shard))
    (ws / "m/weights/model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": keys}))
    return tensors  # type: ignore[return-value]


SHARDS = {"wrapper.embed.weight": "model-00001-of-00002.safetensors",
          "wrapper.norm.weight": "model-00002-of-00002.safetensors",
          "wrapper.norm.bias": "model-00002-of-00002.safetensors"}


def _ws(root: Path) -> Path:
    return write_ws(root, {"common/BUILD": 'neuron_py_library(name = "layers", srcs = ["layers.py"])\n',
                           "common/layers.py": LIB, "common/__init__.py": "",
                           "m/BUILD": BUILD, "m/tied.py": MODEL,
                           "m/config.json": json.dumps({"vocab_size": 50, "width": 8})})


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> tuple[Path, dict[str, object]]:
    ws = _ws(tmp_path_factory.mktemp("files") / "ws")
    tensors = _write_weights(ws, SHARDS)
    proc = run_cli(["build", "//m:tied_cpu", "--cache-dir", str(cache_dir)], ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return ws, tensors


def test_data_library_shards_tied_and_prefix_build_and_validate(built: tuple[Path, dict[str, object]],
                                                                cache_dir: Path) -> None:
    ws, tensors = built
    proc = run_cli(["validate", "//m:tied_cpu", "--cache-dir", str(cache_dir)], ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "every graph is within its tolerance" in proc.stdout
    # The weights really come from the shards (not the seeded init), the tied head included.
    import torch

    from neuronbuild.analysis.planner import plan
    from neuronbuild.loading.target_graph import load_targets
    from neuronbuild.toolchains.model_import import build_eager_model

    ag = plan(load_targets(ws, ["//m:tied_cpu"]))
    trace = next(a for a in ag.actions.values() if a.kind == "trace")
    weights = next(a for a in ag.actions.values() if a.kind == "weights")
    spec = dict(weights.spec["model"])
    model = build_eager_model(spec, ws)
    assert torch.equal(model.embed.weight.detach(), tensors["wrapper.embed.weight"])  # type: ignore[arg-type]
    assert model.head.weight is model.embed.weight
    assert sorted(trace.model["data"]) == ["m/config.json"] and sorted(trace.model["deps"]) == ["common/layers.py"]
    assert "weights" not in trace.model  # a trace works on shapes: the checkpoint is the weights action's
    assert [p for p, _d in weights.model["weights"]["shards"]] == [
        "m/weights/model.safetensors.index.json", "m/weights/model-00001-of-00002.safetensors",
        "m/weights/model-00002-of-00002.safetensors"]


def test_editing_a_data_file_reruns_the_trace_and_a_shard_only_the_weights_action(
        built: tuple[Path, dict[str, object]]) -> None:
    from neuronbuild.analysis.planner import plan
    from neuronbuild.loading.target_graph import load_targets

    ws, _ = built

    def trace_fp() -> str:
        ag = plan(load_targets(ws, ["//m:tied_cpu"]))
        return next(fp for fp, a in ag.actions.items() if a.kind == "trace")

    base = trace_fp()
    cfg = ws / "m/config.json"
    old = cfg.read_text()
    cfg.write_text(old + " ")
    assert trace_fp() != base
    cfg.write_text(old)
    assert trace_fp() == base
    build = ws / "m/BUILD"
    text = build.read_text()
    build.write_text(text.replace('input_ranges = {"ids": [0, 50]}', 'input_ranges = {"ids": [0, 10]}'))
    assert trace_fp() == base  # validate-only: never a rebuild
    build.write_text(text)

    def weights_fp() -> str:
        ag = plan(load_targets(ws, ["//m:tied_cpu"]))
        return next(fp for fp, a in ag.actions.items() if a.kind == "weights")

    shard = ws / "m/weights/model-00002-of-00002.safetensors"
    data = shard.read_bytes()
    before = weights_fp()
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # one weight value changed
    try:
        assert weights_fp() != before
        assert trace_fp() == base  # the trace works on shapes: a weight value is not its input
    finally:
        shard.write_bytes(data)


def test_missing_keys_are_named_and_bad_indexes_are_one_line_errors(tmp_path: Path, cache_dir: Path) -> None:
    ws = _ws(tmp_path / "ws")
    _write_weights(ws, {k: v for k, v in SHARDS.items() if k != "wrapper.norm.bias"})
    proc = run_cli(["build", "//m:tied_cpu", "--cache-dir", str(cache_dir)], ws)
    assert proc.returncode != 0
    assert "missing 1 key(s): norm.bias" in proc.stdout + proc.stderr
    (ws / "m/weights/model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../x.safetensors"}}))
    proc = run_cli(["plan", "//m:tied_cpu"], ws)
    assert proc.returncode == 2 and "names a shard '../x.safetensors'" in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
