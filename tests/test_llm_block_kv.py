"""Block KV cache (hf_causal_lm kv_layout = "block", #46): one tiny Llama workspace, two models with the same
weights (continuous batching over cache lines; over a pool of 12 blocks of 16 positions), built and deployed once, the
block model for cpu and for trn2 (the same traces lowered to HLO, run on XLA:CPU: shuffled blocks, preemption and
chunked prefill give transformers' tokens there too).
The same requests with the blocks handed out in a shuffled order, in order, and through the contiguous cache each get
transformers' greedy tokens of the request alone; admission waits for free blocks; two requests sharing a 48-token
prefix share its 3 blocks (counted as prefix hits) and the second prefills only its suffix through a prefix graph
(prefix_caching) with transformers' tokens; a prompt longer than the context bucket is prefilled in chunks; growing
requests that exhaust the pool preempt one, recomputed later with unchanged tokens; seeded sampled requests get the same tokens from
both layouts; an engine asking for another block count is
refused naming both; the block attributes leave the fingerprints of graphs built without them unchanged."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from helpers import run_cli, write_ws

HF = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "max_position_embeddings": 128, "eos_token_id": 2, "bos_token_id": 1, "pad_token_id": 0}
MAX_SEQ, BLOCK, NUM_BLOCKS = 96, 16, 12
LINES, BLOCKS, TRN2 = "//:lines_cpu", "//:blocks_cpu", "//:blocks_trn2"
SAMPLING = "on_device_sampling = True, output_logits = True"  # greedy requests take the graphs' argmax tokens
PREFIX = [1] + [3 + (7 * i) % 120 for i in range(47)]  # 48 tokens: 3 full blocks
# (prompt, new tokens): positions needed = prompt + new - 1; blocks = ceil(positions / 16)
REQUESTS = [(PREFIX + [5, 6, 7], 8),  # 58 positions: 4 blocks, the first 3 the prefix's
            (PREFIX + [9, 10], 6),  # 55: 4 blocks, sharing the prefix's 3 when the first holds them
            ([1, 20, 21, 22], 10),  # 13: 1 block
            ([1] + list(range(40, 69)), 12),  # 30 + 11 = 41: 3 blocks
            ([1] + list(range(60, 119)), 8)]  # 60 + 7 = 67: 5 blocks (4 + 1 + 1 + 3 + 5 = 14 > 12: it waits)


PREFIX_BUCKETS = [{"batch": 1, "seq": 16, "prefix": 48}, {"batch": 1, "seq": 16, "prefix": 80}]
LONG = ([1] + [4 + (11 * i) % 119 for i in range(87)], 8)  # 88 tokens > the context bucket's 64: chunked prefill


def _build_file(block: str = ', kv_layout = "block", block_size = 16, num_blocks = 12, prefix_caching = True') -> str:
    prefix = "prefix_caching" in block
    return f'''load("@neuronbuild//rules:llm.bzl", "hf_causal_lm")
neuron_target(name = "cpu", platform = "cpu", isa = "native")
neuron_target(name = "trn2", platform = "trn2")
hf_causal_lm(name = "lines", model_type = "llama", config = {json.dumps(HF)}, weights = "llama.safetensors",
             max_seq = {MAX_SEQ}, continuous_batching = True, max_batch = 4, {SAMPLING})
hf_causal_lm(name = "blocks", model_type = "llama", config = {json.dumps(HF)}, weights = "llama.safetensors",
             max_seq = {MAX_SEQ}, continuous_batching = True, {SAMPLING}{block})
neuron_buckets(name = "ctx", shapes = [{{"batch": 2, "seq": 64}}])
neuron_buckets(name = "tok", shapes = [{{"batch": 4}}])
neuron_buckets(name = "pfx", shapes = {json.dumps(PREFIX_BUCKETS)})
BUCKETS = {{"context": [":ctx"], "token": [":tok"]}}
neuron_compile(name = "lines_cpu", model = ":lines", target = ":cpu", buckets = BUCKETS)
neuron_compile(name = "blocks_cpu", model = ":blocks", target = ":cpu",
               buckets = BUCKETS{' | {"prefix": [":pfx"]}' if prefix else ''})
neuron_bundle(name = "release", srcs = [":lines_cpu", ":blocks_cpu"])
# trn2: the same traces lowered to HLO (run on XLA:CPU), a bundle of its own (verify --host here is for cpu graphs)
neuron_compile(name = "blocks_trn2", model = ":blocks", target = ":trn2",
               buckets = BUCKETS{' | {"prefix": [":pfx"]}' if prefix else ''})
neuron_bundle(name = "release_trn2", srcs = [":blocks_trn2"])
'''


def _model() -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    # weights 10x transformers' default scale: peaked next-token distributions (no near-ties for greedy to flip)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **HF, initializer_range=0.2)).eval()


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    ws = write_ws(tmp_path_factory.mktemp("llm_block_kv") / "ws", {"BUILD": _build_file()})
    torch.manual_seed(0)
    save_file({k: v.detach().contiguous() for k, v in _model().state_dict().items()}, str(ws / "llama.safetensors"))
    proc = run_cli(["build", "//:release", "//:release_trn2", "--jobs", "2", "--cache-dir", str(cache_dir)], ws)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name, dest in (("release", ws.parent / "serve"), ("release_trn2", ws.parent / "serve_trn2")):
        proc = run_cli(["deploy", str(ws / "neuronbuild-out" / f"{name}.tar.zst"), "--dest", str(dest)], ws)
        assert proc.returncode == 0, proc.stderr
    return ws.parent / "serve"


@pytest.fixture(scope="module")
def reference(deployed: Path) -> dict[int, list[int]]:
    """transformers' greedy tokens of each request alone."""
    import torch
    from safetensors.torch import load_file

    model = _model()
    model.load_state_dict(load_file(str(deployed.parent / "ws" / "llama.safetensors")))
    out = {}
    with torch.no_grad():
        for i, (prompt, new) in enumerate([*REQUESTS, LONG]):
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
            out[i] = ids[0, len(prompt):].tolist()
    return out


