"""Torch checkpoints (state dicts; whole pickled modules only when allowed) to safetensors files, for
`neuronbuild weights convert`."""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from neuronbuild.atomic import atomic_writer, umask_mode
from neuronbuild.toolchains.errors import ToolchainError

# Keys under which training loops commonly keep the model's state dict in a checkpoint dict.
NESTED_KEYS = ("state_dict", "model_state_dict", "model", "module", "net")


def _tensors(obj: Any) -> dict[str, torch.Tensor] | None:
    """`obj` as {name: tensor} if it is a mapping whose values are mostly tensors (others dropped), else None."""
    if not isinstance(obj, Mapping) or not obj:
        return None
    found = {str(k): v for k, v in obj.items() if isinstance(v, torch.Tensor)}
    return found if found and len(found) * 2 >= len(obj) else None


def state_dict_of(obj: Any, allow_pickle: bool) -> tuple[dict[str, torch.Tensor], str]:
    """The state dict in a loaded checkpoint, and where it was found."""
    if isinstance(obj, torch.nn.Module):
        if not allow_pickle:  # (weights_only loading cannot return one: kept as a guard)
            raise ToolchainError("the file holds a whole pickled module; pass --allow-pickle to convert it")
        return dict(obj.state_dict()), f"the state dict of a pickled {type(obj).__name__}"
    direct = _tensors(obj)
    if direct is not None:
        return direct, "a state dict"
    if isinstance(obj, Mapping):
        for key in NESTED_KEYS:
            inner = obj.get(key)
            if isinstance(inner, torch.nn.Module) and allow_pickle:
                return dict(inner.state_dict()), f"the state dict of the pickled module under '{key}'"
            nested = _tensors(inner)
            if nested is not None:
                return nested, f"the state dict under '{key}'"
        keys = ", ".join(map(str, list(obj)[:8]))
        raise ToolchainError(f"no state dict found: a dict whose keys are {keys} (expected tensors by parameter "
                             f"name, or one of them under {', '.join(repr(k) for k in NESTED_KEYS)})")
    raise ToolchainError(f"no state dict found: the file holds a {type(obj).__name__}")


def convert(src: Path, dest: Path, allow_pickle: bool = False, prefix: str = "") -> str:
    """Write `src`'s state dict to `dest` (atomically); returns a one-line report. ToolchainError on bad input."""
    from safetensors.torch import save_file

    if not src.is_file():
        raise ToolchainError(f"{src}: no such file")
    try:
        obj = torch.load(src, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if not allow_pickle:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ToolchainError(f"{src} is not a plain state dict (loading it with weights_only refused: {first}); "
                                 "if it is a whole pickled module from a source you trust, pass --allow-pickle "
                                 "(unpickling runs code from the file)") from None
        try:
            obj = torch.load(src, map_location="cpu", weights_only=False)
        except Exception as e2:  # noqa: BLE001 - any unpickling failure is the file's
            raise ToolchainError(f"cannot load {src}: {type(e2).__name__}: {e2}") from None
    except (RuntimeError, OSError, EOFError, ValueError) as e:
        raise ToolchainError(f"cannot load {src} as a torch checkpoint: {str(e).strip().splitlines()[0]}") from None
    tensors, what = state_dict_of(obj, allow_pickle)
    if prefix:
        tensors = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        if not tensors:
            raise ToolchainError(f"no key of {src} starts with {prefix!r}")
    # safetensors refuses tensors sharing storage (tied weights) and views: each is written as its own copy.
    out = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    # safetensors writes by path: into the atomic writer's temp file (renamed onto dest once whole, removed if not).
    with atomic_writer(dest, mode=umask_mode()) as f:
        save_file(out, f.name)
    size = dest.stat().st_size
    return (f"wrote {len(out)} tensors ({size / 1e6:.1f} MB) from {what} in {src} to {dest}; use it as "
            f"`weights = \"{dest.name}\"` in a neuron_model next to it")
