"""A bf16 checkpoint builds and runs in bf16 (#28): an hf_causal_lm whose config says `torch_dtype: bfloat16` traces,
lowers and compiles with bf16 weights and a bf16 KV cache (cpu, and trn2 whose HLO runs on XLA:CPU); the one weights
file is bf16 and holds the checkpoint's bytes once (the tied lm_head aliased, not stored again); `validate --generate`
accepts the graphs against transformers' own model in bf16; the deployed bundle's greedy tokens equal transformers'
bf16 `generate`; the continuous-batching + on-device-sampling graphs in bf16 give each request transformers' bf16
greedy tokens through the engine (#42)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
from helpers import run_cli, write_ws

HF = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
      "num_key_value_heads": 1, "max_position_embeddings": 32, "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
MAX_SEQ, SEQ, NEW = 16, 8, 8
CPU, TRN2 = "//:llama_cpu", "//:llama_trn2"
BUILD = f'''load("@neuronbuild//rules:llm.bzl", "hf_causal_lm", "llm_buckets", "llm_compile")
neuron_target(name = "trn2", platform = "trn2")
neuron_target(name = "cpu", platform = "cpu", isa = "native")
llm_buckets(name = "serve", batch_sizes = [2], context_lengths = [{SEQ}])
hf_causal_lm(name = "llama", model_type = "llama", config = {json.dumps(HF).replace("true", "True")},
             weights = "llama.safetensors", max_seq = {MAX_SEQ})
llm_compile(name = "llama", model = ":llama", targets = [":cpu", ":trn2"],
            buckets = {{"context": [":serve_context"], "token": [":serve_token"]}})
# the serving options in bf16 (#42): cpu only, one context and one token bucket (2 more compiles)
hf_causal_lm(name = "serving", model_type = "llama", config = {json.dumps(HF).replace("true", "True")},
             weights = "llama.safetensors", max_seq = {MAX_SEQ}, continuous_batching = True, max_batch = 2,
             on_device_sampling = True)
neuron_buckets(name = "serving_ctx", shapes = [{{"batch": 2, "seq": {SEQ}}}])
neuron_buckets(name = "serving_tok", shapes = [{{"batch": 2}}])
neuron_compile(name = "serving_cpu", model = ":serving", target = ":cpu",
               buckets = {{"context": [":serving_ctx"], "token": [":serving_tok"]}})
neuron_bundle(name = "release", srcs = [":llama_cpu", ":llama_trn2", ":serving_cpu"])
'''


def _reference() -> Any:
    """transformers' own model of the config, in bf16, seeded."""
    import torch

    from neuronbuild.toolchains.hf_causal_lm import hf_model

    torch.manual_seed(0)
    return hf_model({"model_type": "llama", "hf": HF, "max_seq": MAX_SEQ}).eval()


def _header(path: Path) -> dict[str, Any]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n])  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def bf16_built(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Path:
    from safetensors.torch import save_file

    ws = write_ws(tmp_path_factory.mktemp("llm_bf16") / "ws", {"BUILD": BUILD})
    state = {k: v.detach().clone().contiguous() for k, v in _reference().state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(ws / "llama.safetensors"))  # as transformers saves a tied model: the embedding once
    proc = run_cli(["build", "//...", "--jobs", "2", "--cache-dir", str(cache_dir)], ws)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return ws


def test_bf16_checkpoint_gives_bf16_graphs_and_one_bf16_weights_file_of_its_size(bf16_built: Path) -> None:
    ws = bf16_built
    ckpt = _header(ws / "llama.safetensors")
    ckpt_bytes = sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in ckpt.items() if k != "__metadata__")
    files = sorted((ws / "neuronbuild-out").glob("llama_*/*/constants.safetensors"))
    assert len(files) == 4  # 2 targets x (context, token)
    assert len({f.read_bytes() for f in files}) == 1  # one weights file for every graph and target
    header = _header(files[0])
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    assert "lm_head.weight" not in tensors  # tied: stored once, under the embedding's name
    assert json.loads(header["__metadata__"]["neuronbuild.tied"]) == {"lm_head.weight": "model.embed_tokens.weight"}
    for k, v in ckpt.items():
        if k != "__metadata__":
            assert tensors[k]["dtype"] == "BF16" and tensors[k]["shape"] == v["shape"], k
    # The checkpoint's tensors and nothing else: the float32 rotary tables transformers computes in __init__
    # (non-persistent buffers) are each graph's own tensors, beside it.
    assert set(tensors) == {k for k in ckpt if k != "__metadata__"}
    stored = sum(v["data_offsets"][1] - v["data_offsets"][0] for v in tensors.values())
    assert stored == ckpt_bytes
    own = _header(files[0].parent / "program_constants.safetensors")
    own.pop("__metadata__", None)
    assert own and all("rotary_emb" in k and v["dtype"] == "F32" for k, v in own.items()), own
    # The graphs compute in bf16: the Neuron module's weight parameters and KV cache input are bf16.
    params = json.loads((ws / "neuronbuild-out/llama_trn2/token_batch2/params.json").read_text())["parameters"]
    by_name = {p["name"]: p["dtype"] for p in params}
    assert by_name["model.embed_tokens.weight"] == "bfloat16" and by_name["kv"] == "bfloat16", by_name


