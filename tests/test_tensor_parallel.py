"""Tensor parallelism (tp_degree) on the example llama for trn2: one SPMD HLO module per graph and bucket with its
all-reduces and per-rank shapes, a weights shard per rank, validate on tp XLA:CPU devices within tolerance and
generate from the deployed bundle (rank_<r>/ shards) equal to transformers' greedy tokens; bad degrees rejected with
the BUILD file's location."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import copy_example, run_cli, write_ws

REPO = Path(__file__).resolve().parents[1]
LABEL = "//models:llama_tp2"
PROMPT = [[1, 17, 99, 250, 3, 48, 7]]
NEW = 12
TP_BUILD = """
llm_buckets(name = "tp", batch_sizes = [1], context_lengths = [16])
neuron_compile(
    name = "llama_tp2",
    model = ":llama",
    buckets = {"context": [":tp_context"], "token": [":tp_token"]},
    target = ":trn2",
    tp_degree = 2,
)
neuron_compile(
    name = "llama_tp4",
    model = ":llama",
    buckets = {"context": [":tp_context"], "token": [":tp_token"]},
    target = ":trn2",
    tp_degree = 4,
)
neuron_bundle(name = "tp_release", srcs = [":llama_tp2"])

# A vocabulary no degree divides (509 = 2*255 - 1 = 4*128 - 3), tied embeddings: vocab-parallel with padding.
hf_causal_lm(name = "odd", config = ODD_CONFIG, weights = "odd.safetensors", max_seq = 32)
neuron_compile(name = "odd_tp2", model = ":odd", buckets = {"context": [":tp_context"], "token": [":tp_token"]},
               target = ":trn2", tp_degree = 2)
neuron_compile(name = "odd_tp4", model = ":odd", buckets = {"context": [":tp_context"], "token": [":tp_token"]},
               target = ":trn2", tp_degree = 4)
"""
ODD_CONFIG = {"model_type": "llama", "vocab_size": 509, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
              "max_position_embeddings": 64, "eos_token_id": 2, "bos_token_id": 1, "pad_token_id": 0,
              "tie_word_embeddings": True}


def write_odd_weights(path: Path) -> None:
    """Seeded random weights of ODD_CONFIG, the tied lm_head stored once (under the embedding's name)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(7)
    fields = {k: v for k, v in ODD_CONFIG.items() if k != "model_type"}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **fields))
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"},
              str(path))

GENERATE = r"""
import json, sys
from neuronbuild.runtime import open_cache
lm = open_cache(sys.argv[1], strict=True, emulate="xla-cpu").causal_lm(sys.argv[2])
print(json.dumps(lm.generate(json.loads(sys.argv[3]), max_new_tokens=int(sys.argv[4]))[:, -int(sys.argv[4]):].tolist()))
"""


