"""Builds a bundle's manifest: every graph with its records, artifacts, weights and toolchain, all path-free."""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neuronbuild import FORMAT_VERSION, __version__
from neuronbuild.analysis.action_graph import ActionGraph
from neuronbuild.analysis.providers import CompileTarget
from neuronbuild.cache.cas import CorruptBlob
from neuronbuild.cache.local import LocalCache
from neuronbuild.loading.labels import Label
from neuronbuild.runtime.layout import BUNDLE_FORMAT, DRAFT_WEIGHTS

CONSTANTS_OUTPUT = "constants.safetensors"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Member:
    """A file to put in the archive: its path inside the bundle and where its bytes come from."""

    path: str
    sha256: str
    size: int
    source: Path | None = None  # a verified CAS blob ...
    data: bytes | None = field(default=None, repr=False)  # ... or bytes made here (manifest, templates)


@dataclass(frozen=True)
class BundlePlan:
    """Everything a bundle holds: the manifest dict and its members (manifest.json excluded)."""

    label: Label
    manifest: Mapping[str, Any] = field(hash=False)
    members: tuple[Member, ...] = ()
    fingerprints: tuple[str, ...] = ()
    blob_digests: tuple[str, ...] = ()


class MissingResult(Exception):
    """A graph of the bundle is not in the cache (its build failed or was not run)."""


def _hash_blob(cache: LocalCache, digest: str) -> tuple[str, int]:
    """sha256 and size of a CAS blob, verifying its BLAKE3 digest on the way (a corrupt blob is evicted); a blob
    unchanged since an earlier bundle hashed it is not read again (BlobStore.known_sha256: a re-bundle of a model's
    weights costs no pass over them)."""
    import blake3

    known = cache.blobs.known_sha256(digest)
    if known is not None:
        return known
    path = cache.blobs.path(digest)
    sha, b3, size = hashlib.sha256(), blake3.blake3(), 0
    with open(path, "rb") as f:
        before = os.fstat(f.fileno())
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
            b3.update(chunk)
            size += len(chunk)
    if b3.hexdigest() != digest:
        cache.blobs.evict(digest)
        raise CorruptBlob(f"blob {digest[:16]} is corrupt (digest mismatch); evicted")
    cache.blobs.remember_sha256(digest, sha.hexdigest(), before)
    return sha.hexdigest(), size


_RANK_WEIGHTS = re.compile(r"rank_(0|[1-9][0-9]*)\.safetensors")


def _tp_entry(model: Any, artifacts: dict[str, Any]) -> dict[str, Any]:
    """A tensor-parallel graph's manifest entry: its degree, which artifact each rank loads, and how ranks hold
    inputs/outputs (callers hold them whole; the runtime splits and joins them)."""
    tp = dict(model.get("tp") or {})
    if int(tp.get("degree") or 1) <= 1:
        return {}
    ranks = sorted((n for n in artifacts if _RANK_WEIGHTS.fullmatch(n)), key=lambda n: int(n[5:-12]))
    return {"tp": tp | {"ranks": ranks}}


