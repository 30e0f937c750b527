"""Writes examples/models/llama_tiny.safetensors: the tiny Llama config initialised with seed 123."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
CONFIG = {"vocab": 1000, "hidden": 64, "layers": 1, "heads": 2}
SEED = 123


def main() -> None:
    sys.path.insert(0, str(HERE))
    from llama import build_model

    torch.manual_seed(SEED)
    model = build_model(CONFIG)
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    out = HERE / "llama_tiny.safetensors"
    save_file(tensors, str(out))
    print(f"wrote {out} ({out.stat().st_size} bytes, {sum(t.numel() for t in tensors.values())} params)")


if __name__ == "__main__":
    main()
