"""Build roots: per workspace, the action fingerprints each target's last successful build referenced.

Layout: <cache>/v1/roots/<h(workspace path)>.json = {"workspace": path, "targets": {label: [fingerprint, ...]}}.
Written at the end of every successful build (merged per label: the latest build of a label wins), read by gc (keep
what any live workspace last built) and `cache pin` (pin exactly what was built, whatever flags built it)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from neuronbuild import jsondata
from neuronbuild.atomic import atomic_write_bytes, file_lock

MAX_ROOT_FILE = 256 << 20  # a roots file larger than this is not read (treated as absent)


def _path(root: Path, workspace: Path) -> Path:
    key = hashlib.sha256(str(workspace).encode()).hexdigest()[:24]
    return root / "roots" / f"{key}.json"


def _read(p: Path) -> dict[str, object] | None:
    try:
        if p.stat().st_size > MAX_ROOT_FILE:
            return None
        data = jsondata.loads(p.read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def _targets(data: Mapping[str, object] | None) -> dict[str, list[str]]:
    raw = data.get("targets") if data else None
    if not isinstance(raw, dict):
        return {}
    return {str(k): [str(f) for f in v] for k, v in raw.items() if isinstance(v, list)}


def record_roots(root: Path, workspace: Path, targets: Mapping[str, Iterable[str]],
                 loaded_packages: Iterable[str] = (), existing: Iterable[str] = ()) -> None:
    """Merge this build's {label: fingerprints} into the workspace's roots; labels of `loaded_packages` that are no
    longer among `existing` labels (deleted or renamed targets) stop being protected. Never raises for I/O."""
    loaded, alive = set(loaded_packages), set(existing)
    p = _path(root, workspace)
    with contextlib.suppress(OSError):
        p.parent.mkdir(parents=True, exist_ok=True)
        with file_lock(p.with_suffix(".lock")):
            merged = {k: v for k, v in _targets(_read(p)).items()
                      if k in alive or k.removeprefix("//").partition(":")[0] not in loaded}
            merged.update({str(k): sorted(set(v)) for k, v in targets.items()})
            data = {"workspace": str(workspace), "targets": dict(sorted(merged.items()))}
            atomic_write_bytes(p, json.dumps(data, indent=0).encode(), root / "tmp", durable=False)


def workspace_roots(root: Path, workspace: Path) -> dict[str, list[str]]:
    """{label: fingerprints} of the workspace's last successful builds."""
    return _targets(_read(_path(root, workspace)))


def live_roots(root: Path) -> tuple[set[str], int]:
    """(every fingerprint the last builds of live workspaces referenced, how many workspaces). A workspace whose
    directory no longer exists stops protecting anything (its file is removed)."""
    fps: set[str] = set()
    n = 0
    d = root / "roots"
    for p in sorted(d.glob("*.json")) if d.is_dir() else ():
        data = _read(p)
        ws = data.get("workspace") if data else None
        if not isinstance(ws, str):
            continue
        if not os.path.isdir(ws):
            with contextlib.suppress(OSError):
                p.unlink()
            continue
        n += 1
        for v in _targets(data).values():
            fps.update(v)
    return fps, n
