"""The bundle manifest and deployed-directory layout as read by production: names, versions, parsing, sha256.

Stdlib only: the build side (packaging/) writes what this module reads; production imports only this side."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

BUNDLE_FORMAT = 1  # bumped when the manifest's meaning changes; readers refuse other versions
MANIFEST = "manifest.json"
README = "README.md"
ENV_FILE = "neuronbuild.env"
INDEX = "neuronbuild-deploy.json"  # in a deployed directory: the installed releases, newest first
RELEASES = "releases"
DEPLOY_FORMAT = 1
_CHUNK = 1 << 20
MAX_MEMBER_PATH = 400
MAX_MANIFEST_BYTES = 64 << 20  # a manifest (or deploy index) larger than this is refused unread
MAX_JSON_DEPTH = 64  # deeper nesting than any manifest neuronbuild writes: refused before it can exhaust the stack
_TEXT_RE = re.compile(r"^[^\x00-\x1f\x7f]*$")  # no control characters (newlines, NUL, escapes) in names shown to users
_HEX_RE = re.compile(r"^[0-9a-f]{64}$")


# A fused speculation graph (hf_causal_lm speculation fused = True) binds two models' weights: the target's file
# (`weights`) under its own names and its draft model's file (this artifact, the draft's own weights file) under
# DRAFT_PREFIX (the graph's `draft` submodule).
DRAFT_WEIGHTS = "draft.constants.safetensors"
DRAFT_PREFIX = "draft."
PROGRAM_CONSTANTS = "program_constants.safetensors"  # a graph's own tensors (non-persistent buffers, lifted constants)


class LayoutError(ValueError):
    """A manifest or deployed directory that cannot be read; the message is user-facing."""


def sha256_of(f: IO[bytes]) -> tuple[str, int]:
    """sha256 and size of what `f` holds from where it is."""
    h, size = hashlib.sha256(), 0
    while chunk := f.read(_CHUNK):
        h.update(chunk)
        size += len(chunk)
    return h.hexdigest(), size


def sha256_file(path: Path) -> tuple[str, int]:
    with open(path, "rb") as f:
        return sha256_of(f)


@dataclass(frozen=True)
class FileRef:
    """One file of a bundle: its path inside the bundle, sha256 and size (+ its BLAKE3, which manifests give for graph
    artifacts and weights; the runtime verifies with it when present, see verified.py)."""

    path: str
    sha256: str
    size: int
    blake3: str | None = field(default=None, compare=False)  # the file list holds sha256 and size only


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
    format: str = ""  # the artifacts' format, named by the toolchain that built them (the key of its runtime loader)
    graph: str = ""  # the graph family (e.g. "context", "token"); "" for a one-graph model
    aliases: Mapping[str, str] = field(default_factory=dict, hash=False, compare=False)  # output -> input it updates
    # tensor parallelism: {"degree", "ranks": [the artifact each rank loads, by rank], "rank_dims", ...}; {} for one
    tp: Mapping[str, Any] = field(default_factory=dict, hash=False, compare=False)
    # the weights it binds: name -> (dtype, shape), one rank's at tp > 1 ({} in bundles made before #51)
    state: Mapping[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict, hash=False, compare=False)

    @property
    def rank_weights(self) -> list[FileRef]:
        """The weights shard of each rank of a tensor-parallel graph, in rank order ([] otherwise)."""
        return [self.artifacts[str(n)] for n in self.tp.get("ranks") or ()]

    @property
    def key(self) -> tuple[str, str]:
        return (self.label, self.bucket_name)

    @property
    def identity(self) -> tuple[str, str, tuple[str, ...]]:
        """What serves the same results: the graph (its fingerprint) with the same weights (by content). Two models
        with identical graphs and different checkpoints share the fingerprint, never the identity."""
        return (self.fingerprint, self.weights.sha256 if self.weights else "",
                tuple(ref.sha256 for ref in self.rank_weights))

    @property
    def toolchain(self) -> Mapping[str, str]:
        tc = self.record.get("toolchain")
        return tc if isinstance(tc, Mapping) else {}

    def describe(self) -> str:
        dims = ", ".join(f"{k}={v}" for k, v in self.bucket.items())
        return f"{self.label} [{self.graph}: {dims}]" if self.graph else f"{self.label} [{dims}]"


@dataclass(frozen=True)
class Manifest:
    """A parsed bundle manifest."""

    label: str
    graphs: tuple[Graph, ...]
    files: Mapping[str, FileRef] = field(hash=False)
    raw: Mapping[str, Any] = field(hash=False, compare=False)

    def labels(self) -> list[str]:
        return list(dict.fromkeys(g.label for g in self.graphs))


def safe_path(name: str) -> str:
    """`name` if it is a plain relative path inside a release ('a/b/c', no '..', '.', empty or absolute parts, no
    backslashes or control characters); LayoutError otherwise."""
    if not isinstance(name, str) or not name or len(name) > MAX_MEMBER_PATH or "\\" in name \
            or not _TEXT_RE.match(name):
        raise LayoutError(f"refusing member {str(name)[:100]!r}: bad path")
    if name.startswith("/"):
        raise LayoutError(f"refusing member {name!r}: absolute path")
    if any(p in ("", ".", "..") for p in name.split("/")):
        raise LayoutError(f"refusing member {name!r}: path with '..', '.' or an empty component")
    return name


def json_depth_ok(data: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether JSON text nests at most `limit` deep (counted over brackets outside strings; one linear pass)."""
    depth, in_str, esc = 0, False, False
    for ch in data.decode("utf-8", "replace") if isinstance(data, bytes | bytearray) else data:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return False
        elif ch in "]}":
            depth -= 1
    return True


