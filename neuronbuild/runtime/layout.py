"""The bundle manifest and deployed-directory layout as read by production: names, versions, parsing, sha256.

Stdlib only: the build side (packaging/) writes what this module reads; production imports only this side."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BUNDLE_FORMAT = 1  # bumped when the manifest's meaning changes; readers refuse other versions
MANIFEST = "manifest.json"
README = "README.md"
ENV_FILE = "neuronbuild.env"
INDEX = "neuronbuild-deploy.json"  # in a deployed directory: the installed releases, newest first
RELEASES = "releases"
DEPLOY_FORMAT = 1
_CHUNK = 1 << 20


class LayoutError(ValueError):
    """A manifest or deployed directory that cannot be read; the message is user-facing."""


def sha256_file(path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


@dataclass(frozen=True)
class FileRef:
    """One file of a bundle: its path inside the bundle, sha256 and size."""

    path: str
    sha256: str
    size: int


AOTI_FORMAT = "aoti"  # AOTInductor packages (the cpu toolchain's artifact format)


@dataclass(frozen=True)
class Graph:
    """One compiled graph (a compile target at one bucket) as the manifest describes it."""

    label: str
    model: str
    bucket: Mapping[str, int] = field(hash=False)
    bucket_name: str = ""
    platform: str = ""
    isa: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict, hash=False, compare=False)
    fingerprint: str = ""
    record: Mapping[str, Any] = field(default_factory=dict, hash=False, compare=False)
    trace_record: Mapping[str, Any] = field(default_factory=dict, hash=False, compare=False)
    inputs: Mapping[str, Any] = field(default_factory=dict, hash=False, compare=False)  # name -> spec, in order
    outputs: tuple[Mapping[str, Any], ...] = field(default=(), hash=False, compare=False)  # flattened, in order
    output_tree: str = "tuple"  # "tensor" when the model returned one bare tensor
    artifacts: Mapping[str, FileRef] = field(default_factory=dict, hash=False, compare=False)
    weights: FileRef | None = None
    tolerance: float = 1e-4
    format: str = ""  # the artifacts' format, named by the toolchain that built them ("aoti", "neuron-lowered", ...)

    @property
    def key(self) -> tuple[str, str]:
        return (self.label, self.bucket_name)

    @property
    def toolchain(self) -> Mapping[str, str]:
        tc = self.record.get("toolchain")
        return tc if isinstance(tc, Mapping) else {}

    def describe(self) -> str:
        return f"{self.label} [{', '.join(f'{k}={v}' for k, v in self.bucket.items())}]"


@dataclass(frozen=True)
class Manifest:
    """A parsed bundle manifest."""

    label: str
    graphs: tuple[Graph, ...]
    files: Mapping[str, FileRef] = field(hash=False)
    raw: Mapping[str, Any] = field(hash=False, compare=False)

    def labels(self) -> list[str]:
        return list(dict.fromkeys(g.label for g in self.graphs))


def _ref(d: Mapping[str, Any]) -> FileRef:
    return FileRef(str(d["path"]), str(d["sha256"]), int(d["size"]))


def parse_manifest(data: bytes | Mapping[str, Any], source: str = MANIFEST) -> Manifest:
    """Parse manifest JSON (bytes or an already decoded dict); LayoutError on anything unexpected."""
    try:
        raw = json.loads(data) if isinstance(data, bytes | bytearray) else dict(data)
    except ValueError as e:
        raise LayoutError(f"{source}: not JSON ({e})") from None
    if not isinstance(raw, dict) or raw.get("bundle_format") != BUNDLE_FORMAT:
        got = raw.get("bundle_format") if isinstance(raw, dict) else None
        raise LayoutError(f"{source}: unsupported bundle format {got!r} (this runtime reads {BUNDLE_FORMAT})")
    try:
        graphs = tuple(
            Graph(
                label=str(g["label"]), model=str(g["model"]), bucket=dict(g["bucket"]), bucket_name=str(g["bucket_name"]),
                platform=str(g["target"]["platform"]), isa=g["target"].get("isa"), options=dict(g["options"]),
                fingerprint=str(g["fingerprint"]), record=dict(g["record"]), trace_record=dict(g["trace_record"]),
                inputs=dict(g["inputs"]), outputs=tuple(dict(o) for o in g.get("outputs") or ()),
                output_tree=str(g.get("output_tree") or "tuple"), artifacts={k: _ref(v) for k, v in g["artifacts"].items()},
                weights=_ref(g["weights"]) if g.get("weights") else None, tolerance=float(g["tolerance"]),
                format=str(g.get("format") or ("aoti" if "model.pt2" in g["artifacts"] else "neuron-lowered")),
            )
            for g in raw["graphs"]
        )
        files = {p: FileRef(p, str(v["sha256"]), int(v["size"])) for p, v in raw["files"].items()}
        label = str(raw["label"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise LayoutError(f"{source}: malformed manifest ({type(e).__name__}: {e})") from None
    return Manifest(label, graphs, files, raw)


def read_manifest(path: Path) -> Manifest:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise LayoutError(f"cannot read manifest {path}: {e.strerror or e}") from None
    return parse_manifest(data, str(path))


@dataclass(frozen=True)
class Release:
    """One installed bundle in a deployed directory."""

    id: str
    label: str
    dir: Path
    manifest: Manifest


def read_index(root: Path) -> list[dict[str, Any]]:
    """The deployed directory's index entries, newest first ([] when nothing is deployed)."""
    p = Path(root) / INDEX
    try:
        data = json.loads(p.read_bytes())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as e:
        raise LayoutError(f"{p}: unreadable deploy index ({e})") from None
    if not isinstance(data, dict) or data.get("format") != DEPLOY_FORMAT or not isinstance(data.get("releases"), list):
        raise LayoutError(f"{p}: unsupported deploy index format")
    return [dict(r) for r in data["releases"]]


def read_releases(root: Path) -> list[Release]:
    root = Path(root)
    out = []
    for r in read_index(root):
        rid = str(r.get("id", ""))
        if not rid or "/" in rid or rid.startswith("."):
            raise LayoutError(f"{root / INDEX}: bad release id {rid!r}")
        d = root / RELEASES / rid
        out.append(Release(rid, str(r.get("label", "")), d, read_manifest(d / MANIFEST)))
    return out
