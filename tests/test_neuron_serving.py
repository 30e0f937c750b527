"""Neuron graphs served through libnrt: the example's trn2 release bundle, built with the neuronx-cc stand-in,
deployed and opened strictly without emulation on a "Neuron host" whose libnrt is the stand-in
(tests/standins/libnrt/, NEURONBUILD_LIBNRT), generates exactly transformers' greedy tokens, counted as hits; tp 2
loads as a collectives group; a NEFF whose I/O table disagrees with the manifest is refused at open naming the tensor;
a libnrt call failing mid-load leaves nothing loaded and names the call and status. The stand-in's nrt_execute runs
each NEFF's HLO on XLA:CPU by calling back into this process (tests/standins/libnrt/xla_executor.py)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import REPO, run_cli
from introspect_ws import STANDIN
from test_llm import NEW, PROMPTS, reference  # noqa: F401  (the module fixture `reference`: transformers' tokens)

sys.path.insert(0, str(REPO / "tests" / "standins" / "libnrt"))
import xla_executor  # noqa: E402

TRN2, TP2, BADIO = "//models:llama_trn2", "//models:llama_nrt_tp2", "//models:llama_badio"
SERVE_BUILD = """
llm_buckets(name = "tp", batch_sizes = [1], context_lengths = [16])
neuron_compile(name = "llama_nrt_tp2", model = ":llama", buckets = {"context": [":tp_context"], "token": [":tp_token"]},
               target = ":trn2", tp_degree = 2)
neuron_bundle(name = "release_tp2", srcs = [":llama_nrt_tp2"])
llm_buckets(name = "one", batch_sizes = [1], context_lengths = [32])
compiler_options(name = "bad_io", deps = [":token_opts"], flags = ["--standin-io-shape=input1:2x2"])
neuron_compile(name = "llama_badio", model = ":llama", buckets = {"context": [":one_context"], "token": [":one_token"]},
               target = ":trn2", options = {"context": ":context_opts", "token": ":bad_io"})
