"""Copies cached compile outputs (and what they ship: the model's weights) to neuronbuild-out/<package>/<target>/
<bucket>/ with a manifest.json per target; files of LINK_MIN_BYTES or more are read-only links to the cache's blob.

A target's directory is made to hold exactly its current outputs, as Bazel's output tree does: bucket directories
of buckets no longer declared and files no longer produced (a model.neff once neuronx-cc is not configured) go."""

from __future__ import annotations

import contextlib
import hashlib
import json
import operator
import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from neuronbuild import FORMAT_VERSION
from neuronbuild.analysis.action_graph import ActionGraph
from neuronbuild.analysis.providers import CompileTarget
from neuronbuild.atomic import atomic_write_bytes
from neuronbuild.cache.cas import COPY_TEMP_PREFIX, CorruptBlob, linked_beside, umask_mode
from neuronbuild.cache.local import LocalCache
from neuronbuild.digests import StatKey, is_racy, stat_key
from neuronbuild.workspace import OUTPUT_DIR

MANIFEST = "manifest.json"
STAGING = ".tmp"
# A copy in flight younger than this may be a concurrent build's, about to be renamed onto its output: left alone.
IN_FLIGHT_S = 3600
# Outputs at least this big (a model's weights) are read-only hard links to the cache's blob, not copies: one copy on
# disk for cache and output target (#28). The cache does not trust them (BlobStore.link_out); smaller ones are copies
# of their own that users may edit.
LINK_MIN_BYTES = 64 << 20


def target_dir_str(root: Path | str, ct: CompileTarget) -> str:
    """A compile target's output directory, neuronbuild-out/<package>/<target>, as a string (pathlib's joins cost
    more than the rest of a kept target's check, 1,000s per build)."""
    pkg = ct.label.package
    return f"{root}/{OUTPUT_DIR}/{pkg}/{ct.label.name}" if pkg else f"{root}/{OUTPUT_DIR}/{ct.label.name}"


def _traced_outputs(res: Any) -> list[Any]:
    """The model's flattened outputs as its trace (result `res`) recorded them (names, shapes, dims that follow bucket
    dims)."""
    return list(res.metadata.get("outputs") or []) if res is not None else []


def _prune(out: Path, keep: set[str]) -> None:
    """Remove everything under `out` whose relative path is not in `keep` (nor a directory on the way to one), except
    recent in-flight copies (a concurrent build materialising the same target renames them onto its outputs)."""
    recent = time.time() - IN_FLIGHT_S
    dirs: set[str] = set()
    for k in keep:
        parts = k.split("/")
        dirs.update("/".join(parts[:i]) for i in range(1, len(parts)))
    for rel_dir, dirnames, filenames in _walk(str(out)):
        base = f"{out}/{rel_dir}" if rel_dir else str(out)
        for d in dirnames:
            rel = f"{rel_dir}/{d}" if rel_dir else d
            if rel not in dirs:
                p = f"{base}/{d}"
                if os.path.islink(p):
                    os.unlink(p)
                else:
                    shutil.rmtree(p, ignore_errors=True)
        for f in filenames:
            rel = f"{rel_dir}/{f}" if rel_dir else f
            if rel not in keep:
                with contextlib.suppress(FileNotFoundError):
                    if f.startswith(COPY_TEMP_PREFIX) and os.lstat(f"{base}/{f}").st_mtime > recent:
                        continue
                    os.unlink(f"{base}/{f}")


def _walk(top: str) -> list[tuple[str, list[str], list[str]]]:
    """(directory relative to `top` ("" for top), subdirectories, other entries) of every directory under `top`."""
    out: list[tuple[str, list[str], list[str]]] = []
    stack = [""]
    while stack:
        rel = stack.pop()
        try:
            with os.scandir(f"{top}/{rel}" if rel else top) as it:
                entries = list(it)
        except (FileNotFoundError, NotADirectoryError):
            continue
        subdirs = [e.name for e in entries if e.is_dir(follow_symlinks=False)]
        files = [e.name for e in entries if not e.is_dir(follow_symlinks=False)]
        out.append((rel, subdirs, files))
        stack.extend(f"{rel}/{s}" if rel else s for s in subdirs)
    return out


