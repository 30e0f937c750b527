"""The libnrt stand-in's executor: how its nrt_execute computes. `install(lib_path)` registers a callback with the
stand-in (its stand-in-only entry point `nrt_standin_set_executor`), so nrt_execute, called by the runtime in this
process, calls back into this process: the callback reads the stand-in NEFF (the HLO module and the I/O table the
neuronx-cc stand-in wrote), runs the HLO on XLA:CPU over the ranks' input buffers (a collectives group's ranks as one
replicated program on that many host devices) and writes the output buffers. Compiled modules are kept per NEFF."""

from __future__ import annotations

import base64
import ctypes
import hashlib
import json
import traceback
from typing import Any

import torch

NEFF_MAGIC = b"NEFF\x00standin\n"
EXEC_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint32, ctypes.c_uint32,
                           ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t))
TORCH_NAMES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "s32": "int32", "s64": "int64", "s16": "int16",
               "s8": "int8", "u8": "uint8", "pred": "bool", "u32": "uint32", "u64": "uint64"}
_modules: dict[tuple[str, int], Any] = {}
_installed: dict[str, Any] = {}  # lib path -> (library, callback): both kept alive while registered
calls: list[tuple[str, int]] = []  # (NEFF digest, ranks) per execution, for tests


def _read_neff(neff: bytes) -> tuple[bytes, list[tuple[str, bool, str, list[int]]]]:
    if not neff.startswith(NEFF_MAGIC):
        raise ValueError("not a stand-in NEFF")
    body = json.loads(neff[len(NEFF_MAGIC):].split(b"\n", 1)[0])
    io = []
    for row in str(body["nrt_io"]).split(";"):
        name, usage, dtype, _size, dims = row.split(":")
        io.append((name, usage == "out", dtype, [int(d) for d in dims.split("x") if d]))
    return base64.b64decode(body["hlo_b64"]), io


def _module(neff: bytes, ranks: int) -> tuple[Any, list[tuple[str, bool, str, list[int]]]]:
    from neuronbuild.runtime.xla_cpu import XlaCpuModule

    hlo, io = _read_neff(neff)
    key = (hashlib.sha256(neff).hexdigest(), ranks)
    if key not in _modules:
        ins = [e for e in io if not e[1]]
        outs = [e for e in io if e[1]]
        params = {"parameters": [{"index": i, "name": e[0], "kind": "input", "shape": e[3],
                                  "dtype": TORCH_NAMES[e[2]]} for i, e in enumerate(ins)],
                  "outputs": [{"index": j, "shape": e[3], "dtype": TORCH_NAMES[e[2]]} for j, e in enumerate(outs)]}
        if ranks > 1:  # every buffer is one rank's: stacked along dim 0 over the ranks, split back after
            params["tp"] = {"degree": ranks, "rank_dims": {e[0]: 0 for e in ins},
                            "output_rank_dims": {str(j): 0 for j in range(len(outs))}, "blocks": ranks}
        module = XlaCpuModule(hlo, json.dumps(params), source="stand-in NEFF")
        _modules[key] = module.bind([{}] * ranks if ranks > 1 else {})
    return _modules[key], io


def _tensor(ptr: int, size: int, dtype: str, shape: list[int]) -> torch.Tensor:
    raw = bytearray(ctypes.string_at(ptr, size))
    return torch.frombuffer(raw, dtype=getattr(torch, TORCH_NAMES[dtype])).reshape(shape) if size else \
        torch.empty(shape, dtype=getattr(torch, TORCH_NAMES[dtype]))


def execute(neff_ptr: int, neff_size: int, ranks: int, n: int, bufs: Any, sizes: Any) -> int:
    try:
        neff = ctypes.string_at(neff_ptr, neff_size)
        module, io = _module(neff, ranks)
        calls.append((hashlib.sha256(neff).hexdigest()[:16], ranks))
        per_rank = [[_tensor(bufs[r * n + i], sizes[r * n + i], e[2], e[3]) for i, e in enumerate(io) if not e[1]]
                    for r in range(ranks)]
        args = [torch.cat([per_rank[r][k] for r in range(ranks)]) if ranks > 1 else per_rank[0][k]
                for k in range(len(per_rank[0]))]
        outs = module(*args)
        out_idx = [i for i, e in enumerate(io) if e[1]]
        for j, i in enumerate(out_idx):
            whole = outs[j].contiguous()
            parts = whole.chunk(ranks) if ranks > 1 else [whole]
            for r in range(ranks):
                data = parts[r].contiguous().view(torch.uint8).numpy().tobytes() if parts[r].numel() else b""
                if len(data) != sizes[r * n + i]:
                    raise ValueError(f"output {io[i][0]}: {len(data)} bytes computed, the buffer has "
                                     f"{sizes[r * n + i]}")
                ctypes.memmove(bufs[r * n + i], data, len(data))
        return 0
    except Exception:  # noqa: BLE001 - the stand-in reports a failed execution as NRT_FAILURE
        traceback.print_exc()
        return 1


def install(lib_path: str) -> ctypes.CDLL:
    """Register the executor with the stand-in at `lib_path` (the library the runtime loads: the same handle)."""
    if lib_path not in _installed:
        lib = ctypes.CDLL(lib_path)
        cb = EXEC_FN(execute)
        lib.nrt_standin_set_executor(cb)
        _installed[lib_path] = (lib, cb)
    return _installed[lib_path][0]  # type: ignore[no-any-return]


def state(lib: ctypes.CDLL) -> dict[str, int]:
    """The stand-in's counts: live models, tensors, tensor sets; contract violations; executions; bytes written to
    tensors (nrt_tensor_write)."""
    out = (ctypes.c_uint64 * 6)()
    lib.nrt_standin_state(out)
    return dict(zip(("models", "tensors", "sets", "violations", "executions", "written"), (int(v) for v in out),
                    strict=True))


def last_violation(lib: ctypes.CDLL) -> str:
    lib.nrt_standin_last_violation.restype = ctypes.c_char_p
    return (lib.nrt_standin_last_violation() or b"").decode()


def fail(lib: ctypes.CDLL, call: str, nth: int, status: int) -> None:
    """Make the nth next call of `call` return `status` (0 nth: disarm)."""
    lib.nrt_standin_fail(call.encode(), nth, status)
