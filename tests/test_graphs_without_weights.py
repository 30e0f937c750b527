"""Graphs without weights (#51): a compile fleet builds an hf_causal_lm's graphs from its config alone (`weights =
None`: no checkpoint in the workspace), byte-identical to those built with the checkpoint present; where the checkpoint
lives, a `model_weights` target streams it, and a bundle of the cached graphs plus those weights deploys and generates
transformers' tokens. Weights of another shape or tensor-parallel degree are refused at deploy, naming the parameter;
new weights re-publish without rebuilding a graph, new graphs without re-running the weights.

One workspace: package `m` (the graphs: what the fleet builds) and package `rel` (the checkpoint, model_weights
targets and bundles: what the checkpoint host builds), one cache shared between the two steps as a remote cache would
be; trn2 graphs (HLO), run on XLA:CPU."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from helpers import run_cli, write_ws

CONFIG = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 128, "eos_token_id": 2, "bos_token_id": 1, "pad_token_id": 0}
OTHER = CONFIG | {"intermediate_size": 96}  # the same model but one width: every MLP weight another shape
LABEL = "//m:llama_trn2"


def _model(name: str, config: dict[str, object], weights: str | None) -> str:
    return (f'hf_causal_lm(name = "{name}", config = {json.dumps(config)}, max_seq = 32'
            f'{f", weights = {json.dumps(weights)}" if weights else ""})\n')


GRAPHS = """load("@neuronbuild//rules:llm.bzl", "hf_causal_lm", "llm_buckets")
{models}llm_buckets(name = "b", batch_sizes = [1], context_lengths = [16])
llm_buckets(name = "b2", batch_sizes = [1], context_lengths = [8])
neuron_target(name = "trn2", platform = "trn2")
neuron_compile(name = "llama_trn2", model = ":llama", buckets = {{"context": [":b_context"], "token": [":b_token"]}},
               target = ":trn2")
# new graphs for the same weights (another context length; the token graph is the same)
neuron_compile(name = "llama_trn2_s8", model = ":llama", buckets = {{"context": [":b2_context"], "token": [":b_token"]}},
               target = ":trn2")
"""
RELEASE = """load("@neuronbuild//rules:llm.bzl", "hf_causal_lm")
model_weights(name = "llama_w", model = "//m:llama", weights = "llama.safetensors")
model_weights(name = "llama_w_tp2", model = "//m:llama", weights = "llama.safetensors", tp_degree = 2)
model_weights(name = "other_w", model = "//m:other", weights = "other.safetensors")
neuron_bundle(name = "release", srcs = ["//m:llama_trn2"], weights = [":llama_w"])
neuron_bundle(name = "release_s8", srcs = ["//m:llama_trn2_s8"], weights = [":llama_w"])
neuron_bundle(name = "wrong_tp", srcs = ["//m:llama_trn2"], weights = [":llama_w_tp2"])
neuron_bundle(name = "wrong_shape", srcs = ["//m:llama_trn2"], weights = [":other_w"])
neuron_bundle(name = "no_weights", srcs = ["//m:llama_trn2"], tags = ["manual"])
"""
PROMPTS = [[1, 17, 99, 250, 3, 48, 7]]
NEW = 8
GENERATE = r"""
import json, sys
from neuronbuild.runtime import open_cache
lm = open_cache(sys.argv[1], strict=True, emulate="xla-cpu").causal_lm(sys.argv[2])
print(json.dumps(lm.generate(json.loads(sys.argv[3]), max_new_tokens=int(sys.argv[4]))[:, -int(sys.argv[4]):].tolist()))
"""


def write_checkpoint(path: Path, config: dict[str, object], seed: int, scale: float = 1.0) -> None:
    """A transformers LlamaForCausalLM of `config` (seeded init, every tensor times `scale`), saved as transformers
    keys."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    fields = {k: v for k, v in config.items() if k != "model_type"}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **fields))
    save_file({k: (v.detach() * scale).contiguous() for k, v in model.state_dict().items()}, str(path))


