"""Loads an AOTInductor model.pt2 (as produced by the cpu compile) into a callable, without a compiler."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

MODEL_NAME = "model"


class LoadedPackage:
    """Callable over a loaded package: positional tensors in, the model's output structure (tensor(s)) out."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader
        in_spec, out_spec = loader.get_call_spec()
        self._out_spec = pytree.treespec_loads(out_spec)
        self._in_spec = in_spec

    def __call__(self, *args: torch.Tensor) -> Any:
        flat = [a for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor)]
        outputs = self._loader.boxed_run(flat)
        return pytree.tree_unflatten(outputs, self._out_spec)

    def metadata(self) -> dict[str, str]:
        return dict(self._loader.get_metadata())


def load_package(path: Path) -> Callable[..., Any]:
    """Load model.pt2 with the C++ package loader (ms, no g++); fall back to torch._inductor.aoti_load_package."""
    # Must be set before the model is loaded: a wrong input shape then raises RuntimeError instead of crashing.
    os.environ["AOTI_RUNTIME_CHECK_INPUTS"] = "1"
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no AOTInductor package at {path}")
    try:
        loader = torch._C._aoti.AOTIModelPackageLoader(str(path), MODEL_NAME, False, 1, -1)
    except (AttributeError, RuntimeError, TypeError):
        from torch._inductor import aoti_load_package

        fallback: Callable[..., Any] = aoti_load_package(str(path))
        return fallback
    return LoadedPackage(loader)
