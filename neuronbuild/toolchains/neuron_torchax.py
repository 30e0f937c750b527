"""Imports torchax 0.0.13 (+ jax) on torch 2.13, which removed the named-tensor op overloads torchax refers to."""

from __future__ import annotations

import os
import re
import threading
from types import ModuleType
from typing import Any

# torchax's tables name ~22 Dimname overloads (e.g. aten.prod.dim_Dimname) that torch 2.13 dropped; only those may be
# answered with an inert placeholder while torchax imports. Any other missing overload still fails the import.
_NAMED_OVERLOAD = re.compile(r"(?i)dimname|names")
_lock = threading.Lock()


class MissingOverload:
    """Stands for an op overload this torch does not have; never matches a real graph node."""

    def __init__(self, packet: Any, key: str) -> None:
        self.qualified = f"{packet}.{key}"

    def name(self) -> str:
        return self.qualified

    def __repr__(self) -> str:
        return f"<missing overload {self.qualified}>"


def import_jax() -> dict[str, Any]:
    """Import jax as import_torchax would (the CPU platform, read from the environment when jax is imported), without
    torchax and without leaving JAX_PLATFORMS in this process's environment: the Neuron toolchain's warm-up, run in
    a worker before its first lowering, so each lowering forked from it finds jax imported (~1 s of CPU less a
    lowering; torchax itself then takes ~0.02 s). torchax stays out of the worker: importing it registers
    decompositions into torch's global table, which every trace and cpu compile forked from the worker would see.
    Importing jax starts no thread and initialises no backend (checked: the process's thread count is unchanged;
    the worker forks its actions after this)."""
    import time

    start = time.perf_counter()
    saved = os.environ.get("JAX_PLATFORMS")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    try:
        import jax
    finally:
        if saved is None:
            os.environ.pop("JAX_PLATFORMS", None)
    return {"imported": "jax", "jax": str(jax.__version__), "seconds": round(time.perf_counter() - start, 3)}


def import_torchax() -> tuple[ModuleType, ModuleType]:
    """(torchax.ops.ops_registry, torchax.decompositions), importing torchax with the shim once per process.

    jax is pinned to the CPU platform and 32-bit mode before anything imports it (no accelerator plugin probing; int64
    values become s32 as on Neuron frameworks)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    with _lock:
        import torch._ops

        original = torch._ops.OpOverloadPacket.__getattr__

        def tolerant(self: Any, key: str) -> Any:
            try:
                return original(self, key)
            except AttributeError:
                if key.startswith("__") or not _NAMED_OVERLOAD.search(key):
                    raise
                return MissingOverload(self, key)

        torch._ops.OpOverloadPacket.__getattr__ = tolerant  # type: ignore[method-assign]
        try:
            import torchax  # noqa: F401
            import torchax.decompositions as decompositions
            import torchax.ops.jaten  # noqa: F401  (registers the aten lowerings)
            import torchax.ops.jtorch  # noqa: F401
            from torchax.ops import ops_registry
        finally:
            torch._ops.OpOverloadPacket.__getattr__ = original  # type: ignore[method-assign]
        import jax

        jax.config.update("jax_enable_x64", False)
        return ops_registry, decompositions
