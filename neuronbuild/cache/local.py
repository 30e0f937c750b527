"""The local cache: where it lives, and lookups that only count a record as a hit when all its blobs are present."""

from __future__ import annotations

import os
from pathlib import Path

from neuronbuild.cache.action_cache import ActionCache, ActionResult
from neuronbuild.cache.cas import BlobStore

CACHE_ENV = "NEURONBUILD_CACHE_DIR"
LAYOUT = "v1"


def default_cache_dir() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "neuronbuild"


def resolve_cache_dir(flag: str | None) -> Path:
    """--cache-dir, else $NEURONBUILD_CACHE_DIR, else a per-user default (~/.cache/neuronbuild)."""
    if flag:
        return Path(flag).expanduser().resolve()
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser().resolve()
    return default_cache_dir()


class LocalCache:
    """A cache directory shared by any number of workspaces and concurrent builds."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.root = base / LAYOUT
        self.blobs = BlobStore(self.root)
        self.actions = ActionCache(self.root)
        self.logs = self.root / "logs"
        self.locks = self.root / "locks"
        self.scratch = self.root / "sandbox"
        self.toolchain_tmp = self.root / "toolchain-tmp"

    def lookup(self, fp: str) -> ActionResult | None:
        res = self.actions.get(fp)
        if res is None:
            return None
        for out in res.outputs.values():
            if not self.blobs.has(out.digest):
                return None
        return res
