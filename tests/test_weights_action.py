"""One weights action per (model, dtype, layout) (#28): it streams the checkpoint once for every graph, bucket and
target; traces, Lowers and Compiles work on shapes and never read it (the weights are the module's parameters, bound
at load: they ship beside a Compile's outputs). Counted from the build's events, with neuronx-cc configured (the
stand-in): changing buckets or options never re-runs it; changing a weight value re-runs it alone, not a trace, a
Lower nor a Compile (the NEFFs are unchanged), and the output target and the deployed bundle hold the new weights,
once."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from helpers import REPO, run_cli, write_ws

STANDIN = REPO / "tests" / "standins" / "neuronx-cc"

MODEL = '''import torch


class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 8)
        self.register_buffer("steps", torch.arange(8.0), persistent=False)  # computed here: the graph's own

    def forward(self, x):
        return torch.softmax(self.lin(x) + self.steps, dim=-1)


def build(config):
    return M()
'''

BUILD = '''neuron_model(name = "m", srcs = ["m.py"], entry = "m:build", inputs = {{"x": "float32[b, n]"}},
             weights = "m.safetensors")
neuron_buckets(name = "bk", dims = {{"b": {sizes}, "n": [16]}})
neuron_target(name = "t", platform = "trn2")
compiler_options(name = "o", opt_level = {opt})
neuron_compile(name = "c", model = ":m", buckets = [":bk"], target = ":t", options = ":o")
neuron_bundle(name = "rel", srcs = [":c"])
'''


def _weights(path: Path, scale: float) -> dict[str, Any]:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    state = {"lin.weight": torch.randn(8, 16, generator=g) * scale, "lin.bias": torch.randn(8, generator=g)}
    save_file(state, str(path))
    return state


def _build(ws: Path, cache: Path, events: Path, target: str = "//pkg:c") -> Counter[str]:
    """Build `target` with the neuronx-cc stand-in configured; the kinds of the actions it executed (from its build
    events), counted."""
    events.unlink(missing_ok=True)
    proc = run_cli(["build", target, "--jobs", "2", "--cache-dir", str(cache), "--neuronx-cc", str(STANDIN),
                    "--build-event-json-file", str(events)], ws)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = [json.loads(line) for line in events.read_text().splitlines() if line.strip()]
    return Counter(e["kind"] for e in got if e["event"] == "action_finished")


def test_the_weights_action_runs_once_and_only_when_the_checkpoint_changes(tmp_path: Path) -> None:
    ws = write_ws(tmp_path / "ws", {"pkg/m.py": MODEL, "pkg/BUILD": BUILD.format(sizes="[1, 2]", opt=1)})
    _weights(ws / "pkg" / "m.safetensors", 1.0)
    cache, events = tmp_path / "cache", tmp_path / "events.jsonl"

    first = _build(ws, cache, events)
    assert first == {"weights": 1, "trace": 2, "lower": 2, "compile": 2}  # one stream of the checkpoint for both
    out = ws / "neuronbuild-out" / "pkg" / "c"
    files = sorted(out.glob("*/constants.safetensors"))
    assert len(files) == 2 and len({(f.stat().st_dev, f.stat().st_ino) for f in files}) == 1  # one copy

    # Another bucket and other options: the weights action is not run again (nor the buckets' traces).
    (ws / "pkg" / "BUILD").write_text(BUILD.format(sizes="[1, 2, 4]", opt=2))
    second = _build(ws, cache, events)
    assert second["weights"] == 0 and second["trace"] == 1 and second["lower"] == 1, second
    assert second["compile"] == 3, second  # opt_level changes every Compile

    # Other weight values, same shapes: the weights action alone. Traces, Lowers and Compiles work on shapes (the
    # NEFF is the module's and the flags'), so none runs; the NEFFs are the same bytes.
    neffs = {f.parent.name: f.read_bytes() for f in out.glob("*/model.neff")}
    assert len(neffs) == 3
    state = _weights(ws / "pkg" / "m.safetensors", 2.0)
    third = _build(ws, cache, events)
    assert third == {"weights": 1}, third
    assert {f.parent.name: f.read_bytes() for f in out.glob("*/model.neff")} == neffs
    manifest = json.loads((out / "manifest.json").read_text())
    digests = {b["outputs"]["constants.safetensors"]["digest"] for b in manifest["buckets"]}
    assert len(digests) == 1 and all("program_constants.safetensors" in b["outputs"] for b in manifest["buckets"])
    from safetensors.torch import load_file

    got = load_file(str(out / "b4_n16" / "constants.safetensors"))
    assert set(got) == {"lin.weight", "lin.bias"}  # the state only: the non-persistent buffer is the graph's own
    assert float(got["lin.weight"].abs().max()) > 0 and "steps" in load_file(
        str(out / "b4_n16" / "program_constants.safetensors"))
    assert got["lin.weight"].equal(state["lin.weight"])  # the new values (fp32 model: stored as read)

    # The release bundle (its graphs cached: nothing compiles) deploys with the new weights, and the deployed graph
    # computes with them (its HLO on XLA:CPU).
    assert _build(ws, cache, events, "//pkg:rel") == {}
    dest = tmp_path / "serve"
    proc = run_cli(["deploy", str(ws / "neuronbuild-out" / "pkg" / "rel.tar.zst"), "--cache-dir", str(dest)], ws)
    assert proc.returncode == 0, proc.stderr
    import torch

    from neuronbuild.runtime import open_cache

    model = open_cache(dest, strict=True, emulate="xla-cpu").model("//pkg:c")
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(1))
    want = torch.softmax(x @ state["lin.weight"].T + state["lin.bias"] + torch.arange(8.0), dim=-1)
    got_out = model(x)
    assert torch.allclose(got_out, want, atol=1e-5), (got_out, want)
