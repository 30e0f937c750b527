"""transformers models as they come (tiny configs, no wrapper code): HF outputs and caches flattened at trace time,
validate on BERT's token_type_ids, served from a process where transformers cannot be imported, and a transformers
version bump re-running exactly the traces of models that import it (one real cpu build, shared)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run_cli, write_ws

pytest.importorskip("transformers")

MODELS = '''
from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM


def bert(config):
    return BertModel(BertConfig(**config))


def llama(config):
    return LlamaForCausalLM(LlamaConfig(**config))
'''

PLAIN = '''
import torch


def build(config):
    return torch.nn.Linear(4, 4)
'''

# BERT: hidden 32 == the bucket's seq, so a router guessing from sizes cuts pooler_output [batch, 32] to [batch, seq].
BUILD = '''
neuron_model(
    name = "bert",
    srcs = ["models.py"],
    entry = "models:bert",
    config = {"vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
              "intermediate_size": 37, "max_position_embeddings": 64},
    inputs = {"input_ids": "int64[batch, seq]", "token_type_ids": "int64[batch, seq]"},
)
neuron_model(
    name = "llama",
    srcs = ["models.py"],
    entry = "models:llama",
    config = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64},
    inputs = {"input_ids": "int64[batch, seq]"},
)
neuron_model(name = "plain", srcs = ["plain.py"], entry = "plain:build", inputs = {"x": "float32[batch, 4]"})
neuron_buckets(name = "b32", shapes = [{"batch": 2, "seq": 32}])
neuron_buckets(name = "b8", shapes = [{"batch": 2, "seq": 8}])
neuron_buckets(name = "p", shapes = [{"batch": 2}])
neuron_target(name = "cpu", platform = "cpu", isa = "native")
neuron_compile(name = "bert_cpu", model = ":bert", buckets = [":b32"], target = ":cpu")
neuron_compile(name = "llama_cpu", model = ":llama", buckets = [":b8"], target = ":cpu")
neuron_compile(name = "plain_cpu", model = ":plain", buckets = [":p"], target = ":cpu")
neuron_bundle(name = "release", srcs = [":bert_cpu", ":llama_cpu"])
'''


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> tuple[Path, Path]:
    ws = write_ws(tmp_path_factory.mktemp("hf") / "ws", {"hf/BUILD": BUILD, "hf/models.py": MODELS,
                                                        "hf/plain.py": PLAIN})
    proc = run_cli(["build", "//hf/...", "--cache-dir", str(cache_dir)], ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    dest = ws / "deployed"
    proc = run_cli(["deploy", str(ws / "neuronbuild-out/hf/release.tar.zst"), "--cache-dir", str(dest)], ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return ws, dest


def test_validate_handles_token_type_ids_and_every_output(built: tuple[Path, Path], cache_dir: Path) -> None:
    ws, _ = built
    proc = run_cli(["validate", "//hf:bert_cpu", "//hf:llama_cpu", "--cache-dir", str(cache_dir)], ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("//hf:")]
    assert len(rows) == 2 and all(line.rstrip().endswith("ok") for line in rows), proc.stdout


RUN = '''
import sys
sys.modules["transformers"] = None  # not importable: artifacts and the runtime must not need it
import torch
from neuronbuild.runtime import open_cache
cache = open_cache(sys.argv[1], strict=True)
ins = torch.load(sys.argv[2])
outs = {label: cache.model(label)(*args) for label, args in ins.items()}
torch.save(outs, sys.argv[3])
print(cache.counters.hit)
'''


def test_served_without_transformers_with_batch_padding(built: tuple[Path, Path], tmp_path: Path) -> None:
    import torch

    from neuronbuild.toolchains.model_import import build_eager_model
    from neuronbuild.toolchains.outputs import flatten

    ws, dest = built
    gen = torch.Generator().manual_seed(1)
    bert_in = (torch.randint(0, 100, (1, 32), generator=gen), torch.randint(0, 2, (1, 32), generator=gen))
    llama_in = (torch.randint(0, 128, (1, 8), generator=gen),)
    torch.save({"//hf:bert_cpu": bert_in, "//hf:llama_cpu": llama_in}, tmp_path / "in.pt")
    proc = subprocess.run([sys.executable, "-c", RUN, str(dest), str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "2"
    outs = torch.load(tmp_path / "out.pt")
    build = (ws / "hf/BUILD").read_text()
    assert "hidden_size\": 32" in build
    for label, entry, args in (("//hf:bert_cpu", "models:bert", bert_in), ("//hf:llama_cpu", "models:llama", llama_in)):
        config = _config(build, entry)
        eager = build_eager_model({"package": "hf", "entry": entry, "config": config, "seed": 0}, ws)
        with torch.no_grad():
            ref = dict(flatten(eager(*args)))
        got = outs[label]
        assert list(got) == list(ref), label  # by name, in order
        for name, t in ref.items():
            assert got[name].shape == t.shape, (label, name)
            assert float((got[name] - t).abs().max()) < 1e-4, (label, name)
    assert outs["//hf:bert_cpu"]["pooler_output"].shape == (1, 32)  # not cut although seq == hidden
    assert "past_key_values.1.values" in outs["//hf:llama_cpu"]  # use_cache on: the cache comes back as tensors


def _config(build: str, entry: str) -> dict[str, int]:
    block = build[build.index(f'entry = "{entry}"'):]
    text = block[block.index("config = ") + len("config = "):block.index("\n    inputs")].rstrip().rstrip(",")
    return dict(json.loads(text))


def test_transformers_bump_reruns_exactly_the_traces_that_import_it(built: tuple[Path, Path], cache_dir: Path,
                                                                   tmp_path: Path) -> None:
    ws, _ = built
    fake = tmp_path / "site"
    dist = fake / "transformers-99.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: transformers\nVersion: 99.0\n")
    same = json.loads(run_cli(["plan", "//hf/...", "--output", "json", "--cache-dir", str(cache_dir)], ws).stdout)
    bumped = run_cli(["plan", "//hf/...", "--output", "json", "--cache-dir", str(cache_dir)], ws,
                     env={"PYTHONPATH": str(fake)})
    assert bumped.returncode == 0, bumped.stderr
    assert _to_build(same) == set()
    assert _to_build(json.loads(bumped.stdout)) == {
        "trace //hf:bert [batch=2, seq=32]", "compile //hf:bert_cpu [batch=2, seq=32] for cpu",
        "trace //hf:llama [batch=2, seq=8]", "compile //hf:llama_cpu [batch=2, seq=8] for cpu"}
    # upgrade-impact takes any recorded distribution.
    proc = run_cli(["upgrade-impact", "--toolchain", "transformers=99.0", "--output", "json",
                    "--cache-dir", str(cache_dir), "//hf/..."], ws)
    assert proc.returncode == 0, proc.stderr
    impact = json.loads(proc.stdout)
    assert impact["total"]["changed"] == 4 and impact["toolchain"]["transformers"]["current"] == ["5.23.0"]


def _to_build(plan: dict) -> set[str]:  # type: ignore[type-arg]
    return {a["identity"] for a in plan["execute"]}
