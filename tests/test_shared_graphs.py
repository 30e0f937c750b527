"""Two models whose graphs are identical (same code, config and shapes) but whose checkpoints differ (two fine-tunes
of one base model) share their trace, Lower and compile actions (a compile never reads weights), and each target
still ships its own model's weights: in its output directory, in a bundle, and to validate."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import run_cli, write_ws

MODEL = '''
import torch


class M(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.lin = torch.nn.Linear(n, n)

    def forward(self, x):
        return self.lin(x).relu()


def build(config):
    return M(config["n"])
'''


def _weights(path: Path, scale: float) -> None:
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(0)
    save_file({"lin.weight": torch.randn(8, 8) * scale, "lin.bias": torch.randn(8) * scale}, str(path))


def test_identical_graphs_of_two_checkpoints_ship_each_its_own_weights(tmp_path: Path, cache_dir: Path) -> None:
    lines = ['neuron_buckets(name = "bk", shapes = [{"batch": 2}])', 'neuron_target(name = "trn2", platform = "trn2")']
    for name in ("base", "tuned"):
        lines += [f'neuron_model(name = "{name}", srcs = ["m.py"], entry = "m:build", config = {{"n": 8}}, '
                  f'inputs = {{"x": "float32[batch, 8]"}}, weights = "{name}.safetensors")',
                  f'neuron_compile(name = "{name}_trn2", model = ":{name}", buckets = [":bk"], target = ":trn2")']
    lines.append('neuron_bundle(name = "release", srcs = [":base_trn2", ":tuned_trn2"])')
    ws = write_ws(tmp_path / "ws", {"pkg/BUILD": "\n".join(lines) + "\n", "pkg/m.py": MODEL})
    _weights(ws / "pkg/base.safetensors", 1.0)
    _weights(ws / "pkg/tuned.safetensors", 3.0)
    proc = run_cli(["build", "//pkg:all", "--jobs", "2", "--cache-dir", str(cache_dir)], ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # one trace, one Lower, one compile shared; a weights action per checkpoint
    assert "6 actions: 5 executed" in proc.stdout or "5 actions: 5 executed" in proc.stdout, proc.stdout

    from safetensors.torch import load_file

    out = ws / "neuronbuild-out/pkg"
    manifests = {n: json.loads((out / f"{n}_trn2/manifest.json").read_text()) for n in ("base", "tuned")}
    assert manifests["base"]["buckets"][0]["fingerprint"] == manifests["tuned"]["buckets"][0]["fingerprint"]
    for name in ("base", "tuned"):
        files = [p for p in (out / f"{name}_trn2").rglob("*.safetensors") if "program_constants" not in p.name]
        assert files, list((out / f"{name}_trn2").rglob("*"))
        got = {k: v for f in files for k, v in load_file(str(f)).items()}
        want = load_file(str(ws / f"pkg/{name}.safetensors"))
        assert set(want) <= set(got) and all(got[k].equal(want[k]) for k in want), name
    # the bundle holds both weights files, each graph naming its own
    proc = run_cli(["validate", "//pkg:all", "--cache-dir", str(cache_dir)], ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    dest = tmp_path / "serve"
    proc = run_cli(["deploy", str(ws / "neuronbuild-out/pkg/release.tar.zst"), "--dest", str(dest)], ws)
    assert proc.returncode == 0, proc.stderr
    import torch

    from neuronbuild.runtime import open_cache

    x = torch.randn(2, 8)
    cache = open_cache(str(dest), emulate="xla-cpu")
    for name in ("base", "tuned"):
        w = load_file(str(ws / f"pkg/{name}.safetensors"))
        want_y = torch.relu(x @ w["lin.weight"].T + w["lin.bias"])
        got_y = cache.model(f"//pkg:{name}_trn2")(x)
        got_y = got_y[0] if isinstance(got_y, tuple | list) else got_y
        assert torch.allclose(got_y, want_y, atol=1e-5), name
