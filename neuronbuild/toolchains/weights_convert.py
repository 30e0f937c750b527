"""Torch checkpoints (state dicts; whole pickled modules only when allowed) to safetensors files, for
`neuronbuild weights convert`; also a sub-model's keys from a larger checkpoint (a seq2seq model's encoder from the
whole .safetensors file: `--prefix model.encoder.`, `--drop decoder.`), the keys left out listed."""

from __future__ import annotations

import json
import os
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


def select_keys(keys: list[str], prefix: str, drop: list[str], src: Path) -> tuple[dict[str, str], list[str]]:
    """A sub-model's keys from a larger checkpoint: ({key written: key in the file}, [keys left out]). Keys starting
    with a `drop` prefix are left out, then, with `prefix`, those not starting with it; the prefix is stripped. Each
    prefix must match a key, and something must be left."""
    unused = [d for d in drop if not any(k.startswith(d) for k in keys)]
    if unused:
        raise ToolchainError(f"--drop {unused[0]!r} matches no key of {src}")
    if prefix and not any(k.startswith(prefix) for k in keys):
        raise ToolchainError(f"no key of {src} starts with {prefix!r}")
    kept: dict[str, str] = {}
    dropped: list[str] = []
    for k in keys:
        if k.startswith(tuple(drop)) or not k.startswith(prefix):
            dropped.append(k)
        else:
            kept[k[len(prefix):]] = k
    if not kept:
        raise ToolchainError(f"--drop leaves no key of {src}")
    return kept, sorted(dropped)


def _safetensors_keys(src: Path) -> dict[str, Path]:
    """key -> the file holding it, for a .safetensors file or an HF *.safetensors.index.json (shards next to it)."""
    from safetensors import SafetensorError, safe_open

    if src.name.endswith(".json"):
        try:
            weight_map = json.loads(src.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
            shards = {str(k): str(v) for k, v in weight_map.items()}
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ToolchainError(f"{src}: not a safetensors index ({type(e).__name__}: {e})") from None
        bad = next((v for v in shards.values() if "/" in v or "\\" in v or v in ("", ".", "..")), None)
        if bad is not None:
            raise ToolchainError(f"{src}: shard name {bad!r} is not a file name next to the index")
        return {k: src.parent / v for k, v in shards.items()}
    try:
        with safe_open(str(src), framework="pt") as f:
            return {str(k): src for k in f.keys()}
    except (SafetensorError, OSError) as e:
        raise ToolchainError(f"cannot read {src} as safetensors: {str(e).strip().splitlines()[0]}") from None


def _read_safetensors(where: Mapping[str, Path], keys: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """The tensors `keys` names ({key written: key in the file}), each read from its file (no other key is read)."""
    from safetensors import SafetensorError, safe_open

    by_file: dict[Path, list[tuple[str, str]]] = {}
    for new, old in keys.items():
        by_file.setdefault(where[old], []).append((new, old))
    out: dict[str, torch.Tensor] = {}
    for path, pairs in by_file.items():
        try:
            with safe_open(str(path), framework="pt") as f:
                for new, old in pairs:
                    out[new] = f.get_tensor(old)
        except (SafetensorError, OSError) as e:
            raise ToolchainError(f"cannot read {path} as safetensors: {str(e).strip().splitlines()[0]}") from None
    return out


def _load_torch(src: Path, allow_pickle: bool) -> Any:
    try:
        return torch.load(src, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if not allow_pickle:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ToolchainError(f"{src} is not a plain state dict (loading it with weights_only refused: {first}); "
                                 "if it is a whole pickled module from a source you trust, pass --allow-pickle "
                                 "(unpickling runs code from the file)") from None
        try:
            return torch.load(src, map_location="cpu", weights_only=False)
        except Exception as e2:  # noqa: BLE001 - any unpickling failure is the file's
            raise ToolchainError(f"cannot load {src}: {type(e2).__name__}: {e2}") from None
    except (RuntimeError, OSError, EOFError, ValueError) as e:
        raise ToolchainError(f"cannot load {src} as a torch checkpoint: {str(e).strip().splitlines()[0]}") from None


def convert(src: Path, dest: Path, allow_pickle: bool = False, prefix: str = "",
            drop: list[str] | None = None) -> tuple[str, list[str]]:
    """Write `src`'s state dict (a torch checkpoint, or a .safetensors file / index: a larger checkpoint to take a
    sub-model from) to `dest` (atomically), keeping the keys `select_keys` keeps; returns a one-line report and the
    keys left out. ToolchainError on bad input."""
    from safetensors.torch import save_file

    if not src.is_file():
        raise ToolchainError(f"{src}: no such file")
    if src.name.endswith((".safetensors", ".safetensors.index.json")):
        where = _safetensors_keys(src)
        kept, dropped = select_keys(list(where), prefix, list(drop or ()), src)
        out = _read_safetensors(where, kept)
        what = "the safetensors checkpoint"
    else:
        tensors, what = state_dict_of(_load_torch(src, allow_pickle), allow_pickle)
        kept, dropped = select_keys(list(tensors), prefix, list(drop or ()), src)
        # safetensors refuses tensors sharing storage (tied weights) and views: each is written as its own copy.
        out = {new: tensors[old].detach().to("cpu").contiguous().clone() for new, old in kept.items()}
    # safetensors writes by path: into the atomic writer's temp file (renamed onto dest once whole, removed if not).
    # It replaces that file with one of its own (mode 0600), so the mode a plain open() would give is set afterwards.
    with atomic_writer(dest) as f:
        save_file(out, f.name)
        os.chmod(f.name, umask_mode())
    size = dest.stat().st_size
    left = f"; left out {len(dropped)} key(s) (--verbose lists them)" if dropped else ""
    return (f"wrote {len(out)} tensors ({size / 1e6:.1f} MB) from {what} in {src} to {dest}{left}; use it as "
            f"`weights = \"{dest.name}\"` in a neuron_model next to it", dropped)