def load_json(data: bytes, source: str, what: str) -> Any:
    """json.loads with the size and depth limits every manifest/index/record reader uses; LayoutError otherwise."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise LayoutError(f"{source}: {what} larger than {MAX_MANIFEST_BYTES} bytes")
    if not json_depth_ok(data):
        raise LayoutError(f"{source}: {what} nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:
        raise LayoutError(f"{source}: {what} is not JSON ({str(e)[:200]})") from None


def _text(v: Any, what: str) -> str:
    s = str(v)
    if not _TEXT_RE.match(s) or len(s) > 1000:
        raise ValueError(f"{what} {s[:100]!r} holds control characters or is too long")
    return s


def _ref(d: Mapping[str, Any]) -> FileRef:
    sha = str(d["sha256"])
    if not _HEX_RE.match(sha):
        raise ValueError(f"bad sha256 {sha[:80]!r}")
    size = int(d["size"])
    if size < 0:
        raise ValueError("negative size")
    b3 = d.get("blake3")
    if b3 is not None and not (isinstance(b3, str) and _HEX_RE.match(b3)):
        raise ValueError(f"bad blake3 {str(b3)[:80]!r}")
    return FileRef(safe_path(d["path"]), sha, size, b3)


def _aliases(v: Any) -> dict[str, str]:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ValueError("aliases must be a dict of output name -> input name")
    return {_text(k, "alias"): _text(x, "alias") for k, x in v.items()}


def _state(v: Any) -> dict[str, tuple[str, tuple[int, ...]]]:
    """A graph's `state` entry: {name: [dtype, [dims]]}."""
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ValueError("state must be a dict of name -> [dtype, shape]")
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for k, x in v.items():
        if not (isinstance(x, list) and len(x) == 2 and isinstance(x[1], list) and
                all(isinstance(d, int) and not isinstance(d, bool) for d in x[1])):
            raise ValueError(f"state {k!r} must be [dtype, shape]")
        out[_text(k, "state name")] = (_text(x[0], "dtype"), tuple(x[1]))
    return out


