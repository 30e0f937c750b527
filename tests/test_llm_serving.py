"""Serving graphs (hf_causal_lm continuous_batching / on_device_sampling) and the continuous-batching engine: one tiny
Llama workspace built once (cpu, trn2 whose HLO runs on XLA:CPU, trn2 at tp 2) and deployed; 6 requests through a
4-slot engine each get transformers' greedy tokens of that request alone; top_k = 1 is greedy at any temperature; a
seed fixes a request's sampled tokens whatever shares its batch; the in-graph sampler's first-token frequencies
follow transformers' softmax (total variation < 0.05 over 3,000 draws) and top_k = 5 never leaves transformers' top
5; bad requests are refused alone; the serving attributes change the graphs' fingerprints, never the weights'."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers import run_cli, write_ws

HF = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "max_position_embeddings": 64, "eos_token_id": 2, "bos_token_id": 1, "pad_token_id": 0}
MAX_SEQ, MAX_BATCH = 32, 4
CPU, TRN2, TP2 = "//:llama_cpu", "//:llama_trn2", "//:llama_tp2"
PROMPTS = [[1, 5, 6, 7], [1, 40, 41, 42, 43, 44, 45, 46, 47], [1, 30], [1, 9, 8, 7, 6, 5, 4, 3, 2, 10, 11, 12],
           [1, 77, 78], [1, 100, 101, 102, 103, 104]]
NEW = [6, 10, 4, 8, 12, 5]


def _build_file(sampling: bool = True) -> str:
    attrs = "on_device_sampling = True, output_logits = True" if sampling else "on_device_sampling = False"
    return f'''load("@neuronbuild//rules:llm.bzl", "hf_causal_lm")
neuron_target(name = "trn2", platform = "trn2")
neuron_target(name = "cpu", platform = "cpu", isa = "native")
hf_causal_lm(name = "llama", model_type = "llama", config = {json.dumps(HF)}, weights = "llama.safetensors",
             max_seq = {MAX_SEQ}, continuous_batching = True, max_batch = {MAX_BATCH}, {attrs})
# one context bucket (a batch of 1 runs in it with a padding row); token buckets of 2 and 4 rows
neuron_buckets(name = "ctx", shapes = [{{"batch": 2, "seq": 16}}])
neuron_buckets(name = "tok", shapes = [{{"batch": 2}}, {{"batch": 4}}])
BUCKETS = {{"context": [":ctx"], "token": [":tok"]}}
neuron_compile(name = "llama_cpu", model = ":llama", target = ":cpu", buckets = BUCKETS)
neuron_compile(name = "llama_trn2", model = ":llama", target = ":trn2", buckets = BUCKETS)
neuron_compile(name = "llama_tp2", model = ":llama", target = ":trn2", buckets = BUCKETS, tp_degree = 2)
neuron_bundle(name = "release", srcs = [":llama_cpu", ":llama_trn2", ":llama_tp2"])
'''


def _write_workspace(root: Path) -> Path:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    ws = write_ws(root, {"BUILD": _build_file()})
    torch.manual_seed(0)
    # weights 10x transformers' default scale: peaked next-token distributions (the top 10 of 128 tokens hold ~37%),
    # so the sampler's frequencies tell softmax(logits) from a flatter distribution
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **HF, initializer_range=0.2))
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(ws / "llama.safetensors"))
    return ws


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Path:
    ws = _write_workspace(tmp_path_factory.mktemp("llm_serving") / "ws")
    proc = run_cli(["build", "//:release", "--jobs", "2", "--cache-dir", str(cache_dir)], ws)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    dest = ws.parent / "serve"
    proc = run_cli(["deploy", str(ws / "neuronbuild-out" / "release.tar.zst"), "--dest", str(dest)], ws)
    assert proc.returncode == 0, proc.stderr
    return dest


@pytest.fixture(scope="module")
def reference(deployed: Path) -> Any:
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    # weights 10x transformers' default scale: peaked next-token distributions (the top 10 of 128 tokens hold ~37%),
    # so the sampler's frequencies tell softmax(logits) from a flatter distribution
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **HF, initializer_range=0.2)).eval()
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

    return open_cache(deployed, strict=True, emulate=None if label == CPU else "xla-cpu").causal_lm(label)


@pytest.mark.parametrize("label", [CPU, TRN2, TP2], ids=["cpu", "trn2-xla-cpu", "trn2-tp2-xla-cpu"])
def test_six_requests_in_a_4_slot_engine_each_get_transformers_greedy_tokens_alone(
        deployed: Path, reference: Any, label: str) -> None:
    lm = _lm(deployed, label)
    assert (lm.serving, lm.sampling, lm.max_batch, lm.max_seq) == (True, True, MAX_BATCH, MAX_SEQ)
    eng = lm.engine()
    rids = [eng.add(p, max_new_tokens=n, eos_token_id=None) for p, n in zip(PROMPTS, NEW, strict=True)]
    busy, got = [], {}
    while eng.pending:
        for rid, toks in eng.step().items():
            got.setdefault(rid, []).extend(toks)
        busy.append(len(eng.active))
    out = eng.finished
    assert got == out and sorted(out) == rids
    for rid, prompt, new in zip(rids, PROMPTS, NEW, strict=True):
        assert out[rid] == _greedy(reference, prompt, new), (label, rid)
    assert max(busy) == MAX_BATCH and eng.free == list(range(MAX_BATCH))  # every line used, every line freed
    # the smallest token bucket holding the active requests: batch 4 while 3-4 decode, batch 2 at the end
    assert eng.calls["token_batch4"] > 0 and eng.calls["token_batch2"] > 0
    # generate() is the engine too: a ragged batch, left-padded, equal to each prompt's greedy tokens alone
    gen = lm.generate([PROMPTS[2], PROMPTS[0]], max_new_tokens=5, eos_token_id=None)
    assert gen[:, -5:].tolist() == [_greedy(reference, PROMPTS[2], 5), _greedy(reference, PROMPTS[0], 5)]
    assert gen[0, :2].tolist() == [0, 0]  # the shorter prompt left-padded with the config's pad id


def test_top_k_1_is_greedy_and_a_seed_fixes_sampled_tokens_whatever_the_neighbours(
        deployed: Path, reference: Any) -> None:
    lm = _lm(deployed, CPU)
    eng = lm.engine()
    greedy = [eng.add(p, max_new_tokens=8, temperature=0.7, top_k=1, seed=i, eos_token_id=None)
              for i, p in enumerate(PROMPTS[:3])]
    out = eng.run()
    assert [out[r] for r in greedy] == [_greedy(reference, p, 8) for p in PROMPTS[:3]]

    def sampled(neighbours: int, seed: int = 11) -> list[int]:
        eng = lm.engine(seed=seed + neighbours)
        rid = eng.add(PROMPTS[1], max_new_tokens=12, temperature=1.0, seed=seed, eos_token_id=None)
        for p in PROMPTS[2:2 + neighbours]:  # other requests, sampled with the engine's own draws
            eng.add(p, max_new_tokens=10, temperature=1.3, top_p=0.9, eos_token_id=None)
        return eng.run()[rid]  # type: ignore[no-any-return]

    alone = sampled(0)
    assert sampled(3) == alone and sampled(5) == alone  # batch 4 with 3 neighbours; 6 requests queueing for 4 lines
    assert sampled(0, seed=12) != alone and alone != _greedy(reference, PROMPTS[1], 12)


def test_cpu_graphs_write_the_kv_cache_in_place_into_the_callers_tensor(deployed: Path) -> None:
    import torch

    lm = _lm(deployed, CPU)
    # the compile records it (the manifest carries each compile's record): output 2 (tokens, logits, kv) is input 6
    for fam in (lm._context, lm._token):
        for name in fam.buckets:
            assert fam.graph(name).record["in_place"] == ["input-mutation-1", [["kv", 2, "kv", 6]]]
    fn = lm.fn("token", "token_batch2")
    kv = torch.zeros([int(d) for d in lm.kv_spec["dims"]], dtype=torch.float32)
    ptr = kv.data_ptr()
    mask = torch.zeros((2, MAX_SEQ), dtype=torch.int32)
    mask[0, :6] = 1
    mask[1, :1] = 1
    args = (torch.tensor([[5], [9]], dtype=torch.int32), mask, torch.tensor([[5], [0]], dtype=torch.int32),
            torch.tensor([1, -1], dtype=torch.int32), torch.tensor([[1.0, 1.0, 0.0]] * 2), torch.zeros(2))
    with torch.inference_mode():
        out = lm.named("token", fn(*args, kv))
    assert out["kv"] is kv and kv.data_ptr() == ptr  # the caller's tensor, not a copy
    written = kv.abs().sum(dim=(0, 1, 3, 5))  # [line, slot]
    assert written[1, 5] > 0 and written[MAX_BATCH, 0] > 0  # line 1 slot 5; the padding row's scratch line, slot 0
    written[1, 5] = written[MAX_BATCH, 0] = 0
    assert not written.any()  # nothing else
    eng = lm.engine()
    cache = eng.kv
    eng.add(PROMPTS[0], max_new_tokens=3, eos_token_id=None)
    eng.run()
    assert eng.kv is cache and bool(cache[:, :, 0, :, : len(PROMPTS[0]) + 2].abs().sum() > 0)  # one cache, written


def test_only_an_aliased_output_scattered_into_its_input_is_compiled_in_place() -> None:
    """The cpu compile writes an aliased output in place only when it is one scatter into its input (the serving
    graphs' index_put into kv); an output built otherwise (a stack of per-layer updates, as the static token graph's)
    would be computed and then copied into the input, slower than a fresh output, so it stays one."""
    import torch

    from neuronbuild.toolchains.compile import _scatters_into_input, write_in_place

    class Scatter(torch.nn.Module):
        def forward(self, x: torch.Tensor, slot: torch.Tensor, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x.sum(-1), torch.index_put(kv, (slot,), x)

    class Stack(torch.nn.Module):
        def forward(self, x: torch.Tensor, slot: torch.Tensor, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x.sum(-1), torch.stack([kv[0].index_copy(0, slot, x[0, :1]), kv[1]])

    args = (torch.ones(1, 4), torch.tensor([1]), torch.zeros(2, 4))
    scatter, stack = (torch.export.export(m(), args) for m in (Scatter, Stack))
    assert _scatters_into_input(scatter, 1, 2) and not _scatters_into_input(scatter, 0, 2)
    assert not _scatters_into_input(stack, 1, 2)
    meta = write_in_place(scatter, [(1, 2)])
    kinds = [s.kind.name for s in scatter.graph_signature.output_specs]
    assert kinds == ["USER_INPUT_MUTATION", "USER_OUTPUT"] and json.loads(meta["neuronbuild.in_place"]) == [[1, 2]]
    kv = torch.zeros(2, 4)
    out = scatter.module()(torch.full((1, 4), 3.0), torch.tensor([1]), kv)  # the program now updates its input
    assert kv[1].tolist() == [3.0] * 4 and kv[0].tolist() == [0.0] * 4 and float(out[0]) == 12.0


def _draws(lm: Any, params: list[float], n: int) -> list[int]:
    """n first tokens of one prompt sampled by a context graph, two draws per call."""
    import torch

    fn = lm.fn("context", "context_batch2_seq16")
    prompt = PROMPTS[3]
    ids = torch.zeros((2, 16), dtype=torch.int32)
    mask = torch.zeros((2, 16), dtype=torch.int32)
    ids[:, 16 - len(prompt):] = torch.tensor(prompt, dtype=torch.int32)
    mask[:, 16 - len(prompt):] = 1
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1).to(torch.int32)
    seq_ids = torch.tensor([0, 1], dtype=torch.int32)
    kv = torch.zeros([int(d) for d in lm.kv_spec["dims"]], dtype=torch.float32)
    sp = torch.tensor([params, params], dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(n // 2):
            tokens = lm.named("context", fn(ids, mask, pos, seq_ids, sp, torch.rand(2, generator=gen), kv))["tokens"]
            out += tokens.tolist()
    return out


def test_in_graph_sampler_follows_transformers_softmax_and_keeps_to_the_top_k(
        deployed: Path, reference: Any) -> None:
    import torch

    lm = _lm(deployed, TRN2)  # (its HLO on XLA:CPU: ~3 ms a call here, the cpu package's ~40 ms under load)
    with torch.no_grad():
        probs = torch.softmax(reference(torch.tensor([PROMPTS[3]])).logits[0, -1].double(), -1)
    top10 = probs.topk(10).indices.tolist()
    n = 3000
    draws = _draws(lm, [0.0, 1.0, 1.0], n)  # temperature 1, no top-k (the vocabulary of 128 < 256), no top-p
    counts = torch.zeros(11, dtype=torch.float64)
    for t in draws:
        counts[top10.index(t) if t in top10 else 10] += 1
    want = torch.cat([probs[top10], (1 - probs[top10].sum()).reshape(1)])
    tv = 0.5 * float((counts / n - want).abs().sum())
    assert tv < 0.05, (tv, counts.tolist(), want.tolist())
    top5 = set(probs.topk(5).indices.tolist())
    assert set(_draws(lm, [5.0, 1.0, 1.0], n)) <= top5


def test_validate_compares_serving_graphs_and_each_request_with_transformers(deployed: Path, cache_dir: Path) -> None:
    # tp 2: the serving inputs, the cache's whole kv heads (callers' shapes) and the engine through validate's loader
    proc = run_cli(["validate", TP2, "--generate", "4", "--cache-dir", str(cache_dir)], deployed.parent / "ws")
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    rows = [line for line in out.splitlines() if line.startswith("//:llama_tp2 ")]
    assert len(rows) == 3 and all(r.endswith(" ok") for r in rows), out  # 3 graphs, logits against transformers'
    gen = [line for line in out.splitlines() if ": generate " in line]
    assert len(gen) == 2 and all(": ok (4 tokens x " in g for g in gen), out  # batch 1 and 2, each request alone


def test_bad_requests_are_refused_alone_and_the_engine_serves_the_others(deployed: Path, reference: Any) -> None:
    from neuronbuild.runtime import NoBucketFits

    eng = _lm(deployed, CPU).engine()
    good = eng.add(PROMPTS[0], max_new_tokens=4, eos_token_id=None)
    bad = [({"prompt_ids": list(range(3, 23))}, NoBucketFits, "fits no context bucket (the longest holds seq=16)"),
           ({"prompt_ids": [1, 2], "max_new_tokens": 40}, NoBucketFits, "the KV cache holds max_seq=32"),
           ({"prompt_ids": [1, 128]}, ValueError, "input_ids[0][1] = 128 is not a token id of //:llama_cpu"),
           ({"prompt_ids": [1, 2], "top_p": 0.0}, ValueError, "top_p must be in (0, 1]"),
           ({"prompt_ids": [1, 2], "top_p": 1.5}, ValueError, "top_p must be in (0, 1]")]
    for kwargs, error, message in bad:
        with pytest.raises(error) as info:
            eng.add(**kwargs)
        assert message in str(info.value)
    later = eng.add(PROMPTS[2], max_new_tokens=3, eos_token_id=None)
    out = eng.run()
    assert out == {good: _greedy(reference, PROMPTS[0], 4), later: _greedy(reference, PROMPTS[2], 3)}


def test_serving_attributes_change_the_graphs_fingerprints_never_the_weights(tmp_path: Path) -> None:
    from neuronbuild.analysis.planner import plan
    from neuronbuild.loading.target_graph import load_targets

    ws = write_ws(tmp_path / "ws", {"llama.safetensors": ""})

    def actions(build: str) -> dict[str, set[str]]:
        (ws / "BUILD").write_text(build)
        ag = plan(load_targets(ws, ["//:llama_cpu"]))
        (compile_,) = ag.compiles
        fps = {x for _b, fp in compile_.buckets for x in ag.closure(fp)}
        return {kind: {fp for fp in fps if ag.actions[fp].kind == kind} for kind in ("weights", "trace")}

    static = _build_file().replace(f", continuous_batching = True, max_batch = {MAX_BATCH}, on_device_sampling = "
                                   "True, output_logits = True", "")
    runs = [actions(b) for b in (static, _build_file(), _build_file(sampling=False),
                                 _build_file().replace(f"max_batch = {MAX_BATCH}", "max_batch = 8"))]
    assert len({frozenset(r["weights"]) for r in runs}) == 1  # one weights action whatever the serving attributes
    traces = [frozenset(r["trace"]) for r in runs]
    assert all(len(t) == 3 for t in traces)
    assert all(not a & b for i, a in enumerate(traces) for b in traces[i + 1:])  # each attribute: new traces