def plan_bundle(ag: ActionGraph, cache: LocalCache, label: Label, results: Mapping[str, Any]) -> BundlePlan:
    """Collect the bundle's graphs from the build's results (BuildResult.results; blobs from the cache: never
    compiles). MissingResult when a graph is not built."""
    lookup = results.get
    by_label: dict[Label, CompileTarget] = {ct.label: ct for ct in ag.compiles}
    hashed: dict[str, tuple[str, int]] = {}
    members: dict[str, Member] = {}
    graphs: list[dict[str, Any]] = []
    fingerprints: list[str] = []
    weights_models: dict[str, set[str]] = {}

    def add(digest: str, path_for: Any) -> dict[str, Any]:
        if digest not in hashed:
            hashed[digest] = _hash_blob(cache, digest)
        sha, size = hashed[digest]
        path = path_for(sha)
        members.setdefault(path, Member(path, sha, size, cache.blobs.path(digest)))
        return {"path": path, "sha256": sha, "size": size, "blake3": digest}

    # compile label -> the model_weights target it ships instead of (or, built without weights, as) its model's (#51)
    paired = dict(getattr(ag.bundles[label], "weights", ()))
    for src in ag.bundles[label].srcs:
        ct = by_label[src]
        wt = paired.get(src)
        wres = lookup(wt.action) if wt is not None else None
        if wt is not None and (wres is None or any(n not in wres.outputs for n in wt.outputs)):
            raise MissingResult(f"{wt.label} (the weights of {src}) is not built")
        model_label = ct.model
        for bucket, fp in ct.buckets:
            res = lookup(fp)
            if res is None:
                raise MissingResult(f"{src} [{bucket}] is not built")
            action = ag.actions[fp]
            trace = ag.trace_of(fp)
            traced = lookup(trace.fingerprint)
            traced_meta = traced.metadata if traced is not None else {}
            fingerprints += sorted(ag.closure(fp, ct.ships_of(fp)))
            gdir = f"graphs/{src.package}/{src.name}/{bucket.name}" if src.package else f"graphs/{src.name}/{bucket.name}"
            artifacts: dict[str, Any] = {}
            weights = None
            outs = ag.shipped_outputs(fp, lookup, ct.ships_of(fp))  # (+ its model's weights, shipped)
            if outs is None:
                raise MissingResult(f"{src} [{bucket}]: its model's weights are not built")
            if wt is not None and wres is not None:  # the bundle's weights target's file(s), not the model's own
                outs = {n: r for n, r in outs.items() if n != CONSTANTS_OUTPUT and not _RANK_WEIGHTS.fullmatch(n)}
                outs.update({n: wres.outputs[n] for n in wt.outputs})
                fingerprints.append(wt.action)
            for name, ref in sorted(outs.items()):
                if name == CONSTANTS_OUTPUT:
                    weights = add(ref.digest, lambda sha: f"weights/{sha}.safetensors")
                    weights_models.setdefault(weights["path"], set()).add(str(model_label))
                elif name == DRAFT_WEIGHTS:  # a fused speculation graph's draft weights: the draft's own file, once
                    artifacts[name] = add(ref.digest, lambda sha: f"weights/{sha}.safetensors")
                    weights_models.setdefault(artifacts[name]["path"], set()).add(str(_draft_of(trace.model)))
                elif _RANK_WEIGHTS.fullmatch(name):  # a tensor-parallel graph's shard: one directory per rank
                    artifacts[name] = add(ref.digest, lambda sha, name=name: f"weights/{name[:-12]}/{sha}.safetensors")
                    weights_models.setdefault(artifacts[name]["path"], set()).add(str(model_label))
                else:
                    artifacts[name] = add(ref.digest, lambda _sha, name=name, gdir=gdir: f"{gdir}/{name}")
            graphs.append({
                "label": str(src),
                "model": str(model_label),
                "bucket": bucket.as_dict(),
                "bucket_name": bucket.name,
                "target": {"platform": ct.platform, "isa": ct.target.get("isa")},
                "format": ct.artifact_format,
                "options": dict(ct.options_of(bucket.graph)),
                "tolerance": ct.tolerance,
                "fingerprint": fp,
                "record": dict(action.record),
                "trace_record": dict(trace.record),
                # positional order; a tensor-parallel graph's callers feed the whole model's inputs
                "inputs": [[k, v] for k, v in dict(trace.model.get("whole_inputs") or trace.model["inputs"]).items()],
                "outputs": list(traced_meta.get("outputs") or []),  # flattened outputs; dims that follow buckets
                "output_tree": traced_meta.get("output_tree") or "tuple",
                "toolchain": dict(action.versions),
                **({"graph": bucket.graph, "aliases": dict(trace.model.get("aliases") or {})} if bucket.graph
                   else {}),
                "artifacts": artifacts,
                "weights": weights,
                # the weights the graph binds (names -> [dtype, shape]; one rank's at tp > 1): deploy checks them
                **({"state": dict(traced_meta["state"])} if traced_meta.get("state") else {}),
                **({"weights_target": str(wt.label)} if wt is not None else {}),
                **_tp_entry(trace.model, artifacts),
            })
    manifest: dict[str, Any] = {
        "bundle_format": BUNDLE_FORMAT,
        "neuronbuild": {"version": __version__, "format": FORMAT_VERSION},
        "label": str(label),
        "graphs": graphs,
        "weights": {p: sorted(models) for p, models in sorted(weights_models.items())},
        "requirements": requirements(graphs),
    }
    return BundlePlan(label, manifest, tuple(members[p] for p in sorted(members)), tuple(dict.fromkeys(fingerprints)),
                      tuple(sorted(hashed)))


def _draft_of(model_record: Mapping[str, Any]) -> str:
    spec = (model_record.get("config") or {}).get("speculation") or {}
    return str(spec.get("draft") or "")


def requirements(graphs: list[dict[str, Any]]) -> dict[str, Any]:
    """What a host needs, summarised for operators (verify --host checks each graph)."""
    return {
        "torch": sorted({g["toolchain"].get("torch", "") for g in graphs}),
        "python": sorted({g["toolchain"].get("python", "") for g in graphs}),
        # A target with an ISA level (any toolchain writing x86-64 code: cpu, a plug-in's) needs that level; the others
        # need their platform's device.
        "cpu_isa": sorted({g["target"]["isa"] for g in graphs if g["target"].get("isa")}),
        "neuron_platforms": sorted({g["target"]["platform"] for g in graphs if not g["target"].get("isa")}),
    }


def with_files(manifest: Mapping[str, Any], members: list[Member]) -> bytes:
    """The final manifest.json bytes: the manifest plus the digest of every other member."""
    full = dict(manifest)
    full["files"] = {m.path: {"sha256": m.sha256, "size": m.size} for m in sorted(members, key=lambda m: m.path)}
    return (json.dumps(full, sort_keys=True, indent=1) + "\n").encode()
