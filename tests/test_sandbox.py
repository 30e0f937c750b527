"""Actions run in a sandbox with only their declared inputs: an undeclared input fails instead of being cached."""

from __future__ import annotations

from pathlib import Path

from helpers import run_cli, write_ws

TINY = '''
import json, os
import torch

def build(config):
    here = os.path.dirname(os.path.abspath(__file__))
    extra = json.load(open(os.path.join(here, "extra.json")))  # an input the BUILD file does not declare
    return torch.nn.Embedding(extra["vocab"], 4)
'''
BUILD = '''
neuron_model(name = "m", srcs = ["m.py"], entry = "m:build", inputs = {"x": "int64[batch, seq]"})
neuron_buckets(name = "b", shapes = [{"batch": 1, "seq": 4}])
neuron_target(name = "t", platform = "trn2")
neuron_compile(name = "c", model = ":m", buckets = [":b"], target = ":t")
'''


def test_undeclared_input_fails_the_action_and_is_not_cached(tmp_path: Path) -> None:
    ws = write_ws(tmp_path / "ws", {"pkg/BUILD": BUILD, "pkg/m.py": TINY, "pkg/extra.json": '{"vocab": 10}'})
    cache = tmp_path / "cache"
    proc = run_cli(["build", "//pkg:c", "--cache-dir", str(cache)], ws)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    # (the factory runs in the model's weights action and in its trace: whichever the build started first fails)
    assert "FAILED" in proc.stderr and ("Trace //pkg:m [batch=1, seq=4]" in proc.stderr or
                                        "Weights //pkg:m" in proc.stderr)
    assert "extra.json" in proc.stderr  # the first line of the error names the missing file and how to declare it
    assert "not among its declared inputs" in proc.stderr and "`data`" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list((cache / "v1" / "ac").rglob("*.json"))
    # Declaring it (as a source) makes the build work.
    (ws / "pkg/BUILD").write_text(BUILD.replace('srcs = ["m.py"]', 'srcs = ["m.py", "extra.py"]'))
    (ws / "pkg/extra.py").write_text("")
    (ws / "pkg/m.py").write_text(TINY.replace('"extra.json"', '"extra.py"').replace(
        'json.load(open(os.path.join(here, "extra.py")))', '{"vocab": 10} if os.path.exists(os.path.join(here, "extra.py")) else None'))
    proc = run_cli(["build", "//pkg:c", "--cache-dir", str(cache)], ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4 actions: 4 executed, 0 cached" in proc.stdout  # weights, trace, lower, compile