def _lm(deployed: Path, label: str) -> Any:
    from neuronbuild.runtime import open_cache

    return open_cache(deployed, strict=True).causal_lm(label)


def _serve(eng: Any) -> tuple[dict[int, list[int]], list[tuple[int, int]]]:
    """Every request through the engine; (tokens by request index, (active, waiting) after each step)."""
    rids = [eng.add(p, max_new_tokens=n, eos_token_id=None) for p, n in REQUESTS]
    trace = []
    while eng.pending:
        eng.step()
        trace.append((len(eng.active), len(eng.waiting)))
    return {i: eng.finished[rid] for i, rid in enumerate(rids)}, trace


def test_shuffled_blocks_in_order_blocks_and_cache_lines_all_give_transformers_greedy_tokens(
        deployed: Path, reference: dict[int, list[int]]) -> None:
    blocks = _lm(deployed, BLOCKS)
    assert blocks.block_layout is not None and blocks.max_seq == MAX_SEQ
    shuffled = list(range(NUM_BLOCKS))
    random.Random(46).shuffle(shuffled)
    runs = {}
    for name, order in (("shuffled", shuffled), ("in order", None)):
        eng = blocks.engine(block_order=order)
        runs[name], trace = _serve(eng)
        # all five admitted at once: their prompts' blocks (4 + 1 new + 1 + 2 + 4 = 12) fill the pool; growing
        # requests then preempt the latest admitted, which waits and is recomputed (prompt + its tokens so far)
        assert trace[0] == (5, 0) and any(w for _a, w in trace), (name, trace)
        counters = eng.counters()
        assert counters["preemptions"] >= 1 and counters["blocks_in_use"] == 0, counters
        # the recompute of a preempted request reads its prompt's cached blocks through a prefix call
        assert counters["prefix_hits"] > 3 and eng.calls.get("prefix_batch1_seq16_prefix48", 0) >= 2, eng.calls
    lines = _lm(deployed, LINES)
    assert lines.block_layout is None
    runs["cache lines"], _trace = _serve(lines.engine())
    for name, got in runs.items():
        assert got == {i: reference[i] for i in range(len(REQUESTS))}, name


def test_trn2_block_graphs_on_xla_cpu_give_transformers_greedy_tokens_through_shuffled_blocks_preemption_and_chunks(
        deployed: Path, reference: dict[int, list[int]]) -> None:
    from neuronbuild.runtime import open_cache

    lm = open_cache(deployed.parent / "serve_trn2", strict=True, emulate="xla-cpu").causal_lm(TRN2)
    assert lm.block_layout is not None and lm.block_layout["num_blocks"] == NUM_BLOCKS
    shuffled = list(range(NUM_BLOCKS))
    random.Random(46).shuffle(shuffled)
    eng = lm.engine(block_order=shuffled)
    reqs = [*REQUESTS, LONG]  # (the 88-token prompt is chunked: 64 through the context graph, then prefix calls)
    rids = [eng.add(p, max_new_tokens=n, eos_token_id=None) for p, n in reqs]
    out = eng.run()
    assert [out[r] for r in rids] == [reference[i] for i in range(len(reqs))]
    counters = eng.counters()
    assert counters["preemptions"] >= 1 and counters["prefix_hits"] >= 3 and counters["blocks_in_use"] == 0, counters
    assert eng.calls.get("prefix_batch1_seq16_prefix80", 0) >= 2, eng.calls  # the long prompt's chunks


