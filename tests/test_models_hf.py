"""transformers models as they come (tiny configs, no wrapper code): HF outputs and caches flattened at trace time,
validate on BERT's token_type_ids, served from a process where transformers cannot be imported, and a transformers
version bump re-running exactly the traces of models that import it (one real cpu build, shared)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import copy_example, run_cli

pytest.importorskip("transformers")

LABELS = ("//hf:llama_cpu", "//hf:gpt2_cpu", "//hf:bert_cpu", "//hf:vit_cpu")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> tuple[Path, Path]:
    """examples/ with examples/hf, whose release (4 models) is built, then deployed."""
    ws = copy_example(tmp_path_factory.mktemp("hf") / "ws", hf=True)
    proc = run_cli(["build", "//hf:release", "--cache-dir", str(cache_dir)], ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    dest = ws / "deployed"
    proc = run_cli(["deploy", str(ws / "neuronbuild-out/hf/release.tar.zst"), "--cache-dir", str(dest)], ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return ws, dest


def test_validate_handles_token_type_ids_and_every_output(built: tuple[Path, Path], cache_dir: Path) -> None:
    ws, _ = built
    proc = run_cli(["validate", "//hf/...", "--cache-dir", str(cache_dir)], ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("//hf:")]
    assert len(rows) == 4 and all(line.rstrip().endswith("ok") for line in rows), proc.stdout


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

    from neuronbuild.analysis.planner import plan
    from neuronbuild.loading.target_graph import load_targets
    from neuronbuild.toolchains.model_import import build_eager_model
    from neuronbuild.toolchains.outputs import flatten

    ws, dest = built
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (1, 32), generator=gen)  # batch 1: padded to the bucket's 2
    ins = {"//hf:llama_cpu": (ids,), "//hf:gpt2_cpu": (ids,),
           "//hf:bert_cpu": (ids, torch.randint(0, 2, (1, 32), generator=gen)),
           "//hf:vit_cpu": (torch.randn(1, 3, 32, 32, generator=gen),)}
    torch.save(ins, tmp_path / "in.pt")
    proc = subprocess.run([sys.executable, "-c", RUN, str(dest), str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "4"
    outs = torch.load(tmp_path / "out.pt")
    ag = plan(load_targets(ws, list(LABELS)))
    for ct in ag.compiles:
        label = str(ct.label)
        eager = build_eager_model(ag.model_of(ct.buckets[0][1]), ws)  # the trace's model with the checkpoint it binds
        with torch.no_grad():
            ref = dict(flatten(eager(*ins[label])))
        got = outs[label]
        assert list(got) == list(ref), label  # by name, in order
        for name, t in ref.items():
            assert got[name].shape == t.shape, (label, name)
            assert float((got[name] - t).abs().max()) < 1e-4, (label, name)
    assert outs["//hf:bert_cpu"]["pooler_output"].shape == (1, 32)  # not cut although seq == hidden == 32
    assert "past_key_values.1.values" in outs["//hf:gpt2_cpu"]  # use_cache: the cache comes back as tensors
    assert "past_key_values.1.values" in outs["//hf:llama_cpu"]


def test_transformers_bump_reruns_exactly_the_traces_that_import_it(built: tuple[Path, Path], cache_dir: Path,
                                                                   tmp_path: Path) -> None:
    ws, _ = built
    fake = tmp_path / "site"
    dist = fake / "transformers-99.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: transformers\nVersion: 99.0\n")
    # //models:llama_tiny_cpu (plain torch, no transformers): whether built or not, the bump must not change that.
    patterns = [*LABELS, "//models:llama_tiny_cpu"]
    same = run_cli(["plan", *patterns, "--output", "json", "--cache-dir", str(cache_dir)], ws)
    bumped = run_cli(["plan", *patterns, "--output", "json", "--cache-dir", str(cache_dir)], ws,
                     env={"PYTHONPATH": str(fake)})
    assert same.returncode == 0 and bumped.returncode == 0, same.stderr + bumped.stderr
    before, after = _to_build(json.loads(same.stdout)), _to_build(json.loads(bumped.stdout))
    assert all("llama_tiny" in i for i in before)
    buckets = (("llama", "batch=2, seq=32"), ("gpt2", "batch=2, seq=32"), ("bert", "batch=2, seq=32"),
               ("vit", "batch=2"))
    assert after - before == {f"{kind} //hf:{m}{suffix} [{dims}]{tail}" for m, dims in buckets
                              for kind, suffix, tail in (("trace", "", ""), ("compile", "_cpu", " for cpu"))} | {
        f"weights //hf:{m}" for m, _dims in buckets}  # the module's state is transformers' code too
    # The rebuild under the bump: the four traces run again (each progress line is an action that ran); their
    # programs are byte-identical (the same transformers code is imported), so each compile is reused by early cutoff,
    # not executed.
    proc = run_cli(["build", *LABELS, "--jobs", "2", "--cache-dir", str(cache_dir)], ws, env={"PYTHONPATH": str(fake)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ran = re.findall(r"^\[\d+/\d+\] (\w+) (//\S+) \[([^\]]+)\](.*)$", proc.stderr, re.M)
    assert sorted((k, lbl, b) for k, lbl, b, tail in ran if "result reused" not in tail) == sorted(
        ("Trace", f"//hf:{m}", dims) for m, dims in buckets), proc.stderr
    assert sorted((k, lbl, b) for k, lbl, b, tail in ran if "result reused" in tail) == sorted(
        ("Compile", f"//hf:{m}_cpu", dims) for m, dims in buckets), proc.stderr
    assert re.search(r"\b8 executed\b", proc.stdout + proc.stderr), proc.stdout + proc.stderr  # + 4 weights actions
    again = run_cli(["plan", *LABELS, "--output", "json", "--cache-dir", str(cache_dir)], ws,
                    env={"PYTHONPATH": str(fake)})
    assert again.returncode == 0 and _to_build(json.loads(again.stdout)) == set(), again.stdout + again.stderr
    # upgrade-impact takes any recorded distribution.
    proc = run_cli(["upgrade-impact", "--toolchain", "transformers=99.0", "--output", "json",
                    "--cache-dir", str(cache_dir), *patterns], ws)
    assert proc.returncode == 0, proc.stderr
    impact = json.loads(proc.stdout)
    assert impact["total"]["changed"] == 12  # 4 traces, 4 compiles, 4 weights actions
    assert impact["toolchain"]["transformers"]["current"] == ["5.23.0"]


def _to_build(plan: dict) -> set[str]:  # type: ignore[type-arg]
    return {a["identity"] for a in plan["execute"]}


TRACE = '''
import hashlib, json, sys
from pathlib import Path
from neuronbuild.toolchains.trace import run_trace
specs = json.loads(sys.argv[1])
for i, spec in enumerate(specs):  # earlier specs: what the worker ran before
    run_trace(spec, Path(sys.argv[2]), Path(sys.argv[3]) / str(i))
print(hashlib.sha256((Path(sys.argv[3]) / str(len(specs) - 1) / "program.pt2").read_bytes()).hexdigest())
'''


def test_a_trace_is_the_same_in_a_fresh_and_in_a_used_worker(built: tuple[Path, Path], tmp_path: Path) -> None:
    """HF output types never reach the program: the llama trace's bytes do not depend on whether the worker had
    imported transformers (and traced BERT) before."""
    from neuronbuild.analysis.planner import plan
    from neuronbuild.loading.target_graph import load_targets

    ws, _ = built
    ag = plan(load_targets(ws, ["//hf:llama_cpu", "//hf:bert_cpu"]))
    spec = {str(ct.label): ag.trace_of(ct.buckets[0][1]).spec for ct in ag.compiles}
    digests = []
    for n, specs in enumerate(([spec["//hf:llama_cpu"]], [spec["//hf:bert_cpu"], spec["//hf:llama_cpu"]])):
        proc = subprocess.run([sys.executable, "-c", TRACE, json.dumps(specs), str(ws), str(tmp_path / str(n))],
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr
        digests.append(proc.stdout.strip())
    assert digests[0] == digests[1]
