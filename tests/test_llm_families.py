"""The LLM families users serve, built as hf_causal_lm in ONE workspace by one build (cpu, and trn2 whose HLO runs on
XLA:CPU): `neuronbuild validate --generate` compares every graph with transformers' own model on the same config and
weights (context and token logits) and the runtime's greedy tokens with transformers' `generate` for batch 1 and a
padded batch, the prompt plus generation longer than the sliding window where the family has one. A wrapper that
ignores the window is caught by validate's comparison."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import run_cli, write_ws

WINDOW, SEQ, NEW, MAX_SEQ = 4, 8, 8, 16  # prompt (8) + generation (8) > the window (4)
_BASE = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 32}
FAMILIES = {
    "llama": ("llama", _BASE),
    "mistral_sw": ("mistral", _BASE | {"sliding_window": WINDOW}),
    "gemma3_sw": ("gemma3_text", _BASE | {"head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": WINDOW,
                                          "layer_types": ["sliding_attention", "full_attention"]}),
    # soft-capping is monotonic: the capped logits are what validate's tolerance catches, tokens stay the same
    "gemma2_cap": ("gemma2", _BASE | {"head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": WINDOW,
                                      "final_logit_softcapping": 0.05, "attn_logit_softcapping": 0.5}),
    "phi3": ("phi3", _BASE | {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 1}),
    "qwen2_sw": ("qwen2", _BASE | {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    "qwen2_moe": ("qwen2_moe", _BASE | {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
                                        "shared_expert_intermediate_size": 16}),
    "falcon_mqa": ("falcon", {"vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
                              "multi_query": True, "parallel_attn": True, "bias": False}),
    "bloom_alibi": ("bloom", {"vocab_size": 64, "hidden_size": 16, "n_layer": 2, "n_head": 2}),
}


# Every family is built for trn2 (its HLO runs on XLA:CPU): the traced program, where the semantics live, is the same
# for both targets; the cpu target (an AOTInductor compile, the costly step) for these only, to keep CI time down:
# a sliding window and experts. (llama on cpu: tests/test_llm.py's tokens from the deployed bundle, left-padded batch,
# equal transformers' greedy generate, and tests/test_validate.py validates its cpu graphs.)
CPU_FAMILIES = ("gemma3_sw", "qwen2_moe")


def _targets(name: str) -> list[str]:
    return ["cpu", "trn2"] if name in CPU_FAMILIES else ["trn2"]


def _write_weights(root: Path, name: str) -> None:
    """The family's transformers model, seeded, saved as transformers' keys."""
    import torch
    from safetensors.torch import save_file

    from neuronbuild.toolchains.hf_causal_lm import hf_model

    model_type, hf = FAMILIES[name]
    torch.manual_seed(0)
    model = hf_model({"model_type": model_type, "hf": hf, "max_seq": MAX_SEQ})
    root.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()},
              str(root / f"{name}.safetensors"))


def _write_family_workspace(root: Path) -> Path:
    lines = ['load("@neuronbuild//rules:llm.bzl", "hf_causal_lm", "llm_buckets", "llm_compile")',
             'neuron_target(name = "trn2", platform = "trn2")',
             'neuron_target(name = "cpu", platform = "cpu", isa = "native")',
             # one context and one token bucket of batch 2: batch 1 runs in it with a dummy row, as the runtime does
             f'llm_buckets(name = "serve", batch_sizes = [2], context_lengths = [{SEQ}])']
    root.mkdir(parents=True, exist_ok=True)
    for name, (model_type, hf) in FAMILIES.items():
        _write_weights(root, name)
        lines += [f'hf_causal_lm(name = "{name}", model_type = "{model_type}", config = {json.dumps(hf)}, '
                  f'weights = "{name}.safetensors", max_seq = {MAX_SEQ})',
                  f'llm_compile(name = "{name}", model = ":{name}", targets = {json.dumps([":" + t for t in _targets(name)])}, '
                  'buckets = {"context": [":serve_context"], "token": [":serve_token"]})']
    text = "\n".join(lines).replace("true", "True").replace("false", "False") + "\n"
    return write_ws(root, {"BUILD": text})


@pytest.fixture(scope="session")
def families_built(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> tuple[Path, float]:
    """Every family, both targets, in one workspace and one build invocation; returns it and the build's seconds."""
    ws = _write_family_workspace(tmp_path_factory.mktemp("llm_families") / "ws")
    start = time.monotonic()
    proc = run_cli(["build", "//...", "--jobs", "2", "--cache-dir", str(cache_dir)], ws)
    took = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    print(f"\nllm families: {len(FAMILIES)} models (trn2; cpu for {len(CPU_FAMILIES)}) built in {took:.0f} s",
          flush=True)
    return ws, took


