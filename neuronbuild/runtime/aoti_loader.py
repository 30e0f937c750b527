"""Loads an AOTInductor model.pt2 (as produced by the cpu compile) into a callable, without a compiler."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

from neuronbuild.runtime.layout import DRAFT_PREFIX, PROGRAM_CONSTANTS
from neuronbuild.runtime.verified import with_tied

MODEL_NAME = "model"
CONSTANTS_FILE = "constants.safetensors"  # next to model.pt2: the model's weights (its weights action's)
# Package metadata of a graph compiled with outputs written in place (toolchains/compile.py write_in_place writes
# them): which output is which input, and the program's output structure with them.
IN_PLACE_KEY = "neuronbuild.in_place"
OUT_SPEC_KEY = "neuronbuild.out_spec"


def in_place_outputs(metadata: Mapping[str, str]) -> tuple[list[tuple[int, int]], Any]:
    """(output index, input index) pairs a package writes in place, and its full output treespec (None: none)."""
    raw = metadata.get(IN_PLACE_KEY)
    if not raw:
        return [], None
    pairs = [(int(o), int(i)) for o, i in json.loads(raw)]
    return sorted(pairs), pytree.treespec_loads(str(metadata[OUT_SPEC_KEY]))


class LoadedPackage:
    """Callable over a loaded package: positional tensors in, the model's output structure (tensor(s)) out.

    A package compiled with in-place outputs (declared aliases, e.g. kv -> kv) writes such an output into the
    caller's input tensor and does not return it: the call returns that input tensor itself in its place, so callers
    see the declared outputs (the serving cache stays one tensor, written in place, never copied)."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader
        _in_spec, out_spec = loader.get_call_spec()
        self._in_place, full = in_place_outputs(dict(loader.get_metadata()))
        self._out_spec = full if full is not None else pytree.treespec_loads(out_spec)
        # a flat tuple of tensors (every graph of a FlatForward trace): built directly, not through pytree (a
        # serving step's host work is of the order of a small graph's call)
        self._flat_tuple = self._out_spec == pytree.tree_flatten(tuple(range(self._out_spec.num_leaves)))[1]

    def __call__(self, *args: torch.Tensor) -> Any:
        flat = list(args) if all(type(a) is torch.Tensor for a in args) else \
            [a for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor)]
        inputs = list(flat) if self._in_place else flat  # (boxed_run empties the list it is given)
        outputs = self._loader.boxed_run(flat)
        if self._in_place:
            outputs = list(outputs)
            for out_i, in_i in self._in_place:
                outputs.insert(out_i, inputs[in_i])
        return tuple(outputs) if self._flat_tuple else pytree.tree_unflatten(outputs, self._out_spec)

    def metadata(self) -> dict[str, str]:
        return dict(self._loader.get_metadata())


def read_constants(path: Path) -> dict[str, torch.Tensor]:
    """A constants/weights safetensors file as {FQN: tensor}, tied aliases included (read into memory, no
    compiler, no torch._inductor)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    return with_tied(dict(load_file(str(path))), metadata)


def with_program_constants(weights: Mapping[str, torch.Tensor], path: Path | None) -> dict[str, torch.Tensor]:
    """A graph's tensors: the model's weights (shared by its graphs) and, when the graph has the file, its own
    (non-persistent buffers, lifted constants; a few small tensors) read from `path`. A name in both keeps the
    weights file's value (a tensor-parallel rank's shard holds its own values of per-rank buffers)."""
    if path is None or not Path(path).is_file():
        return dict(weights)
    return {**read_constants(Path(path)), **weights}


def with_draft(weights: Mapping[str, torch.Tensor], path: Path | None) -> dict[str, torch.Tensor]:
    """A fused speculation graph's tensors: `weights` (the target's) and its draft model's weights file at `path`
    (draft.constants.safetensors) under "draft."; `weights` alone for any other graph (`path` None)."""
    if path is None:
        return dict(weights)
    return {**{DRAFT_PREFIX + k: v for k, v in read_constants(Path(path)).items()}, **weights}


def load_package(path: Path, constants: Mapping[str, torch.Tensor] | None = None) -> Callable[..., Any]:
    """Load model.pt2 with the C++ package loader (ms, no g++); fall back to torch._inductor.aoti_load_package.

    Packages are built without their weights: `constants` (FQN -> tensor) are loaded before the callable is
    returned; when not given, the constants.safetensors next to the package is used. The tensors are used in place
    (not copied), so several buckets of one model share one set of weights; keep them alive and unmodified."""
    # Must be set before the model is loaded: a wrong input shape then raises RuntimeError instead of crashing.
    os.environ["AOTI_RUNTIME_CHECK_INPUTS"] = "1"
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no AOTInductor package at {path}")
    if constants is None and (path.parent / CONSTANTS_FILE).is_file():
        constants = with_program_constants(read_constants(path.parent / CONSTANTS_FILE),
                                           path.parent / PROGRAM_CONSTANTS)
    try:
        loader = torch._C._aoti.AOTIModelPackageLoader(str(path), MODEL_NAME, False, 1, -1)
    except (AttributeError, RuntimeError, TypeError):
        from torch._inductor import aoti_load_package

        fallback: Any = aoti_load_package(str(path))
        if constants is not None:
            fallback.load_constants(dict(constants), check_full_update=True, user_managed=True)
        pairs, full = in_place_outputs(dict(fallback.get_metadata()))
        if not pairs:
            return fallback  # type: ignore[no-any-return]

        def with_inputs(*args: torch.Tensor) -> Any:
            flat = [a for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor)]
            outputs = list(pytree.tree_leaves(fallback(*args)))
            for out_i, in_i in pairs:
                outputs.insert(out_i, flat[in_i])
            return pytree.tree_unflatten(outputs, full)

        return with_inputs
    if constants is not None:
        needed = {str(n) for n in loader.get_constant_fqns()}
        absent = sorted(needed - set(constants))
        if absent:
            # check_full_update would throw too, but a named list is more useful than "not all constants updated".
            raise RuntimeError(f"{path.name}: constants missing for {len(absent)} weight(s): {', '.join(absent[:5])}")
        loader.load_constants({k: constants[k] for k in sorted(needed)}, False, True, True)
    return LoadedPackage(loader)
