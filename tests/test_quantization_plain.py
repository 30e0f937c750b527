"""Weight-only quantization of a plain `neuron_model` (its own torch code, no transformers): every nn.Linear but those
`modules_to_not_convert` names is stored quantized by the weights action (int8 values and per-channel scales), the
trn2 graph binds them, and `validate` finds the graph equal to the eager model on the same dequantized weights; a bad
value is a located error."""

from __future__ import annotations

from pathlib import Path

from helpers import run_cli, write_ws

MODEL = '''
import torch


class MLP(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.up = torch.nn.Linear(n, 4 * n)
        self.down = torch.nn.Linear(4 * n, n)
        self.head = torch.nn.Linear(n, 3)

    def forward(self, x):
        return self.head(self.down(torch.relu(self.up(x))))


def build(config):
    return MLP(config["n"])
'''


def _ws(root: Path, quant: str) -> Path:
    build = ('neuron_buckets(name = "bk", shapes = [{"batch": 4}])\n'
             'neuron_target(name = "trn2", platform = "trn2")\n'
             'neuron_model(name = "mlp", srcs = ["m.py"], entry = "m:build", config = {"n": 16},\n'
             f'             inputs = {{"x": "float32[batch, 16]"}}, weights = "mlp.safetensors", quantization = {quant})\n'
             'neuron_compile(name = "mlp_trn2", model = ":mlp", buckets = [":bk"], target = ":trn2")\n')
    return write_ws(root, {"pkg/BUILD": build, "pkg/m.py": MODEL})


def test_a_plain_models_linears_are_stored_int8_and_its_graph_validates(tmp_path: Path, cache_dir: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    ws = _ws(tmp_path / "ws", '{"dtype": "int8", "modules_to_not_convert": ["head"]}')
    torch.manual_seed(0)
    save_file({"up.weight": torch.randn(64, 16), "up.bias": torch.randn(64), "down.weight": torch.randn(16, 64),
               "down.bias": torch.randn(16), "head.weight": torch.randn(3, 16), "head.bias": torch.randn(3)},
              str(ws / "pkg/mlp.safetensors"))
    proc = run_cli(["build", "//pkg:mlp_trn2", "--cache-dir", str(cache_dir)], ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    files = list((ws / "neuronbuild-out/pkg/mlp_trn2").rglob("constants.safetensors"))
    assert files, list((ws / "neuronbuild-out/pkg/mlp_trn2").rglob("*"))
    state = load_file(str(files[0]))
    assert state["up.weight"].dtype == torch.int8 and state["down.weight"].dtype == torch.int8
    assert state["head.weight"].dtype == torch.float32  # modules_to_not_convert
    scales = [k for k in state if k.startswith("up.") and k not in ("up.weight", "up.bias")]
    assert scales and state[scales[0]].shape == (64, 1), {k: tuple(v.shape) for k, v in state.items()}  # per channel
    proc = run_cli(["validate", "//pkg:mlp_trn2", "--cache-dir", str(cache_dir)], ws)
    assert proc.returncode == 0 and " ok" in proc.stdout, proc.stdout + proc.stderr


def test_a_bad_quantization_of_a_plain_model_is_a_located_error(tmp_path: Path) -> None:
    ws = _ws(tmp_path / "ws", '{"dtype": "int4"}')
    (ws / "pkg/mlp.safetensors").write_bytes(b"")
    proc = run_cli(["plan", "//pkg:mlp_trn2", "--cache-dir", str(tmp_path / "cache")], ws)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr.strip()
    assert err.startswith("pkg/BUILD:4:") and "quantization: dtype 'int4' is not one of int8" in err, err
    assert len(err.splitlines()) == 1, err
