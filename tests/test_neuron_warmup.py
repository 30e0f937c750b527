"""The Neuron toolchain's warm-up: jax is imported once, in the pool's zygote, and the workers forked from it do not
import it again; every lowering forked from them writes the same bytes as a lowering in a fresh process (which imports
jax itself)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from helpers import REPO, run_cli, write_ws

MODEL = '''import torch


class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 8)

    def forward(self, x):
        return torch.softmax(self.lin(x), dim=-1)


def build(config):
    return M()
'''

BUILD = '''neuron_model(name = "m", srcs = ["m.py"], entry = "m:build", inputs = {"x": "float32[b, n]"})
neuron_buckets(name = "bk", dims = {"b": [1, 3], "n": [16]})
neuron_target(name = "t", platform = "trn2")
neuron_compile(name = "c", model = ":m", buckets = [":bk"], target = ":t")
'''

LOWER_ALONE = '''
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from neuronbuild.toolchains.neuron_steps import run_lower
assert "jax" not in sys.modules
run_lower({"program": "program.pt2", "inputs": {"x": {"dtype": "float32", "dims": ["b", "n"]}},
           "bucket": {"b": int(sys.argv[3]), "n": 16}, "options": {}}, Path(sys.argv[2]), Path(sys.argv[4]))
'''


def test_jax_is_imported_once_in_the_zygote_and_lowerings_match_fresh_processes(tmp_path: Path) -> None:
    ws = write_ws(tmp_path / "ws", {"pkg/BUILD": BUILD, "pkg/m.py": MODEL})
    cache = tmp_path / "cache"
    events = tmp_path / "events.jsonl"
    proc = run_cli(["build", "//pkg:c", "--jobs", "1", "--cache-dir", str(cache), "--build-event-json-file",
                    str(events)], ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = [json.loads(line) for line in events.read_text().splitlines()]
    lowers = [e for e in got if e["event"] == "action_finished" and e["kind"] == "lower"]
    assert len(lowers) == 2
    # One warm-up, in the zygote (beside the worker, even with one worker), which imported jax; the lowerings ran
    # after it, in a worker forked from the zygote afterwards: no worker imported jax itself.
    (warm,) = [e for e in got if e["event"] == "warm_up_finished"]
    assert warm["worker"] == "zygote" and warm["ok"] and warm["metadata"]["imported"] == "jax", warm
    assert all(e["time"] > warm["time"] for e in got if e["event"] == "action_started" and e["kind"] == "lower")
    logs = sorted((cache / "v1" / "logs").glob("*/*.log"))
    assert not [f for f in logs if "# warm-up in the worker process" in f.read_text()]

    # Each lowering again, alone in a fresh process from the same program: the same bytes.
    traces = {e["fingerprint"]: e for e in got if e["event"] == "action_finished" and e["kind"] == "trace"}
    out = ws / "neuronbuild-out" / "pkg" / "c"
    for b in (1, 3):
        (trace,) = [t for t in traces.values() if f"b={b}," in t["description"]]
        sandbox, alone = tmp_path / f"in{b}", tmp_path / f"alone{b}"
        sandbox.mkdir()
        # The trace's output the Lower reads: the shape-only program (no weights file: the Compile binds it).
        for name in ("program.pt2",):
            digest = trace["outputs"][name]
            (blob,) = [p for p in (cache / "v1" / "cas").glob(f"*/{digest}") if p.is_file()]
            (sandbox / name).write_bytes(blob.read_bytes())
        r = subprocess.run([sys.executable, "-c", LOWER_ALONE, str(REPO), str(sandbox), str(b), str(alone)],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        for name in ("model.hlo.pb", "params.json", "program_constants.safetensors"):
            assert (alone / name).read_bytes() == (out / f"b{b}_n16" / name).read_bytes(), name
