"""Expert parallelism with tensor parallelism inside the experts (NxD Inference's moe_ep_degree x moe_tp_degree =
tp_degree): a Qwen2-MoE with a shared expert built at tp_degree 4 as 2 expert-parallel groups of 2 ranks for trn2,
each rank holding its group's 2 of the 4 experts at half their width (fused gate|up part by part), validated on 4
XLA:CPU devices against transformers (logits and greedy tokens, batch 1 and a padded batch); the degrees checked at
analysis with the BUILD line; the moe degrees out of every unsharded fingerprint, and one plan written two ways one
set of fingerprints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_cli, write_ws

SEQ, NEW, MAX_SEQ = 8, 8, 16
# 4 heads (one per rank), 2 kv heads (each on 2 ranks); 4 experts of width 8 (each rank: 2 experts x 4), a shared
# expert of width 16 (4 per rank, over all 4 ranks)
QWEN2_MOE = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32, "num_experts": 4,
             "num_experts_per_tok": 2, "moe_intermediate_size": 8, "shared_expert_intermediate_size": 16}
HEAD = ['load("@neuronbuild//rules:llm.bzl", "hf_causal_lm", "llm_buckets")',
        'neuron_target(name = "trn2", platform = "trn2")',
        f'llm_buckets(name = "serve", batch_sizes = [2], context_lengths = [{SEQ}])']


def _model(name: str, hf: dict[str, object], extra: str = "", tp: int = 4) -> list[str]:
    return [f'hf_causal_lm(name = "{name}", model_type = "qwen2_moe", config = {json.dumps(hf)}, '
            f'weights = "w.safetensors", max_seq = {MAX_SEQ}{extra})',
            f'neuron_compile(name = "{name}_tp{tp}", model = ":{name}", target = ":trn2", tp_degree = {tp}, '
            'buckets = {"context": [":serve_context"], "token": [":serve_token"]})']


@pytest.mark.timeout(1800)
def test_experts_on_a_2x2_grid_at_tp4_validate_and_generate_like_transformers(tmp_path: Path, cache_dir: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from neuronbuild.toolchains.hf_causal_lm import hf_model

    torch.manual_seed(0)
    model = hf_model({"model_type": "qwen2_moe", "hf": QWEN2_MOE, "max_seq": MAX_SEQ})
    g = torch.Generator().manual_seed(1)
    state = {k: v + 0.2 * torch.randn(v.shape, generator=g) if v.dim() == 1 else v  # (norms: not transformers' 1)
             for k, v in model.state_dict().items()}
    ws = write_ws(tmp_path / "ws", {"BUILD": "\n".join(HEAD + _model("moe", QWEN2_MOE, ", moe_ep_degree = 2"))})
    save_file({k: v.detach().clone().contiguous() for k, v in state.items()}, str(ws / "w.safetensors"))
    proc = run_cli(["build", "//...", "--jobs", "2", "--cache-dir", str(cache_dir)], ws)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = ws / "neuronbuild-out/moe_tp4/token_batch2"
    params = json.loads((out / "params.json").read_text())
    shapes = {p["name"]: p["shape"] for p in params["parameters"]}
    experts = "model.layers.0.mlp.experts"
    # the group's 2 experts, each at 4 of its 8 intermediate columns (gate|up: 4 of each); the shared expert 1/4
    assert shapes[f"{experts}.gate_up_proj"] == [2, 8, 16] and shapes[f"{experts}.down_proj"] == [2, 16, 4]
    assert shapes["model.layers.0.mlp.shared_expert.gate_proj.weight"] == [4, 16]
    proc = run_cli(["validate", "//...", "--generate", str(NEW), "--cache-dir", str(cache_dir)], ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("//:moe_tp4 ")]
    assert len(rows) == 2 and all(r.endswith(" ok") for r in rows), proc.stdout
    gen = [line for line in proc.stdout.splitlines() if line.startswith("//:moe_tp4: generate ")]
    assert [g.split()[2] for g in gen] == ["batch1", "batch2_padded"], proc.stdout
    assert all(f": ok ({NEW} tokens x " in g and "tie" not in g for g in gen), proc.stdout


REFUSED = {
    "product": (", moe_ep_degree = 2, moe_tp_degree = 1", QWEN2_MOE,
                "tp_degree 4: the model's moe_tp_degree 1 x moe_ep_degree 2 = 2 must equal it"),
    "not_dividing": (", moe_tp_degree = 3", QWEN2_MOE, "the model's moe_tp_degree 3 must equal it or divide it"),
    # each expert split over its group's 2 ranks: 5 columns cannot be
    "width": (", moe_ep_degree = 2", QWEN2_MOE | {"moe_intermediate_size": 5},
              "tp_degree 4: moe_tp_degree 2 does not divide the model's moe_intermediate_size 5"),
    "experts": (", moe_tp_degree = 1", QWEN2_MOE | {"num_experts": 6},
                "tp_degree 4: moe_ep_degree 4 does not divide its 6 experts"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_moe_degrees_the_grid_or_the_experts_refuse_are_located_analysis_errors(tmp_path: Path, case: str) -> None:
    extra, hf, message = REFUSED[case]
    ws = write_ws(tmp_path / "ws", {"BUILD": "\n".join(HEAD + _model("moe", hf, extra)) + "\n", "w.safetensors": ""})
    proc = run_cli(["plan", "//...", "--cache-dir", str(tmp_path / "cache")], ws)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "BUILD:5" in proc.stderr and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_moe_degrees_are_out_of_unsharded_fingerprints_and_one_plan_is_one_set(tmp_path: Path) -> None:
    from neuronbuild.analysis.planner import plan
    from neuronbuild.loading.target_graph import load_targets

    ws = write_ws(tmp_path / "ws", {"w.safetensors": ""})
    # an expert width tp 4 does not divide (6) but each group's 2 ranks do: the grid is accepted
    hf = QWEN2_MOE | {"moe_intermediate_size": 6}

    def closure(extra: str, tp: int) -> set[str]:
        (ws / "BUILD").write_text("\n".join(HEAD + _model("moe", hf, extra, tp)) + "\n")
        ag = plan(load_targets(ws, ["//:all"]))
        (c,) = ag.compiles
        return {x for _b, fp in c.buckets for x in ag.closure(fp)}

    assert closure(", moe_ep_degree = 2", 1) == closure("", 1) == closure(", moe_tp_degree = 3", 1)
    grid = closure(", moe_ep_degree = 2", 4)
    assert closure(", moe_tp_degree = 2", 4) == closure(", moe_ep_degree = 2, moe_tp_degree = 2", 4) == grid
    assert not grid & closure(", moe_ep_degree = 4", 4)  # whole experts: every sharded action differs
