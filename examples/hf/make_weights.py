"""Writes the tiny configs' seeded weights: <name>/model.safetensors (llama: two shards + an HF index.json).

Run from the repository root: .venv/bin/python examples/hf/make_weights.py"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
SEED = 1234


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    seen: dict[int, str] = {}
    out = {}
    for k, v in model.state_dict(keep_vars=True).items():
        if id(v) in seen:
            continue  # tied weights are stored once, as HF checkpoints do
        seen[id(v)] = k
        out[k] = v.detach().contiguous().clone()
    return out


def main() -> None:
    sys.path.insert(0, str(HERE))
    import models

    for name in ("llama", "gpt2", "bert", "vit"):
        torch.manual_seed(SEED)
        tensors = _tensors(getattr(models, name)({}))
        if name == "llama":
            keys = sorted(tensors)
            half = len(keys) // 2
            shards = {"model-00001-of-00002.safetensors": keys[:half], "model-00002-of-00002.safetensors": keys[half:]}
            for shard, ks in shards.items():
                save_file({k: tensors[k] for k in ks}, str(HERE / name / shard))
            index = {"metadata": {}, "weight_map": {k: s for s, ks in shards.items() for k in ks}}
            (HERE / name / "model.safetensors.index.json").write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
        else:
            save_file(tensors, str(HERE / name / "model.safetensors"))
        print(f"{name}: {sum(t.numel() for t in tensors.values())} params")


if __name__ == "__main__":
    main()