def test_a_request_sharing_a_cached_48_token_prefix_prefills_only_its_suffix_with_transformers_tokens(
        deployed: Path, reference: dict[int, list[int]]) -> None:
    eng = _lm(deployed, BLOCKS).engine()
    first = eng.add(REQUESTS[0][0], max_new_tokens=REQUESTS[0][1], eos_token_id=None)
    eng.run()
    held = eng.counters()
    # the finished request's 3 full prompt blocks stay cached (unreferenced) for a later prompt; its last is freed
    assert held == {"blocks_in_use": 0, "blocks_free": NUM_BLOCKS - 3, "blocks_cached": 3, "prefix_queries": 3,
                    "prefix_hits": 0, "prefill_tokens": 51, "cached_tokens": 0, "preemptions": 0}
    assert eng.calls == {"context_batch2_seq64": 1, "token_batch4": REQUESTS[0][1] - 1}
    second = eng.add(REQUESTS[1][0], max_new_tokens=REQUESTS[1][1], eos_token_id=None)
    eng.step()
    now = eng.counters()
    assert now["prefix_hits"] == 3 and now["blocks_in_use"] == 4  # 3 shared + its own
    # its prefill computed its 2 suffix tokens only, after 48 read from the shared blocks, through the smallest
    # prefix bucket holding them (prefix 48, not 80); no context call
    assert now["prefill_tokens"] - held["prefill_tokens"] == 2 and now["cached_tokens"] == 48, now
    assert eng.calls["prefix_batch1_seq16_prefix48"] == 1 and eng.calls["context_batch2_seq64"] == 1, eng.calls
    out = eng.run()
    assert out[first] == reference[0] and out[second] == reference[1]


def test_a_prompt_longer_than_the_largest_context_bucket_is_prefilled_in_chunks_with_transformers_tokens(
        deployed: Path, reference: dict[int, list[int]]) -> None:
    from neuronbuild.runtime.router import NoBucketFits

    prompt, new = LONG
    eng = _lm(deployed, BLOCKS).engine()
    rid = eng.add(prompt, max_new_tokens=new, eos_token_id=None)
    out = eng.run()
    assert out[rid] == reference[len(REQUESTS)]
    # 88 tokens: 64 through the context bucket, then 16 + 8 through the prefix bucket reading 64, then 80 positions
    assert eng.calls == {"context_batch2_seq64": 1, "prefix_batch1_seq16_prefix80": 2, "token_batch4": new - 1}
    assert eng.counters()["prefill_tokens"] == len(prompt)
    with pytest.raises(NoBucketFits, match="88 tokens fits no context bucket"):  # (the line layout: no chunks)
        _lm(deployed, LINES).engine().add(prompt, max_new_tokens=new)


def test_sampled_requests_with_a_seed_get_the_same_tokens_from_blocks_and_from_cache_lines(
        deployed: Path, reference: dict[int, list[int]]) -> None:
    got = []
    for label in (BLOCKS, LINES):
        eng = _lm(deployed, label).engine()
        rids = [eng.add(p, max_new_tokens=n, temperature=1.0, top_p=0.9, seed=i, eos_token_id=None)
                for i, (p, n) in enumerate(REQUESTS)]
        out = eng.run()
        got.append([out[r] for r in rids])
    assert got[0] == got[1]  # the in-graph sampler over the same logits, the same per-request draws
    assert got[0] != [reference[i] for i in range(len(REQUESTS))]  # (sampled: not the greedy tokens)


def test_the_bundle_records_the_block_layout_and_another_block_count_is_refused_naming_both(deployed: Path) -> None:
    from neuronbuild.runtime.block_engine import BlockLayoutMismatch

    lm = _lm(deployed, BLOCKS)
    heads, head_dim = HF["num_key_value_heads"], HF["hidden_size"] // HF["num_attention_heads"]
    pool = [HF["num_hidden_layers"], 2, NUM_BLOCKS + 1, heads, BLOCK, head_dim]
    assert lm.block_layout == {"block_size": BLOCK, "num_blocks": NUM_BLOCKS, "blocks_per_seq": MAX_SEQ // BLOCK,
                               "kv_dtype": "float32", "max_batch": None, "shape": pool, "tp_degree": 1,
                               "rank_shape": pool}
    # the layout is in the graphs' trace record (the bundle's manifest)
    tok = lm._token.graph(next(iter(lm._token.buckets)))
    assert tok.trace_record["model"]["config"]["kv_layout"] == {"kind": "block", "block_size": BLOCK,
                                                                 "num_blocks": NUM_BLOCKS}
    assert lm.engine(num_blocks=NUM_BLOCKS).blocks.num_blocks == NUM_BLOCKS
    with pytest.raises(BlockLayoutMismatch) as info:
        lm.engine(num_blocks=16)
    assert "num_blocks=16 requested" in str(info.value) and "compiled for num_blocks=12" in str(info.value)
    with pytest.raises(BlockLayoutMismatch, match="compiled without kv_layout"):
        _lm(deployed, LINES).engine(num_blocks=12)


