"""Weights without holding them: a checkpoint's index read from safetensors headers, its tensors streamed one at a time,
and safetensors files written tensor by tensor (the same bytes as safetensors' own `save`)."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from neuronbuild import jsondata
from neuronbuild.runtime.verified import TIED_KEY, tied_names
from neuronbuild.toolchains.errors import ToolchainError

# safetensors' names of torch dtypes, in the order its `save` lays tensors out (descending, then by name).
_ST_ORDER: tuple[tuple[torch.dtype, str], ...] = (
    (torch.uint64, "U64"), (torch.int64, "I64"), (torch.float64, "F64"), (torch.complex64, "C64"),
    (torch.float32, "F32"), (torch.uint32, "U32"), (torch.int32, "I32"), (torch.bfloat16, "BF16"),
    (torch.float16, "F16"), (torch.uint16, "U16"), (torch.int16, "I16"), (torch.float8_e4m3fn, "F8_E4M3"),
    (torch.float8_e5m2, "F8_E5M2"), (torch.int8, "I8"), (torch.uint8, "U8"), (torch.bool, "BOOL"),
)
_ST_NAME = {dt: name for dt, name in _ST_ORDER}
_ST_RANK = {dt: i for i, (dt, _n) in enumerate(_ST_ORDER)}
_ST_DTYPE = {name: dt for dt, name in _ST_ORDER}


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file to write: its name, dtype and shape (the value comes later, by name)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n * torch.empty((), dtype=self.dtype).element_size()


def write_safetensors(path: Path, entries: Iterable[Entry],
                      value: Callable[[Entry], torch.Tensor | Iterable[torch.Tensor]],
                      tied: Mapping[str, str] | None = None) -> int:
    """Write `entries` to `path` as safetensors, asking `value(entry)` for one tensor at a time (so at most one is held),
    or for an iterable of consecutive pieces of it (flat, in order: a large tensor converted piece by piece);
    returns the file's size. Same layout as safetensors.torch.save (tensors by dtype, then name; no metadata).
    `tied` ({alias: stored entry's name}): names bound to a stored tensor, written once; recorded in the header's
    `__metadata__` (TIED_KEY), which every reader of weights files here resolves (runtime.verified.with_tied)."""
    items = sorted(entries, key=lambda e: (_ST_RANK.get(e.dtype, -1), e.name))
    if len({e.name for e in items}) != len(items):
        raise ToolchainError("internal: a weights file names a tensor twice")
    header: dict[str, Any] = {}
    if tied:
        names = {e.name for e in items}
        if any(s not in names or a in names for a, s in tied.items()):
            raise ToolchainError("internal: a tied name must alias a stored tensor and not be stored itself")
        header["__metadata__"] = {TIED_KEY: json.dumps(dict(sorted(tied.items())), separators=(",", ":"))}
    offset = 0
    for e in items:
        if e.dtype not in _ST_NAME:
            raise ToolchainError(f"tensor {e.name}: dtype {e.dtype} cannot be stored in a safetensors file")
        header[e.name] = {"dtype": _ST_NAME[e.dtype], "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for e in items:
            got = value(e)
            if isinstance(got, torch.Tensor):
                if got.dtype != e.dtype or tuple(got.shape) != e.shape:
                    raise ToolchainError(f"tensor {e.name}: got {got.dtype}{list(got.shape)}, "
                                         f"expected {e.dtype}{list(e.shape)}")
                got = (got,)
            written = 0
            for piece in got:
                if piece.dtype != e.dtype:
                    raise ToolchainError(f"tensor {e.name}: got a {piece.dtype} piece, expected {e.dtype}")
                data = piece.detach().contiguous().reshape(-1)
                if data.numel():
                    f.write(data.view(torch.uint8).numpy().data)
                    written += data.numel() * data.element_size()
                del piece, data
            if written != e.nbytes:
                raise ToolchainError(f"tensor {e.name}: {written} bytes written, expected {e.nbytes}")
    return 8 + len(text) + offset


def read_header(path: Path) -> dict[str, tuple[torch.dtype | None, tuple[int, ...]]]:
    """A safetensors file's tensors by name: (dtype (None when torch has none), shape), from its header only."""
    return {k: (dt, shape) for k, (dt, shape, _a, _b) in read_layout(path).items()}


def read_layout(path: Path) -> dict[str, tuple[torch.dtype | None, tuple[int, ...], int, int]]:
    """A safetensors file's tensors by name: (dtype, shape, start, end): absolute byte offsets of the data; a tied
    name (stored once, see write_safetensors) has its stored tensor's."""
    try:
        with open(path, "rb") as f:
            size = struct.unpack("<Q", f.read(8))[0]
            if size > 100 << 20:
                raise ToolchainError(f"weights file {path.name}: header of {size} bytes is not believable")
            header = jsondata.loads(f.read(size))
    except (OSError, struct.error, ValueError, UnicodeDecodeError) as exc:
        raise ToolchainError(f"cannot read weights {path.name}: {exc}") from None
    if not isinstance(header, dict):
        raise ToolchainError(f"cannot read weights {path.name}: the header is not a JSON object")
    try:
        tied = tied_names(header.get("__metadata__"))
    except ValueError as exc:
        raise ToolchainError(f"cannot read weights {path.name}: {exc}") from None
    out = {}
    base = 8 + size
    for k, v in header.items():
        if k == "__metadata__":
            continue
        try:
            start, end = (int(x) for x in v["data_offsets"])
            out[str(k)] = (_ST_DTYPE.get(str(v["dtype"])), tuple(int(d) for d in v["shape"]), base + start, base + end)
        except (KeyError, TypeError, ValueError):
            raise ToolchainError(f"cannot read weights {path.name}: bad header entry for {k!r}") from None
    for alias, stored in tied.items():  # a tied name reads its stored tensor's bytes
        if stored not in out or alias in out:
            raise ToolchainError(f"cannot read weights {path.name}: tied name {alias!r} does not alias one tensor")
        out[alias] = out[stored]
    return out


class Checkpoint:
    """A model's weight files (one file or shards) as an index, key -> (file, shape, dtype), read from headers only;
    `tensor(key)` reads one tensor with plain reads into a tensor of its own (no mapping of the file, whose pages
    would count against the action's memory as it is read through)."""

    def __init__(self, paths: list[Path], label: str, prefix: str = "") -> None:
        self.label = label
        self.index: dict[str, tuple[Path, str, torch.dtype | None, tuple[int, ...]]] = {}
        self._where: dict[str, tuple[int, int]] = {}
        for path in paths:
            if not path.is_file():
                raise ToolchainError(f"weights file {path.name} of {label} not found")
            for key, (dtype, shape, start, end) in read_layout(path).items():
                name = key[len(prefix):] if prefix and key.startswith(prefix) else key
                if name in self.index:
                    raise ToolchainError(f"weights {label}: key {key} is in more than one shard")
                self.index[name] = (path, key, dtype, shape)
                self._where[name] = (start, end)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.index[name][3]

    def tensor(self, name: str) -> torch.Tensor:
        """The whole tensor, as stored."""
        path, key, dtype, shape = self.index[name]
        start, end = self._checked(name)
        out = torch.empty(shape, dtype=dtype)
        if out.numel():
            self._read_into(path, key, start, out.reshape(-1))
        return out

    def rows(self, name: str, first: int, count: int) -> torch.Tensor:
        """Rows [first, first + count) of the tensor along its dim 0, as stored (one contiguous read: a rank's block
        of a tensor split along dim 0 without reading the rest)."""
        path, key, dtype, shape = self.index[name]
        start, _end = self._checked(name)
        if not shape or first < 0 or count < 0 or first + count > shape[0]:
            raise ToolchainError(f"weights {path.name}: rows [{first}, {first + count}) are not in tensor {key} "
                                 f"{list(shape)}")
        out = torch.empty((count, *shape[1:]), dtype=dtype)
        if out.numel():
            row = out[0].numel() * out.element_size()
            self._read_into(path, key, start + first * row, out.reshape(-1))
        return out

    def pieces(self, name: str, dtype: torch.dtype, max_bytes: int = 64 << 20) -> Iterator[torch.Tensor]:
        """The tensor flat, in consecutive pieces of at most ~max_bytes as stored, each converted to `dtype`: a large
        weight is converted without holding it twice (the stored and the converted copy)."""
        path, key, stored, _shape = self.index[name]
        start, end = self._checked(name)
        assert stored is not None
        size = torch.empty((), dtype=stored).element_size()
        step = max(1, max_bytes // size)
        total = (end - start) // size
        for first in range(0, total, step):
            n = min(step, total - first)
            buf = torch.empty(n, dtype=stored)
            self._read_into(path, key, start + first * size, buf)
            yield buf if stored == dtype else buf.to(dtype)
            del buf

    def _checked(self, name: str) -> tuple[int, int]:
        path, key, dtype, shape = self.index[name]
        start, end = self._where[name]
        if dtype is None:
            raise ToolchainError(f"weights {path.name}: tensor {key} has a dtype torch cannot hold")
        n = 1
        for d in shape:
            n *= d
        if end - start != n * torch.empty((), dtype=dtype).element_size():
            raise ToolchainError(f"cannot read weights {path.name}: tensor {key} has {end - start} bytes for "
                                 f"{dtype}{list(shape)}")
        return start, end

    @staticmethod
    def _read_into(path: Path, key: str, start: int, flat: torch.Tensor) -> None:
        view = flat.view(torch.uint8).numpy()
        try:
            with open(path, "rb", buffering=0) as f:
                f.seek(start)
                done = 0
                while done < len(view):
                    n = f.readinto(view[done:].data)
                    if not n:
                        raise ToolchainError(f"cannot read weights {path.name}: the file ends inside tensor {key}")
                    done += n
        except OSError as exc:
            raise ToolchainError(f"cannot read weights {path.name}: {exc}") from None


class Tensors(Protocol):
    """What reads a model's weights: a Checkpoint, or a view of one (quantize.QuantizedCheckpoint)."""

    label: str
    index: dict[str, tuple[Path, str, torch.dtype | None, tuple[int, ...]]]

    def shape(self, name: str) -> tuple[int, ...]: ...
    def tensor(self, name: str) -> torch.Tensor: ...
    def rows(self, name: str, first: int, count: int) -> torch.Tensor: ...
    def pieces(self, name: str, dtype: torch.dtype, max_bytes: int = ...) -> Iterator[torch.Tensor]: ...


def check_against(expected: Mapping[str, tuple[int, ...]], tied: Mapping[str, set[str]], ckpt: Tensors,
                  tp: int = 1, fused: Mapping[str, Any] | None = None) -> None:
    """Keys and shapes of `ckpt` against a module's state (name -> shape; tied: key -> keys sharing its tensor), as a
    strict load_state_dict would check them: missing and unexpected keys named, then shape mismatches. tp > 1: the
    module is one rank's, so a file tensor matches when the rank's shape is a shard of it (tp_ops.shard_rule)."""

    have = set(ckpt.index)
    missing = sorted(k for k in set(expected) - have if not tied.get(k, set()) & have)
    unexpected = sorted(have - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} key(s): {', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}")
        if unexpected:
            more = ", ..." if len(unexpected) > 5 else ""
            parts.append(f"unexpected {len(unexpected)} key(s): {', '.join(unexpected[:5])}{more}")
        raise ToolchainError(f"weights {ckpt.label} do not match the model: {'; '.join(parts)}")
    if tp > 1:
        from neuronbuild.toolchains.tp_ops import fused_whole_shape, shard_rule

        fused = dict(fused or {})
        bad = [k for k in sorted(have) if (tuple(ckpt.shape(k)) != fused_whole_shape(tuple(expected[k]), *fused[k])
                                           if k in fused else shard_rule(ckpt.shape(k), tuple(expected[k]), tp) is None)]
    else:
        bad = [k for k in sorted(have) if ckpt.shape(k) != tuple(expected[k])]
    if bad:
        k = bad[0]
        raise ToolchainError(
            f"weights {ckpt.label} do not match the model: {len(bad)} shape mismatch(es), e.g. {k}: "
            f"file {list(ckpt.shape(k))} vs model {list(expected[k])}"
        )
