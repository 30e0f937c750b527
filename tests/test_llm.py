"""LLMs compiled the way they are served (hf_causal_lm, graph families, a KV cache as declared state): tokens generated
from the deployed release bundle in a fresh process where transformers cannot be imported equal transformers'
greedy `generate` on the same weights, for the cpu target and for trn2 (its HLO on XLA:CPU); strict bucket errors;
changing only the token buckets re-runs only token-graph actions."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import copy_example, run_cli

REPO = Path(__file__).resolve().parents[1]
BUNDLE = Path("neuronbuild-out/models/release.tar.zst")
CPU, TRN2 = "//models:llama_cpu", "//models:llama_trn2"
NEW = 24
PROMPTS = {"batch1": [[1, 17, 99, 250, 3, 48, 7]],
           "batch3": [[1, 5, 6, 7, 8], [1, 40, 41, 42, 43, 44, 45, 46, 47], [1, 300, 301]]}

# Runs in a fresh interpreter: transformers is made unimportable before anything else is imported.
GENERATE = r"""
import importlib.abc, json, sys

class NoTransformers(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "transformers" or name.startswith("transformers."):
            raise ImportError("transformers is blocked in this process")

sys.meta_path.insert(0, NoTransformers())
from neuronbuild.runtime import open_cache
from neuronbuild.runtime.router import NoBucketFits

root, label, emulate, prompts, new = sys.argv[1], sys.argv[2], sys.argv[3] or None, json.loads(sys.argv[4]), int(sys.argv[5])
lm = open_cache(root, strict=True, emulate=emulate).causal_lm(label)
out = {k: lm.generate(p, max_new_tokens=new)[:, -new:].tolist() for k, p in prompts.items()}  # eos/pad: the config's
errors = []
for bad in ([list(range(3, 43))], [[1, 2, 3]] * 5):
    try:
        lm.generate(bad, max_new_tokens=4)
        errors.append("no error")
    except NoBucketFits as e:
        errors.append(str(e))
try:
    import transformers  # noqa: F401
    blocked = False
except ImportError:
    blocked = True
print(json.dumps({"tokens": out, "errors": errors, "blocked": blocked,
                  "loaded_transformers": any(m.startswith("transformers") for m in sys.modules)}))
"""


@pytest.fixture(scope="module")
def deployed(built_example, tmp_path_factory: pytest.TempPathFactory) -> Path:  # type: ignore[no-untyped-def]
    ws, _ = built_example
    dest = tmp_path_factory.mktemp("llm_serve") / "cache"
    proc = run_cli(["deploy", str(ws / BUNDLE), "--cache-dir", str(dest)], ws)
    assert proc.returncode == 0, proc.stderr
    return dest


@pytest.fixture(scope="module")
def reference() -> dict[str, list[list[int]]]:
    """transformers' own LlamaForCausalLM on the example's weights: greedy generate with left padding."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    sys.path.insert(0, str(REPO / "examples" / "models"))
    try:
        from make_weights import HF_CONFIG
    finally:
        sys.path.pop(0)
    fields = {k: v for k, v in HF_CONFIG.items() if k != "model_type"}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(str(HF_CONFIG["model_type"]), **fields)).eval()
    model.load_state_dict(load_file(str(REPO / "examples/models/llama.safetensors")), strict=False)
    out = {}
    for key, prompts in PROMPTS.items():
        width = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)  # the config's eos/pad
        out[key] = gen[:, width:].tolist()
    return out