def parse_manifest(data: bytes | Mapping[str, Any], source: str = MANIFEST) -> Manifest:
    """Parse manifest JSON (bytes or an already decoded dict); LayoutError on anything unexpected."""
    raw = load_json(bytes(data), source, "manifest") if isinstance(data, bytes | bytearray) else dict(data)
    if not isinstance(raw, dict) or raw.get("bundle_format") != BUNDLE_FORMAT:
        got = raw.get("bundle_format") if isinstance(raw, dict) else None
        raise LayoutError(f"{source}: unsupported bundle format {got!r} (this runtime reads {BUNDLE_FORMAT})")
    try:
        graphs = tuple(
            Graph(
                label=_text(g["label"], "label"), model=_text(g["model"], "model"), bucket=dict(g["bucket"]),
                bucket_name=_text(g["bucket_name"], "bucket name"),
                platform=str(g["target"]["platform"]), isa=g["target"].get("isa"), options=dict(g["options"]),
                fingerprint=str(g["fingerprint"]), record=dict(g["record"]), trace_record=dict(g["trace_record"]),
                inputs=dict(g["inputs"]), outputs=tuple(dict(o) for o in g.get("outputs") or ()),
                output_tree=str(g.get("output_tree") or "tuple"), artifacts={k: _ref(v) for k, v in g["artifacts"].items()},
                weights=_ref(g["weights"]) if g.get("weights") else None, tolerance=float(g["tolerance"]),
                format=_text(g["format"], "format"),
                graph=_text(g.get("graph") or "", "graph"), aliases=_aliases(g.get("aliases")),
                tp=dict(g.get("tp") or {}), state=_state(g.get("state")),
            )
            for g in raw["graphs"]
        )
        files = {safe_path(p): _ref({**v, "path": p}) for p, v in raw["files"].items()}
        label = _text(raw["label"], "label")
        for g in graphs:
            for ref in [*g.artifacts.values(), *([g.weights] if g.weights else [])]:
                if files.get(ref.path) != ref:
                    raise ValueError(f"{g.describe()} refers to {ref.path!r}, which the file list does not hold")
    except LayoutError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as e:
        raise LayoutError(f"{source}: malformed manifest ({type(e).__name__}: {str(e)[:300]})") from None
    return Manifest(label, graphs, files, raw)


def read_manifest_bytes(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as e:
        raise LayoutError(f"cannot read manifest {path}: {e.strerror or e}") from None


def read_manifest(path: Path) -> Manifest:
    return parse_manifest(read_manifest_bytes(Path(path)), str(path))


@dataclass(frozen=True)
class Release:
    """One installed bundle in a deployed directory."""

    id: str
    label: str
    dir: Path
    manifest: Manifest
    manifest_bytes: bytes = field(default=b"", repr=False, compare=False)  # exactly what `manifest` was parsed from


def read_index(root: Path) -> list[dict[str, Any]]:
    """The deployed directory's index entries, newest first ([] when nothing is deployed)."""
    p = Path(root) / INDEX
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise LayoutError(f"{p}: unreadable deploy index ({e.strerror or e})") from None
    data = load_json(raw, str(p), "deploy index")
    if not isinstance(data, dict) or data.get("format") != DEPLOY_FORMAT or not isinstance(data.get("releases"), list):
        raise LayoutError(f"{p}: unsupported deploy index format")
    out = []
    for r in data["releases"]:
        if not isinstance(r, dict) or not isinstance(r.get("id"), str) or not isinstance(r.get("label", ""), str):
            raise LayoutError(f"{p}: malformed deploy index entry {str(r)[:100]!r}")
        out.append(dict(r))
    return out


def read_releases(root: Path) -> list[Release]:
    root = Path(root)
    out = []
    for r in read_index(root):
        rid = str(r.get("id", ""))
        if not re.match(r"^[0-9a-f]{1,64}$", rid):
            raise LayoutError(f"{root / INDEX}: bad release id {rid[:80]!r}")
        d = root / RELEASES / rid
        data = read_manifest_bytes(d / MANIFEST)
        out.append(Release(rid, _text_or_empty(r.get("label", "")), d, parse_manifest(data, str(d / MANIFEST)), data))
    return out


def _text_or_empty(v: Any) -> str:
    s = str(v)
    return s if _TEXT_RE.match(s) else repr(s)