@pytest.mark.timeout(1800)  # the fixture's one build of every family counts towards the first test using it
def test_every_family_validates_and_generates_like_transformers(families_built, cache_dir: Path) -> None:
    ws, _took = families_built
    proc = run_cli(["validate", "//...", "--generate", str(NEW), "--cache-dir", str(cache_dir)], ws)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    for name in FAMILIES:
        for target in _targets(name):
            label = f"//:{name}_{target}"
            rows = [line for line in out.splitlines() if line.startswith(label + " ")]
            assert len(rows) == 2 and all(r.endswith(" ok") for r in rows), (label, out)
            gen = [line for line in out.splitlines() if line.startswith(f"{label}: generate ")]
            assert [g.split()[2] for g in gen] == ["batch1", "batch2_padded"], (label, out)
            assert all(f": ok ({NEW} tokens x " in g for g in gen), (label, out)


def _eager_serving_lm(name: str, max_batch: int = 3) -> tuple[Any, Any]:
    """The family's continuous-batching graphs (the shipped wrapper's serving_context / serving_token, eager, with
    transformers' seeded weights) as the runtime's CausalLM sees deployed graphs, and transformers' model."""
    import torch

    from neuronbuild.runtime.causal_lm import CausalLM
    from neuronbuild.toolchains import hf_causal_lm
    from neuronbuild.toolchains.validate import _Family, _Graph, _Model

    model_type, hf = FAMILIES[name]
    cfg = {"model_type": model_type, "hf": hf, "max_seq": MAX_SEQ}
    torch.manual_seed(0)
    ref = hf_causal_lm.hf_model(cfg).eval()
    state = ref.state_dict()
    static = hf_causal_lm.context(cfg).eval()
    static.load_state_dict(state)
    with torch.no_grad():  # the family's cache layout [layers, 2, batch, kv_heads, max_seq, head_dim]
        dims = list(static(torch.ones(1, 2, dtype=torch.int64), torch.ones(1, 2, dtype=torch.int64))["kv"].shape)
    dims[2] = max_batch + 1
    kv = {"dtype": "float32", "dims": dims}
    i32 = "int32"
    families = {}
    for fam, entry, ids, mask, pos, buckets in (
            ("context", hf_causal_lm.serving_context, ["batch", "seq"], ["batch", "seq"], ["batch", "seq"],
             {"context_batch2_seq8": {"batch": 2, "seq": SEQ}}),
            ("token", hf_causal_lm.serving_token, ["batch", 1], ["batch", MAX_SEQ], ["batch", 1],
             {"token_batch2": {"batch": 2}, "token_batch4": {"batch": 4}})):
        module = entry(cfg).eval()
        module.load_state_dict(state)
        spec = {"config": cfg, "outputs": [["logits", {}], ["kv", kv]],
                "inputs": [["input_ids", {"dtype": i32, "dims": ids}], ["attention_mask", {"dtype": i32, "dims": mask}],
                           ["position_ids", {"dtype": i32, "dims": pos}], ["seq_ids", {"dtype": i32, "dims": ["batch"]}],
                           ["kv", kv]]}

        def flat(module: Any = module) -> Any:  # outputs as a loaded artifact returns them: a list
            return lambda *args: list(module(*args).values())

        families[fam] = _Family(f"//:{name}", {n: (_Graph(spec, b, n, {"kv": "kv"}, f"//:{name}"), flat())
                                               for n, b in buckets.items()})
    return CausalLM(_Model(f"//:{name}", families), strict=True), ref


@pytest.mark.parametrize("name", list(FAMILIES))
def test_serving_graphs_of_every_family_run_eagerly_by_the_engine_give_each_request_transformers_greedy_tokens(
        name: str) -> None:
    """The continuous-batching wrapper (eager, not compiled: the compiled serving graphs are checked on llama in
    tests/test_llm_serving.py) of every family, driven by the runtime's engine: requests admitted at different steps
    into different lines decode side by side at different positions (prompt + generation beyond the sliding window
    where the family has one), each equal to transformers' greedy `generate` of that request alone."""
    import torch

    lm, ref = _eager_serving_lm(name)
    prompts, new = [[5, 6, 7, 8, 9, 10, 11], [9, 10], [3, 4, 5]], NEW
    eng = lm.engine()
    with torch.no_grad():
        first = eng.add(prompts[0], max_new_tokens=new, eos_token_id=None)
        for _ in range(3):  # the first request decodes alone, then two more join it in the other lines
            eng.step()
        rids = [first] + [eng.add(p, max_new_tokens=new, eos_token_id=None) for p in prompts[1:]]
        got = eng.run()
        for rid, p in zip(rids, prompts, strict=True):
            want = ref.generate(torch.tensor([p]), attention_mask=torch.ones((1, len(p)), dtype=torch.int64),
                                max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(p):].tolist()
            assert got[rid] == want, (name, rid, got[rid], want)
    assert eng.calls["token_batch4"] > 0 and eng.calls["token_batch2"] > 0


