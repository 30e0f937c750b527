"""`neuronbuild audit-keys`: an input that changes an output without changing its key is UNDER-KEYED (exit 1), one
that changes a key without changing the output is over-keyed, the example's keys are sound, moving the workspace,
HOME or the cache dir keeps every key, and a model reading the wall clock fails the determinism check.
The full-mode runs (two baseline builds and a build per variation, each in a fresh cache) are few and tiny."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers import EXAMPLES, run_cli, write_ws
from introspect_ws import tiny_ws

PLUGIN_ENV = {"NEURONBUILD_PLUGINS": "leaky_toolchain",
              "NEURONBUILD_PLUGIN_PATH": str(Path(__file__).resolve().parent / "plugins")}

TOY = '''"""A toy model for the key audit."""
import torch
from torch import nn

SCALE = 3


class Toy(nn.Module):
    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.out = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(input_ids) * SCALE)


def build_model(config):
    return Toy(int(config["vocab"]), int(config["hidden"]))
'''
# A model reading the wall clock into a constant: its trace differs from one run to the next.
WALL_CLOCK = TOY.replace("import torch", "import time\n\nimport torch").replace(
    "* SCALE)", "* float(time.time_ns() % 9973 + 1))")
LEAKY_BUILD = """
neuron_model(name = "toy", srcs = ["toy.py"], entry = "toy:build_model", config = {"vocab": 32, "hidden": 8},
             inputs = {"input_ids": "int64[batch, seq]"})
neuron_buckets(name = "b", dims = {"batch": [1], "seq": [8]})
neuron_target(name = "leaky", platform = "leaky")
compiler_options(name = "opts", leak_scale = 2, leak_revision = 1)
neuron_compile(name = "toy_leaky", model = ":toy", buckets = [":b"], target = ":leaky", options = ":opts")
"""
CLOCK_BUILD = """
neuron_model(name = "clock", srcs = ["clock.py"], entry = "clock:build_model", config = {"vocab": 32, "hidden": 8},
             inputs = {"input_ids": "int64[batch, seq]"})
