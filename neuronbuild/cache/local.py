"""The local cache: where it lives, and the interface the scheduler, sandboxes and materialisation use.

Interface (keep it when adding tiers): lookup, store_outputs, place_blob, copy_blob, record_failure, try_claim."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from neuronbuild.cache.action_cache import ActionCache, ActionResult, OutputRef
from neuronbuild.cache.atomic import atomic_write_bytes
from neuronbuild.cache.cas import BlobStore
from neuronbuild.cache.identity_index import IdentityIndex

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
        self.failures = self.root / "failures"
        self.scratch = self.root / "sandbox"
        self.toolchain_tmp = self.root / "toolchain-tmp"

    def lookup(self, fp: str) -> ActionResult | None:
        """The cached result of an action, only if every output blob is present."""
        res = self.actions.get(fp)
        if res is None:
            return None
        for out in res.outputs.values():
            if not self.blobs.has(out.digest):
                return None
        return res

    def store_outputs(self, fp: str, identity: str, record: Mapping[str, Any], out_dir: Path,
                      names: Sequence[str], duration_s: float, metadata: Mapping[str, Any]) -> ActionResult:
        """Put an action's outputs into the CAS, then (last, atomically) its record: no partial entry is visible."""
        outputs: dict[str, OutputRef] = {}
        for name in names:
            p = out_dir / name
            if not p.is_file():
                raise FileNotFoundError(f"the action did not produce its declared output '{name}'")
            digest, size = self.blobs.put_file(p)
            outputs[name] = OutputRef(digest, size)
        res = ActionResult(fp, identity, outputs, record, duration_s, dict(metadata), time.time())
        self.actions.put(res)
        IdentityIndex(self.root).record(res)  # explain/plan/upgrade-impact: this identity's most recent result
        with contextlib.suppress(OSError):
            os.unlink(self.failures / fp[:2] / f"{fp}.json")
        return res

    def place_blob(self, digest: str, dest: Path) -> None:
        """A verified copy (or hard link) of a blob at `dest`, for sandbox inputs."""
        self.blobs.link_or_copy(digest, dest)

    def copy_blob(self, digest: str, dest: Path) -> int:
        """A verified, atomically written copy of a blob at `dest`, for outputs users see."""
        return self.blobs.copy_out(digest, dest)

    def record_failure(self, fp: str, identity: str, record: Mapping[str, Any], error: str, log: Path) -> None:
        """Keep a failure (with its log) for reports; it is never replayed as a result."""
        try:
            log_text = log.read_text(encoding="utf-8", errors="replace")[-200_000:]
        except OSError:
            log_text = ""
        data = json.dumps({"fingerprint": fp, "identity": identity, "record": record, "error": error,
                           "log": log_text, "created": time.time()}, sort_keys=True, indent=1).encode()
        atomic_write_bytes(self.failures / fp[:2] / f"{fp}.json", data, self.root / "tmp")

    def try_claim(self, fp: str) -> Claim | None:
        """Claim the right to execute action `fp`, so concurrent builds execute it once.

        Returns None while another build holds the claim (the caller waits and looks the result up again)."""
        self.locks.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.locks / f"{fp}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return Claim(fd)


class Claim:
    """An exclusive, process-lifetime-bound claim on one action (an flock: released if the process dies)."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
