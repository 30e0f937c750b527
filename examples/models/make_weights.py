"""Writes the example weights: llama_tiny.safetensors (the plain-torch decoder in llama.py, seed 123) and
llama.safetensors (a tiny transformers LlamaForCausalLM, the config in BUILD's hf_causal_lm, seed 0)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
CONFIG = {"vocab": 1000, "hidden": 64, "layers": 1, "heads": 2}
SEED = 123
# Must equal `config` of hf_causal_lm(name = "llama") in BUILD.
HF_CONFIG = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 128, "eos_token_id": 2, "bos_token_id": 1, "pad_token_id": 0}
HF_SEED = 0


def main() -> None:
    sys.path.insert(0, str(HERE))
    from llama import build_model

    torch.manual_seed(SEED)
    model = build_model(CONFIG)
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    out = HERE / "llama_tiny.safetensors"
    save_file(tensors, str(out))
    print(f"wrote {out} ({out.stat().st_size} bytes, {sum(t.numel() for t in tensors.values())} params)")

    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in HF_CONFIG.items() if k != "model_type"}
    torch.manual_seed(HF_SEED)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(str(HF_CONFIG["model_type"]), **fields))
    tensors = {k: v.detach().contiguous() for k, v in hf.state_dict().items()}
    out = HERE / "llama.safetensors"
    save_file(tensors, str(out))
    print(f"wrote {out} ({out.stat().st_size} bytes, {sum(t.numel() for t in tensors.values())} params)")


if __name__ == "__main__":
    main()
