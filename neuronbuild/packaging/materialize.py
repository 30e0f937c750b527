"""Copies cached compile outputs to neuronbuild-out/<package>/<target>/<bucket>/ with a manifest.json per target.

A target's directory is made to hold exactly its current outputs, as Bazel's output tree does: bucket directories
of buckets no longer declared and files no longer produced (a model.neff once neuronx-cc is not configured) go."""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from pathlib import Path
from typing import Any

from neuronbuild import FORMAT_VERSION
from neuronbuild.analysis.planner import ActionGraph, CompileTarget
from neuronbuild.atomic import atomic_write_bytes
from neuronbuild.cache.cas import COPY_TEMP_PREFIX, umask_mode
from neuronbuild.cache.local import LocalCache
from neuronbuild.workspace import OUTPUT_DIR

MANIFEST = "manifest.json"
STAGING = ".tmp"
# A copy in flight younger than this may be a concurrent build's, about to be renamed onto its output: left alone.
IN_FLIGHT_S = 3600


def target_dir(root: Path, ct: CompileTarget) -> Path:
    return root / OUTPUT_DIR / ct.label.package / ct.label.name


def _traced_outputs(cache: LocalCache, trace_fp: str) -> list[Any]:
    """The model's flattened outputs as its trace recorded them (names, shapes, dims that follow bucket dims)."""
    res = cache.lookup(trace_fp)
    return list(res.metadata.get("outputs") or []) if res is not None else []


def _prune(out: Path, keep: set[str]) -> None:
    """Remove everything under `out` whose relative path is not in `keep` (nor a directory on the way to one), except
    recent in-flight copies (a concurrent build materialising the same target renames them onto its outputs)."""
    recent = time.time() - IN_FLIGHT_S
    dirs = {str(p) for k in keep for p in (Path(k), *Path(k).parents)}
    for dirpath, dirnames, filenames in list(_walk(out)):
        rel_dir = dirpath.relative_to(out)
        for d in dirnames:
            rel = str(rel_dir / d) if str(rel_dir) != "." else d
            if rel not in dirs:
                p = dirpath / d
                if p.is_symlink():
                    p.unlink()
                else:
                    shutil.rmtree(p, ignore_errors=True)
        for f in filenames:
            rel = str(rel_dir / f) if str(rel_dir) != "." else f
            if rel not in keep:
                with contextlib.suppress(FileNotFoundError):
                    if f.startswith(COPY_TEMP_PREFIX) and (dirpath / f).lstat().st_mtime > recent:
                        continue
                    (dirpath / f).unlink()


def _walk(top: Path) -> list[tuple[Path, list[str], list[str]]]:
    out: list[tuple[Path, list[str], list[str]]] = []
    stack = [top]
    while stack:
        d = stack.pop()
        try:
            entries = list(d.iterdir())
        except (FileNotFoundError, NotADirectoryError):
            continue
        subdirs = [e.name for e in entries if e.is_dir() and not e.is_symlink()]
        files = [e.name for e in entries if not (e.is_dir() and not e.is_symlink())]
        out.append((d, subdirs, files))
        stack.extend(d / s for s in subdirs)
    return out


def materialize(root: Path, ag: ActionGraph, cache: LocalCache, failed: set[str]) -> list[Path]:
    """Write outputs of every compile target whose actions all succeeded (unchanged files are not rewritten) and
    remove what else its directory holds. Returns the directories of the targets materialised."""
    done: list[Path] = []
    for ct in ag.compiles:
        if any(fp in failed or cache.lookup(fp) is None for _b, fp in ct.buckets):
            continue
        out = target_dir(root, ct)
        if out.is_file() or out.is_symlink():
            out.unlink()  # a stale file where the target's directory goes
        old: dict[str, Any] = {}
        try:
            old = json.loads((out / MANIFEST).read_text())
        except (OSError, ValueError):
            pass
        old_files = {(b.get("name"), n): o.get("digest") for b in old.get("buckets", [])
                     for n, o in b.get("outputs", {}).items()}
        buckets = []
        keep = {MANIFEST}
        for bucket, fp in ct.buckets:
            res = cache.lookup(fp)
            assert res is not None
            for name, ref in res.outputs.items():
                dest = out / bucket.name / name
                keep.add(f"{bucket.name}/{name}")
                if old_files.get((bucket.name, name)) == ref.digest and dest.is_file() and \
                        dest.stat().st_size == ref.size:
                    continue
                if dest.is_dir() and not dest.is_symlink():
                    shutil.rmtree(dest)
                cache.copy_blob(ref.digest, dest)
            buckets.append({
                "name": bucket.name,
                "bucket": bucket.as_dict(),
                **({"graph": bucket.graph, "options": dict(ct.options_of(bucket.graph)),
                    "aliases": dict(ag.trace_of(fp).model.get("aliases") or {})} if bucket.graph else {}),
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
        done.append(out)
        if not ((out / MANIFEST).is_file() and (out / MANIFEST).read_bytes() == data):
            atomic_write_bytes(out / MANIFEST, data, out / STAGING, mode=umask_mode())
        _prune(out, keep | {STAGING})
        with contextlib.suppress(OSError):
            (out / STAGING).rmdir()  # only when empty: a concurrent build may be writing through it
    return done
