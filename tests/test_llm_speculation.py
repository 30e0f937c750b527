"""Speculative decoding (hf_causal_lm speculation = {...}): one tiny workspace built once, cpu and trn2 (its HLO on
XLA:CPU), a Llama target at speculation lengths 3 (a random 1-layer draft) and 5 (a draft with the target's own
config and weights). Greedy speculative output equals transformers' greedy `generate` of every request of a
continuous batch; a draft equal to the target gets every proposal accepted; a bundle built for k = 5 refuses to serve
k = 3 (or another draft) with the reason; the speculation enters only the verify graphs' fingerprints; sampled
speculation (the rejection-sampling rule) follows the target's sampler distribution."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers import run_cli, write_ws

HF = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "max_position_embeddings": 64, "eos_token_id": 2, "bos_token_id": 1, "pad_token_id": 0}
SMALL = HF | {"num_hidden_layers": 1, "intermediate_size": 32}
MAX_SEQ, MAX_BATCH = 32, 4
PROMPTS = [[1, 5, 6, 7], [1, 40, 41, 42, 43, 44, 45, 46, 47], [1, 30], [1, 9, 8, 7, 6, 5, 4, 3, 2, 10, 11, 12],
           [1, 77, 78], [1, 100, 101, 102, 103, 104]]
NEW = [6, 10, 4, 8, 12, 5]
SERVE = f"max_seq = {MAX_SEQ}, continuous_batching = True, max_batch = {MAX_BATCH}, on_device_sampling = True, " \
        "output_logits = True"


def _build_file(spec3: str = '{"draft": ":small", "length": 3}', spec5: str = '{"draft": ":same", "length": 5}') -> str:
    return f'''load("@neuronbuild//rules:llm.bzl", "hf_causal_lm")
neuron_target(name = "trn2", platform = "trn2")
neuron_target(name = "cpu", platform = "cpu", isa = "native")
# two targets on one set of weights, speculating 3 tokens with a random 1-layer draft and 5 with a draft equal to the
# target (same config and weights: its context and token graphs are the targets' own, built once)
hf_causal_lm(name = "llama3", model_type = "llama", config = {json.dumps(HF)}, weights = "llama.safetensors",
             {SERVE}, speculation = {spec3})
hf_causal_lm(name = "llama5", model_type = "llama", config = {json.dumps(HF)}, weights = "llama.safetensors",
             {SERVE}, speculation = {spec5})
hf_causal_lm(name = "same", model_type = "llama", config = {json.dumps(HF)}, weights = "llama.safetensors", {SERVE})
hf_causal_lm(name = "small", model_type = "llama", config = {json.dumps(SMALL)}, weights = "small.safetensors",
             {SERVE})
neuron_buckets(name = "ctx", shapes = [{{"batch": 2, "seq": 16}}])
neuron_buckets(name = "tok", shapes = [{{"batch": 4}}])
TARGET = {{"context": [":ctx"], "token": [":tok"], "verify": [":tok"]}}
DRAFT = {{"context": [":ctx"], "token": [":tok"]}}
[neuron_compile(name = m + "_" + t, model = ":" + m, target = ":" + t, buckets = TARGET if m.startswith("llama") else DRAFT)
 for m in ["llama3", "llama5", "same", "small"] for t in ["cpu", "trn2"]]
neuron_bundle(name = "release", srcs = [":%s_%s" % (m, t) for m in ["llama3", "llama5", "same", "small"]
                                        for t in ["cpu", "trn2"]])
'''


def _model(hf: dict[str, Any], seed: int) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **hf, initializer_range=0.2)).eval()


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Path:
    from safetensors.torch import save_file

    ws = write_ws(tmp_path_factory.mktemp("llm_speculation") / "ws", {"BUILD": _build_file()})
    for name, hf, seed in (("llama", HF, 0), ("small", SMALL, 1)):
        sd = _model(hf, seed).state_dict()
        save_file({k: v.detach().contiguous() for k, v in sd.items()}, str(ws / f"{name}.safetensors"))
    proc = run_cli(["build", "//:release", "--jobs", "2", "--cache-dir", str(cache_dir)], ws)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    dest = ws.parent / "serve"
    proc = run_cli(["deploy", str(ws / "neuronbuild-out" / "release.tar.zst"), "--dest", str(dest)], ws)
    assert proc.returncode == 0, proc.stderr
    return dest


@pytest.fixture(scope="module")
def reference(deployed: Path) -> Any:
    from safetensors.torch import load_file

    model = _model(HF, 0)
    model.load_state_dict(load_file(str(deployed.parent / "ws" / "llama.safetensors")))
    return model


def _greedy(model: Any, prompt: list[int], new: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()  # type: ignore[no-any-return]


def _lm(deployed: Path, label: str) -> Any:
    from neuronbuild.runtime import open_cache

    return open_cache(deployed, strict=True, emulate="xla-cpu" if label.endswith("trn2") else None).causal_lm(label)


@pytest.mark.parametrize("label", ["//:llama3_cpu", "//:llama5_cpu", "//:llama3_trn2", "//:llama5_trn2"],
                         ids=["cpu-k3", "cpu-k5-same-draft", "trn2-xla-cpu-k3", "trn2-xla-cpu-k5-same-draft"])
def test_greedy_speculation_equals_transformers_generate_for_every_request_in_a_batch(
        deployed: Path, reference: Any, label: str) -> None:
    from neuronbuild.runtime.speculative import SpeculativeEngine

    lm = _lm(deployed, label)
    k = 3 if "llama3" in label else 5
    assert lm.speculation == {"draft": "//:small" if k == 3 else "//:same", "length": k, "fused": False}
    eng = lm.engine()
    assert isinstance(eng, SpeculativeEngine) and eng.k == k
    rids = [eng.add(p, max_new_tokens=n, eos_token_id=None) for p, n in zip(PROMPTS, NEW, strict=True)]
    busy = []
    while eng.pending:
        eng.step()
        busy.append(len(eng.active))
    out = eng.finished
    for rid, prompt, new in zip(rids, PROMPTS, NEW, strict=True):
        assert out[rid] == _greedy(reference, prompt, new), (label, rid)
    assert max(busy) == MAX_BATCH and eng.free == list(range(MAX_BATCH))
    stats = [eng.stats[r] for r in rids]
    assert all(s["proposed"] == k * s["verify_calls"] > 0 for s in stats)
    if k == 5:  # the draft is the target: every proposal accepted, k + 1 tokens per verify call
        assert all(s["accepted"] == s["proposed"] for s in stats), stats
        assert all(s["verify_calls"] == -(-(n - 1) // (k + 1)) for s, n in zip(stats, NEW, strict=True)), stats
    else:  # a random draft: some proposals rejected (rolled back), and the output is the target's all the same
        assert sum(s["accepted"] for s in stats) < sum(s["proposed"] for s in stats)
    # one verify call per step for the whole batch, after k draft token calls (+ catch-ups)
    assert eng.calls["verify_batch4"] >= max(s["verify_calls"] for s in stats)
    assert eng.calls["draft_token_batch4"] >= k * eng.calls["verify_batch4"]
    # generate() speculates too, and stays transformers' greedy decoding
    gen = lm.generate([PROMPTS[2], PROMPTS[0]], max_new_tokens=7, eos_token_id=None)
    assert gen[:, -7:].tolist() == [_greedy(reference, PROMPTS[2], 7), _greedy(reference, PROMPTS[0], 7)]


def test_a_bundle_built_for_k5_refuses_to_serve_k3_or_another_draft_with_the_reason(deployed: Path) -> None:
    from neuronbuild.runtime import NoBucketFits
    from neuronbuild.runtime.speculative import SpeculationMismatch

    lm = _lm(deployed, "//:llama5_cpu")
    with pytest.raises(SpeculationMismatch, match=r"speculation length 3 requested, but the bundle was built for "
                                                  r"length 5 \(its verify graph scores 6 positions per row"):
        lm.engine(speculation={"length": 3})
    with pytest.raises(SpeculationMismatch, match="draft //:small requested, but the bundle was built with draft //:same"):
        lm.engine(speculation={"draft": "//:small"})
    with pytest.raises(SpeculationMismatch, match="given, but the bundle was built with draft //:same"):
        lm.engine(speculation={"draft": _lm(deployed, "//:small_cpu")})
    with pytest.raises(SpeculationMismatch, match="the bundle has no verify graphs"):
        _lm(deployed, "//:same_cpu").engine(speculation={"length": 5})
    eng = lm.engine(speculation={"length": 5, "draft": "//:same"})  # the bundle's own configuration is served
    with pytest.raises(NoBucketFits, match="speculation length 5 need 33 cache slots"):
        eng.add(PROMPTS[0], max_new_tokens=25)  # 4 + 25 fit the cache, not the 5 slots a verify call writes past it
    assert type(lm.engine(speculation=False)).__name__ == "Engine"


def test_speculation_enters_only_the_verify_graphs_fingerprints(tmp_path: Path) -> None:
    from neuronbuild.analysis.planner import plan
    from neuronbuild.loading.target_graph import load_targets

    ws = write_ws(tmp_path / "ws", {"llama.safetensors": "", "small.safetensors": ""})

    def actions(build: str) -> dict[str, set[str]]:
        (ws / "BUILD").write_text(build)
        ag = plan(load_targets(ws, ["//:llama3_cpu"]))
        (compile_,) = ag.compiles
        out: dict[str, set[str]] = {}
        for bucket, fp in compile_.buckets:
            for x in ag.closure(fp):
                kind = ag.actions[x].kind
                out.setdefault(kind if kind == "weights" else f"{bucket.graph}:{kind}", set()).add(x)
        return out

    base, k5 = actions(_build_file()), actions(_build_file(spec3='{"draft": ":small", "length": 5}'))
    other_draft = actions(_build_file(spec3='{"draft": ":same", "length": 3}'))
    plain = actions(_build_file(spec3="None").replace(', "verify": [":tok"]', ""))
    assert "verify:trace" in base and "verify:trace" not in plain
    for run in (k5, other_draft, plain):  # the weights and the context and token graphs never change
        for key in ("weights", "context:trace", "token:trace"):
            assert run[key] == base[key], key
    # the length and the draft's identity: a new verify graph each (the bundle's record of the pairing)
    assert not base["verify:trace"] & k5["verify:trace"] and not base["verify:trace"] & other_draft["verify:trace"]


@pytest.mark.parametrize("spec, message", [
    ('{"draft": ":small", "length": 0}', "speculation length must be an int in 1..64"),
    ('{"draft": "small", "length": 3}', "speculation draft must be the label of another hf_causal_lm"),
    ('{"draft": ":small", "length": 3, "fused": True}', "fused = True (one graph running the draft steps and the "
                                                        "verification) is not supported yet"),
    ('{"draft": ":small", "k": 3}', 'speculation: unknown key "k"'),
], ids=["length-0", "relative-draft", "fused", "unknown-key"])
def test_a_bad_speculation_attribute_is_one_located_error(tmp_path: Path, spec: str, message: str) -> None:
    ws = write_ws(tmp_path / "ws", {"llama.safetensors": "", "small.safetensors": "", "BUILD": _build_file(spec3=spec)})
    proc = run_cli(["plan", "//:llama3_cpu"], ws)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    assert "BUILD:" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
