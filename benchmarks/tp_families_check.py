"""Every transformers family with a sharding plan, built at a tp_degree for trn2 and checked by `validate --generate 8`
against transformers (each rank's HLO on XLA:CPU host devices), with the build's and validate's wall time: the by-hand
check behind docs/neuron.md's table of TP plans (tests/test_tp_families.py builds a few of these in CI).

    .venv/bin/python benchmarks/tp_families_check.py --tp 2 /tmp/tpf bloom gpt_bigcode_mqa ...   (no names: all that
                                                                                                 the degree divides)
    .venv/bin/python benchmarks/tp_families_check.py --tp 4 /tmp/tpf mixtral_ep2 gpt_oss_ep2 ...  (expert parallelism
                                                                              x tensor parallelism: a 2 x 2 grid)

Tiny random configs (as tests/test_llm_families.py and test_llm_new_families.py); every 1-D tensor (biases, norms,
sinks) and every bias (gpt-oss's experts' [experts, width] ones too) perturbed from transformers' initial 0/1, so a
bias added on every rank or a norm on the wrong rank shows."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

_BASE = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 32}
_DSV3 = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "moe_intermediate_size": 8,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 4,
         "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1, "kv_lora_rank": 8,
         "q_lora_rank": 12, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 6,
         "max_position_embeddings": 64}
FAMILIES: dict[str, tuple[str, dict[str, object]]] = {
    "llama_bias": ("llama", _BASE | {"num_key_value_heads": 2, "attention_bias": True, "mlp_bias": True}),
    "mistral_sw": ("mistral", _BASE | {"sliding_window": 4}),
    "gemma": ("gemma", _BASE | {"head_dim": 8}),
    "gemma2_cap": ("gemma2", _BASE | {"head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": 4,
                                      "final_logit_softcapping": 0.05, "attn_logit_softcapping": 0.5}),
    "mixtral": ("mixtral", _BASE | {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": ("qwen3_moe", _BASE | {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
                                        "moe_intermediate_size": 8}),
    "glm4": ("glm4", _BASE | {"pad_token_id": 0, "num_key_value_heads": 2, "head_dim": 8,
                              "partial_rotary_factor": 0.5}),
    "glm": ("glm", _BASE | {"pad_token_id": 0, "head_dim": 8}),
    "starcoder2": ("starcoder2", _BASE),
    "phi": ("phi", _BASE | {"num_key_value_heads": 2}),
    "smollm3": ("smollm3", _BASE | {"pad_token_id": 0}),
    "cohere2": ("cohere2", _BASE | {"pad_token_id": 0, "sliding_window": 4,
                                    "layer_types": ["sliding_attention", "full_attention"]}),
    "olmoe": ("olmoe", _BASE | {"num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4,
                                "num_experts_per_tok": 2}),
    "qwen2_moe": ("qwen2_moe", _BASE | {"num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4,
                                        "num_experts_per_tok": 2, "moe_intermediate_size": 8,
                                        "shared_expert_intermediate_size": 16}),
    "gpt_oss": ("gpt_oss", _BASE | {"intermediate_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
                                    "head_dim": 4, "num_local_experts": 4, "num_experts_per_tok": 2,
                                    "sliding_window": 4, "max_position_embeddings": 131072}),
    "deepseek_v3": ("deepseek_v3", _DSV3),
    "llama4_text": ("llama4_text", _BASE | {"intermediate_size_mlp": 32, "head_dim": 8, "num_local_experts": 2,
                                            "num_experts_per_tok": 1, "max_position_embeddings": 64}),
    "falcon_mqa": ("falcon", {"vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
                              "multi_query": True, "parallel_attn": True, "bias": False}),
    "falcon_mha": ("falcon", {"vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
                              "multi_query": False, "parallel_attn": False, "bias": True}),
    "falcon_alibi": ("falcon", {"vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
                                "alibi": True, "multi_query": False, "bias": True}),
    "falcon_alibi_mqa": ("falcon", {"vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 2,
                                    "num_attention_heads": 4, "alibi": True, "multi_query": True}),
    # new decoder architecture: kv groups [q.. k v], k and v broadcast to every query head (the cache holds them all)
    "falcon_nda": ("falcon", {"vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
                              "new_decoder_architecture": True, "num_kv_heads": 2}),
    "falcon_nda_kv1": ("falcon", {"vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 2,
                                  "num_attention_heads": 4, "new_decoder_architecture": True, "num_kv_heads": 1}),
    "gpt2": ("gpt2", {"vocab_size": 64, "n_embd": 16, "n_layer": 2, "n_head": 4, "n_positions": 32, "bos_token_id": 1,
                      "eos_token_id": 1}),
    "bloom": ("bloom", {"vocab_size": 64, "hidden_size": 16, "n_layer": 2, "n_head": 4}),
    "gpt_bigcode_mqa": ("gpt_bigcode", {"vocab_size": 64, "n_embd": 16, "n_layer": 2, "n_head": 4, "n_positions": 32}),
    "gpt_bigcode_mha": ("gpt_bigcode", {"vocab_size": 64, "n_embd": 16, "n_layer": 2, "n_head": 4, "n_positions": 32,
                                        "multi_query": False}),
}


# expert parallelism: "<family>_ep" builds that family's config with hf_causal_lm(moe_ep_degree = the tp degree)
# (whole experts, one group per rank); "<family>_ep2" with moe_ep_degree = 2, so at tp 4 NxD's EP x TP grid of 2
# groups x 2 ranks (moe_tp_degree 2: each expert's width split over its group's 2 ranks), with EP2's changes (4 heads;
# mixtral's expert width 24: 12 per rank). Expert widths 4 does not divide are accepted on a 2 x 2 grid (analysis,
# tests/test_moe_ep_tp.py); validate's reference runs transformers' eager experts, so any width is checked the same.
EP = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "deepseek_v3")
EP2: dict[str, dict[str, object]] = {
    "mixtral": {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 24},
    "qwen3_moe": {"num_attention_heads": 4, "num_key_value_heads": 2},
}


def _family(name: str) -> tuple[str, dict[str, object], str]:
    """(model_type, config, extra hf_causal_lm attributes) of a name: a family, "<family>_ep" or "<family>_ep2"."""
    for suffix, extra in (("_ep", ", moe_ep_degree = TP"), ("_ep2", ", moe_ep_degree = 2")):
        base = name.removesuffix(suffix)
        if name.endswith(suffix) and base in EP:
            model_type, hf = FAMILIES[base]
            return model_type, hf | (EP2.get(base, {}) if suffix == "_ep2" else {}), extra
    model_type, hf = FAMILIES[name]
    return model_type, hf, ""


def _heads(hf: dict[str, object]) -> int:
    return int(hf.get("num_attention_heads") or hf.get("n_head") or 0)  # type: ignore[call-overload]


def _divides(hf: dict[str, object], tp: int) -> bool:
    """Whether the degree divides the heads (and Falcon's new-architecture kv groups, unless one)."""
    groups = int(hf.get("num_kv_heads") or 1) if hf.get("new_decoder_architecture") else 1  # type: ignore[call-overload]
    return _heads(hf) % tp == 0 and (groups == 1 or groups % tp == 0)


def write_workspace(root: Path, names: list[str], tp: int) -> None:
    import torch
    from safetensors.torch import save_file

    from neuronbuild.toolchains.hf_causal_lm import hf_model

    root.mkdir(parents=True, exist_ok=True)
    (root / "WORKSPACE.neuronbuild").write_text("")
    lines = ['load("@neuronbuild//rules:llm.bzl", "hf_causal_lm", "llm_buckets")',
             'neuron_target(name = "trn2", platform = "trn2")',
             'llm_buckets(name = "serve", batch_sizes = [2], context_lengths = [8])']
    for name in names:
        model_type, hf, extra = _family(name)
        torch.manual_seed(0)
        model = hf_model({"model_type": model_type, "hf": hf, "max_seq": 16})
        g = torch.Generator().manual_seed(1)
        state = {k: v + 0.2 * torch.randn(v.shape, generator=g).to(v.dtype)
                 if (v.dim() == 1 or k.endswith("bias")) and v.is_floating_point() else v
                 for k, v in model.state_dict().items()}
        save_file({k: v.detach().clone().contiguous() for k, v in state.items()}, str(root / f"{name}.safetensors"))
        lines += [f'hf_causal_lm(name = "{name}", model_type = "{model_type}", config = {json.dumps(hf)}, '
                  f'weights = "{name}.safetensors", max_seq = 16{extra.replace("TP", str(tp))})',
                  f'neuron_compile(name = "{name}_tp{tp}", model = ":{name}", target = ":trn2", tp_degree = {tp}, '
                  'buckets = {"context": [":serve_context"], "token": [":serve_token"]})']
    text = "\n".join(lines).replace("true", "True").replace("false", "False") + "\n"
    (root / "BUILD").write_text(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workspace", type=Path)
    ap.add_argument("names", nargs="*", help=f"families (default: all the degree divides): {', '.join(FAMILIES)}; "
                    f"expert parallelism: {', '.join(n + '_ep' for n in EP)}; x tensor parallelism (a 2 x 2 grid "
                    f"at --tp 4): {', '.join(n + '_ep2' for n in EP)}")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--cache-dir", default=None, help="default: <workspace>/.cache")
    args = ap.parse_args()
    names = args.names or [n for n, (_t, hf) in FAMILIES.items() if _divides(hf, args.tp)]
    write_workspace(args.workspace, names, args.tp)
    cache = args.cache_dir or str(args.workspace / ".cache")
    for cmd in (["build", "//...", "--jobs", "2"], ["validate", "//...", "--generate", "8"]):
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "neuronbuild", "--batch", *cmd, "--cache-dir", cache],
                              cwd=args.workspace, capture_output=True, text=True)
        print(proc.stdout[-8000:], file=sys.stdout)
        print(f"{cmd[0]}: exit {proc.returncode} in {time.monotonic() - start:.0f} s ({len(names)} families, "
              f"tp {args.tp})", flush=True)
        if proc.returncode:
            print(proc.stderr[-4000:], file=sys.stderr)
            return proc.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