Snapshot = tuple[tuple[str, StatKey], ...]
# Targets this process materialised, by directory: (a digest of the manifest's canonical JSON, a snapshot of the
# directory tree: every directory and file in it with its lstat key, the same before and after the directory was
# checked and found right, nothing written, and what the manifest was made from: the CompileTarget and the results
# of its buckets' actions and of their traces). While a target's manifest is the same and every entry still has its
# key (a file added to or removed from a directory changes the directory's mtime), the directory holds exactly what
# materialising would write: it is skipped (a build server's warm builds would otherwise re-read 500 manifests and
# list 1,500 directories at 1,000 graphs). The manifest is a function of those values (frozen; held here, so compared
# by identity: the build server replays the same CompileTarget and the action cache hands out the same result while
# its record is unchanged): when they are the same objects it is not even made again. Anything else takes the full
# path.
_done: dict[str, tuple[bytes, Snapshot, tuple[Any, ...]]] = {}
_MAX_DONE = 20_000  # ~2 KiB each: at most ~40 MiB


def _unchanged(snapshot: Snapshot) -> bool:
    try:
        return all(stat_key(os.lstat(p)) == k for p, k in snapshot)
    except OSError:
        return False


def _snapshot(out: Path, keep: set[str]) -> Snapshot | None:
    """The tree under `out` if it holds exactly `keep` (and the directories on the way) and nothing in it changed
    within the racy window (a second change could hide in the same timestamp tick); else None."""
    found: list[tuple[str, StatKey]] = []
    seen: set[str] = set()
    dirs = {k.rsplit("/", 1)[0] for k in keep if "/" in k}  # (outputs are <bucket>/<name>)
    now = time.time_ns()
    try:
        for rel_dir, _dirnames, filenames in _walk(str(out)):
            base = f"{out}/{rel_dir}" if rel_dir else str(out)
            k = stat_key(os.lstat(base))
            if is_racy(k, now) or (rel_dir and rel_dir not in dirs):
                return None
            found.append((base, k))
            for f in filenames:
                rel = f"{rel_dir}/{f}" if rel_dir else f
                k = stat_key(os.lstat(f"{base}/{f}"))
                if is_racy(k, now) or rel not in keep:
                    return None
                seen.add(rel)
                found.append((f"{base}/{f}", k))
    except OSError:
        return None
    return tuple(found) if seen == keep else None


