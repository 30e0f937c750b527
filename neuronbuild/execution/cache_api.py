"""The cache as execution sees it: the interface the scheduler and executors use, implemented by neuronbuild/cache/
(as Bazel's exec/SpawnCache is implemented by remote/). Execution never imports the cache package."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from neuronbuild.history import History


class OutputRef(Protocol):
    """One stored output: its content digest and size."""

    @property
    def digest(self) -> str: ...

    @property
    def size(self) -> int: ...


class CachedResult(Protocol):
    """A stored action result."""

    @property
    def fingerprint(self) -> str: ...

    @property
    def outputs(self) -> Mapping[str, OutputRef]: ...

    @property
    def record(self) -> Mapping[str, Any]: ...

    @property
    def duration_s(self) -> float: ...

    @property
    def metadata(self) -> Mapping[str, Any]: ...


class Claim(Protocol):
    """The right to execute an action (held by one build at a time); released when stored or abandoned."""

    def release(self) -> None: ...


class SpawnCache(Protocol):
    """Lookups, execute-once claims, storing outputs and placing blobs into sandboxes."""

    @property
    def root(self) -> Path:
        """The cache layout root (<cache>/v1)."""

    @property
    def logs(self) -> Path:
        """Where per-action logs go."""

    @property
    def scratch(self) -> Path:
        """Where sandboxes are made."""

    @property
    def toolchain_tmp(self) -> Path:
        """Per-machine toolchain scratch (precompiled headers ...)."""

    def lookup(self, fp: str) -> CachedResult | None: ...

    def peek(self, fp: str) -> bool: ...

    def peek_many(self, fps: Sequence[str]) -> set[str]:
        """Those of `fps` whose peek() is true (one pass that writes nothing: a plan's probe of every action). A
        cache may answer from listings instead of a lookup each; this default asks peek() for each."""
        return {fp for fp in fps if self.peek(fp)}

    def try_claim(self, fp: str) -> Claim | None: ...

    def store_outputs(self, fp: str, identity: str, record: Mapping[str, Any], out_dir: Path,
                      names: Sequence[str], duration_s: float, metadata: Mapping[str, Any],
                      expect: Mapping[str, str] | None = None, scratch: bool = False) -> CachedResult:
        """The result recorded (what a lookup now returns). `scratch`: out_dir is the caller's to remove (files may be
        linked, not copied); `expect`: {name: digest} the outputs must match (a farm worker's blobs, verified here;
        CorruptBlob if one does not)."""

    def shared_record(self, data: bytes) -> bytes | None:
        """A record's JSON (bytes) as this build writes it to any shared tier, a farm's store included: signed with
        its key when it has one; None when it must write none (it trusts only signed records and holds no key)."""

    def record_failure(self, fp: str, identity: str, record: Mapping[str, Any], error: str, log: Path) -> None: ...

    def place_blob(self, digest: str, dest: Path) -> None: ...

    def copy_blob(self, digest: str, dest: Path) -> int: ...

    def history(self) -> History: ...