def _generate(root: Path, label: str, emulate: str = "") -> dict:  # type: ignore[type-arg]
    proc = subprocess.run([sys.executable, "-c", GENERATE, str(root), label, emulate, json.dumps(PROMPTS), str(NEW)],
                          capture_output=True, text=True, timeout=600, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.parametrize("label,emulate", [(CPU, ""), (TRN2, "xla-cpu")], ids=["cpu", "trn2-xla-cpu"])
def test_generate_from_the_deployed_bundle_equals_transformers_greedy(
        deployed: Path, reference: dict[str, list[list[int]]], label: str, emulate: str) -> None:
    got = _generate(deployed, label, emulate)
    assert got["blocked"] and not got["loaded_transformers"]
    assert len(got["tokens"]["batch1"][0]) == NEW and len(got["tokens"]["batch3"]) == 3  # batch 3 runs in a 4 bucket
    assert got["tokens"] == reference
    too_long, too_wide = got["errors"]
    assert f"{label}: no context bucket fits batch=1, seq=40; the largest context buckets are [batch=4, seq=32]" \
        in too_long and "strict mode" in too_long
    assert "no context bucket fits batch=5, seq=3" in too_wide


def test_bundle_ships_one_weights_file_and_the_kv_alias(deployed: Path) -> None:
    (release,) = list((deployed / "releases").iterdir())
    manifest = json.loads((release / "manifest.json").read_text())
    assert len(list((release / "weights").iterdir())) == 1  # cpu and trn2, context and token graphs: one file
    graphs = {(g["label"], g["bucket_name"]): g for g in manifest["graphs"]}
    assert set(graphs) == {(lbl, b) for lbl in (CPU, TRN2) for b in ("context_batch1_seq32", "context_batch4_seq32",
                                                                     "token_batch1", "token_batch4")}
    tok = graphs[(CPU, "token_batch4")]
    assert tok["graph"] == "token" and tok["aliases"] == {"kv": "kv"}
    assert [n for n, _ in tok["inputs"]] == ["input_ids", "position_ids", "cache_mask", "slot", "kv"]
    assert graphs[(TRN2, "context_batch1_seq32")]["options"]["opt_level"] == 1  # NxD: context -O1, token -O2
    assert graphs[(TRN2, "token_batch1")]["options"]["opt_level"] == 2


def test_changing_only_token_buckets_reruns_only_token_graph_actions(
        built_example, tmp_path: Path, cache_dir: Path) -> None:  # type: ignore[no-untyped-def]
    ws = copy_example(tmp_path / "ws")
    build = ws / "models" / "BUILD"
    text = build.read_text()
    old = 'name = "llama_cpu",\n    model = ":llama",\n    buckets = {"context": [":serve_context"], "token": [":serve_token"]}'
    assert old in text
    build.write_text(text.replace(old, old.replace('[":serve_token"]', '[":tok3"]')) +
                     '\nneuron_buckets(name = "tok3", shapes = [{"batch": 1}, {"batch": 3}, {"batch": 4}])\n')
    proc = run_cli(["build", CPU, "--jobs", "2", "--cache-dir", str(cache_dir)], ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Every action that ran (a progress line each: Trace, Lower, Compile, ...) is the new token bucket's.
    ran = sorted(re.findall(r"^\[\d+/\d+\] (\w+ //\S+ \[[^\]]+\])", proc.stderr, re.M))
    assert ran == ["Compile //models:llama_cpu [token: batch=3]", "Trace //models:llama [token: batch=3]"], proc.stderr
    assert "11 actions: 2 executed, 9 cached" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


FAMILIES = {
    "llama": {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64},
    "mistral": {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64},
    "qwen2": {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64},
    "gpt2": {"vocab_size": 256, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64},
}


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_shipped_graphs_decode_like_transformers_for_each_family(model_type: str) -> None:
    """The context + token graphs hf_causal_lm declares (run eagerly, fed back as the runtime does) give
    transformers' greedy tokens, with left padding and a padded batch row."""
    import torch

    from neuronbuild.toolchains import hf_causal_lm

    cfg = {"model_type": model_type, "hf": FAMILIES[model_type], "max_seq": 32}
    torch.manual_seed(0)
    ref = hf_causal_lm.hf_model(cfg).eval()
    ctx, tok = hf_causal_lm.context(cfg).eval(), hf_causal_lm.token(cfg).eval()
    ctx.load_state_dict(ref.state_dict())
    tok.load_state_dict(ref.state_dict())
    prompts, seq, batch, new = [[5, 6, 7, 8], [9, 10], [3, 4, 5, 6, 7, 8, 9]], 12, 4, 10
    ids, mask = torch.zeros(batch, seq, dtype=torch.int64), torch.ones(batch, seq, dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, seq - len(p):] = torch.tensor(p)
        mask[i, : seq - len(p)] = 0
    with torch.no_grad():
        out = ctx(ids, mask)
        kv, nxt, got = out["kv"], out["logits"].argmax(-1), []
        cache_mask = torch.zeros(batch, 32, dtype=torch.int64)
        cache_mask[:, :seq] = mask
        pos = mask.sum(-1, keepdim=True)
        for t in range(new):
            got.append(nxt)
            cache_mask[:, seq + t] = 1
            out = tok(nxt[:, None], pos, cache_mask, torch.tensor([seq + t]), kv)
            kv, nxt, pos = out["kv"], out["logits"].argmax(-1), pos + 1
        width = max(len(p) for p in prompts)
        rids, rmask = torch.zeros(3, width, dtype=torch.int64), torch.zeros(3, width, dtype=torch.int64)
        for i, p in enumerate(prompts):
            rids[i, width - len(p):] = torch.tensor(p)
            rmask[i, width - len(p):] = 1
        want = ref.generate(rids, attention_mask=rmask, max_new_tokens=new, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[:, width:]
    assert torch.stack(got, 1)[:3].tolist() == want.tolist()
    assert kv.shape == (2, 2, batch, FAMILIES[model_type].get("num_key_value_heads", 4), 32, 8)


def test_strict_causal_lm_fails_at_open_when_its_graphs_cannot_run_here(deployed: Path) -> None:
    """trn2 graphs without emulation cannot run on this host: a strict causal_lm() says so when opened, naming the
    graphs, instead of returning an object whose first generate fails."""
    from neuronbuild.runtime import open_cache

    with pytest.raises(RuntimeError, match=r"strict mode: //models:llama_trn2"):
        open_cache(deployed, strict=True).causal_lm(TRN2)