def test_a_host_asking_for_another_block_count_is_refused_by_verify_and_open_cache_naming_both(
        deployed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from neuronbuild.runtime import open_cache
    from neuronbuild.runtime.block_engine import BlockLayoutMismatch

    ws = deployed.parent / "ws"
    bundle = str(ws / "neuronbuild-out" / "release.tar.zst")
    proc = run_cli(["verify", bundle, "--host", "--num-blocks", "16"], ws)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert ("//:blocks_cpu: kv_layout.num_blocks differs (built for num_blocks=12 (block_size 16), this host has "
            "num_blocks=16 asked by --num-blocks)") in proc.stderr, proc.stderr
    assert "lines_cpu" not in proc.stderr  # (a count for every block-layout model: the line layout is not concerned)
    ok = run_cli(["verify", bundle, "--host"], ws, env={"NEURONBUILD_NUM_BLOCKS": "12"})
    assert ok.returncode == 0, ok.stderr
    named = run_cli(["verify", bundle, "--host", "--num-blocks", "//:lines_cpu=4"], ws)
    assert named.returncode == 1 and "built for a contiguous cache of sequence lines" in named.stderr, named.stderr
    bad = run_cli(["verify", bundle, "--host", "--num-blocks", "many"], ws)
    assert bad.returncode == 2 and "--num-blocks: 'many' is not a block count" in bad.stderr
    assert "Traceback" not in bad.stderr
    with pytest.raises(RuntimeError) as info:  # strict: at open, before any graph loads
        open_cache(deployed, strict=True, require=[BLOCKS, LINES], num_blocks=16)
    assert "built for num_blocks=12" in str(info.value) and "num_blocks=16 asked by open_cache" in str(info.value)
    monkeypatch.setenv("NEURONBUILD_NUM_BLOCKS", f"{BLOCKS}=16")
    with pytest.raises(BlockLayoutMismatch, match=r"num_blocks=16 requested by \$NEURONBUILD_NUM_BLOCKS, but its "
                                                  r"graphs were compiled for num_blocks=12"):
        open_cache(deployed, strict=False).causal_lm(BLOCKS)
    monkeypatch.setenv("NEURONBUILD_NUM_BLOCKS", "12")
    assert open_cache(deployed, strict=True, require=[BLOCKS]).causal_lm(BLOCKS).block_layout["num_blocks"] == 12


def test_block_attributes_leave_graphs_built_without_them_unchanged(tmp_path: Path) -> None:
    from neuronbuild.analysis.planner import plan
    from neuronbuild.loading.target_graph import load_targets

    ws = write_ws(tmp_path / "ws", {"llama.safetensors": ""})

    code: dict[str, set[str]] = {}  # label -> the shipped modules whose digests its traces' fingerprints cover

    def actions(build: str, label: str) -> dict[str, set[str]]:
        (ws / "BUILD").write_text(build)
        ag = plan(load_targets(ws, [label]))
        (compile_,) = ag.compiles
        fps = {x for _b, fp in compile_.buckets for x in ag.closure(fp)}
        code[label] = {m for fp in fps if ag.actions[fp].kind == "trace" for m in ag.actions[fp].record["model"]["builtin"]}
        return {kind: {fp for fp in fps if ag.actions[fp].kind == kind} for kind in ("weights", "trace")}

    block = _build_file()
    plain = _build_file(block=", max_batch = 4")  # the second model as the first: without the block attributes
    explicit = _build_file(block=', max_batch = 4, kv_layout = "contiguous"')
    lines = [actions(b, LINES) for b in (block, plain, explicit)]
    assert lines[0] == lines[1] == lines[2]  # the other model's graphs whatever this one's layout
    # the block graphs' code is a module of its own: editing it cannot change the fingerprints of the others
    assert code[LINES] == {"neuronbuild.toolchains.hf_causal_lm"}
    runs = [actions(b, BLOCKS) for b in (plain, explicit, block, block.replace("num_blocks = 12", "num_blocks = 13"),
                                         _build_file(block=', kv_layout = "block", block_size = 16, num_blocks = 12'))]
    assert runs[0] == runs[1]  # kv_layout absent or "contiguous": the very graphs built without it
    # one weights action whatever the block count (the block layout's model record names its module too, so its
    # weights action is not the line layout's: computed once more, same checkpoint)
    assert runs[0]["weights"] == runs[1]["weights"] and runs[2]["weights"] == runs[3]["weights"]
    assert code[BLOCKS] == {"neuronbuild.toolchains.hf_causal_lm", "neuronbuild.toolchains.hf_block_kv"}
    traces = [frozenset(r["trace"]) for r in runs[1:4]]
    assert [len(t) for t in traces] == [2, 4, 4]  # block layout: context, token and the 2 prefix buckets
    assert all(not a & b for i, a in enumerate(traces) for b in traces[i + 1:])  # block, its count: new traces
    # prefix_caching adds the prefix graphs and leaves the block layout's context and token graphs as they were
    assert len(runs[4]["trace"]) == 2 and runs[4]["trace"] < runs[2]["trace"]


def test_block_graphs_shard_at_tp2_with_each_ranks_pool_holding_its_kv_heads(tmp_path: Path) -> None:
    """The block layout shards as the line layout does: each rank's pool [layers, 2, N + 1, kv_heads / tp, B, head_dim]
    (tokens equal to transformers' at tp 2 on trn2, with shuffled blocks, preemption and chunks, checked by hand)."""
    from neuronbuild.analysis.planner import plan
    from neuronbuild.loading.target_graph import load_targets

    build = _build_file() + 'neuron_compile(name = "blocks_tp2", model = ":blocks", target = ":trn2", ' \
        'buckets = BUCKETS | {"prefix": [":pfx"]}, tp_degree = 2)\n'
    ws = write_ws(tmp_path / "ws", {"llama.safetensors": "", "BUILD": build})
    ag = plan(load_targets(ws, ["//:blocks_tp2"]))
    traces = [a for a in ag.actions.values() if a.kind == "trace"]
    assert len(traces) == 4 and all(a.record["model"]["tp"]["degree"] == 2 for a in traces)
    for a in traces:
        kv = dict(a.record["model"]["inputs"])["kv"]["dims"]
        whole = dict(a.record["model"]["whole_inputs"])["kv"]["dims"]
        assert kv[3] * 2 == whole[3] == HF["num_key_value_heads"] and kv[:3] == whole[:3], (kv, whole)


def test_a_block_size_that_does_not_divide_max_seq_is_refused_naming_the_target(tmp_path: Path) -> None:
    ws = write_ws(tmp_path / "ws", {"llama.safetensors": "",
                                    "BUILD": _build_file().replace("block_size = 16", "block_size = 20")})
    proc = run_cli(["build", BLOCKS], ws)  # (analysis fails: nothing is built)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "BUILD:" in out and "needs block_size = B, a positive int dividing max_seq (96), got 20" in out, out
    assert "Traceback" not in out
    (ws / "BUILD").write_text(_build_file(block=", max_batch = 4, prefix_caching = True"))
    proc = run_cli(["build", BLOCKS], ws)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Traceback" not in out
    assert "BUILD:" in out and 'prefix_caching = True needs kv_layout = "block"' in out, out


def test_validate_compares_the_block_graphs_with_transformers_and_generates_through_the_block_engine(
        deployed: Path, cache_dir: Path) -> None:
    proc = run_cli(["validate", BLOCKS, "--generate", "4", "--cache-dir", str(cache_dir)], deployed.parent / "ws")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith(BLOCKS + " ")]
    assert sorted(r[1] for r in rows) == ["context_batch2_seq64", "prefix_batch1_seq16_prefix48",
                                          "prefix_batch1_seq16_prefix80", "token_batch4"] and all(r[-1] == "ok" for r in rows)
    # (recognised as hf_causal_lm graphs: compared with transformers, and generated from as served)
    assert f"{BLOCKS}: generate batch1 against transformers: ok (4 tokens x 1 equal)" in proc.stdout, proc.stdout


