"""Build events: what the scheduler reports as a build runs, the listeners that receive them, and the JSON-lines file.

Each event is one JSON object on its own line in --build-event-json-file (format in docs/executor.md)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from neuronbuild.plugin_api.actions import Action

BUILD_STARTED = "build_started"
CACHE_CHECKED = "cache_checked"
ACTION_CACHED = "action_cached"
ACTION_WAITING = "action_waiting"  # another build holds the claim: its result will be reused
ACTION_STARTED = "action_started"
ACTION_FINISHED = "action_finished"
ACTION_FAILED = "action_failed"
ACTION_SKIPPED = "action_skipped"  # an input failed
OUTPUTS_STORED = "outputs_stored"
BUILD_FINISHED = "build_finished"
WARM_UP_STARTED = "warm_up_started"  # a step provider's warm-up (field `toolchain`: its name) sent to a worker
WARM_UP_FINISHED = "warm_up_finished"


@dataclass(frozen=True)
class BuildEvent:
    """One thing that happened: a kind, a wall-clock time (seconds since the epoch) and its fields."""

    kind: str
    time: float
    fields: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def to_json(self) -> str:
        return json.dumps({"event": self.kind, "time": round(self.time, 6), **self.fields}, sort_keys=False)


def action_fields(a: Action) -> dict[str, Any]:
    """What identifies an action in events: fingerprint, kind, label, bucket, target."""
    d: dict[str, Any] = {"fingerprint": a.fingerprint, "kind": a.kind, "label": str(a.label),
                         "bucket": a.bucket.as_dict(), "description": a.describe()}
    if a.platform:
        d["platform"] = a.platform
        d["target"] = a.target
    if a.spec.get("skipped"):  # the step's real work is left out (e.g. a Neuron compile without neuronx-cc)
        d["skipped"] = a.spec["skipped"]
    return d


class Listener(Protocol):
    def on_event(self, ev: BuildEvent) -> None: ...

    def close(self) -> None: ...


class EventBus:
    """Fans events out to listeners; a listener that fails (a full disk, a closed pipe) never breaks the build."""

    def __init__(self, listeners: Sequence[Listener] = ()) -> None:
        self.listeners = list(listeners)

    def emit(self, kind: str, /, at: float | None = None, **fields: Any) -> BuildEvent:
        ev = BuildEvent(kind, time.time() if at is None else at, fields)
        for lst in self.listeners:
            try:
                lst.on_event(ev)
            except (OSError, ValueError):
                pass
        return ev

    def close(self) -> None:
        for lst in self.listeners:
            try:
                lst.close()
            except (OSError, ValueError):
                pass


class JsonLinesWriter:
    """--build-event-json-file: one event per line, flushed as it happens (so it can be followed during a build)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f: IO[str] | None = open(path, "w", encoding="utf-8")  # noqa: SIM115 - open for the whole build

    def on_event(self, ev: BuildEvent) -> None:
        if self._f is not None:
            self._f.write(ev.to_json() + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
