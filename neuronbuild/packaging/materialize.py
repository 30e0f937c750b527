"""Copies cached compile outputs to neuronbuild-out/<package>/<target>/<bucket>/ with a manifest.json per target."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from neuronbuild import FORMAT_VERSION
from neuronbuild.analysis.planner import ActionGraph, CompileTarget
from neuronbuild.atomic import atomic_write_bytes
from neuronbuild.cache.cas import umask_mode
from neuronbuild.cache.local import LocalCache
from neuronbuild.workspace import OUTPUT_DIR

MANIFEST = "manifest.json"


def target_dir(root: Path, ct: CompileTarget) -> Path:
    return root / OUTPUT_DIR / ct.label.package / ct.label.name


def _traced_outputs(cache: LocalCache, trace_fp: str) -> list[Any]:
    """The model's flattened outputs as its trace recorded them (names, shapes, dims that follow bucket dims)."""
    res = cache.lookup(trace_fp)
    return list(res.metadata.get("outputs") or []) if res is not None else []


def materialize(root: Path, ag: ActionGraph, cache: LocalCache, failed: set[str]) -> list[Path]:
    """Write outputs of every compile target whose actions all succeeded. Unchanged files are not rewritten."""
    written: list[Path] = []
    for ct in ag.compiles:
        if any(fp in failed or cache.lookup(fp) is None for _b, fp in ct.buckets):
            continue
        out = target_dir(root, ct)
        old: dict[str, Any] = {}
        try:
            old = json.loads((out / MANIFEST).read_text())
        except (OSError, ValueError):
            pass
        old_files = {(b.get("name"), n): o.get("digest") for b in old.get("buckets", [])
                     for n, o in b.get("outputs", {}).items()}
        buckets = []
        for bucket, fp in ct.buckets:
            res = cache.lookup(fp)
            assert res is not None
            for name, ref in res.outputs.items():
                dest = out / bucket.name / name
                if old_files.get((bucket.name, name)) == ref.digest and dest.is_file() and \
                        dest.stat().st_size == ref.size:
                    continue
                cache.copy_blob(ref.digest, dest)
                written.append(dest)
            buckets.append({
                "name": bucket.name,
                "bucket": bucket.as_dict(),
                "fingerprint": fp,
                "trace": ag.trace_of(fp).fingerprint,
                "model_outputs": _traced_outputs(cache, ag.trace_of(fp).fingerprint),
                "outputs": {n: {"digest": r.digest, "size": r.size, "path": f"{bucket.name}/{n}"}
                            for n, r in sorted(res.outputs.items())},
            })
        manifest = {
            "format": FORMAT_VERSION,
            "label": str(ct.label),
            "platform": ct.platform,
            "isa": ct.target.get("isa"),
            "artifact_format": ct.artifact_format,
            "options": dict(ct.options),
            "buckets": buckets,
        }
        data = json.dumps(manifest, sort_keys=True, indent=1).encode()
        if (out / MANIFEST).is_file() and (out / MANIFEST).read_bytes() == data:
            continue
        atomic_write_bytes(out / MANIFEST, data, out / ".tmp", mode=umask_mode())
        try:
            (out / ".tmp").rmdir()
        except OSError:
            pass
    return written