def test_validate_block_cases_match_transformers_and_catch_a_graph_reading_the_wrong_blocks(tmp_path: Path) -> None:
    from neuronbuild.toolchains import hf_block_kv
    from neuronbuild.toolchains.validate import HfReference, compare_hf, is_hf_causal_lm

    cfg = {"model_type": "llama", "hf": HF | {"initializer_range": 0.2}, "max_seq": MAX_SEQ,
           "kv_layout": {"kind": "block", "block_size": BLOCK, "num_blocks": NUM_BLOCKS}}
    heads, head_dim = HF["num_key_value_heads"], HF["hidden_size"] // HF["num_attention_heads"]
    spec = {"entry": "neuronbuild.toolchains.hf_block_kv:block_serving_token", "config": cfg, "inputs": [
        ["kv", {"dims": [HF["num_hidden_layers"], 2, NUM_BLOCKS + 1, heads, BLOCK, head_dim], "dtype": "float32"}]]}
    assert is_hf_causal_lm(spec)
    ref = HfReference(spec, tmp_path)  # (no weights file: the seeded model, shared with the graphs below)
    for graph, make, bucket in (("context", hf_block_kv.block_serving_context, {"batch": 2, "seq": 64}),
                                ("token", hf_block_kv.block_serving_token, {"batch": 4}),
                                ("prefix", hf_block_kv.block_serving_prefix, {"batch": 2, "seq": 16, "prefix": 48})):
        eager = make(cfg).eval()
        eager.load_state_dict(ref.model.state_dict())
        got = compare_hf(eager, ref, graph, bucket, ["logits", "kv"], seed=3)
        assert not got.error and got.max_abs < 1e-4, (graph, got)
        if graph != "context":  # (a context graph reads no cache) rows handed each other's blocks: caught
            wrong = compare_hf(lambda i, m, p, t, *rest: eager(i, m, p, t.roll(1, 0), *rest),  # noqa: B023
                               ref, graph, bucket, ["logits", "kv"], seed=3)
            assert wrong.max_abs > 0.1, (graph, wrong)
    # validate --generate's reference for serving graphs (each request alone): a prompt token equal to the pad id (0)
    # is a token, as the engine serves it, not padding
    import torch

    from neuronbuild.toolchains.validate import _hf_tokens

    ids = torch.tensor([[1, 17, 0, 99, 0, 5]])
    seq = ids[0].tolist()
    with torch.no_grad():
        for _ in range(3):
            seq.append(int(ref.model(torch.tensor([seq])).logits[0, -1].argmax()))
        assert _hf_tokens(ref, ids, torch.ones_like(ids), 3)[0][0].tolist() == seq[6:]