def test_bf16_graphs_validate_and_generate_like_transformers_in_bf16(bf16_built: Path, cache_dir: Path) -> None:
    # (the serving graphs are checked by the engine test below, not validated again here: CI time)
    proc = run_cli(["validate", CPU, TRN2, "--generate", str(NEW), "--cache-dir", str(cache_dir)], bf16_built)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    rows = [line for line in out.splitlines() if line.startswith(("//:llama_cpu ", "//:llama_trn2 "))]
    assert len(rows) == 4 and all(r.endswith(" ok") for r in rows), out
    gen = [line for line in out.splitlines() if ": generate " in line]
    assert len(gen) == 4 and all(f": ok ({NEW} tokens x " in g for g in gen), out


@pytest.mark.parametrize("label,emulate", [(CPU, None), (TRN2, "xla-cpu")], ids=["cpu", "trn2-xla-cpu"])
def test_deployed_bf16_bundle_generates_transformers_bf16_tokens(
        bf16_built: Path, tmp_path: Path, label: str, emulate: str | None) -> None:
    import torch

    from neuronbuild.runtime import open_cache

    dest = tmp_path / "deployed"
    proc = run_cli(["deploy", str(bf16_built / "neuronbuild-out/release.tar.zst"), "--cache-dir", str(dest)],
                   bf16_built)
    assert proc.returncode == 0, proc.stderr
    prompt = [[1, 17, 9, 25, 3, 48, 7, 5]]
    lm = open_cache(dest, strict=True, emulate=emulate).causal_lm(label)
    got = lm.generate(prompt, max_new_tokens=NEW, eos_token_id=None)[:, -NEW:].tolist()
    ref = _reference()
    assert next(ref.parameters()).dtype == torch.bfloat16
    with torch.no_grad():
        want = ref.generate(torch.tensor(prompt), attention_mask=torch.ones((1, len(prompt[0])), dtype=torch.int64),
                            max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[:, -NEW:].tolist()
    assert got == want


def test_bf16_continuous_batching_and_on_device_sampling_give_transformers_bf16_greedy_tokens(
        bf16_built: Path, tmp_path: Path) -> None:
    """The serving graphs in bf16 (cache in bf16, written in place on cpu): 3 requests of different lengths through
    a 2-line engine (one queues), greedy and top_k = 1 at temperature 0.8, each equal to transformers' bf16
    `generate` of that request alone (tokens exactly, as docs/llm.md defines the bf16 comparison)."""
    import torch

    from neuronbuild.runtime import open_cache

    dest = tmp_path / "deployed"
    proc = run_cli(["deploy", str(bf16_built / "neuronbuild-out/release.tar.zst"), "--cache-dir", str(dest)],
                   bf16_built)
    assert proc.returncode == 0, proc.stderr
    lm = open_cache(dest, strict=True).causal_lm("//:serving_cpu")
    assert (lm.serving, lm.sampling, lm.kv_spec["dtype"]) == (True, True, "bfloat16")
    prompts = [[1, 17, 9, 25, 3, 48, 7, 5], [1, 30, 31], [1, 12, 40, 41, 42]]
    eng = lm.engine()
    cache = eng.kv
    rids = [eng.add(prompts[0], max_new_tokens=NEW, eos_token_id=None),
            eng.add(prompts[1], max_new_tokens=5, temperature=0.8, top_k=1, eos_token_id=None),
            eng.add(prompts[2], max_new_tokens=6, eos_token_id=None)]
    got = eng.run()
    assert eng.kv is cache and cache.dtype == torch.bfloat16  # one bf16 cache, written in place
    ref = _reference()
    for rid, p, n in zip(rids, prompts, (NEW, 5, 6), strict=True):
        with torch.no_grad():
            want = ref.generate(torch.tensor([p]), attention_mask=torch.ones((1, len(p)), dtype=torch.int64),
                                max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(p):].tolist()
        assert got[rid] == want, (rid, got[rid], want)


def test_a_weights_file_whose_tied_names_point_nowhere_is_refused() -> None:
    """Bundles are untrusted: a tied alias naming no stored tensor (or shadowing one) is a malformed file."""
    from neuronbuild.runtime.verified import TIED_KEY, with_tied

    assert with_tied({"a": 1}, {TIED_KEY: '{"b": "a"}'}) == {"a": 1, "b": 1}
    for bad in ('{"b": "zzz"}', '{"a": "a"}', '[1]', "{", '{"b": 3}'):
        with pytest.raises(ValueError):
            with_tied({"a": 1}, {TIED_KEY: bad})