neuron_compile(name = "clock_leaky", model = ":clock", buckets = [":b"], target = ":leaky")
"""


def _audit(ws: Path, args: list[str], env: dict[str, str] | None = None) -> tuple[int, dict[str, Any], str]:
    proc = run_cli(["audit-keys", *args, "--cache-dir", str(ws.parent / "user-cache"), "--output", "json"], ws, env)
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    return proc.returncode, json.loads(proc.stdout), proc.stderr


def _inputs(report: dict[str, Any], name: str) -> list[dict[str, Any]]:
    found = [r for r in report["inputs"] if r["input"] == name]
    assert found, (name, [r["input"] for r in report["inputs"]])
    return found


def _kind(result: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(k for k in result["kinds"] if k["kind"] == kind)


@pytest.fixture(scope="module")
def leaky_full(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict[str, Any], str]:
    """Full mode over the leaky toolchain's two options (2 baseline builds + 2 variants, each 2 traces and 2
    summaries), beside a model reading the wall clock (the baseline builds are the determinism check)."""
    ws = write_ws(tmp_path_factory.mktemp("leaky") / "ws", {"m/toy.py": TOY, "m/clock.py": WALL_CLOCK,
                                                            "m/BUILD": LEAKY_BUILD + CLOCK_BUILD})
    return _audit(ws, ["--only", "leak_", "--jobs", "2"], PLUGIN_ENV)


def test_an_option_that_changes_the_output_but_not_the_key_is_under_keyed_and_exits_1(
        leaky_full: tuple[int, dict[str, Any], str]) -> None:
    code, report, stderr = leaky_full
    assert code == 1 and report["mode"] == "full"
    scale = _inputs(report, "//m:opts leak_scale")[0]
    assert scale["verdict"] == "UNDER-KEYED" and scale["detail"] == "2 -> 4"
    summarize = _kind(scale, "summarize")  # (only the toy's compile reads these options)
    assert summarize == {"kind": "summarize", "actions": 2, "key_changed": 0, "output_changed": 1,
                         "verdict": "UNDER-KEYED", "note": "the output changed under an unchanged key"}
    assert "audit-keys: [1/2] //m:opts leak_" in stderr and "audit-keys: [2/2]" in stderr  # a line per variation


def test_a_keyed_value_the_output_ignores_is_over_keyed(leaky_full: tuple[int, dict[str, Any], str]) -> None:
    _code, report, _stderr = leaky_full
    revision = _inputs(report, "//m:opts leak_revision")[0]
    assert revision["verdict"] == "over-keyed"
    summarize = _kind(revision, "summarize")
    assert summarize["key_changed"] == 1 and summarize["output_changed"] == 0 and summarize["verdict"] == "over-keyed"


def test_quick_mode_flags_a_declared_option_that_changes_no_key(tmp_path: Path) -> None:
    ws = write_ws(tmp_path / "ws", {"m/toy.py": TOY, "m/BUILD": LEAKY_BUILD})
    code, report, _stderr = _audit(ws, ["--quick"], PLUGIN_ENV)
    assert code == 0 and report["mode"] == "quick"  # (a suspect, not a finding: only full mode sees outputs)
    assert [r["input"] for r in report["inputs"] if r["verdict"] == "unkeyed?"] == ["//m:opts leak_scale"]
    assert _inputs(report, "//m:opts leak_revision")[0]["verdict"] == "ok"  # (its key changes: quick cannot tell)
    # a real source change re-keys the trace; a comment too, by design (listed with its reason)
    change, comment = (next(r for r in _inputs(report, "file m/toy.py") if r["detail"].startswith(p))
                       for p in ("line", "comment"))
    assert change["detail"] == "line 5: 3 -> 6" and _kind(change, "trace")["key_changed"] == 1
    assert comment["verdict"] == "over-keyed" and "early cutoff" in _kind(comment, "trace")["note"]
    assert _kind(comment, "summarize")["verdict"] == "ok" and "through its inputs" in _kind(comment, "summarize")["note"]


@pytest.fixture(scope="module")
def example_quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict[str, Any], str]:
    ws = tmp_path_factory.mktemp("example") / "ws"
    import shutil

    shutil.copytree(EXAMPLES, ws, ignore=shutil.ignore_patterns("neuronbuild-out", "__pycache__", "hf"))
    return _audit(ws, ["--quick", "//models/..."])


def test_the_examples_keys_have_no_under_keyed_input_in_quick_mode(
        example_quick: tuple[int, dict[str, Any], str]) -> None:
    code, report, _stderr = example_quick
    assert code == 0, [r for r in report["inputs"] if r["verdict"] == "UNDER-KEYED"]
    assert report["counts"].get("UNDER-KEYED", 0) == 0 and len(report["inputs"]) > 30
    names = {r["input"] for r in report["inputs"]}
    assert {"//models:llama config", "env PATH", "HOME", "workspace path", "cache dir"} <= names
    # every option a toolchain declares re-keys its compiles ...
    opt = _inputs(report, "//models:context_opts opt_level")[0]
    assert opt["verdict"] == "ok" and _kind(opt, "compile")["key_changed"] > 0
    # ... but auto_cast_type without a cast: neither the HLO nor neuronx-cc's argv reads it, nor does the key (it did)
    (cast_type,) = _inputs(report, "//models:context_opts auto_cast_type")
    assert cast_type["detail"] == "unset (None) -> 'bf16'" and cast_type["verdict"] == "unkeyed?"
    assert all(k["key_changed"] == 0 for k in cast_type["kinds"])
    # a comment re-keys the trace and the weights (made by running the sources) alone: the keys after them change
    # only through the trace's (early cutoff decides)
    comment = next(r for r in _inputs(report, "file models/llama.py") if r["detail"] == "comment")
    assert [k["kind"] for k in comment["kinds"] if k["verdict"] == "over-keyed"] == ["trace", "weights"]
    assert "early cutoff" in _kind(comment, "compile")["note"] and _kind(comment, "compile")["verdict"] == "ok"


def test_moving_the_workspace_home_and_cache_dir_keeps_every_key(
        example_quick: tuple[int, dict[str, Any], str]) -> None:
    _code, report, _stderr = example_quick
    for name in ("workspace path", "HOME", "cache dir", "env PATH", "env TMPDIR", "env OMP_NUM_THREADS"):
        (r,) = _inputs(report, name)
        assert r["verdict"] == "ok" and r["kinds"], r
        assert all(k["key_changed"] == 0 for k in r["kinds"]), r


def test_full_mode_on_a_small_neuron_target_finds_its_keys_sound(tmp_path: Path) -> None:
    ws = tiny_ws(tmp_path / "ws", seqs=(8,))
    code, report, _stderr = _audit(ws, ["--only", "workspace path", "--jobs", "2"], {"NEURONX_CC": ""})
    assert code == 0, report
    assert report["nondeterministic"] == []  # (its baseline, built twice from scratch, is reproducible)
    (moved,) = report["inputs"]
    assert moved["input"] == "workspace path" and moved["verdict"] == "ok"
    assert {k["kind"] for k in moved["kinds"]} == {"trace", "weights", "lower", "compile"}
    # the workspace moved: no key changed, and no output either (no absolute path reached the HLO or the weights)
    assert all(k["key_changed"] == 0 and k["output_changed"] == 0 for k in moved["kinds"]), moved


def test_a_model_reading_the_wall_clock_is_reported_by_the_determinism_check(
        leaky_full: tuple[int, dict[str, Any], str]) -> None:
    _code, report, stderr = leaky_full
    assert report["nondeterministic"] == ["Trace //m:clock [batch=1, seq=8]"]
    assert "audit-keys: nondeterministic: Trace //m:clock [batch=1, seq=8]" in stderr
    # its trace is left out of the verdicts (its outputs differ whatever the input), the other model's are judged
    scale = _inputs(report, "//m:opts leak_scale")[0]
    assert _kind(scale, "trace") == {"kind": "trace", "actions": 2, "key_changed": 0, "output_changed": 0,
                                     "verdict": "nondeterministic",
                                     "note": "1 action(s) not judged: their outputs are not reproducible"}


def test_explain_key_names_each_part_of_a_key_and_the_parts_a_miss_changed(tmp_path: Path) -> None:
    ws = write_ws(tmp_path / "ws", {"m/toy.py": TOY, "m/BUILD": LEAKY_BUILD})
    cache = str(tmp_path / "cache")
    built = run_cli(["build", "--cache-dir", cache], ws, PLUGIN_ENV)
    assert built.returncode == 0, built.stdout + built.stderr
    (ws / "m" / "BUILD").write_text(LEAKY_BUILD.replace("leak_revision = 1", "leak_revision = 3"))
    plan = json.loads(run_cli(["explain", "--cache-dir", cache, "--output", "json"], ws, PLUGIN_ENV).stdout)
    (todo,) = plan["execute"]
    fp = todo["fingerprint"]
    proc = run_cli(["explain", "--key", fp[:10], "--cache-dir", cache], ws, PLUGIN_ENV)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"Summarize //m:toy_leaky [batch=1, seq=8] for leaky  ({fp})"
    assert [ln.split()[0] for ln in lines[1:-1]] == ["action", "bucket", "format", "*options", "target", "toolchain",
                                                      "trace"]
    assert lines[-1].startswith("not cached; against its identity's most recent result (") and \
        lines[-1].endswith(") 1 part differs (*): options")
    data = json.loads(run_cli(["explain", "--key", fp[:10], "--cache-dir", cache, "--output", "json"], ws,
                              PLUGIN_ENV).stdout)
    assert data["differs"] == ["options"] and data["cached"] is False and data["compared_with"]
    parts = {p["name"]: p for p in data["parts"]}
    assert parts["options"]["value"] == {"leak_revision": 3} and len(parts["options"]["digest"]) == 64
    # a trace's model record is split into its parts; an unchanged key says it is cached
    planned = json.loads(run_cli(["plan", "--cache-dir", cache, "--output", "json"], ws, PLUGIN_ENV).stdout)
    (trace_fp,) = planned["cached"]
    trace = run_cli(["explain", "--key", trace_fp[:12], "--cache-dir", cache], ws, PLUGIN_ENV).stdout
    assert "  model.srcs " in trace and "  model.config " in trace and trace.endswith("cached: this key has a result\n")
    bad = run_cli(["explain", "--key", "zz", "--cache-dir", cache], ws, PLUGIN_ENV)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--key zz: no action of this plan" in bad.stderr
