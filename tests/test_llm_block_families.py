"""The block KV cache (hf_causal_lm kv_layout = "block", #46) on every family of tests/test_llm_families.py's matrix
whose attention the block layout must respect (sliding windows, soft-capping, sliding and full layers, ALiBi,
multi-query, Phi-3's fused q|k|v, Qwen2-MoE's experts) and DeepSeek-V3's latent attention cache, in bf16, and at
tp_degree 2: tiny configs, one workspace, one build, trn2 only (the traced programs lowered to HLO and run on XLA:CPU:
the cheapest target, no AOTInductor compile), 3 graphs per model (context, token, one prefix bucket).
Each model serves the same 4 requests through the block engine, blocks handed out in a shuffled order: two sharing
an 8-token prefix (2 blocks, the second prefilling only its suffix through the prefix graph), a 20-token prompt longer
than the 8-token context bucket (prefilled in chunks), sequences longer than the sliding window, and more blocks
wanted than the 14-block pool holds (preemptions, recomputed through the prefix graph); each request's tokens equal
transformers' greedy `generate` of that request alone (bf16: transformers-bf16's, up to ties within bf16 rounding,
judged as `validate --generate` does). The manifest records the layout, the per-rank pool shape included."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import run_cli, write_ws
from test_llm_families import FAMILIES as MATRIX
from test_llm_new_families import DEEPSEEK_V3

MAX_SEQ, BLOCK, NUM_BLOCKS = 32, 4, 14
# every family of the matrix but llama (tests/test_llm_block_kv.py), and DeepSeek-V3's latent cache; phi3 with 2 kv
# heads (its tp 2 build splits them over the ranks); gemma2's caps within reach of the logits (the matrix's final cap
# of 0.05 saturates most of them at 10x the default weights' scale: fp32 ties between the graphs and transformers);
# falcon's lm_head untied (tied, it repeats its last token: a decode reading the wrong blocks went unnoticed)
CHANGED = {
    "phi3": {"num_attention_heads": 4, "num_key_value_heads": 2},
    "gemma2_cap": {"final_logit_softcapping": 5.0, "attn_logit_softcapping": 2.0},
    "falcon_mqa": {"tie_word_embeddings": False},
}
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    name: (model_type, hf | CHANGED.get(name, {})) for name, (model_type, hf) in MATRIX.items() if name != "llama"
} | {"deepseek_v3": ("deepseek_v3", DEEPSEEK_V3)}
BF16 = ("llama", MATRIX["llama"][1] | {"torch_dtype": "bfloat16"})
MODELS = FAMILIES | {"llama_bf16": BF16}
TP2 = "phi3"  # also built at tp_degree 2

PREFIX = [1, 7, 12, 19, 26, 33, 40, 47]  # 8 tokens: 2 full blocks
# (prompt, new tokens): positions = prompt + new - 1, blocks = ceil(positions / 4)
REQUESTS = [
    (PREFIX + [5], 8),  # 16 positions: 4 blocks
    (PREFIX + [9, 10], 6),  # 15: 4 blocks, the first 2 shared
    ([3 + (5 * i) % 60 for i in range(20)], 6),  # 25: 7 blocks; 20 tokens > the context bucket's 8: chunked
    ([1, 20, 21, 22, 23], 10),  # 14: 4 blocks (4 + 2 + 7 + 4 = 17 > 14: preemptions)
]


def _build_file() -> str:
    lines = [
        'load("@neuronbuild//rules:llm.bzl", "hf_causal_lm")',
        'neuron_target(name = "trn2", platform = "trn2")',
        'neuron_buckets(name = "ctx", shapes = [{"batch": 2, "seq": 8}])',
        'neuron_buckets(name = "tok", shapes = [{"batch": 4}])',
        f'neuron_buckets(name = "pfx", shapes = [{{"batch": 1, "seq": 8, "prefix": {MAX_SEQ - 8}}}])',
        'BUCKETS = {"context": [":ctx"], "token": [":tok"], "prefix": [":pfx"]}',
    ]
    targets = []
    for name, (model_type, hf) in MODELS.items():
        lines += [
            f'hf_causal_lm(name = "{name}", model_type = "{model_type}", config = {json.dumps(hf)}, '
            f'weights = "{name}.safetensors", max_seq = {MAX_SEQ}, continuous_batching = True, '
            f'kv_layout = "block", block_size = {BLOCK}, num_blocks = {NUM_BLOCKS}, prefix_caching = True)',
            f'neuron_compile(name = "{name}_trn2", model = ":{name}", target = ":trn2", buckets = BUCKETS)',
        ]
        targets.append(f'":{name}_trn2"')
    lines.append(
        f'neuron_compile(name = "{TP2}_tp2", model = ":{TP2}", target = ":trn2", buckets = BUCKETS, tp_degree = 2)'
    )
    targets.append(f'":{TP2}_tp2"')
    lines.append(f'neuron_bundle(name = "release", srcs = [{", ".join(targets)}])')
    return "\n".join(lines).replace("true", "True").replace("false", "False") + "\n"


def _model(name: str) -> Any:
    """The family's transformers model, seeded (its weights are the workspace's), initialised at 10x transformers'
    default scale: peaked next-token distributions that follow the context (at the default scale some tiny models
    repeat their last token whatever they attend to) and no near-ties for greedy to flip."""
    import torch

    from neuronbuild.toolchains.hf_causal_lm import hf_model

    model_type, hf = MODELS[name]
    torch.manual_seed(0)
    return hf_model({"model_type": model_type, "hf": hf | {"initializer_range": 0.2}, "max_seq": MAX_SEQ}).eval()


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Path:
    """Every model's block graphs built for trn2 in one build, one bundle, deployed."""
    from safetensors.torch import save_file

    ws = write_ws(tmp_path_factory.mktemp("llm_block_families") / "ws", {"BUILD": _build_file()})
    for name in MODELS:
        save_file(
            {k: v.detach().clone().contiguous() for k, v in _model(name).state_dict().items()},
            str(ws / f"{name}.safetensors"),
        )
    start = time.monotonic()
    proc = run_cli(["build", "//:release", "--jobs", "2", "--cache-dir", str(cache_dir)], ws)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    print(f"\nblock families: {len(MODELS)} models + 1 at tp 2 built in {time.monotonic() - start:.0f} s", flush=True)
    dest = ws.parent / "serve"
    proc = run_cli(["deploy", str(ws / "neuronbuild-out" / "release.tar.zst"), "--dest", str(dest)], ws)
    assert proc.returncode == 0, proc.stderr
    return dest