@pytest.fixture(scope="module")
def tp_ws(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Path:
    ws = copy_example(tmp_path_factory.mktemp("tp") / "ws")
    odd = json.dumps(ODD_CONFIG).replace("true", "True")
    (ws / "models" / "BUILD").write_text((ws / "models" / "BUILD").read_text() + TP_BUILD.replace("ODD_CONFIG", odd))
    write_odd_weights(ws / "models" / "odd.safetensors")
    proc = run_cli(["build", "//models:tp_release", "//models:llama_tp4", "//models:odd_tp2", "//models:odd_tp4",
                    "--jobs", "2", "--cache-dir", str(cache_dir)], ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return ws


# The example llama: hidden 64, 4 heads x 16, 2 kv heads, intermediate 128. At tp 4 each rank has 1 head and 1 kv
# head, the 2 kv heads each replicated on 2 ranks.
SHAPES = {2: {"q_proj": [32, 64], "k_proj": [16, 64], "o_proj": [64, 32], "gate_proj": [64, 64], "down_proj": [64, 64]},
          4: {"q_proj": [16, 64], "k_proj": [16, 64], "o_proj": [64, 16], "gate_proj": [32, 64], "down_proj": [64, 32]}}


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_module_holds_all_reduces_and_per_rank_shapes(tp_ws: Path, tp: int) -> None:
    from jax._src.lib import xla_client as xc

    out = tp_ws / f"neuronbuild-out/models/llama_tp{tp}"
    groups = "{{" + ",".join(map(str, range(tp))) + "}}"
    for bucket in ("context_batch1_seq16", "token_batch1"):
        text = xc.XlaComputation((out / bucket / "model.hlo.pb").read_bytes()).as_hlo_text()
        reduces = [line for line in text.splitlines() if " all-reduce(" in line]
        assert len(reduces) == 5  # the embedding's, o_proj and down_proj of each of the 2 layers
        gathers = [line for line in text.splitlines() if " all-gather(" in line]
        # lm_head's logits: each rank's block of the vocabulary, gathered whole
        assert len(gathers) == 1 and "f32[1,1,512]" in gathers[0] and "dimensions={2}" in gathers[0]
        assert all(f"replica_groups={groups}" in line for line in reduces + gathers)
        params = json.loads((out / bucket / "params.json").read_text())
        assert params["tp"]["degree"] == tp and params["tp"]["collectives"] == "replica"
        shapes = {p["name"]: p["shape"] for p in params["parameters"]}
        for layer, shape in SHAPES[tp].items():
            part = "mlp" if layer.endswith(("gate_proj", "down_proj")) else "self_attn"
            assert shapes[f"model.layers.0.{part}.{layer}.weight"] == shape, layer
        # vocabulary-parallel: each rank holds its block of the embedding and lm_head, and its rank id
        assert shapes["model.embed_tokens.weight"] == shapes["lm_head.weight"] == [512 // tp, 64]
        assert shapes["model.embed_tokens.nb_tp_rank"] == [1]
        kv = [p["shape"] for p in params["parameters"] if p["kind"] == "input" and p["name"] == "kv"]
        assert kv == ([[2, 2, 1, 1, 64, 16]] if bucket.startswith("token") else [])  # this rank's one kv head
        assert sorted(p.name for p in (out / bucket).glob("rank_*.safetensors")) == [
            f"rank_{r}.safetensors" for r in range(tp)]


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_shards_pad_an_undivided_vocabulary_and_hold_one_tied_block(tp_ws: Path, tp: int) -> None:
    from safetensors.torch import load_file

    whole = load_file(str(tp_ws / "models" / "odd.safetensors"))["model.embed_tokens.weight"]
    rows = -(-509 // tp)
    out = tp_ws / f"neuronbuild-out/models/odd_tp{tp}/token_batch1"
    shapes = {p["name"]: p["shape"] for p in json.loads((out / "params.json").read_text())["parameters"]}
    assert shapes["model.embed_tokens.weight"] == shapes["lm_head.weight"] == [rows, 32]
    for r in range(tp):
        shard = load_file(str(out / f"rank_{r}.safetensors"))
        assert shard["model.embed_tokens.nb_tp_rank"].tolist() == [r]
        block = shard["model.embed_tokens.weight"]
        assert "lm_head.weight" not in shard  # tied: the one block serves both (an alias in the file's metadata)
        held = whole[r * rows:(r + 1) * rows]
        assert block.shape == (rows, 32) and bool((block[:len(held)] == held).all())
        assert bool((block[len(held):] == 0).all())  # the padding past the vocabulary


@pytest.mark.parametrize("name", ["llama_tp2", "llama_tp4", "odd_tp2", "odd_tp4"])
def test_tp_validate_and_generate_match_transformers(tp_ws: Path, cache_dir: Path, name: str) -> None:
    label = f"//models:{name}"
    proc = run_cli(["validate", label, "--generate", "8", "--cache-dir", str(cache_dir)], tp_ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith(label + " ")]
    assert len(rows) == 2 and all(line.endswith("  ok") for line in rows)
    assert "generate batch1 against transformers: ok" in proc.stdout


def test_tp2_deployed_bundle_has_rank_dirs_and_generates_transformers_tokens(
        tp_ws: Path, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    dest = tmp_path / "cache"
    proc = run_cli(["deploy", str(tp_ws / "neuronbuild-out/models/tp_release.tar.zst"), "--cache-dir", str(dest)],
                   tp_ws)
    assert proc.returncode == 0, proc.stderr
    (release,) = list((dest / "releases").iterdir())
    assert sorted(p.name for p in (release / "weights").iterdir()) == ["rank_0", "rank_1"]
    manifest = json.loads((release / "manifest.json").read_text())
    for g in manifest["graphs"]:
        assert g["tp"]["degree"] == 2 and g["tp"]["ranks"] == ["rank_0.safetensors", "rank_1.safetensors"]
        assert g["artifacts"]["rank_1.safetensors"]["path"].startswith("weights/rank_1/")

    got = subprocess.run([sys.executable, "-c", GENERATE, str(dest), LABEL, json.dumps(PROMPT), str(NEW)],
                         capture_output=True, text=True, timeout=600, cwd=dest)
    assert got.returncode == 0, got.stderr[-3000:]
    sys.path.insert(0, str(REPO / "examples" / "models"))
    try:
        from make_weights import HF_CONFIG
    finally:
        sys.path.pop(0)
    fields = {k: v for k, v in HF_CONFIG.items() if k != "model_type"}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(str(HF_CONFIG["model_type"]), **fields)).eval()
    model.load_state_dict(load_file(str(REPO / "examples/models/llama.safetensors")), strict=False)
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
    assert json.loads(got.stdout.strip().splitlines()[-1]) == ref[:, ids.shape[1]:].tolist()


@pytest.mark.parametrize("target,tp,message", [
    (":trn2", 3, "tp_degree 3 is not one trn2 accepts (1, 2, 4, 8, 16, 32, 64)"),
    (":cpu", 2, "tp_degree 2 is not one cpu accepts (1)"),
    (":trn2", 8, "tp_degree 8 does not divide the model's 4 attention heads"),
])
def test_bad_tp_degree_is_a_located_error(tmp_path: Path, target: str, tp: int, message: str) -> None:
    ws = copy_example(tmp_path / "ws")
    (ws / "models" / "BUILD").write_text((ws / "models" / "BUILD").read_text() + f"""
neuron_compile(name = "bad_tp", model = ":llama", buckets = {{"context": [":serve_context"], "token": [":serve_token"]}},
               target = "{target}", tp_degree = {tp})
""")
    proc = run_cli(["plan", "//models:bad_tp", "--cache-dir", str(tmp_path / "c")], ws)
    assert proc.returncode != 0
    assert message in proc.stderr and "models/BUILD:" in proc.stderr and "Traceback" not in proc.stderr


# A plain neuron_model (no transformers) sharded by its declared plan: up column-parallel (weight and bias split
# along dim 0), down row-parallel (weight dim 1, followed by an all-reduce; its bias added once).
MLP_SRC = '''import torch
from torch import nn


class Mlp(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


def build(config):
    return Mlp(config["d"], config["h"])
'''
MLP_BUILD = '''
neuron_model(name = "mlp", srcs = ["mlp.py"], entry = "mlp:build", config = {"d": 16, "h": 32},
             inputs = {"x": "float32[batch, 16]"}, tp_plan = {"up.*": 0, "down.weight": 1})
neuron_buckets(name = "bk", shapes = [{"batch": 3}])
neuron_target(name = "trn2", platform = "trn2")
neuron_compile(name = "mlp_tp2", model = ":mlp", buckets = [":bk"], target = ":trn2", tp_degree = 2)
neuron_compile(name = "mlp_tp4", model = ":mlp", buckets = [":bk"], target = ":trn2", tp_degree = 4)
'''


@pytest.fixture(scope="module")
def mlp_ws(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Path:
    ws = write_ws(tmp_path_factory.mktemp("mlp") / "ws", {"pkg/mlp.py": MLP_SRC, "pkg/BUILD": MLP_BUILD})
    proc = run_cli(["build", "//pkg:mlp_tp2", "//pkg:mlp_tp4", "--jobs", "2", "--cache-dir", str(cache_dir)], ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return ws


@pytest.mark.parametrize("tp", [2, 4])
def test_plain_model_plan_gives_per_rank_shapes_an_all_reduce_and_validates(
        mlp_ws: Path, cache_dir: Path, tp: int) -> None:
    from jax._src.lib import xla_client as xc

    out = mlp_ws / f"neuronbuild-out/pkg/mlp_tp{tp}/batch3"
    text = xc.XlaComputation((out / "model.hlo.pb").read_bytes()).as_hlo_text()
    reduces = [line for line in text.splitlines() if " all-reduce(" in line]
    assert len(reduces) == 1 and "replica_groups={{" + ",".join(map(str, range(tp))) + "}}" in reduces[0]
    shapes = {p["name"]: p["shape"] for p in json.loads((out / "params.json").read_text())["parameters"]}
    assert shapes == {"up.weight": [32 // tp, 16], "up.bias": [32 // tp], "down.weight": [16, 32 // tp],
                      "down.bias": [16], "x": [3, 16]}
    assert sorted(p.name for p in out.glob("rank_*.safetensors")) == [f"rank_{r}.safetensors" for r in range(tp)]
    label = f"//pkg:mlp_tp{tp}"
    proc = run_cli(["validate", label, "--cache-dir", str(cache_dir)], mlp_ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith(label + " ")]
    assert len(rows) == 1 and rows[0].endswith("  ok"), proc.stdout


def test_the_example_tp2_target_plans_by_name_and_stays_out_of_wildcards(tmp_path: Path) -> None:
    ws = copy_example(tmp_path / "ws")
    named = run_cli(["plan", "//models:llama_trn2_tp2", "--cache-dir", str(tmp_path / "c")], ws)
    assert named.returncode == 0, named.stderr
    assert "\n13 actions: " in named.stdout, named.stdout  # 4 buckets: trace, lowering, compile each; weights
    every = run_cli(["plan", "//...", "--cache-dir", str(tmp_path / "c")], ws)
    assert every.returncode == 0 and "llama_trn2_tp2" not in every.stdout, every.stdout


def test_a_plan_pattern_matching_no_parameter_fails_the_trace(tmp_path: Path) -> None:
    ws = write_ws(tmp_path / "ws", {"pkg/mlp.py": MLP_SRC,
                                    "pkg/BUILD": MLP_BUILD.replace('"down.weight": 1', '"dwn.weight": 1')})
    proc = run_cli(["build", "//pkg:mlp_tp2", "--cache-dir", str(tmp_path / "c")], ws)
    assert proc.returncode != 0
    assert "tp_plan: pattern 'dwn.weight' matches no parameter of the model" in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


def test_explain_names_a_tp_degree_change(mlp_ws: Path, tmp_path: Path, cache_dir: Path) -> None:
    ws = tmp_path / "ws"
    shutil.copytree(mlp_ws, ws, ignore=shutil.ignore_patterns("neuronbuild-out"))
    build = ws / "pkg" / "BUILD"
    build.write_text(build.read_text().replace('target = ":trn2", tp_degree = 2)', 'target = ":trn2", tp_degree = 8)'))
    proc = run_cli(["explain", "//pkg:mlp_tp2", "--cache-dir", str(cache_dir)], ws)
    assert proc.returncode == 0, proc.stderr
    # The per-rank program depends on the degree: trace, lowering and compile re-run, each naming the change.
    trace, rest = proc.stdout.split("Lower //pkg:mlp [batch=3]")
    assert "Trace //pkg:mlp [batch=3]" in trace and "tp_degree: " in trace
    assert "tp_degree: 2 -> 8" in rest.split("Compile //pkg:mlp_tp2 [batch=3] for trn2")[1]


def test_tp_degree_and_plan_change_only_the_sharded_graphs_fingerprints(tmp_path: Path) -> None:
    from neuronbuild.analysis.planner import plan
    from neuronbuild.loading.target_graph import load_targets

    ws = write_ws(tmp_path / "ws", {"pkg/mlp.py": MLP_SRC})
    unsharded = 'neuron_compile(name = "mlp_tp1", model = ":mlp", buckets = [":bk"], target = ":trn2")\n'

    def closures(build: str) -> dict[str, set[str]]:
        (ws / "pkg" / "BUILD").write_text(build)
        ag = plan(load_targets(ws, ["//pkg:all"]))
        return {str(c.label): {x for _b, fp in c.buckets for x in ag.closure(fp)} for c in ag.compiles}

    base = closures(MLP_BUILD + unsharded)
    assert len(base) == 3 and not base["//pkg:mlp_tp2"] & base["//pkg:mlp_tp4"]  # nothing shared across degrees
    # No plan (and no sharded compile): the unsharded graph's trace, lowering and compile are the same actions.
    no_plan = MLP_BUILD.split("neuron_compile(")[0].replace(', tp_plan = {"up.*": 0, "down.weight": 1}', "")
    assert "tp_plan" not in no_plan and closures(no_plan + unsharded)["//pkg:mlp_tp1"] == base["//pkg:mlp_tp1"]
    changed = closures(MLP_BUILD.replace("tp_degree = 2)", "tp_degree = 8)") + unsharded)
    assert changed["//pkg:mlp_tp1"] == base["//pkg:mlp_tp1"] and changed["//pkg:mlp_tp4"] == base["//pkg:mlp_tp4"]
    assert not changed["//pkg:mlp_tp2"] & base["//pkg:mlp_tp2"]  # its trace, lowering and compile all change


def test_a_bad_plan_value_is_a_located_error(tmp_path: Path) -> None:
    ws = write_ws(tmp_path / "ws", {"pkg/mlp.py": MLP_SRC,
                                    "pkg/BUILD": MLP_BUILD.replace('"down.weight": 1', '"down.weight": "rows"')})
    proc = run_cli(["plan", "//pkg:mlp_tp2", "--cache-dir", str(tmp_path / "c")], ws)
    assert proc.returncode != 0
    assert "pkg/BUILD:" in proc.stderr and "attribute 'tp_plan': 'down.weight'" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_change_to_the_sharding_code_rekeys_sharded_weights_and_traces_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tp_ops cuts the rank shards (the weights action) and builds each rank's program (the traces): its digest is in
    both records at tp > 1, so editing it can never serve shards cut by the old code; unsharded actions keep theirs."""
    from neuronbuild.analysis import analysis_context, tensor_parallel
    from neuronbuild.analysis.planner import plan
    from neuronbuild.loading.target_graph import load_targets

    ws = write_ws(tmp_path / "ws", {"pkg/mlp.py": MLP_SRC, "pkg/w.safetensors": ""})
    build = MLP_BUILD.replace('name = "mlp",', 'name = "mlp", weights = "w.safetensors",') + \
        'neuron_compile(name = "mlp_tp1", model = ":mlp", buckets = [":bk"], target = ":trn2")\n'
    (ws / "pkg" / "BUILD").write_text(build)

    def kinds() -> dict[str, dict[str, str]]:
        ag = plan(load_targets(ws, ["//pkg:all"]))
        return {str(c.label): {ag.actions[x].kind + ("" if ag.actions[x].kind == "weights" else str(b)): x
                               for b, fp in c.buckets for x in ag.closure(fp)} for c in ag.compiles}

    before = kinds()
    real = tensor_parallel.builtin_digest
    edited = lambda m: "edited" if m == tensor_parallel.TP_OPS else real(m)  # noqa: E731
    monkeypatch.setattr(tensor_parallel, "builtin_digest", edited)
    monkeypatch.setattr(analysis_context, "builtin_digest", edited)
    after = kinds()
    assert after["//pkg:mlp_tp1"] == before["//pkg:mlp_tp1"]
    for label in ("//pkg:mlp_tp2", "//pkg:mlp_tp4"):
        assert "weights" in before[label], before[label]
        changed = {k for k in before[label] if after[label].get(k) != before[label][k]}
        assert {"weights"} | {k for k in before[label] if k.startswith("trace")} <= changed, (label, changed)
