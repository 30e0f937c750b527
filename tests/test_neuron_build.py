"""Neuron targets built for real: a model with casts builds for trn1 and trn2 from one shared lowering; flags-only
changes never re-lower; validate runs the exact model.hlo.pb on XLA:CPU; two workspace paths give identical bytes."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from helpers import run_cli, write_ws
from introspect_ws import cli_json, copy_ws, edit

# A small decoder-ish model that casts the way HF models do (.to(dtype), .float()).
MODEL = '''
import torch


class CastingModel(torch.nn.Module):
    def __init__(self, vocab, hidden):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, hidden)
        self.norm = torch.nn.LayerNorm(hidden)
        self.up = torch.nn.Linear(hidden, 2 * hidden)
        self.down = torch.nn.Linear(2 * hidden, vocab, bias=False)

    def forward(self, input_ids):
        h = self.emb(input_ids).to(torch.bfloat16)
        h = self.norm(h.float())
        return self.down(torch.nn.functional.gelu(self.up(h))).to(torch.float32)


def build(config):
    return CastingModel(**config)
'''

BUILD = '''
neuron_model(name = "m", srcs = ["m.py"], entry = "m:build", config = {"vocab": 48, "hidden": 16},
             inputs = {"input_ids": "int64[batch, seq]"})
neuron_buckets(name = "b", shapes = [{"batch": 1, "seq": 8}, {"batch": 2, "seq": 4}])
neuron_target(name = "trn1", platform = "trn1")
neuron_target(name = "trn2", platform = "trn2")
compiler_options(name = "o1", opt_level = 1, model_type = "transformer")
compiler_options(name = "o2", opt_level = 2, lnc = 1)
neuron_compile(name = "c_trn1", model = ":m", buckets = [":b"], target = ":trn1", options = ":o1")
neuron_compile(name = "c_trn2", model = ":m", buckets = [":b"], target = ":trn2", options = ":o2")
neuron_bundle(name = "rel", srcs = [":c_trn1", ":c_trn2"])
'''
NO_CC = {"NEURONX_CC": ""}


def _ok(proc) -> str:  # type: ignore[no-untyped-def]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return str(proc.stdout)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    base = tmp_path_factory.mktemp("neuron_build")
    ws, cache = write_ws(base / "ws", {"pkg/m.py": MODEL, "pkg/BUILD": BUILD}), base / "cache"
    proc = run_cli(["build", "//pkg:all", "--jobs", "2", "--cache-dir", str(cache)], ws, NO_CC)
    _ok(proc)
    return ws, cache, proc.stdout + proc.stderr


def test_trn1_and_trn2_share_one_lowering_per_bucket(built) -> None:  # type: ignore[no-untyped-def]
    ws, _cache, out = built
    # 2 buckets: 2 traces, 2 lowerings (shared by both platforms), 4 compiles (and the bundle)
    assert "9 actions: 9 executed, 0 cached" in out
    ran = re.findall(r"\] (Trace|Lower|Compile|Bundle) (//\S+) \[?([^\]\n(]*)", out)
    assert sorted(r[0] for r in ran).count("Lower") == 2 and [r for r in ran if r[0] == "Lower"][0][1] == "//pkg:m"
    for bucket in ("batch1_seq8", "batch2_seq4"):
        d1, d2 = (ws / f"neuronbuild-out/pkg/{t}/{bucket}" for t in ("c_trn1", "c_trn2"))
        assert {p.name for p in d2.iterdir()} == {"model.hlo.pb", "params.json", "constants.safetensors",
                                                 "program_constants.safetensors", "compile_flags.json"}
        assert (d1 / "model.hlo.pb").read_bytes() == (d2 / "model.hlo.pb").read_bytes()
        a1 = json.loads((d1 / "compile_flags.json").read_text())["argv"]
        a2 = json.loads((d2 / "compile_flags.json").read_text())["argv"]
        assert a1[9:] == ["-O1", "--auto-cast", "none", "--model-type", "transformer"]
        assert a2[9:] == ["-O2", "--auto-cast", "none", "--lnc", "1"]
    assert "NEFFs were not produced" in out


def test_flags_only_change_never_relowers(built, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ws0, cache0, _ = built
    ws, cache = copy_ws(ws0, tmp_path / "ws"), tmp_path / "cache"
    shutil.copytree(cache0, cache)
    edit(ws / "pkg/BUILD", 'opt_level = 2, lnc = 1', 'opt_level = 3, lnc = 2')
    edit(ws / "pkg/BUILD", 'model_type = "transformer"', 'model_type = "generic"')
    explained = cli_json(["explain", "//pkg:c_trn1", "//pkg:c_trn2", "--cache-dir", str(cache)], ws, NO_CC)
    assert {a["description"].split(" ")[0] for a in explained["execute"]} == {"Compile"}
    changes = {c["text"] for a in explained["execute"] for c in a["changes"]}
    assert changes == {"options.opt_level: 2 -> 3", "options.lnc: 1 -> 2", "options.model_type: transformer -> generic"}
    out = _ok(run_cli(["build", "//pkg:c_trn1", "//pkg:c_trn2", "--cache-dir", str(cache)], ws, NO_CC))
    assert "9 actions: 4 executed, 5 cached" in out  # the 4 compiles; weights, traces and lowerings cached
    # auto_cast changes the module: that re-lowers (once, for both platforms' compiles of each bucket)
    edit(ws / "pkg/BUILD", 'opt_level = 3, lnc = 2', 'opt_level = 3, lnc = 2, auto_cast = "matmult"')
    planned = cli_json(["plan", "//pkg:c_trn2", "--cache-dir", str(cache)], ws, NO_CC)
    assert sorted(a["description"].split(" ")[0] for a in planned["execute"]) == ["Compile"] * 2 + ["Lower"] * 2


def test_compiles_without_neuronx_cc_run_in_the_build_process_with_the_new_flags(built, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A Neuron compile without neuronx-cc only writes compile_flags.json (a light step, #53): the build process runs
    it in its sandbox, no worker is forked for it, and what it writes is what a worker wrote."""
    ws0, cache0, _ = built
    ws, cache = copy_ws(ws0, tmp_path / "ws"), tmp_path / "cache"
    shutil.copytree(cache0, cache)
    edit(ws / "pkg/BUILD", 'opt_level = 2, lnc = 1', 'opt_level = 3, lnc = 1')
    events = tmp_path / "events.json"
    out = _ok(run_cli(["build", "//pkg:c_trn2", "--cache-dir", str(cache), "--build-event-json-file", str(events)],
                      ws, NO_CC))
    assert "2 executed" in out
    started = [json.loads(line) for line in events.read_text().splitlines() if '"action_started"' in line]
    assert [(e["kind"], e["worker"]) for e in started] == [("compile", "build")] * 2
    assert len({e["pid"] for e in started}) == 1
    for b in ("batch1_seq8", "batch2_seq4"):
        new = json.loads((ws / "neuronbuild-out/pkg/c_trn2" / b / "compile_flags.json").read_text())
        old = json.loads((ws0 / "neuronbuild-out/pkg/c_trn2" / b / "compile_flags.json").read_text())
        assert "-O3" in new["argv"] and "-O2" in old["argv"]
        assert [a for a in new["argv"] if a != "-O3"] == [a for a in old["argv"] if a != "-O2"]
        assert new["hlo_sha256"] == old["hlo_sha256"]
    # $NEURONBUILD_LIGHT_STEPS=0 (A/B measurements): the same steps run in a worker, as every other action
    edit(ws / "pkg/BUILD", 'opt_level = 3, lnc = 1', 'opt_level = 1, lnc = 1')
    out = _ok(run_cli(["build", "//pkg:c_trn2", "--cache-dir", str(cache), "--build-event-json-file", str(events)],
                      ws, {**NO_CC, "NEURONBUILD_LIGHT_STEPS": "0"}))
    assert "2 executed" in out
    started = [json.loads(line) for line in events.read_text().splitlines() if '"action_started"' in line]
    assert [e["kind"] for e in started] == ["compile"] * 2 and all(e["worker"] != "build" for e in started)