def _serve(deployed: Path, label: str) -> tuple[Any, list[list[int]]]:
    """The 4 requests through the block engine of `label` (blocks shuffled); the engine and each request's tokens."""
    from neuronbuild.runtime import open_cache

    lm = open_cache(deployed, strict=True, emulate="xla-cpu").causal_lm(label)
    order = list(range(NUM_BLOCKS))
    random.Random(46).shuffle(order)
    eng = lm.engine(block_order=order)
    rids = [eng.add(p, max_new_tokens=n, eos_token_id=None) for p, n in REQUESTS]
    out = eng.run()
    return eng, [out[r] for r in rids]


def _check_engine(eng: Any) -> None:
    """The scenario happened: the shared prefix's blocks referenced, the long prompt chunked, blocks exhausted."""
    c = eng.counters()
    assert c["preemptions"] >= 1 and c["prefix_hits"] >= 2 and c["blocks_in_use"] == 0, c
    assert c["cached_tokens"] >= len(PREFIX), c  # the second request's prefill read the shared prefix's 8 positions
    # the 20-token prompt: 8 through the context graph, then 8 + 4 through the prefix graph (and recomputes)
    assert eng.calls.get(f"prefix_batch1_seq8_prefix{MAX_SEQ - 8}", 0) >= 3, eng.calls


def _reference(name: str) -> list[list[int]]:
    """transformers' greedy tokens of each request alone."""
    import torch

    model = _model(name)
    with torch.no_grad():
        return [
            model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones((1, len(p)), dtype=torch.int64),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(p) :].tolist()
            for p, n in REQUESTS
        ]


@pytest.mark.timeout(1800)  # the fixture's one build counts towards the first test using it
@pytest.mark.parametrize("name", list(FAMILIES))
def test_block_graphs_of_every_family_give_transformers_greedy_tokens_through_shuffled_shared_chunked_preempted_blocks(
    deployed: Path, name: str
) -> None:
    eng, got = _serve(deployed, f"//:{name}_trn2")
    _check_engine(eng)
    assert got == _reference(name), name


def test_block_graphs_at_tp2_give_transformers_tokens_and_the_manifest_records_each_ranks_pool(deployed: Path) -> None:
    from neuronbuild.runtime import open_cache

    eng, got = _serve(deployed, f"//:{TP2}_tp2")
    _check_engine(eng)
    assert got == _reference(TP2)
    layers, heads = MODELS[TP2][1]["num_hidden_layers"], MODELS[TP2][1]["num_key_value_heads"]
    head_dim = MODELS[TP2][1]["hidden_size"] // MODELS[TP2][1]["num_attention_heads"]
    for label, tp in ((f"//:{TP2}_tp2", 2), (f"//:{TP2}_trn2", 1)):
        # (read from the bundle's manifest: not strict, no graph loaded)
        layout = open_cache(deployed, strict=False, emulate="xla-cpu").causal_lm(label).block_layout
        assert layout is not None
        assert {k: layout[k] for k in ("block_size", "num_blocks", "kv_dtype", "shape", "tp_degree", "rank_shape")} == {
            "block_size": BLOCK,
            "num_blocks": NUM_BLOCKS,
            "kv_dtype": "float32",
            "tp_degree": tp,
            "shape": [layers, 2, NUM_BLOCKS + 1, heads, BLOCK, head_dim],
            "rank_shape": [layers, 2, NUM_BLOCKS + 1, heads // tp, BLOCK, head_dim],
        }, (label, layout)


def test_block_graphs_in_bf16_give_transformers_bf16_greedy_tokens_up_to_ties_within_bf16_rounding(
    deployed: Path,
) -> None:
    import torch

    from neuronbuild.toolchains.validate import HfReference, _against_transformers

    eng, got = _serve(deployed, "//:llama_bf16_trn2")
    _check_engine(eng)
    model_type, hf = BF16
    spec = {
        "entry": "neuronbuild.toolchains.hf_block_kv:block_serving_token",
        "config": {"model_type": model_type, "hf": hf, "max_seq": MAX_SEQ},
    }
    ref = HfReference(spec, deployed)  # (no weights file: the seeded model, the workspace's weights)
    ref.model.load_state_dict(_model("llama_bf16").state_dict())
    assert ref.serving and next(ref.model.parameters()).dtype == torch.bfloat16
    for (prompt, _n), tokens in zip(REQUESTS, got, strict=True):
        ok, detail = _against_transformers(
            ref, torch.tensor([prompt]), torch.ones((1, len(prompt)), dtype=torch.int64), torch.tensor([tokens]), 0.0
        )
        assert ok, (prompt, detail)
