"""A call's inputs as users give them, checked against the manifest before any graph runs.

Inputs come positionally (in declaration order), by their declared names, or both; each is a torch tensor or a numpy
array on the CPU. Its dtype is checked against the declared one first: a lossless integer widening (int32 token ids
for an int64 input, uint8 for int16, ...) is done, anything else is an InputError naming the input, the declared and
the given dtype. So a failed call raises one clear Python exception and nothing reaches a compiled graph (whose own
checks print to stderr and raise unreadable errors). torch is imported only when a call is made."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any


class InputError(TypeError):
    """Inputs that do not match the model's declaration (names, types, dtypes); the message is one line."""


_SIGNED = {"int8": 8, "int16": 16, "int32": 32, "int64": 64}
_UNSIGNED = {"uint8": 8, "uint16": 16, "uint32": 32, "uint64": 64}


def widens(given: str, declared: str) -> bool:
    """Whether every value of integer dtype `given` is a value of integer dtype `declared` (bool and floats: never)."""
    if declared in _SIGNED:
        bits = _SIGNED[declared]
        return (given in _SIGNED and _SIGNED[given] < bits) or (given in _UNSIGNED and _UNSIGNED[given] < bits)
    if declared in _UNSIGNED:
        return given in _UNSIGNED and _UNSIGNED[given] < _UNSIGNED[declared]
    return False


def bind(names: Sequence[str], args: Sequence[Any], named: Mapping[str, Any], label: str) -> list[Any]:
    """The inputs in declaration order from positional and named ones; InputError for an unknown, repeated or
    missing name, or too many positional inputs."""
    if len(args) > len(names):
        raise InputError(f"{label} takes {len(names)} input(s) ({', '.join(names)}), got {len(args)} positional")
    given = dict(zip(names, args, strict=False))
    for k, v in named.items():
        if k not in names:
            raise InputError(f"{label} has no input {k!r} (its inputs: {', '.join(names)})")
        if k in given:
            raise InputError(f"{label}: input {k!r} given twice (positionally and by name)")
        given[k] = v
    missing = [n for n in names if n not in given]
    if missing:
        raise InputError(f"{label}: missing input(s) {', '.join(missing)} (its inputs: {', '.join(names)})")
    return [given[n] for n in names]


def _dtype_name(x: Any) -> str:
    return str(x.dtype).removeprefix("torch.")


def _from_numpy(name: str, arr: Any, declared: str | None, label: str) -> Any:
    """A numpy array as a CPU tensor of the declared dtype (widened on the numpy side, which has every integer dtype);
    arrays torch cannot view (read-only, negative strides, other byte order) are copied, never warned about."""
    import numpy as np
    import torch

    arr = np.asarray(arr)
    given = arr.dtype.name
    if declared is not None and given != declared:
        if not widens(given, declared):
            raise _dtype_error(name, declared, given, label)
        arr = arr.astype(declared)
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    arr = np.ascontiguousarray(arr)
    if not arr.flags.writeable:
        arr = arr.copy()
    if arr.dtype.name == "bfloat16":  # ml_dtypes' bfloat16: torch reads its bits
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    try:
        return torch.from_numpy(arr)
    except TypeError:
        raise InputError(f"{label}: input {name!r} has numpy dtype {given}, which torch cannot hold") from None


def from_numpy(x: Any, name: str, label: str) -> Any:
    """`x` as a CPU tensor when it is a numpy array (its own dtype kept), else `x` unchanged."""
    np = sys.modules.get("numpy")
    if np is not None and isinstance(x, np.ndarray | np.generic):
        return _from_numpy(name, x, None, label)
    return x


def _dtype_error(name: str, declared: str, given: str, label: str) -> InputError:
    why = ("only lossless integer widening is done" if declared in _SIGNED or declared in _UNSIGNED
           else "no conversion is done")
    return InputError(f"{label}: input {name!r} is declared {declared}, given {given} ({why}; convert it before "
                      f"the call if that is what you mean)")


def prepare(inputs: Mapping[str, Mapping[str, Any]], args: Sequence[Any], named: Mapping[str, Any],
            label: str) -> list[Any]:
    """The call's inputs as contiguous CPU torch tensors of the declared dtypes, in declaration order; InputError
    otherwise.
    `inputs` is the manifest's declaration (name -> {"dtype", "dims"}), in order."""
    values = bind(list(inputs), args, named, label)
    np = sys.modules.get("numpy")  # a numpy array can only come from a process that imported numpy
    out = []
    for (name, spec), x in zip(inputs.items(), values, strict=True):
        declared = spec.get("dtype")
        declared = str(declared) if declared else None
        if np is not None and isinstance(x, np.ndarray | np.generic):
            out.append(_from_numpy(name, x, declared, label))
            continue
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(x, torch.Tensor):
            raise InputError(f"{label}: input {name!r} must be a torch tensor or a numpy array, got "
                             f"{type(x).__name__}")
        if x.device.type != "cpu":
            raise InputError(f"{label}: input {name!r} is on {x.device}; the deployed graphs take CPU tensors")
        given = _dtype_name(x)
        if declared is not None and given != declared:
            if not widens(given, declared):
                raise _dtype_error(name, declared, given, label)
            x = x.to(getattr(torch, declared))
        out.append(x.contiguous())  # compiled graphs take dense row-major inputs (a no-op when it is one)
    return out