def materialize(root: Path, ag: ActionGraph, cache: LocalCache, results: Mapping[str, Any]) -> list[Path]:
    """Write outputs of every compile target whose actions all have a result (`results`: the build's,
    BuildResult.results; unchanged files are not rewritten) and remove what else its directory holds. Returns the
    directories of the targets materialised."""
    done: list[Path] = []
    copied: set[str] = set()  # digests of blobs verified by a copy of this call (later copies are not hashed again)
    lookup = results.get
    for ct in ag.compiles:
        bucket_results: list[Any] = []
        shipped: list[Any] = []  # the results of what the buckets ship beside their outputs (the model's weights)
        for i, (_b, fp) in enumerate(ct.buckets):
            res = lookup(fp)
            if res is None:
                break
            for s in ct.ships[i] if i < len(ct.ships) else ag.actions[fp].ships:  # (this target's own weights)
                other = lookup(s.action)
                if other is None or s.output not in other.outputs:
                    res = None
                    break
                shipped.append(other)
            if res is None:
                break
            bucket_results.append(res)
        if len(bucket_results) != len(ct.buckets):  # (an action failed or is not cached)
            continue
        out_s = target_dir_str(root, ct)
        done.append(Path(out_s))
        traces = [ag.trace_of(fp).fingerprint for _b, fp in ct.buckets]
        traced = [lookup(t) for t in traces]
        made_from = (ct, *bucket_results, *shipped, *traced)  # (the same objects while records are unchanged)
        known = _done.get(out_s)
        if known is not None and len(known[2]) == len(made_from) and \
                all(map(operator.is_, known[2], made_from)) and _unchanged(known[1]):
            continue
        out = Path(out_s)
        buckets = []
        for (bucket, fp), res, trace_fp, trace_res in zip(ct.buckets, bucket_results, traces, traced, strict=True):
            assert res is not None
            buckets.append({
                "name": bucket.name,
                "bucket": bucket.as_dict(),
                **({"graph": bucket.graph, "options": dict(ct.options_of(bucket.graph)),
                    "aliases": dict(ag.trace_of(fp).model.get("aliases") or {})} if bucket.graph else {}),
                "fingerprint": fp,
                "trace": trace_fp,
                "model_outputs": _traced_outputs(trace_res),
                "outputs": {n: {"digest": r.digest, "size": r.size, "path": f"{bucket.name}/{n}"}
                            for n, r in sorted(_with_shipped(ag, fp, res, lookup, ct.ships_of(fp)).items())},
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
        # (without indent: json's C encoder, 10x faster; kept as a digest: the JSON is ~1.5 KiB)
        key = hashlib.blake2b(json.dumps(manifest, sort_keys=True).encode(), digest_size=16).digest()
        if known is not None and known[0] == key and _unchanged(known[1]):
            _done[out_s] = (key, known[1], made_from)
            continue
        _done.pop(out_s, None)
        keep = {MANIFEST} | {f"{b['name']}/{n}" for b in buckets for n in b["outputs"]}
        before = _snapshot(out, keep)
        _write_target(out, manifest, cache, copied)
        # Kept only when the directory was already right and nothing changed it meanwhile (a concurrent build
        # materialising another version of this target): what was checked is what the snapshot describes.
        if before is not None and before == _snapshot(out, keep) and len(_done) < _MAX_DONE:
            _done[out_s] = (key, before, made_from)  # (full: the targets kept first stay kept)
    return done


def _with_shipped(ag: ActionGraph, fp: str, res: Any, lookup: Any,
                  ships: tuple[Any, ...] | None = None) -> dict[str, Any]:
    """A bucket's files: its action's outputs and what it ships (ActionGraph.shipped_outputs; all cached here).
    `ships`: the compile target's own (CompileTarget.ships_of)."""
    if not (ag.actions[fp].ships if ships is None else ships):
        return dict(res.outputs)
    out = ag.shipped_outputs(fp, lookup, ships)
    assert out is not None
    return out


def _link_to(first: Path, dest: Path) -> bool:
    """Make `dest` a hard link to `first` (already checked or copied: the same blob); False where the filesystem
    cannot link (then it gets a copy of its own)."""
    with contextlib.suppress(OSError):
        if os.path.samefile(first, dest):
            return True
    try:
        with linked_beside(first, dest) as tmp:
            return tmp is not None
    except OSError:
        return False


def _linked_out(cache: LocalCache, digest: str, dest: Path) -> bool:
    """`dest` a read-only hard link to the cache's verified blob (LocalCache.link_out); False where it cannot be
    (another filesystem, a blob only a remote tier holds, a corrupt one): the caller copies."""
    try:
        return cache.link_out(digest, dest) is not None
    except (OSError, CorruptBlob):
        return False


def _write_target(out: Path, manifest: dict[str, Any], cache: LocalCache, copied: set[str]) -> None:
    """Make `out` hold exactly the outputs and manifest: files whose digest and size the old manifest and the
    directory confirm are kept, big ones linked read-only to the cache's verified blob, others copied from the cache (the first copy of each blob in this materialisation
    verified on the way, the others copied by the kernel: copy_blob's verified_size); the rest pruned."""
    if out.is_file() or out.is_symlink():
        out.unlink()  # a stale file where the target's directory goes
    old: dict[str, Any] = {}
    try:
        old = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        pass
    old_files = {(b.get("name"), n): o.get("digest") for b in old.get("buckets", [])
                 for n, o in b.get("outputs", {}).items()}
    keep = {MANIFEST}
    # One copy per blob in the target's directory: the buckets' equal files (the model's weights file, which every
    # bucket ships) are hard links to the first bucket's.
    placed: dict[str, Path] = {}
    for b in manifest["buckets"]:
        for name, ref in b["outputs"].items():
            dest = out / b["name"] / name
            keep.add(f"{b['name']}/{name}")
            first = placed.get(ref["digest"])
            if first is not None:
                if _link_to(first, dest):
                    continue
            elif old_files.get((b["name"], name)) == ref["digest"] and dest.is_file() and \
                    dest.stat().st_size == ref["size"]:
                placed[ref["digest"]] = dest
                continue
            if ref["size"] >= LINK_MIN_BYTES and _linked_out(cache, ref["digest"], dest):
                copied.add(ref["digest"])
                placed.setdefault(ref["digest"], dest)
                continue
            if dest.is_dir() and not dest.is_symlink():
                shutil.rmtree(dest)
            cache.copy_blob(ref["digest"], dest, ref["size"] if ref["digest"] in copied else None)
            copied.add(ref["digest"])
            placed.setdefault(ref["digest"], dest)
    data = json.dumps(manifest, sort_keys=True, indent=1).encode()
    if not ((out / MANIFEST).is_file() and (out / MANIFEST).read_bytes() == data):
        # Not synced, as the outputs beside it (BlobStore.copy_out): the directory is derived from the cache, and
        # a manifest lost in a crash differs from what the next build would write, which then writes it again
        atomic_write_bytes(out / MANIFEST, data, out / STAGING, durable=False, mode=umask_mode())
    _prune(out, keep | {STAGING})
    with contextlib.suppress(OSError):
        (out / STAGING).rmdir()  # only when empty: a concurrent build may be writing through it
