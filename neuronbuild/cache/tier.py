"""The shared-tier contract (a shared directory or an S3 bucket) and the errors a tier reports."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import BinaryIO, Protocol

# A record larger than this in a shared tier is read as unreadable (a miss), never into memory: records are a few KiB
# (an action's input record, its outputs' digests), and anyone who can write the tier could put gigabytes there.
MAX_RECORD_BYTES = 64 << 20


class TierUnavailable(Exception):
    """The shared tier cannot be reached (missing directory, dead endpoint, no credentials...)."""


class TierReadOnly(Exception):
    """The shared tier refused a write (read-only mount, no write permission)."""


class Lease(Protocol):
    """A held execute-once claim on a shared tier."""

    def release(self) -> None: ...


class SharedTier(Protocol):
    """Same layout as the local cache (v1/ac, v1/cas, v1/locks) on shared storage. Records are written after blobs.
    The tiers subclass it (for its defaults)."""

    url: str

    def get_record(self, fp: str) -> bytes | None: ...

    def records_among(self, fps: Sequence[str]) -> set[str]:
        """Those of `fps` that may have a record here: every one that has one when the call begins (a superset is
        correct, get_record decides). A tier answers a long list from one listing of each shard asked; this default,
        for a tier that cannot list, keeps them all."""
        return set(fps)

    def open_blob(self, digest: str) -> AbstractContextManager[BinaryIO]:
        """A readable stream of a blob; raises FileNotFoundError when it is absent."""
        ...

    def has_blob(self, digest: str, size: int) -> bool: ...

    def put_blob(self, digest: str, src: Path) -> None: ...

    def put_record(self, fp: str, data: bytes) -> None: ...

    def evict_blob(self, digest: str) -> None: ...

    def evict_record(self, fp: str) -> None: ...

    def try_claim(self, fp: str) -> Lease | None: ...

    def records(self) -> Iterator[tuple[str, bytes]]: ...

    def blobs(self) -> Iterator[tuple[str, int]]: ...
