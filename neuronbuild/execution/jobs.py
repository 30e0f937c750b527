"""The contract between the scheduler and an executor: a Job handed out, a Completion handed back."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from neuronbuild.plugin_api.actions import Action


@dataclass(frozen=True)
class Job:
    """One attempt at one action; `log` is where its full output goes on this machine."""

    action: Action
    attempt: int
    log: Path
    host: str = ""  # a warm-up pseudo-job: the host it must run on ("" : any)
    # the scheduler's estimates of the action (seconds, peak MB; 0: none), which its default limits scale from
    estimate_s: float = 0.0
    estimate_mb: float = 0.0
    estimate_mb_recorded: bool = True  # False: the peak estimate is a default (nothing recorded for the action)

    @property
    def id(self) -> str:
        return f"{self.action.fingerprint}#{self.attempt}"


@dataclass(frozen=True)
class Started:
    """Where a job went: a track name for displays and profiles, and the worker's pid (0 when remote)."""

    worker: str
    pid: int = 0


@dataclass(frozen=True)
class Completion:
    """A finished job. On success `outputs` is a local directory holding its declared outputs (for store_outputs;
    the executor's scratch, removed by `finish`)."""

    job: Job
    ok: bool
    worker: str
    pid: int = 0
    error: str = ""
    duration_s: float = 0.0
    peak_rss_mb: float = 0.0
    metadata: Mapping[str, Any] = field(default_factory=dict, hash=False, compare=False)
    outputs: Path | None = None
    worker_died: bool = False  # an infrastructure failure (killed, OOM, lost host): worth a retry
    cpu_s: float = 0.0  # CPU seconds of the action's process and its compilers (0: not measured, e.g. on Dask)
    # {name: digest} the outputs must match when stored: a farm worker's blobs, placed unverified (store_outputs
    # verifies them while adopting them into the local cache); None: the executor's own files (a local sandbox).
    digests: Mapping[str, str] | None = field(default=None, hash=False, compare=False)
    # When the job started on its worker and when that worker was free of it (seconds since the epoch), where the
    # executor knows better than dispatch and receipt (a farm task queued on its Dask worker); 0.0: not known.
    started: float = 0.0
    ended: float = 0.0


class Executor(Protocol):
    """What the scheduler needs from a place that runs actions (local worker processes or a Dask cluster)."""

    slots: int  # how many jobs it runs at once
    # (optional) `ahead: int`: jobs it takes beyond `slots`, queued on its workers so each starts the moment a slot
    # frees (the Dask farm); the scheduler dispatches up to slots + ahead when no --local-ram budget applies
    local: bool  # runs on this machine (the --local-ram cap applies)
    name: str

    def warm(self, n: int) -> None: ...

    def hosts(self) -> list[str]:
        """The machines a per-machine toolchain warm-up must run on, one pseudo-job each ([""]: this one)."""
        ...

    def start(self, job: Job) -> Started:
        """Prepare the job's inputs and dispatch it; raises InputChanged, CorruptBlob or OSError if it cannot."""
        ...

    def wait(self, timeout: float | None) -> list[Completion]: ...

    def finish(self, job: Job) -> None:
        """Drop the job's scratch space (after its outputs were stored)."""
        ...

    def cancel(self) -> None:
        """End every running job now (workers are killed; nothing is stored)."""
        ...

    def shutdown(self) -> None: ...