neuron_bundle(name = "release_badio", srcs = [":llama_badio"])
"""


@pytest.fixture(scope="module")
def libnrt(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The stand-in built with its build.sh, configured as this process's libnrt, its executor installed."""
    out = tmp_path_factory.mktemp("libnrt")
    proc = subprocess.run([str(REPO / "tests/standins/libnrt/build.sh"), str(out)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    path = str(out / "libnrt.so")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NEURONBUILD_LIBNRT", path)
        mp.delenv("NEURON_PLATFORM_TARGET_OVERRIDE", raising=False)
        mp.delenv("NEURONBUILD_EMULATE", raising=False)
        lib = xla_executor.install(path)
        yield lib
        from neuronbuild.runtime.libnrt import close_session

        gc.collect()
        close_session()


@pytest.fixture(scope="module")
def deployed(built_example, cache_dir: Path, libnrt: Any,  # type: ignore[no-untyped-def]
             tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The example workspace (a copy) built again with the neuronx-cc stand-in, plus a tp 2 target and one whose token
    NEFF's I/O table disagrees with its manifest (the example's traces and lowerings come from the session cache: its
    trn2 graphs only compile again, the tp 2 graphs trace, lower and compile); its release bundles deployed, keyed by
    bundle name ("ws": the workspace)."""
    import shutil

    from neuronbuild.runtime.libnrt import library_path

    src, _ = built_example
    ws = tmp_path_factory.mktemp("nrt_ws") / "ws"
    shutil.copytree(src, ws, ignore=shutil.ignore_patterns("neuronbuild-out"))
    (ws / "models/BUILD").write_text((ws / "models/BUILD").read_text() + SERVE_BUILD)
    proc = run_cli(["build", "//models:release", "//models:release_tp2", "//models:release_badio", "--jobs", "2",
                    "--neuronx-cc", str(STANDIN), "--cache-dir", str(cache_dir)], ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = {}
    for name in ("release", "release_tp2", "release_badio"):
        dest = tmp_path_factory.mktemp(f"serve_{name}") / "cache"
        env = {"NEURONBUILD_LIBNRT": library_path()}
        proc = run_cli(["deploy", str(ws / f"neuronbuild-out/models/{name}.tar.zst"), "--dest", str(dest)], ws, env)
        assert proc.returncode == 0, proc.stderr
        out[name] = dest
    out["ws"] = ws
    return out


def _state(lib: Any) -> dict[str, int]:
    gc.collect()  # graphs of caches no test holds any more are released by their finalizers
    return xla_executor.state(lib)


def test_verify_host_asks_libnrt_for_the_platform_and_cores(deployed: dict[str, Path]) -> None:
    ws = deployed["ws"]
    env = {"NEURONBUILD_LIBNRT": os.environ["NEURONBUILD_LIBNRT"]}
    ok = run_cli(["verify", "neuronbuild-out/models/release.tar.zst", "--host"], ws, env)
    assert ok.returncode == 0, ok.stderr
    assert "neuron trn2 (4 NeuronCores visible to libnrt)) can use every graph" in ok.stdout
    one_core = run_cli(["verify", "neuronbuild-out/models/release_tp2.tar.zst", "--host"], ws,
                       {**env, "NEURON_RT_VISIBLE_CORES": "2"})
    assert one_core.returncode == 1
    assert one_core.stderr.count("tp_degree differs (built for 2 NeuronCores, this host has 1 visible to libnrt") == 2
    inf2 = run_cli(["verify", "neuronbuild-out/models/release_tp2.tar.zst", "--host"], ws,
                   {**env, "NRT_STANDIN_FAMILY": "inf2"})
    assert inf2.returncode == 1 and "target.platform differs (built for trn2, this host has inf2)" in inf2.stderr


def test_a_trn2_host_without_libnrt_refuses_the_neffs_at_open_naming_the_library(
        deployed: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from neuronbuild.runtime import open_cache

    monkeypatch.setenv("NEURONBUILD_LIBNRT", str(tmp_path / "libnrt.so"))  # absent
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    with pytest.raises(RuntimeError) as e:
        open_cache(deployed["release"], strict=True, require=[TRN2])
    assert f"no Neuron runtime library at {tmp_path / 'libnrt.so'}" in str(e.value)
    assert "emulate='xla-cpu'" in str(e.value)


def test_trn2_bundle_served_through_libnrt_generates_transformers_greedy_tokens(
        deployed: dict[str, Path], libnrt: Any, reference: dict[str, list[list[int]]]) -> None:  # noqa: F811
    from neuronbuild.runtime import open_cache

    before = _state(libnrt)
    cache = open_cache(deployed["release"], strict=True, require=[TRN2])
    assert (cache.counters.hit, cache.counters.emulated, cache.counters.error, cache.counters.miss) == (4, 0, 0, 0)
    loaded = _state(libnrt)
    assert loaded["models"] - before["models"] == 4  # one per graph (bucket)
    # the model's weights are copied once onto the NeuronCore and shared by the 4 graphs: one device tensor per
    # weight, plus each graph's own constants (program_constants.safetensors) and its own input and output tensors
    from safetensors import safe_open

    release = next((deployed["release"] / "releases").iterdir())
    graphs = [g for g in json.loads((release / "manifest.json").read_text())["graphs"] if g["label"] == TRN2]
    with safe_open(str(release / graphs[0]["weights"]["path"]), "pt") as f:
        model_weights = set(f.keys())
    expected = len(model_weights)
    for g in graphs:
        ps = json.loads((release / g["artifacts"]["params.json"]["path"]).read_text())
        state = {p["name"] for p in ps["parameters"] if p["kind"] != "input"}
        assert state - model_weights, "a graph without constants of its own: the count below proves less"
        expected += len(state - model_weights) + len(ps["parameters"]) - len(state) + len(ps["outputs"])
    assert loaded["tensors"] - before["tensors"] == expected
    lm = cache.causal_lm(TRN2)
    for key, prompts in PROMPTS.items():  # batch 1, and a padded batch of 3 ragged prompts (the batch-4 buckets)
        start = _state(libnrt)
        got = lm.generate(prompts, max_new_tokens=NEW)[:, -NEW:].tolist()
        assert got == reference[key], key
        ran = _state(libnrt)
        assert ran["executions"] - start["executions"] == NEW  # 1 context + NEW-1 token steps, all through libnrt
        # the KV cache stays on the device between steps: less than one copy of it written in the whole generate
        kv_bytes = 2 * 2 * (1 if key == "batch1" else 4) * 2 * 64 * 16 * 4  # [layers, k/v, batch, kv heads, seq, dim]
        assert ran["written"] - start["written"] < kv_bytes
    assert (cache.counters.hit, cache.counters.emulated, cache.counters.eager) == (4, 0, 0)
    assert _state(libnrt)["violations"] == before["violations"]


def test_a_lenient_open_loads_a_neff_at_first_use_and_matches_emulation(deployed: dict[str, Path],
                                                                          libnrt: Any) -> None:
    import torch

    from neuronbuild.runtime import open_cache

    cache = open_cache(deployed["release"], strict=False)
    assert cache.counters.hit == 0  # nothing loaded at open
    ids = torch.randint(0, 512, (3, 32), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    got = cache.model(TRN2).family("context")(ids, mask)  # batch 3 padded to the batch-4 bucket, un-padded
    assert (cache.counters.hit, cache.counters.emulated) == (1, 0)
    emulated = open_cache(deployed["release"], strict=False, emulate="xla-cpu")
    want = emulated.model(TRN2).family("context")(ids, mask)
    assert (emulated.counters.hit, emulated.counters.emulated) == (0, 1)
    for name in ("logits", "kv"):
        assert got[name].shape == want[name].shape and torch.equal(got[name], want[name])


def test_tp2_loads_one_model_per_rank_as_a_collectives_group(
        deployed: dict[str, Path], libnrt: Any, reference: dict[str, list[list[int]]]) -> None:  # noqa: F811
    from neuronbuild.runtime import open_cache

    before = _state(libnrt)
    cache = open_cache(deployed["release_tp2"], strict=True, require=[TP2])
    assert (cache.counters.hit, cache.counters.emulated) == (2, 0)
    assert _state(libnrt)["models"] - before["models"] == 4  # 2 graphs x 2 ranks
    xla_executor.calls.clear()
    got = cache.causal_lm(TP2).generate(PROMPTS["batch1"], max_new_tokens=NEW)[:, -NEW:].tolist()
    assert got == reference["batch1"]
    assert xla_executor.calls and all(ranks == 2 for _, ranks in xla_executor.calls)  # each step: the whole group
    assert _state(libnrt)["violations"] == before["violations"]


def test_a_neff_whose_io_table_disagrees_with_the_manifest_is_refused_at_open(
        deployed: dict[str, Path], libnrt: Any) -> None:
    from neuronbuild.runtime import open_cache

    before = _state(libnrt)
    with pytest.raises(RuntimeError) as e:
        open_cache(deployed["release_badio"], strict=True, require=[BADIO])
    msg = str(e.value)
    del e
    assert "//models:llama_badio [token: batch=1]" in msg and "NeffMismatch" in msg
    assert ("NEFF tensor input1 (parameter model.layers.0.self_attn.q_proj.weight) is float32[2, 2] (16 bytes) in the "
            "NEFF, float32[64, 64] (16384 bytes) in params.json") in msg, msg
    after = _state(libnrt)
    assert (after["models"], after["tensors"], after["sets"]) == (before["models"], before["tensors"], before["sets"])
    assert after["violations"] == before["violations"]


@pytest.mark.parametrize("bundle,label,call,nth,status,named", [
    ("release", TRN2, "nrt_tensor_allocate", 12, 4, "nrt_tensor_allocate returned NRT_RESOURCE (4) (tensor "),
    ("release_tp2", TP2, "nrt_load_collectives", 2, 9,
     "nrt_load_collectives returned NRT_LOAD_NOT_ENOUGH_NC (9) (rank 1 of 2, NeuronCore 1)"),
])
def test_a_call_failing_mid_load_leaves_nothing_loaded_and_names_call_and_status(
        deployed: dict[str, Path], libnrt: Any, bundle: str, label: str, call: str, nth: int, status: int,
        named: str) -> None:
    from neuronbuild.runtime import open_cache

    before = _state(libnrt)
    xla_executor.fail(libnrt, call, nth, status)
    try:
        with pytest.raises(RuntimeError) as e:
            open_cache(deployed[bundle], strict=True, require=[label])
        msg = str(e.value)
        del e
    finally:
        xla_executor.fail(libnrt, "", 0, 0)
    assert f"strict mode: {label} [" in msg and named in msg, msg
    after = _state(libnrt)
    assert (after["models"], after["tensors"], after["sets"]) == (before["models"], before["tensors"], before["sets"])
    assert after["violations"] == before["violations"]


def test_the_standin_refuses_what_the_contract_forbids(deployed: dict[str, Path], libnrt: Any) -> None:
    """The stand-in is strict where libnrt's contract is: each broken rule fails loudly with the header's status."""
    from neuronbuild.runtime.libnrt import NrtError, session

    release = next((deployed["release"] / "releases").iterdir())
    neff = next(release.glob("graphs/**/token_batch1/model.neff")).read_bytes()
    s = session()
    before = _state(libnrt)

    def refused(status: int, what: str, fn: Any, *args: Any) -> None:
        with pytest.raises(NrtError) as e:
            fn(*args)
        assert e.value.status == status and what in xla_executor.last_violation(libnrt), xla_executor.last_violation(
            libnrt)

    refused(2, "NeuronCore 9, which is not visible (4 visible)", s.allocate, 9, 16, "off-core")
    refused(9, "NeuronCore 4 is not visible", s.load, neff, 4, 0, 1)
    model = s.load(neff, 0, 0, 1)
    tin, tout, t = s.new_set(), s.new_set(), s.allocate(0, 16, "x")
    s.bind(tin, "input0", t)
    s.free(t)  # held by a live set: refused (nrt_tensor_free returns nothing; the violation is counted)
    assert "freed while 1 live tensor set(s) hold it" in xla_executor.last_violation(libnrt)
    assert s.execute(model, tin, tout) == 1002  # NRT_EXEC_BAD_INPUT: input0 has 16 bytes, not the NEFF's size
    assert "input0 has 16 bytes, the NEFF takes" in xla_executor.last_violation(libnrt)
    rank0 = s.load(neff, 0, 0, 2)  # rank 0 of a 2-rank collectives group; rank 1 may not share its NeuronCore
    refused(2, "ranks 0 and 1 of one collectives group on the same NeuronCore 0", s.load, neff, 0, 1, 2)
    s.destroy_set(tin)
    s.destroy_set(tout)
    s.free(t)
    s.unload(model)
    s.unload(rank0)
    refused(3, "not a loaded model (unloaded twice?)", s.unload, model)
    after = _state(libnrt)
    assert (after["models"], after["tensors"], after["sets"]) == (before["models"], before["tensors"], before["sets"])
    assert after["violations"] - before["violations"] == 6


def test_closing_unloads_everything_before_nrt_close(deployed: dict[str, Path], libnrt: Any) -> None:
    from neuronbuild.runtime import open_cache
    from neuronbuild.runtime.libnrt import close_session

    cache = open_cache(deployed["release"], strict=True, require=[TRN2])
    before = _state(libnrt)
    assert before["models"] >= 4
    close_session()  # what runs at exit: every graph released, then nrt_close (which flags anything left)
    state = xla_executor.state(libnrt)
    assert (state["models"], state["tensors"], state["sets"]) == (0, 0, 0)
    assert state["violations"] == before["violations"], xla_executor.last_violation(libnrt)
    del cache


def test_a_bf16_module_through_libnrt_computes_what_emulation_computes(libnrt: Any, tmp_path: Path) -> None:
    """bf16 weights, inputs and outputs (2-byte NEFF tensors, nrt dtype BFLOAT16) through the libnrt path, against
    the same module on XLA:CPU (emulation); an input of the wrong shape is refused naming it."""
    import torch

    from neuronbuild.runtime.neff_graph import load_neff_graph
    from neuronbuild.runtime.xla_cpu import load_graph
    from neuronbuild.toolchains.neuron_hlo import lower_program

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).to(torch.bfloat16)
    with torch.no_grad():
        ep = torch.export.export(model.eval(), (torch.ones(3, 8, dtype=torch.bfloat16),), strict=False)
    low = lower_program(ep)
    (tmp_path / "model.hlo.pb").write_bytes(low.proto)
    (tmp_path / "params.json").write_bytes(low.params_json())
    proc = subprocess.run([str(STANDIN), "compile", "model.hlo.pb", "--framework", "XLA", "--target", "trn2",
                           "--output", "model.neff"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    params = json.loads(low.params_json())
    assert {p["dtype"] for p in params["parameters"]} == {"bfloat16"}
    before = _state(libnrt)
    graph = load_neff_graph("mlp [batch=3]", (tmp_path / "model.neff").read_bytes(), low.params_json(),
                            [{"name": "out"}], {}, [weights])
    x = torch.randn(3, 8).to(torch.bfloat16)
    got = graph(x)
    want = load_graph(tmp_path / "model.hlo.pb", tmp_path / "params.json", weights)(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    with pytest.raises(ValueError, match=r"input .* must have shape \[3, 8\], got \[2, 8\]"):
        graph(x[:2])
    graph.release()
    after = _state(libnrt)
    assert (after["models"], after["tensors"], after["sets"], after["violations"]) == \
        (before["models"], before["tensors"], before["sets"], before["violations"])