def test_validate_catches_a_wrapper_that_ignores_the_sliding_window(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The wrapper passing its own 4-D mask (so the window is dropped, as it once was) differs from transformers: the
    context logits beyond the window and the generated tokens are reported as failures by validate's comparisons
    (the graphs run eagerly here: the window is in the traced program, which the build test above compiles)."""
    import torch

    from neuronbuild.toolchains import hf_causal_lm
    from neuronbuild.toolchains.validate import HfReference, compare_hf, generate_cases

    ws = tmp_path
    _write_weights(ws, "gemma3_sw")
    cfg = {"model_type": "gemma3_text", "hf": FAMILIES["gemma3_sw"][1], "max_seq": MAX_SEQ}
    spec = {"entry": "neuronbuild.toolchains.hf_causal_lm:context", "config": cfg,
            "weights": "gemma3_sw.safetensors", "srcs": {}, "package": "", "seed": 0,
            "inputs": [["input_ids", {"dtype": "int64", "dims": ["batch", "seq"]}]]}
    ref = HfReference(spec, ws)
    state = ref.model.state_dict()
    kv = {"dtype": "float32", "dims": [2, 2, "batch", 1, MAX_SEQ, 8]}
    outs = [["logits", {"dtype": "float32", "dims": ["batch", "vocab"]}], ["kv", kv]]
    specs = {"context": {"config": cfg, "inputs": [["input_ids", {"dims": ["batch", "seq"]}],
                                                     ["attention_mask", {"dims": ["batch", "seq"]}]], "outputs": outs},
             "token": {"config": cfg, "inputs": [["input_ids", {"dims": ["batch", 1]}],
                                                   ["position_ids", {"dims": ["batch", 1]}],
                                                   ["cache_mask", {"dims": ["batch", MAX_SEQ]}],
                                                   ["slot", {"dims": [1]}], ["kv", kv]], "outputs": outs}}

    def graphs() -> dict:  # type: ignore[type-arg]
        ctx, tok = hf_causal_lm.context(cfg).eval(), hf_causal_lm.token(cfg).eval()
        ctx.load_state_dict(state)
        tok.load_state_dict(state)

        def flat(module):  # type: ignore[no-untyped-def]  # outputs as a loaded artifact returns them: a list
            return lambda *args: list(module(*args).values())

        return {"context": {"context_batch2": (specs["context"], {"batch": 2, "seq": SEQ}, flat(ctx))},
                "token": {"token_batch2": (specs["token"], {"batch": 2}, flat(tok))}}

    def check() -> tuple[float, list[bool]]:
        g = graphs()
        with torch.no_grad():
            ctx_cmp = compare_hf(g["context"]["context_batch2"][2], ref, "context", {"batch": 2, "seq": SEQ},
                                 ["logits", "kv"], 0)
        cases = generate_cases("//:gemma3_sw", ref, g, {"kv": "kv"}, NEW, 0)
        assert [c for c, _ok, _d in cases] == ["batch1", "batch2_padded"], cases
        return ctx_cmp.max_abs, [ok for _c, ok, _d in cases]

    faithful_err, faithful_ok = check()
    assert faithful_err < 1e-5 and faithful_ok == [True, True]
    own_forward = hf_causal_lm._model_forward

    def prepared_mask_forward(self, **kw):  # type: ignore[no-untyped-def]
        """As the wrapper once did: its own causal + padding 4-D mask, which transformers uses as is on every layer."""
        mask2d, cache = kw["attention_mask"], kw["past_key_values"]
        q_pos = (0 if cache.slot is None else cache.slot[0]) + torch.arange(kw["input_ids"].shape[1])
        allowed = (torch.arange(mask2d.shape[1])[None, :] <= q_pos[:, None])[None] & (mask2d[:, None, :] != 0)
        kw["attention_mask"] = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[:, None]
        return own_forward(self, **kw)

    monkeypatch.setattr(hf_causal_lm, "_model_forward", prepared_mask_forward)
    windowless_err, windowless_ok = check()
    assert windowless_err > 1e-3 and not all(windowless_ok), (windowless_err, windowless_ok)


def test_a_program_needing_an_unregistered_op_names_the_op_when_loaded(tmp_path: Path) -> None:
    """A traced program using a custom op that the loading process has not registered (as transformers' grouped_mm
    once did) fails naming the op, not with torch's generic 'error when deserializing'."""
    import subprocess
    import sys

    save = ("import sys, torch\nfrom neuronbuild.toolchains.trace import program_bytes\n"
            "@torch.library.custom_op('nbtest::twice', mutates_args=())\n"
            "def twice(x: torch.Tensor) -> torch.Tensor:\n    return x * 2\n"
            "@twice.register_fake\ndef _(x):\n    return torch.empty_like(x)\n"
            "class M(torch.nn.Module):\n    def forward(self, x):\n        return torch.ops.nbtest.twice(x)\n"
            "open(sys.argv[1], 'wb').write(program_bytes(torch.export.export(M(), (torch.ones(2),))))\n")
    load = ("import sys\nfrom pathlib import Path\nfrom neuronbuild.toolchains.trace import load_program\n"
            "try:\n    load_program(Path(sys.argv[1]))\nexcept Exception as e:\n    print(type(e).__name__, e)\n")
    prog = str(tmp_path / "program.pt2")
    subprocess.run([sys.executable, "-c", save, prog], check=True, capture_output=True, timeout=300)
    out = subprocess.run([sys.executable, "-c", load, prog], capture_output=True, text=True, timeout=300).stdout
    assert out.startswith("ToolchainError cannot load the traced program program.pt2: SerializeError: "), out
    assert "nbtest.twice" in out and len(out.splitlines()) == 1, out