def transformers_tokens(ckpt: Path) -> list[list[int]]:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in CONFIG.items() if k != "model_type"}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **fields))
    model.load_state_dict(load_file(str(ckpt)))
    model.eval()
    with torch.no_grad():
        out = model.generate(torch.tensor(PROMPTS), max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    return [row[-NEW:] for row in out.tolist()]


def ran(proc: subprocess.CompletedProcess[str]) -> list[str]:
    """The kinds of the actions a build executed ('Trace', 'Lower', 'Compile', 'Weights'), from its progress lines."""
    return re.findall(r"^\[\d+/\d+\] (\w+) ", proc.stdout + proc.stderr, re.M)


def build(ws: Path, cache: Path, *labels: str) -> subprocess.CompletedProcess[str]:
    proc = run_cli(["build", *labels, "--jobs", "2", "--cache-dir", str(cache)], ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def generate(deployed: Path, label: str) -> list[list[int]]:
    proc = subprocess.run([sys.executable, "-c", GENERATE, str(deployed), label, json.dumps(PROMPTS), str(NEW)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def graph_files(out: Path) -> dict[str, bytes]:
    """Every graph file of an output target (bucket/name -> bytes), its weights left out."""
    return {f"{p.parent.name}/{p.name}": p.read_bytes() for p in sorted(out.glob("*/*"))
            if p.name != "constants.safetensors" and not p.name.startswith("rank_")}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The compile fleet's build: the graphs of a model declared without weights, in a workspace holding no weights
    file at all (the checkpoint host's package is there, its checkpoint not yet)."""
    base = tmp_path_factory.mktemp("graphs51")
    ws = write_ws(base / "ws", {"m/BUILD": GRAPHS.format(models=_model("llama", CONFIG, None) +
                                                          _model("other", OTHER, None)),
                                "rel/BUILD": RELEASE})
    cache = base / "cache"
    before = sorted(str(p.relative_to(ws)) for p in ws.rglob("*.safetensors"))
    plan = run_cli(["plan", LABEL, "--cache-dir", str(cache)], ws)
    proc = build(ws, cache, LABEL)
    return {"base": base, "ws": ws, "cache": cache, "before": before, "plan": plan, "proc": proc}


def test_graph_targets_build_with_no_weights_file_in_the_workspace(fleet: dict[str, object]) -> None:
    ws, proc, plan = fleet["ws"], fleet["proc"], fleet["plan"]
    assert isinstance(ws, Path) and isinstance(proc, subprocess.CompletedProcess)
    assert isinstance(plan, subprocess.CompletedProcess)
    assert fleet["before"] == []  # no checkpoint anywhere in the workspace
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert sorted(ran(proc)) == ["Compile", "Compile", "Lower", "Lower", "Trace", "Trace"]  # no Weights
    out = ws / "neuronbuild-out/m/llama_trn2"
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["context_batch1_seq16", "token_batch1"]
    assert not list(out.rglob("constants.safetensors"))  # nothing ships: the graphs alone
    assert (out / "context_batch1_seq16/model.hlo.pb").stat().st_size > 0
    # validate has no weights to run them with: each graph says so, and the summary does not claim it checked them
    val = run_cli(["validate", LABEL, "--cache-dir", str(fleet["cache"])], ws)
    assert val.returncode == 0, val.stdout + val.stderr
    assert val.stdout.count("skipped: built without weights (graphs only)") == 2, val.stdout
    assert "no graph was run: 2 graph(s) built without weights" in val.stdout, val.stdout


def test_graphs_equal_those_built_with_the_weights_present_bytes_and_fingerprints(
        fleet: dict[str, object], tmp_path: Path) -> None:
    ws = fleet["ws"]
    assert isinstance(ws, Path)
    # The same model declared with its checkpoint, built from scratch in another workspace and cache.
    other = write_ws(tmp_path / "ws", {"m/BUILD": GRAPHS.format(models=_model("llama", CONFIG, "llama.safetensors") +
                                                                 _model("other", OTHER, None))})
    write_checkpoint(other / "m/llama.safetensors", CONFIG, seed=0)
    proc = build(other, tmp_path / "cache", LABEL)
    assert "Weights" in ran(proc)  # (this one ships its weights)
    a, b = ws / "neuronbuild-out/m/llama_trn2", other / "neuronbuild-out/m/llama_trn2"
    assert list(b.rglob("constants.safetensors"))
    graphs = graph_files(a)
    assert {k for k in graphs if not k.startswith("manifest")} == {k for k in graph_files(b)}
    assert "context_batch1_seq16/model.hlo.pb" in graphs
    for name, data in graph_files(b).items():
        assert graphs[name] == data, f"{name} differs with the weights present"

    # Fingerprints: every trace, Lower and Compile key is the same with and without a checkpoint (none holds its digest)
    def fps(out: Path) -> list[str]:
        return [bk["fingerprint"] for bk in json.loads((out / "manifest.json").read_text())["buckets"]]

    assert fps(a) == fps(b)


@pytest.fixture(scope="module")
def released(fleet: dict[str, object]) -> dict[str, object]:
    """The checkpoint host: the checkpoint arrives in `rel`, its weights targets and the bundles are built with the
    fleet's cache (the graphs are cache hits)."""
    ws, cache = fleet["ws"], fleet["cache"]
    assert isinstance(ws, Path) and isinstance(cache, Path)
    write_checkpoint(ws / "rel/llama.safetensors", CONFIG, seed=0)
    write_checkpoint(ws / "rel/other.safetensors", OTHER, seed=1)
    proc = build(ws, cache, "//rel:release", "//rel:wrong_tp", "//rel:wrong_shape")
    return {"ws": ws, "cache": cache, "proc": proc}


def test_bundle_of_cached_graphs_and_a_weights_target_deploys_and_generates_transformers_tokens(
        released: dict[str, object], tmp_path: Path) -> None:
    ws, proc = released["ws"], released["proc"]
    assert isinstance(ws, Path) and isinstance(proc, subprocess.CompletedProcess)
    assert sorted(ran(proc)) == ["Weights"] * 3  # the graphs were the fleet's: only the weights ran here
    bundle = ws / "neuronbuild-out/rel/release.tar.zst"
    dep = run_cli(["deploy", str(bundle), "--cache-dir", str(tmp_path / "deployed")], ws)
    assert dep.returncode == 0, dep.stdout + dep.stderr
    assert generate(tmp_path / "deployed", LABEL) == transformers_tokens(ws / "rel/llama.safetensors")


@pytest.mark.parametrize(("bundle", "why"), [
    ("wrong_tp", "its weights are 2 rank shards (tp_degree 2); the graph takes one unsharded weights file"),
    ("wrong_shape", "parameter model.layers.0.mlp.down_proj.weight: the graph takes float32[64, 128], its weights "
                    "file weights/"),
])
def test_weights_of_another_shape_or_tp_degree_are_refused_at_deploy_naming_it(
        released: dict[str, object], tmp_path: Path, bundle: str, why: str) -> None:
    ws = released["ws"]
    assert isinstance(ws, Path)
    dest = tmp_path / "deployed"
    proc = run_cli(["deploy", str(ws / f"neuronbuild-out/rel/{bundle}.tar.zst"), "--cache-dir", str(dest)], ws)
    assert proc.returncode != 0
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert why in err and "weights do not match the graph" in err, err
    if bundle == "wrong_shape":
        assert "holds float32[64, 96]" in err
    assert not (dest / "releases").exists() or not any((dest / "releases").iterdir())  # nothing installed


def test_a_graphs_only_compile_in_a_bundle_without_weights_is_a_located_error(released: dict[str, object]) -> None:
    ws, cache = released["ws"], released["cache"]
    assert isinstance(ws, Path) and isinstance(cache, Path)
    proc = run_cli(["build", "//rel:no_weights", "--cache-dir", str(cache)], ws)
    assert proc.returncode != 0
    assert "rel/BUILD:9:" in proc.stderr and "//m:llama_trn2 is built without weights" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def _members(archive: Path) -> dict[str, str]:
    """A bundle's manifest: each graph's artifacts and weights by sha256 (path -> sha256)."""
    import zstandard

    with open(archive, "rb") as f, zstandard.ZstdDecompressor().stream_reader(f) as z, \
            tarfile.open(fileobj=z, mode="r|") as tar:
        for m in tar:
            if m.name == "manifest.json":
                got = tar.extractfile(m)
                assert got is not None
                manifest = json.loads(got.read())
                return {f"{g['bucket_name']}/{n}": a["sha256"] for g in manifest["graphs"]
                        for n, a in [*g["artifacts"].items(), *([("weights", g["weights"])] if g["weights"] else [])]}
    raise AssertionError("no manifest.json")


def test_new_weights_republish_without_a_graph_action_and_new_graphs_without_the_weights_action(
        released: dict[str, object]) -> None:
    ws, cache = released["ws"], released["cache"]
    assert isinstance(ws, Path) and isinstance(cache, Path)
    bundle = ws / "neuronbuild-out/rel/release.tar.zst"
    first = _members(bundle)
    write_checkpoint(ws / "rel/llama.safetensors", CONFIG, seed=0, scale=0.5)  # new values, same shapes
    proc = build(ws, cache, "//rel:release")
    assert ran(proc) == ["Weights"]  # no Trace, Lower or Compile
    second = _members(bundle)
    assert second.keys() == first.keys()
    changed = sorted(k for k in first if first[k] != second[k])
    assert changed and all(k.endswith("/weights") for k in changed), changed  # the graphs' bytes are the same
    # The reverse: new graphs (another context length) with the same weights: the weights action is not run again.
    proc = build(ws, cache, "//rel:release_s8")
    assert "Weights" not in ran(proc) and sorted(ran(proc)) == ["Compile", "Lower", "Trace"]


def test_key_audit_a_changed_checkpoint_rekeys_the_weights_action_alone(released: dict[str, object]) -> None:
    """By construction: flipping a byte of the checkpoint changes the weights target's key and no trace, Lower or
    Compile key (`audit-keys --quick`, keys only)."""
    ws, cache = released["ws"], released["cache"]
    assert isinstance(ws, Path) and isinstance(cache, Path)
    proc = run_cli(["audit-keys", "--quick", "//rel:release", "--only", "rel/llama.safetensors", "--output", "json",
                    "--cache-dir", str(cache)], ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (flipped,) = json.loads(proc.stdout)["inputs"]
    changed = {k["kind"]: (k["key_changed"], k["actions"]) for k in flipped["kinds"]}
    assert changed == {"weights": (1, 1), "trace": (0, 2), "lower": (0, 2), "compile": (0, 2)}, changed


def test_strict_open_cache_refuses_weights_that_do_not_fit_a_graph_naming_the_parameter(
        released: dict[str, object], tmp_path: Path) -> None:
    """A deployed graph whose recorded parameters differ from its weights file (here: its manifest edited to take
    another shape of one parameter) is refused by a strict open before anything is loaded, naming the parameter."""
    from neuronbuild.runtime import open_cache

    ws = released["ws"]
    assert isinstance(ws, Path)
    dest = tmp_path / "deployed"
    proc = run_cli(["deploy", str(ws / "neuronbuild-out/rel/release.tar.zst"), "--cache-dir", str(dest)], ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (release,) = (dest / "releases").iterdir()
    manifest = json.loads((release / "manifest.json").read_text())
    manifest["graphs"][0]["state"]["model.norm.weight"] = ["float32", [32]]
    (release / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(RuntimeError) as e:
        open_cache(dest, strict=True, emulate="xla-cpu", require=[LABEL])
    assert "weights do not match the graph: parameter model.norm.weight: the graph takes float32[32], its weights " \
           "file weights/" in str(e.value) and "holds float32[64]" in str(e.value), str(e.value)


def test_a_plain_graphs_only_neuron_model_plans_no_weights_action_and_refuses_weights_beside_it(tmp_path: Path) -> None:
    """`neuron_model(graphs_only = True)`: its compiles plan traces and compiles alone (the factory's own parameter
    shapes; no seeded weights are made), with the keys of the same model's compile that ships seeded weights; a
    checkpoint declared beside it is a located error."""
    from neuronbuild.analysis.planner import plan
    from neuronbuild.errors import UserInputError
    from neuronbuild.loading.target_graph import load_targets
    from neuronbuild.plugin_api.actions import WEIGHTS

    build = """neuron_model(name = "net", srcs = ["net.py"], entry = "net:build", inputs = {{"x": "float32[batch, 8]"}}{extra})
neuron_buckets(name = "b", shapes = [{{"batch": 2}}])
neuron_target(name = "cpu", platform = "cpu", isa = "x86-64-v3")
neuron_compile(name = "net_cpu", model = ":net", buckets = [":b"], target = ":cpu")
"""
    src = "import torch\n\ndef build(config):\n    return torch.nn.Linear(8, 4)\n"

    def planned(name: str, extra: str) -> dict[str, str]:
        ws = write_ws(tmp_path / name, {"p/BUILD": build.format(extra=extra), "p/net.py": src})
        ag = plan(load_targets(ws, ["//p:net_cpu"]))
        return {a.kind: a.fingerprint for a in ag.actions.values()}

    graphs = planned("graphs_only", ", graphs_only = True")
    seeded = planned("seeded", "")
    assert WEIGHTS not in graphs and WEIGHTS in seeded
    assert graphs == {k: v for k, v in seeded.items() if k != WEIGHTS}  # the same trace and compile keys
    ws = write_ws(tmp_path / "both", {"p/BUILD": build.format(extra=', graphs_only = True, weights = "w.safetensors"'),
                                      "p/net.py": src, "p/w.safetensors": ""})
    with pytest.raises(UserInputError) as e:
        load_targets(ws, ["//p:net_cpu"])
    assert "graphs_only" in str(e.value) and "p/BUILD:1" in str(e.value.location), e.value