def test_validate_runs_the_hlo_on_xla_cpu(built) -> None:  # type: ignore[no-untyped-def]
    ws, cache, _ = built
    proc = run_cli(["validate", "//pkg:c_trn2", "--cache-dir", str(cache)], ws, NO_CC)
    out = _ok(proc)
    rows = [ln for ln in out.splitlines() if ln.startswith("//pkg:c_trn2")]
    assert len(rows) == 2 and all(ln.endswith(" ok") for ln in rows)
    assert all(float(ln.split()[3]) < 1e-5 for ln in rows)  # fp32 module vs eager
    assert "exact model.hlo.pb run on XLA:CPU" in out


def test_two_workspace_paths_give_identical_modules_and_bundles(built, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ws0, _cache, _ = built
    other = write_ws(tmp_path / "somewhere" / "else" / "checkout", {"pkg/m.py": MODEL, "pkg/BUILD": BUILD})
    out = _ok(run_cli(["build", "//pkg:rel", "--cache-dir", str(tmp_path / "fresh-cache")], other, NO_CC))
    assert " 0 cached" in out  # built from scratch, not served from the first build's cache
    for bucket in ("batch1_seq8", "batch2_seq4"):
        for name in ("model.hlo.pb", "params.json", "compile_flags.json", "constants.safetensors"):
            rel = f"neuronbuild-out/pkg/c_trn2/{bucket}/{name}"
            assert (ws0 / rel).read_bytes() == (other / rel).read_bytes(), rel
    rel = "neuronbuild-out/pkg/rel.tar.zst"
    assert (ws0 / rel).read_bytes() == (other / rel).read_bytes()


def test_a_lowering_failure_names_the_op_and_the_source_line(tmp_path: Path) -> None:
    bad = "        h = h + torch.fft.rfft(h, n=30).real"
    src = MODEL.replace("        return self.down(", f"{bad}\n        return self.down(")
    lineno = src.splitlines().index(bad) + 1
    ws = write_ws(tmp_path / "ws", {"pkg/m.py": src, "pkg/BUILD": BUILD.replace(
        '[{"batch": 1, "seq": 8}, {"batch": 2, "seq": 4}]', '[{"batch": 1, "seq": 8}]')})
    proc = run_cli(["build", "//pkg:c_trn2", "--cache-dir", str(tmp_path / "cache")], ws, NO_CC)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAILED Lower //pkg:m [batch=1, seq=8]" in proc.stderr
    line = next(ln for ln in proc.stderr.splitlines() if "cannot lower" in ln or "Neuron does not support" in ln)
    line = line.split(" (log: ")[0]
    assert "fft" in line and f"pkg/m.py:{lineno} in forward: {bad.strip()}" in line, line
    assert str(tmp_path) not in line and "Traceback" not in proc.stderr
