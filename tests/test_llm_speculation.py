"""Speculative decoding (hf_causal_lm speculation = {...}): one tiny workspace built once (10 graphs): a Llama target
speculating k = 3 tokens with a random 1-layer draft on cpu, and k = 5 with a draft of the target's own config and
weights on trn2 (its HLO run on XLA:CPU); fused (one graph running the draft's steps and the verification, both
models' weights bound), k = 5 with the random draft on cpu and k = 3 with the equal draft on trn2. Greedy speculative
output equals transformers' greedy `generate` of every request of a continuous batch; a draft equal to the target gets
every proposal accepted; a bundle built for k = 5 refuses to serve k = 3 (or another draft, or fused vs not) with the
reason; the speculation enters only the verify (fused) graphs' fingerprints; sampled speculation (the
rejection-sampling rule) follows the target's sampler distribution."""

from __future__ import annotations

import json
import re
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


def _build_file(spec3: str = '{"draft": ":small", "length": 3}', spec5: str = '{"draft": ":same", "length": 5}',
                fused5: str = '{"draft": ":small", "length": 5, "fused": True}',
                fused3: str = '{"draft": ":same", "length": 3, "fused": True}') -> str:
    return f'''load("@neuronbuild//rules:llm.bzl", "hf_causal_lm")
neuron_target(name = "trn2", platform = "trn2")
neuron_target(name = "cpu", platform = "cpu", isa = "native")
# two targets on one set of weights, speculating 3 tokens with a random 1-layer draft and 5 with a draft equal to the
# target (same config and weights: its context and token graphs are the targets' own, built once)
hf_causal_lm(name = "llama3", model_type = "llama", config = {json.dumps(HF)}, weights = "llama.safetensors",
             {SERVE}, speculation = {spec3})
hf_causal_lm(name = "llama5", model_type = "llama", config = {json.dumps(HF)}, weights = "llama.safetensors",
             {SERVE}, speculation = {spec5})
# fused (draft steps and verification in one graph): k = 5 with the random draft on cpu, k = 3 with the equal draft
# on trn2 (the cross-product's other two cells); their context and token graphs are the targets' own
hf_causal_lm(name = "llama5f", model_type = "llama", config = {json.dumps(HF)}, weights = "llama.safetensors",
             {SERVE}, speculation = {fused5})
hf_causal_lm(name = "llama3f", model_type = "llama", config = {json.dumps(HF)}, weights = "llama.safetensors",
             {SERVE}, speculation = {fused3})
hf_causal_lm(name = "same", model_type = "llama", config = {json.dumps(HF)}, weights = "llama.safetensors", {SERVE})
hf_causal_lm(name = "small", model_type = "llama", config = {json.dumps(SMALL)}, weights = "small.safetensors",
             {SERVE})
neuron_buckets(name = "ctx", shapes = [{{"batch": 2, "seq": 16}}])
neuron_buckets(name = "tok", shapes = [{{"batch": 4}}])
TARGET = {{"context": [":ctx"], "token": [":tok"], "verify": [":tok"]}}
FUSED = {{"context": [":ctx"], "token": [":tok"], "fused": [":tok"]}}
DRAFT = {{"context": [":ctx"], "token": [":tok"]}}
# k = 3 on cpu, k = 5 on trn2 (its HLO run on XLA:CPU): 8 graphs in all (the context and token graphs of llama5 and
# same are one trace)
neuron_compile(name = "llama3_cpu", model = ":llama3", target = ":cpu", buckets = TARGET)
neuron_compile(name = "small_cpu", model = ":small", target = ":cpu", buckets = DRAFT)
neuron_compile(name = "llama5_trn2", model = ":llama5", target = ":trn2", buckets = TARGET)
neuron_compile(name = "same_trn2", model = ":same", target = ":trn2", buckets = DRAFT)
neuron_compile(name = "llama5f_cpu", model = ":llama5f", target = ":cpu", buckets = FUSED)
neuron_compile(name = "llama3f_trn2", model = ":llama3f", target = ":trn2", buckets = FUSED)
neuron_bundle(name = "release", srcs = [":llama3_cpu", ":small_cpu", ":llama5_trn2", ":same_trn2", ":llama5f_cpu",
                                        ":llama3f_trn2"])
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


_OPEN: dict[tuple[Path, str], Any] = {}  # one deployed cache per platform for the module: graphs loaded once


def _lm(deployed: Path, label: str) -> Any:
    from neuronbuild.runtime import open_cache

    emulate = "xla-cpu" if label.endswith("trn2") else None
    key = (deployed, str(emulate))
    if key not in _OPEN:
        _OPEN[key] = open_cache(deployed, strict=True, emulate=emulate)
    return _OPEN[key].causal_lm(label)


# label -> (k, draft, fused)
SPECULATING = {"//:llama3_cpu": (3, "//:small", False), "//:llama5_trn2": (5, "//:same", False),
               "//:llama5f_cpu": (5, "//:small", True), "//:llama3f_trn2": (3, "//:same", True)}


@pytest.mark.parametrize("label", list(SPECULATING),
                         ids=["cpu-k3-random-draft", "trn2-xla-cpu-k5-draft-equal-to-target", "cpu-fused-k5-random-draft",
                              "trn2-xla-cpu-fused-k3-draft-equal-to-target"])
def test_greedy_speculation_equals_transformers_generate_for_every_request_in_a_batch(
        deployed: Path, reference: Any, label: str) -> None:
    from neuronbuild.runtime.speculative import SpeculativeEngine

    lm = _lm(deployed, label)
    k, draft, fused = SPECULATING[label]
    assert lm.speculation == {"draft": draft, "length": k, "fused": fused}
    eng = lm.engine()
    assert isinstance(eng, SpeculativeEngine) and eng.k == k and eng.fused == fused
    rids = [eng.add(p, max_new_tokens=n, eos_token_id=None) for p, n in zip(PROMPTS, NEW, strict=True)]
    served = []  # requests getting tokens in each step
    while eng.pending:
        served.append(len(eng.step()))
    out = eng.finished
    for rid, prompt, new in zip(rids, PROMPTS, NEW, strict=True):
        assert out[rid] == _greedy(reference, prompt, new), (label, rid)
    assert max(served) == MAX_BATCH and eng.free == list(range(MAX_BATCH))  # a continuous batch, every line freed
    stats = [eng.stats[r] for r in rids]
    assert all(s["proposed"] == k * s["verify_calls"] > 0 for s in stats)
    if draft == "//:same":  # the draft is the target: every proposal accepted, k + 1 tokens per verify call (fused:
        # the draft catches up on the k-th proposal in the next call's first step)
        assert all(s["accepted"] == s["proposed"] for s in stats), stats
        assert all(s["verify_calls"] == -(-(n - 1) // (k + 1)) for s, n in zip(stats, NEW, strict=True)), stats
    else:  # a random draft: some proposals rejected (rolled back), and the output is the target's all the same
        assert sum(s["accepted"] for s in stats) < sum(s["proposed"] for s in stats)
    if fused:  # one fused call per step for the whole batch: no draft token call, no verify call
        assert eng.calls["fused_batch4"] >= max(s["verify_calls"] for s in stats)
        assert not any(c.startswith(("draft_token", "verify")) for c in eng.calls), eng.calls
    else:  # one verify call per step for the whole batch, after k draft token calls (+ catch-ups)
        assert eng.calls["verify_batch4"] >= max(s["verify_calls"] for s in stats)
        assert eng.calls["draft_token_batch4"] >= k * eng.calls["verify_batch4"]
    # generate() speculates too, and stays transformers' greedy decoding
    gen = lm.generate([PROMPTS[2], PROMPTS[0]], max_new_tokens=7, eos_token_id=None)
    assert gen[:, -7:].tolist() == [_greedy(reference, PROMPTS[2], 7), _greedy(reference, PROMPTS[0], 7)]


def test_requests_ending_at_their_prefill_or_at_eos_mid_round_end_there(deployed: Path, reference: Any) -> None:
    lm = _lm(deployed, "//:llama3_cpu")
    eng = lm.engine()
    news = [1, 3, 1, 7, 2, 5]  # one-token requests end at their prefill; the others mid-round (k = 3)
    rids = [eng.add(p, max_new_tokens=n, eos_token_id=None) for p, n in zip(PROMPTS, news, strict=True)]
    out = eng.run()
    assert [out[r] for r in rids] == [_greedy(reference, p, n) for p, n in zip(PROMPTS, news, strict=True)]
    full = _greedy(reference, PROMPTS[1], 10)
    eos = full[4]
    rid = eng.add(PROMPTS[1], max_new_tokens=10, eos_token_id=eos)
    assert eng.run()[rid] == full[: full.index(eos) + 1]  # the tokens after eos in the same round are dropped


def test_a_bundle_built_for_k5_refuses_to_serve_k3_or_another_draft_with_the_reason(deployed: Path) -> None:
    from neuronbuild.runtime import NoBucketFits
    from neuronbuild.runtime.speculative import SpeculationMismatch

    lm = _lm(deployed, "//:llama5_trn2")
    with pytest.raises(SpeculationMismatch, match=r"speculation length 3 requested, but the bundle was built for "
                                                  r"length 5 \(its verify graph scores 6 positions per row"):
        lm.engine(speculation={"length": 3})
    with pytest.raises(SpeculationMismatch, match="draft //:small requested, but the bundle was built with draft //:same"):
        lm.engine(speculation={"draft": "//:small"})
    with pytest.raises(SpeculationMismatch, match="given, but the bundle was built with draft //:same"):
        lm.engine(speculation={"draft": _lm(deployed, "//:small_cpu")})
    with pytest.raises(SpeculationMismatch, match="the bundle has no verify graphs"):
        _lm(deployed, "//:same_trn2").engine(speculation={"length": 5})
    eng = lm.engine(speculation={"length": 5, "draft": "//:same"})  # the bundle's own configuration is served
    with pytest.raises(NoBucketFits, match="speculation length 5 need 33 cache slots"):
        eng.add(PROMPTS[0], max_new_tokens=25)  # 4 + 25 fit the cache, not the 5 slots a verify call writes past it
    assert type(lm.engine(speculation=False)).__name__ == "Engine"


def test_a_fused_bundle_refuses_unfused_another_length_or_another_draft_naming_both(deployed: Path) -> None:
    from neuronbuild.runtime.speculative import SpeculationMismatch, SpeculativeEngine

    fused = _lm(deployed, "//:llama3f_trn2")
    with pytest.raises(SpeculationMismatch, match=r"speculation fused=False requested, but the bundle was built with "
                                                  r"fused=True \(a fused graph per bucket"):
        fused.engine(speculation={"fused": False})
    with pytest.raises(SpeculationMismatch, match=r"speculation length 5 requested, but the bundle was built for length "
                                                  r"3 \(its fused graph proposes 3 draft tokens and scores 4 positions"):
        fused.engine(speculation={"length": 5, "fused": True})
    with pytest.raises(SpeculationMismatch, match="draft //:small requested, but the bundle was built with draft //:same"):
        fused.engine(speculation={"draft": "//:small"})
    with pytest.raises(SpeculationMismatch, match=r"fused=True requested, but the bundle was built with fused=False "
                                                  r"\(separate draft token and verify graphs"):
        _lm(deployed, "//:llama5_trn2").engine(speculation={"fused": True})
    # the fused graph holds its draft's cache: a draft of another shape is refused, both named
    with pytest.raises(SpeculationMismatch, match=r"its fused graph holds the draft cache float32\[2, 2, 5, 2, 32, 8\], "
                                                  r"but draft //:small_cpu has float32\[1, 2, 5, 2, 32, 8\]"):
        SpeculativeEngine(fused, _lm(deployed, "//:small_cpu"), 3)
    eng = fused.engine(speculation={"length": 3, "fused": True, "draft": "//:same"})  # its own configuration
    assert eng.fused and eng.k == 3


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


def test_fused_speculation_enters_only_the_fused_graphs_fingerprints_and_ships_the_drafts_weights(
        tmp_path: Path) -> None:
    from neuronbuild.analysis.planner import plan
    from neuronbuild.loading.target_graph import load_targets

    ws = write_ws(tmp_path / "ws", {"llama.safetensors": "", "small.safetensors": ""})

    def planned(build: str) -> tuple[dict[str, set[str]], dict[str, str]]:
        (ws / "BUILD").write_text(build)
        ag = plan(load_targets(ws, ["//:llama5f_cpu", "//:small_cpu"]))
        out: dict[str, set[str]] = {}
        shipped: dict[str, str] = {}
        for ct in ag.compiles:
            for bucket, fp in ct.buckets:
                for x in ag.closure(fp, ct.ships_of(fp)):
                    kind = ag.actions[x].kind
                    key = f"{ag.actions[x].label}:{kind}" if kind == "weights" else f"{bucket.graph}:{kind}"
                    out.setdefault(f"{ct.label.name}/{key}", set()).add(x)
                shipped.update({f"{ct.label.name}/{bucket.graph}/{s.path}": s.action for s in ct.ships_of(fp) or ()})
        return out, shipped

    base, ships = planned(_build_file())
    # the fused graph binds both models' weights: the target's file and the draft's own weights action's, shipped
    assert ships["llama5f_cpu/fused/constants.safetensors"] == ships["llama5f_cpu/token/constants.safetensors"]
    assert ships["llama5f_cpu/fused/draft.constants.safetensors"] == ships["small_cpu/token/constants.safetensors"]
    assert "llama5f_cpu/context/draft.constants.safetensors" not in ships  # (only the fused graphs bind the draft)
    variants = [planned(_build_file(fused5=f))[0] for f in (
        '{"draft": ":same", "length": 5, "fused": True}',  # another draft
        '{"draft": ":small", "length": 3, "fused": True}',  # another length
    )]
    for run in variants:
        for key in ("llama5f_cpu///:llama5f:weights", "llama5f_cpu/context:trace", "llama5f_cpu/token:trace",
                    "small_cpu/token:trace"):
            assert run[key] == base[key], key
        assert not run["llama5f_cpu/fused:trace"] & base["llama5f_cpu/fused:trace"]
    unfused = planned(_build_file(fused5='{"draft": ":small", "length": 5}').replace(
        'FUSED = {"context": [":ctx"], "token": [":tok"], "fused": [":tok"]}',
        'FUSED = {"context": [":ctx"], "token": [":tok"], "verify": [":tok"]}'))[0]
    assert "llama5f_cpu/fused:trace" not in unfused and unfused["llama5f_cpu/context:trace"] == \
        base["llama5f_cpu/context:trace"]


@pytest.mark.parametrize("spec, message", [
    ('{"draft": ":small", "length": 0}', "speculation length must be an int in 1..64"),
    ('{"draft": "small", "length": 3}', "speculation draft must be the label of another hf_causal_lm"),
    ('{"draft": ":small", "length": 3, "fused": 1}', "speculation fused must be True or False"),
    ('{"draft": ":small", "k": 3}', 'speculation: unknown key "k"'),
], ids=["length-0", "relative-draft", "fused-not-bool", "unknown-key"])
def test_a_bad_speculation_attribute_is_one_located_error(tmp_path: Path, spec: str, message: str) -> None:
    ws = write_ws(tmp_path / "ws", {"llama.safetensors": "", "small.safetensors": "", "BUILD": _build_file(spec3=spec)})
    proc = run_cli(["plan", "//:llama3_cpu"], ws)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    assert "BUILD:" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("fused5, extra, message", [
    ('{"draft": ":nope", "length": 5, "fused": True}', "", "speculation draft //:nope is not a target here"),
    ('{"draft": ":plain", "length": 5, "fused": True}',
     'hf_causal_lm(name = "plain", model_type = "llama", config = {"vocab_size": 128, "hidden_size": 32, '
     '"num_hidden_layers": 1, "num_attention_heads": 4}, weights = "small.safetensors", max_seq = 32)\n',
     "speculation draft //:plain must be an hf_causal_lm with continuous_batching = True"),
    ('{"draft": ":small", "length": 5, "fused": True}',
     'neuron_compile(name = "tp2", model = ":llama5f", target = ":trn2", buckets = FUSED, tp_degree = 2)\n',
     "fused speculation (graph 'fused') with tp_degree > 1 is not supported yet"),
], ids=["unknown-draft", "draft-without-continuous-batching", "tp-degree-2"])
def test_a_fused_speculation_the_build_cannot_make_is_one_located_error(tmp_path: Path, fused5: str, extra: str,
                                                                        message: str) -> None:
    ws = write_ws(tmp_path / "ws", {"llama.safetensors": "", "small.safetensors": "",
                                    "BUILD": _build_file(fused5=fused5) + extra})
    proc = run_cli(["plan", "//:tp2" if "tp_degree" in extra else "//:llama5f_cpu"], ws)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    assert "BUILD:" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_rejection_sampling_rule_draws_each_token_from_the_targets_distribution(deployed: Path, reference: Any) -> None:
    """The rule (runtime/speculative.py) on transformers' own logits of the target and of the random draft at one
    context: over 20,000 draws the token a speculation position yields follows the target's sampler distribution
    (total variation < 0.02), though the draft's distribution is far from it."""
    import torch
    from safetensors.torch import load_file

    from neuronbuild.runtime.engine import Request, Sampling
    from neuronbuild.runtime.speculative import distribution, speculative_rule_draw

    draft = _model(SMALL, 1)
    draft.load_state_dict(load_file(str(deployed.parent / "ws" / "small.safetensors")))
    ctx = torch.tensor([PROMPTS[3]])
    with torch.no_grad():
        p_logits, q_logits = reference(ctx).logits[0, -1], draft(ctx).logits[0, -1]
    sampling = Sampling(temperature=1.0, top_k=0, top_p=0.95)
    p, q = distribution(p_logits, sampling), distribution(q_logits, sampling)
    assert 0.5 * float((p - q).abs().sum()) > 0.3  # the draft proposes from a distribution far from the target's
    r = Request(0, PROMPTS[3], 1, sampling, None, torch.Generator().manual_seed(3))
    n = 20000
    counts = torch.zeros_like(p)
    accepted = 0
    for _ in range(n):
        token, ok = speculative_rule_draw(r, q, p)
        counts[token] += 1
        accepted += ok
    tv = 0.5 * float((counts / n - p).abs().sum())
    assert tv < 0.02, tv
    assert abs(accepted / n - float(torch.minimum(p, q).sum())) < 0.02  # acceptance = sum min(p, q), as the rule says


@pytest.mark.parametrize("label", ["//:llama5_trn2", "//:llama3f_trn2"], ids=["unfused", "fused"])
def test_sampled_speculation_with_a_draft_equal_to_the_target_accepts_and_a_seed_fixes_the_tokens(
        deployed: Path, label: str) -> None:
    lm = _lm(deployed, label)

    def sampled(neighbours: int) -> tuple[list[int], dict[str, int]]:
        eng = lm.engine(seed=neighbours)
        rid = eng.add(PROMPTS[1], max_new_tokens=12, temperature=1.0, seed=11, eos_token_id=None)
        for p in PROMPTS[2:2 + neighbours]:
            eng.add(p, max_new_tokens=10, temperature=0.8, top_p=0.9, eos_token_id=None)
        return eng.run()[rid], eng.stats[rid]

    alone, stats = sampled(0)
    assert len(alone) == 12 and all(0 <= t < HF["vocab_size"] for t in alone)
    # p == q up to the verify graph's float rounding: min(1, p/q) ~ 1, every proposal (or all but a rare one) kept
    assert stats["accepted"] >= stats["proposed"] - 1, stats
    assert sampled(3)[0] == alone  # the request's own generator: the same tokens whatever shares its batch


def test_validate_compares_the_verify_and_fused_graphs_with_transformers(deployed: Path, cache_dir: Path) -> None:
    proc = run_cli(["validate", "//:llama3_cpu", "//:llama5f_cpu", "--cache-dir", str(cache_dir)],
                   deployed.parent / "ws")
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    for label, family in (("//:llama3_cpu", "verify"), ("//:llama5f_cpu", "fused")):
        rows = [line for line in out.splitlines() if line.startswith(label + " ")]
        assert len(rows) == 3 and all(r.endswith(" ok") for r in rows), out  # context, token and verify / fused
        # verify: the k + 1 positions' logits against transformers'; fused: those and the draft's k positions'
        # logits against transformers' draft model, at the graph's own proposals
        assert any(f" {family}_batch4 " in r for r in rows), out


def test_a_bundle_shipping_verify_graphs_without_their_drafts_graphs_is_refused_at_its_srcs(tmp_path: Path) -> None:
    build = _build_file() + 'neuron_bundle(name = "no_draft", srcs = [":llama3_cpu", ":same_trn2", ":llama5_trn2"])\n'
    ws = write_ws(tmp_path / "ws", {"llama.safetensors": "", "small.safetensors": "", "BUILD": build})
    proc = run_cli(["plan", "//:no_draft"], ws)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    # the cpu target's draft (//:small) has no cpu compile here; the trn2 one's (//:same, same_trn2) is shipped
    assert re.search(r"BUILD:\d+.*//:llama3_cpu speculates with draft model //:small \(verify graphs\), but this bundle "
                     r"ships no compile of //:small for .*cpu.*: add one to `srcs`", proc.stderr), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert run_cli(["plan", "//:release"], ws).returncode == 0  # (every draft shipped)