def test_block_manager_shares_prefix_blocks_by_refcount_and_evicts_cached_ones_least_recently_used() -> None:
    from neuronbuild.runtime.block_engine import BlockManager

    m = BlockManager(num_blocks=4, block_size=2, order=[3, 1, 0, 2])
    a = m.allocate([1, 2, 3, 4, 5], positions=6)  # 3 blocks, the first 2 full prompt blocks (hashed)
    assert a == ([3, 1, 0], 0)
    b = m.allocate([1, 2, 3, 4, 9], positions=5)  # the same 4-token prefix: its 2 blocks shared, 1 new
    assert b == ([3, 1, 2], 2) and m.refs == {3: 2, 1: 2, 0: 1, 2: 1}
    assert m.allocate([7, 8], positions=2) is None  # no block left: nothing taken
    m.release(a[0])
    assert m.in_use == 3 and m.free == [0]  # the shared ones still referenced by the second request
    m.release(b[0])
    assert m.in_use == 0 and list(m.cached) == [3, 1] and sorted(m.free) == [0, 2]
    c = m.allocate([5, 6, 7, 8, 9, 10, 11], positions=8)  # 4 blocks: both free ones, then the cached, oldest first
    assert c is not None and c[1] == 0 and sorted(c[0]) == [0, 1, 2, 3] and not m.cached
    m.release(c[0])
    again = m.allocate([1, 2, 3, 4, 5], positions=5)  # the evicted prefix is not found any more
    assert again is not None and again[1] == 0 and (m.prefix_queries, m.prefix_hits) == (9, 2)
    # a prompt made of cached blocks only: the block of its last token is not shared (its prefill computes that
    # token: its logits are the next token's)
    assert m.lookup([1, 2, 3, 4]) == 1 and m.lookup([1, 2, 3, 4, 5]) == 2
    m.release(again[0])
    grown = [m.grow() for _ in range(5)]  # a running request's next blocks: free, then cached (evicted), then none
    assert sorted(b for b in grown if b is not None) == [0, 1, 2, 3] and grown[-1] is None and not m.by_hash


# -- the engine's block bookkeeping against stand-in graphs (no compile) -------------------------------------------

