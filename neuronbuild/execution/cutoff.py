"""Early cutoff: an action that reads other actions' outputs is also keyed by those outputs' digests, so when an
input action re-ran and produced byte-identical outputs (a comment-only model edit re-traces to the same program),
the consumer's earlier result is reused instead of re-running it."""

from __future__ import annotations

import contextlib
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from neuronbuild.atomic import atomic_write_bytes
from neuronbuild.digests import fingerprint
from neuronbuild.execution.cache_api import CachedResult, SpawnCache
from neuronbuild.plugin_api.actions import Action

CUTOFF_DIR = "cutoff"
REASON = "trace output unchanged"  # what progress lines and explain say when the input is the trace's program


def reason(action: Action) -> str:
    """Why `action`'s earlier result stands: its trace's output, or (e.g. a Neuron compile reading its Lower's
    outputs) its inputs' outputs, came out byte-identical."""
    return REASON if action.record.get("trace") in {d.action for d in action.dep_inputs} else "inputs unchanged"
_FP_RE = re.compile(r"^[0-9a-f]{64}$")


def _get(cache: SpawnCache, fp: str, probe: bool, known: Mapping[str, CachedResult] | None = None) -> Any:
    """A result; with `probe` (plan, explain, dry runs) only from the local tier: checking is never fetching.
    `known`: results the caller has already (a build's, BuildResult.results), not asked of the cache again."""
    res = known.get(fp) if known is not None else None
    if res is not None:
        return res
    if not probe:
        return cache.lookup(fp)
    local = getattr(cache, "lookup_local", None)
    if local is None:
        return None
    res, bad = local(fp)
    return None if bad else res


def cutoff_key(action: Action, cache: SpawnCache, probe: bool = False,
               known: Mapping[str, CachedResult] | None = None) -> str | None:
    """The action's record with each input action's fingerprint replaced by the digest of the output it reads, and
    any other action fingerprint it names (provenance, e.g. a Neuron compile's trace, read only through its Lower)
    dropped: a sandboxed action sees only its declared files and the outputs it reads. None when the action reads no
    outputs or an input's result is not in the cache."""
    if not action.dep_inputs:
        return None
    reads: dict[str, list[str]] = {}
    for d in action.dep_inputs:
        res = _get(cache, d.action, probe, known)
        if res is None or d.output not in res.outputs:
            return None
        reads.setdefault(d.action, []).append(f"{d.output}={res.outputs[d.output].digest}")
    record = {k: ({"outputs": sorted(reads[v])} if v in reads else "upstream" if _FP_RE.match(v) else v)
              if isinstance(v, str) else v for k, v in action.record.items()}
    return fingerprint({"cutoff": 1, "record": record})


def _entry(cache: SpawnCache, key: str) -> Path:
    return cache.root / CUTOFF_DIR / key[:2] / key


def reused_from(cache: SpawnCache, fp: str) -> str | None:
    """The earlier fingerprint a locally stored result was reused from by early cutoff, else None (never fetches)."""
    res = _get(cache, fp, True)
    prev = (getattr(res, "metadata", None) or {}).get("cutoff_from") if res is not None else None
    return prev if isinstance(prev, str) else None


def remember(action: Action, cache: SpawnCache, known: Mapping[str, CachedResult] | None = None) -> None:
    """After `action` succeeded: its cutoff key -> its fingerprint (best effort: a speed-up only)."""
    key = cutoff_key(action, cache, known=known)
    if key is None:
        return
    with contextlib.suppress(OSError):
        atomic_write_bytes(_entry(cache, key), action.fingerprint.encode(), cache.root / CUTOFF_DIR / ".tmp",
                           durable=False)


def peek(action: Action, cache: SpawnCache, probe: bool = False,
         known: Mapping[str, CachedResult] | None = None) -> str | None:
    """The fingerprint of an earlier action with the same cutoff key whose result is complete, else None."""
    found = _earlier(action, cache, probe, known)
    return found[0] if found is not None else None


def _earlier(action: Action, cache: SpawnCache, probe: bool,
             known: Mapping[str, CachedResult] | None) -> tuple[str, CachedResult] | None:
    """peek's fingerprint and that earlier action's result."""
    key = cutoff_key(action, cache, probe, known)
    if key is None:
        return None
    try:
        prev = _entry(cache, key).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    if not _FP_RE.match(prev) or prev == action.fingerprint:
        return None
    res = _get(cache, prev, probe)
    if res is None or set(res.outputs) != set(action.outputs):
        return None
    return prev, res


def reuse(action: Action, cache: SpawnCache,
          known: Mapping[str, CachedResult] | None = None) -> tuple[str, CachedResult] | None:
    """When an earlier action with the same cutoff key has a complete result, store it as `action`'s result too and
    return (that earlier fingerprint, the result stored); else None. `known`: as cutoff_key's."""
    found = _earlier(action, cache, False, known)
    if found is None:
        return None
    prev, res = found
    cache.scratch.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="cutoff-", dir=cache.scratch))
    try:
        for name, ref in res.outputs.items():
            cache.place_blob(ref.digest, tmp / name)
        meta = {**dict(getattr(res, "metadata", {}) or {}), "cutoff_from": prev, "cutoff": reason(action)}
        stored = cache.store_outputs(action.fingerprint, action.identity, action.record, tmp, tuple(action.outputs),
                                     float(getattr(res, "duration_s", 0.0) or 0.0), meta)
    except OSError:
        return None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return prev, stored
