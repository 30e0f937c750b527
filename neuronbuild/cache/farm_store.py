"""The compile farm's shared store: a shared directory (a local-layout cache) or an S3 tier used directly, so Dask
workers read their inputs from and write their outputs to it with no shared filesystem. Every read is verified."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from neuronbuild.atomic import atomic_writer, umask_mode
from neuronbuild.cache.action_cache import ActionResult, OutputRef
from neuronbuild.cache.cas import CorruptBlob, hash_file
from neuronbuild.cache.local import LocalCache
from neuronbuild.cache.tier import SharedTier
from neuronbuild.digests import copy_hashing


class TierStore:
    """Blob and record operations of the farm protocol over a SharedTier (S3): what LocalCache offers a farm."""

    def __init__(self, tier: SharedTier) -> None:
        self.tier = tier

    @property
    def url(self) -> str:
        return self.tier.url

    def has_blob(self, digest: str, size: int | None = None) -> bool:
        if size is not None:
            return self.tier.has_blob(digest, size)
        try:
            with self.tier.open_blob(digest):
                return True
        except FileNotFoundError:
            return False

    def put_file(self, path: Path, scratch: bool = False) -> tuple[str, int]:
        digest, size = hash_file(path)
        if not self.tier.has_blob(digest, size):
            self.tier.put_blob(digest, path)
        return digest, size

    def copy_blob(self, digest: str, dest: Path) -> int:
        """Download a blob to `dest`, verifying its digest (a corrupt one raises CorruptBlob; nothing is left)."""
        with self.tier.open_blob(digest) as src, atomic_writer(dest, durable=False, mode=umask_mode()) as out:
            got, size = copy_hashing(src, out)
            if got != digest:
                raise CorruptBlob(f"blob {digest[:16]} in {self.url} is corrupt (digest mismatch)")
        return size

    def link_blob(self, digest: str, dest: Path) -> None:
        """A download (verified while it is made; the caller verifies it again while storing it)."""
        self.copy_blob(digest, dest)

    def place_blob(self, digest: str, dest: Path) -> None:
        self.copy_blob(digest, dest)
        with contextlib.suppress(OSError):
            os.chmod(dest, 0o444)

    def store_outputs(self, fp: str, identity: str, record: Mapping[str, Any], out_dir: Path,
                      names: Sequence[str], duration_s: float, metadata: Mapping[str, Any],
                      sign: Callable[[bytes], bytes | None] | None = None) -> ActionResult:
        """Blobs first, the record last: a reader never sees a record whose blobs are missing. `sign`: the writing
        build's shared_record (its record signed with its key), None from it: no record is written."""
        if sign is not None and sign(b"{}") is None:
            return ActionResult(fp, identity, {}, dict(record), duration_s, dict(metadata), time.time())  # no write
        outputs = {}
        for name in names:
            digest, size = self.put_file(out_dir / name)
            outputs[name] = OutputRef(digest, size)
        res = ActionResult(fp, identity, outputs, dict(record), duration_s, dict(metadata), time.time())
        data = sign(res.to_json()) if sign is not None else res.to_json()
        if data is not None:
            self.tier.put_record(fp, data)
        return res


def open_farm_store(url: str, endpoint_url: str | None = None) -> Any:
    """The farm store at `url`: s3://bucket/prefix (an S3 tier) or a directory every worker mounts at that path.

    Picklable by reference (a module-level function), so the Dask executor sends it to workers."""
    if url.startswith("s3://"):
        from neuronbuild.cache.s3 import S3Tier

        return TierStore(S3Tier(url, endpoint_url))
    return LocalCache(Path(url))