class _FakeFamily:
    """A graph family of stand-in graphs: each writes the token ids it is given into the pool at their positions
    through the block table and returns, as one-hot logits, a function of the whole sequence: context graphs of their
    prompt, token and prefix graphs of what they read back through the table (cached positions included), so any
    block handed out wrongly, shared wrongly or read before it is written changes a later token."""

    def __init__(self, kind: str, buckets: dict[str, dict[str, int]]) -> None:
        self.kind, self.buckets = kind, buckets

    def bucket_fn(self, name: str) -> Any:
        return self._run

    def graph(self, name: str) -> Any:
        from types import SimpleNamespace

        return SimpleNamespace(outputs=[{"name": "logits"}, {"name": "kv"}], describe=lambda: name)

    def _run(self, *args: Any) -> Any:
        import torch

        kv = args[-1]
        ids, mask, positions, table = args[:4]
        size = kv.shape[4]
        logits = torch.zeros((ids.shape[0], _VOCAB))
        for b in range(ids.shape[0]):
            if self.kind == "token":
                p = int(positions[b, 0])
                kv[0, 0, int(table[b, p // size]), 0, p % size, 0] = float(ids[b, 0]) + 1
                upto = [q for q in range(p + 1) if mask[b, q]]
            else:
                start = int(args[4][b].sum()) if self.kind == "prefix" else 0
                new = [(int(positions[b, j]) if self.kind == "prefix" else start + k, int(ids[b, j]))
                       for k, j in enumerate(j for j in range(ids.shape[1]) if mask[b, j])]
                for p, t in new:
                    kv[0, 0, int(table[b, p // size]), 0, p % size, 0] = float(t) + 1
                upto = list(range(new[-1][0] + 1))
                if self.kind == "context":  # (attends within the prompt: reads no cache)
                    logits[b, _next([t for _p, t in new])] = 1.0
                    continue
            seq = [int(kv[0, 0, int(table[b, q // size]), 0, q % size, 0]) - 1 for q in upto]
            logits[b, _next(seq)] = 1.0
        return logits, kv


_VOCAB = 97


def _next(seq: list[int]) -> int:
    return (sum((i + 1) * (t + 1) for i, t in enumerate(seq)) * 31 + len(seq)) % (_VOCAB - 3) + 3


class _FakeLM:
    """What BlockEngine reads of a CausalLM, over stand-in graphs: 8 blocks of 4 positions (or num_blocks), max_seq 32;
    prefix buckets of `prefix_batch` rows."""

    def __init__(self, prefix: bool, ctx_seq: int = 8, num_blocks: int = 8, prefix_batch: int = 1) -> None:
        from neuronbuild.runtime.causal_lm import CausalLM

        self.label, self.strict, self.serving, self.sampling = "//:fake", True, True, False
        self.max_seq, self.max_batch, self.pad_token_id, self.eos_token_id, self.vocab_size = 32, 4, 0, None, _VOCAB
        self.block_layout = {"block_size": 4, "num_blocks": num_blocks, "blocks_per_seq": 8}
        self.kv_spec = {"dims": [1, 2, num_blocks + 1, 1, 4, 1], "dtype": "float32"}
        self.context_buckets = {f"context_batch2_seq{ctx_seq}": {"batch": 2, "seq": ctx_seq}}
        self.token_buckets = {f"token_batch{n}": {"batch": n} for n in (1, 2, 4)}
        pfx = {f"prefix_batch{prefix_batch}_seq{seq}_prefix{n}": {"batch": prefix_batch, "seq": seq, "prefix": n}
               for seq, n in ((4, 16), (8, 24))}
        self._fams = {"context": _FakeFamily("context", self.context_buckets),
                      "token": _FakeFamily("token", self.token_buckets)} | (
            {"prefix": _FakeFamily("prefix", pfx)} if prefix else {})
        self.model = self
        self.families = list(self._fams)
        self.pick = CausalLM.pick.__get__(self)
        self.token_id, self.check_ids = CausalLM.token_id, CausalLM.check_ids.__get__(self)

    def family(self, name: str) -> Any:
        return self._fams[name]

    def fn(self, family: str, name: str) -> Any:
        return self._fams[family].bucket_fn(name)

    def named(self, family: str, out: Any) -> dict[str, Any]:
        return {"logits": out[0], "kv": out[1]}


def _greedy(prompt: list[int], n: int) -> list[int]:
    seq, out = list(prompt), []
    for _ in range(n):
        out.append(_next(seq))
        seq.append(out[-1])
    return out


@pytest.mark.parametrize("prefix", [True, False], ids=["prefix graphs", "no prefix graphs"])
def test_block_engine_preempts_recomputes_shares_and_chunks_with_unchanged_tokens(prefix: bool) -> None:
    from neuronbuild.runtime.block_engine import BlockEngine

    shared = [5, 6, 7, 8, 9, 10, 11, 12]  # 2 full blocks
    reqs = [(shared + [13], 12), (shared + [14, 15], 10), ([20, 21, 22], 14), ([30, 31, 32, 33, 34], 9)]
    if prefix:  # 20 tokens > the context bucket's 8: chunked (8 through the context graph, then prefix calls)
        reqs.append(([40 + i for i in range(20)], 5))
    # without prefix graphs a request is recomputable while its prompt and tokens fit the context bucket (12): the
    # latest admitted may not be, and an earlier one is preempted instead
    eng = BlockEngine(_FakeLM(prefix, ctx_seq=8 if prefix else 12))
    rids = [eng.add(p, max_new_tokens=n, eos_token_id=None) for p, n in reqs]
    out = eng.run()
    assert [out[r] for r in rids] == [_greedy(p, n) for p, n in reqs]
    c = eng.counters()
    assert c["preemptions"] >= 1 and c["prefix_hits"] >= 2 and c["blocks_in_use"] == 0, c
    if prefix:
        assert c["cached_tokens"] >= 8 and any(n.startswith("prefix_") for n in eng.calls), (c, eng.calls)
        return
    assert not any(n.startswith("prefix_") for n in eng.calls)
    # a long request that cannot be recomputed (12 + its tokens > 12) outgrows the pool beside a short one admitted
    # before it: the short one is preempted (though already due to decode in that step) and completes later
    eng = BlockEngine(_FakeLM(prefix, ctx_seq=12))
    reqs = [([20], 12), ([30 + i for i in range(12)], 13)]
    rids = [eng.add(p, max_new_tokens=n, eos_token_id=None) for p, n in reqs]
    out = eng.run()
    assert [out[r] for r in rids] == [_greedy(p, n) for p, n in reqs] and eng.counters()["preemptions"] >= 1


def test_generate_left_pads_prompts_and_pads_each_row_after_its_eos() -> None:
    """What a caller of generate() reads off its tensor (transformers' layout): the prompts right-aligned, left-padded
    with the pad id to the longest, then each row's new tokens, those of its prompt alone; a row that reached eos
    stops there and is padded to the longest row; the prompts as a tensor with a mask give the same."""
    import torch

    from neuronbuild.runtime.block_engine import BlockEngine
    from neuronbuild.runtime.causal_lm import CausalLM

    lm = _FakeLM(False, ctx_seq=12)  # CausalLM's generate over the fake's engine
    lm.engine, lm._generate_serving = lambda: BlockEngine(lm), CausalLM._generate_serving.__get__(lm)
    generate = CausalLM.generate.__get__(lm)
    prompts, new = [[5, 6, 7, 8, 9], [20, 21], [30, 31, 32]], 6
    alone = [_greedy(p, new) for p in prompts]
    eos = alone[1][2]  # the second row ends at its third token
    ends = [a.index(eos) + 1 if eos in a else new for a in alone]
    assert ends[0] == new and ends[1] == 3, ends
    pad = 0
    got = generate(prompts, max_new_tokens=new, eos_token_id=eos)
    assert got.tolist() == [[pad] * (5 - len(p)) + p + a[:end] + [pad] * (new - end)
                            for p, a, end in zip(prompts, alone, ends, strict=True)]
    ids = got[:, :5]
    assert torch.equal(generate(ids, attention_mask=(ids != pad).long(), max_new_tokens=new, eos_token_id=eos), got)


def test_block_engine_batches_chunks_over_requests_and_interleaves_them_with_decodes_with_unchanged_tokens() -> None:
    """Prefix and chunk calls run several requests' chunks at once (prefix buckets of 2 rows), one chunk per request
    per step, so a long prompt's chunks alternate with the other requests' decode steps; a request sharing blocks
    that a chunked prompt writes only in its second chunk waits for that chunk."""
    from neuronbuild.runtime.block_engine import BlockEngine

    shared = [40 + i for i in range(16)]  # 4 full blocks: the context bucket's 8 tokens write 2 of them
    reqs = [(shared + [1, 2, 3, 4], 3),  # 20 tokens: chunks 0-8 (context), 8-16, 16-20 (prefix)
            ([60 + i for i in range(18)], 3),  # 18: 0-8, 8-16, 16-18
            (shared + [9], 4),  # 17: its first 16 read from the first request's blocks, 16-17 computed
            ([30, 31, 32], 8)]  # a whole prompt
    eng = BlockEngine(_FakeLM(True, num_blocks=24, prefix_batch=2))
    rids = [eng.add(p, max_new_tokens=n, eos_token_id=None) for p, n in reqs]
    for _ in range(3):
        eng.step()
    # step 1: the 3 context chunks in 2 context calls, the whole prompt decodes; step 2: both long prompts' second
    # chunks in one prefix call (the third request waits: its blocks 2-3 are being written), the whole prompt
    # decodes; step 3: the last chunks of all three (4, 2 and 1 tokens after 16), 2 + 1 rows of the smaller bucket,
    # then all four decode (one request at a time and each prefilled whole, 5 prefix calls would have run before
    # the first decode)
    assert eng.calls == {"context_batch2_seq8": 2, "prefix_batch2_seq8_prefix24": 1, "prefix_batch2_seq4_prefix16": 2,
                         "token_batch1": 2, "token_batch4": 1}, eng.calls
    assert [len(eng.active[line].tokens) for line in sorted(eng.active)] == [2, 2, 2, 4]
    assert eng.counters()["cached_tokens"] == 16 and eng.counters()["prefix_hits"] == 4, eng.counters()
    out = eng.run()
    assert [out[r] for r in rids] == [_greedy(p, n) for p, n in reqs]
