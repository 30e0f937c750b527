"""Writes neuron_bundle archives: reproducible tar (+zstd or gzip) of manifest, artifacts, weights and operator docs."""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import re
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from neuronbuild.analysis.action_graph import ActionGraph
from neuronbuild.atomic import atomic_write_bytes, atomic_writer
from neuronbuild.cache.cas import umask_mode
from neuronbuild.cache.local import LocalCache
from neuronbuild.errors import UserInputError
from neuronbuild.loading.labels import Label
from neuronbuild.loading.target_graph import TargetGraph
from neuronbuild.packaging.envfile import render_env
from neuronbuild.packaging.manifest import BundlePlan, Member, MissingResult, plan_bundle, with_files
from neuronbuild.runtime.layout import ENV_FILE, MANIFEST, README, sha256_file
from neuronbuild.runtime.signing import SIGNATURE, SignatureError, sign_manifest
from neuronbuild.workspace import OUTPUT_DIR

# Compression level chosen per member: weights (`weights/`) are floats that hardly compress (bf16: ~0.78 at any
# level), so they take a fast level at disk speed; graphs, HLO, manifests and docs are small and compress well, so they
# take a high level with long-distance matching over a 128 MiB window (the default decoder limit). Each run of members
# with one level is its own zstd (or gzip) frame; deploy reads across frames.
FAST, HIGH = "fast", "high"
ZSTD_LEVELS = {FAST: 1, HIGH: 10}
GZIP_LEVELS = {FAST: 1, HIGH: 9}
ZSTD_WINDOW_LOG = 27
# zstd's multi-threaded mode: its output is the same for any number of workers >= 1 (and any write sizes), so the
# bytes never depend on the machine. Jobs of the high level are capped so memory stays bounded on many-core hosts.
ZSTD_MAX_THREADS = 8
ZSTD_HIGH_JOB_SIZE = 32 << 20
SUFFIX = {"zstd": ".tar.zst", "gzip": ".tar.gz"}


@dataclass(frozen=True)
class BundleOutput:
    """A written (or already up-to-date) bundle."""

    label: Label
    archive: Path
    sha256: str
    size: int
    written: bool


def bundle_paths(root: Path, label: Label, compression: str) -> tuple[Path, Path, Path]:
    """(archive, manifest copy, sha256 file) under neuronbuild-out/<package>/."""
    base = root / OUTPUT_DIR / label.package
    archive = base / f"{label.name}{SUFFIX[compression]}"
    return archive, base / f"{label.name}.manifest.json", Path(f"{archive}.sha256")


def render_docs(manifest: dict[str, Any]) -> dict[str, bytes]:
    """README.md rendered from its jinja2 template and neuronbuild.env (envfile.render_env); inputs: the manifest."""
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(Path(__file__).resolve().parent / "templates")),
        undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False,
    )
    ctx = dict(manifest)
    ctx["labels"] = list(dict.fromkeys(g["label"] for g in manifest["graphs"]))
    return {README: env.get_template("README.md.j2").render(**ctx).encode(), ENV_FILE: render_env(manifest)}


def _tarinfo(path: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(path)
    info.size = size
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    return info


def member_level(path: str) -> str:
    """FAST for weights files, HIGH for everything else (graphs, HLO, params, manifest, signature, docs)."""
    return FAST if path.startswith("weights/") else HIGH


def zstd_threads() -> int:
    """Worker threads for zstd: the host's CPUs, at least 1 (multi-threaded mode) and at most ZSTD_MAX_THREADS."""
    return max(1, min(os.cpu_count() or 1, ZSTD_MAX_THREADS))


class _FramedWriter:
    """A write-only stream that compresses into `out`, one frame per run of writes at one level (`level()`).

    tarfile writes to it unbuffered in "w" mode (header, data, padding per member), so a member's bytes are all in
    the frame chosen before it; tell() is the uncompressed offset tarfile keeps its blocks aligned to."""

    def __init__(self, out: IO[bytes], compression: str) -> None:
        self._out = out
        self._compression = compression
        self._level: str | None = None
        self._frame: Any = None
        self._pos = 0

    def level(self, level: str) -> None:
        if level == self._level:
            return
        self._end_frame()
        self._level = level
        if self._compression == "gzip":
            self._frame = gzip.GzipFile(filename="", mode="wb", fileobj=self._out, mtime=0,
                                        compresslevel=GZIP_LEVELS[level])
            return
        import zstandard

        extra: dict[str, Any] = (dict(window_log=ZSTD_WINDOW_LOG, enable_ldm=True, job_size=ZSTD_HIGH_JOB_SIZE)
                                 if level == HIGH else {})
        params = zstandard.ZstdCompressionParameters.from_level(ZSTD_LEVELS[level], threads=zstd_threads(), **extra)
        self._frame = zstandard.ZstdCompressor(compression_params=params).stream_writer(self._out, closefd=False)

    def write(self, data: bytes) -> int:
        assert self._frame is not None, "level() first"
        self._frame.write(data)
        self._pos += len(data)
        return len(data)

    def tell(self) -> int:
        return self._pos

    def _end_frame(self) -> None:
        if self._frame is not None:
            self._frame.close()  # ends the frame; `out` stays open (closefd=False / fileobj given)
            self._frame = None

    def close(self) -> None:
        self._end_frame()


def write_archive(dest: IO[bytes], manifest_bytes: bytes, members: list[Member], compression: str,
                  signature: bytes | None = None) -> None:
    """manifest.json first (deploy reads it before anything else), its signature (if signed), then members sorted;
    each member compressed at its level (member_level)."""
    stream = _FramedWriter(dest, compression)
    stream.level(HIGH)
    tar = tarfile.TarFile(fileobj=stream, mode="w", format=tarfile.USTAR_FORMAT)  # type: ignore[arg-type]
    tar.addfile(_tarinfo(MANIFEST, len(manifest_bytes)), io.BytesIO(manifest_bytes))
    if signature is not None:
        tar.addfile(_tarinfo(SIGNATURE, len(signature)), io.BytesIO(signature))
    for m in sorted(members, key=lambda m: m.path):
        stream.level(member_level(m.path))
        if m.data is not None:
            tar.addfile(_tarinfo(m.path, m.size), io.BytesIO(m.data))
        else:
            assert m.source is not None
            with open(m.source, "rb") as f:
                tar.addfile(_tarinfo(m.path, m.size), f)
    stream.level(HIGH)  # the end-of-archive blocks
    tar.close()
    stream.close()


class _HashingWriter:
    """Writes through to `out`, hashing what passes (sha256)."""

    def __init__(self, out: IO[bytes]) -> None:
        self._out = out
        self.sha256 = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        return self._out.write(data)

    def flush(self) -> None:
        self._out.flush()


def pin_name(root: Path, label: Label) -> str:
    """One pin per (workspace, bundle label): rebuilding a bundle moves its pin to the new contents."""
    ws = hashlib.sha256(str(root).encode()).hexdigest()[:10]
    return "bundle-" + re.sub(r"[^A-Za-z0-9_.-]", "_", f"{label.package}__{label.name}") + f"-{ws}"


def write_pin(cache: LocalCache, name: str, plan: BundlePlan) -> Path:
    """<cache>/v1/pins/<name>.json = {"fingerprints": [...], "digests": [...]}: what GC must keep for this bundle."""
    data = json.dumps({"fingerprints": list(plan.fingerprints), "digests": list(plan.blob_digests)},
                      sort_keys=True, indent=1).encode()
    dest = cache.root / "pins" / f"{name}.json"
    if not (dest.is_file() and dest.read_bytes() == data):
        atomic_write_bytes(dest, data, cache.root / "tmp")
    return dest


def build_bundle(root: Path, ag: ActionGraph, cache: LocalCache, label: Label, results: Mapping[str, Any],
                 key: Path | None = None) -> BundleOutput:
    """Write the bundle from the build's results (BuildResult.results; never compiles); skipped when the archive is
    already up to date. `key`: the private key its manifest is signed with (the command's --signing-key), or None."""
    compression = ag.bundles[label].compression
    plan = plan_bundle(ag, cache, label, results)
    docs = render_docs(dict(plan.manifest))
    members = list(plan.members) + [Member(p, hashlib.sha256(b).hexdigest(), len(b), None, b) for p, b in docs.items()]
    manifest_bytes = with_files(plan.manifest, members)
    archive, manifest_copy, sha_file = bundle_paths(root, label, compression)
    try:
        signature = sign_manifest(manifest_bytes, key) if key is not None else None
    except SignatureError as e:
        raise UserInputError(f"bundle {label}: {e}") from None
    sig_copy = Path(f"{manifest_copy}.sig")
    write_pin(cache, pin_name(root, label), plan)
    with contextlib.suppress(OSError, ValueError, IndexError):
        if manifest_copy.read_bytes() == manifest_bytes and (
                sig_copy.read_bytes() == signature if signature is not None else not sig_copy.exists()):
            recorded = sha_file.read_text().split()[0]
            if archive.is_file() and sha256_file(archive)[0] == recorded:
                return BundleOutput(label, archive, recorded, archive.stat().st_size, False)
    archive.parent.mkdir(parents=True, exist_ok=True)
    mode = umask_mode()
    with atomic_writer(archive, mode=mode, prefix=f".{archive.name}.") as out:
        hashing = _HashingWriter(out)  # the archive's sha256 as it is written (not read back: ~1x the weights)
        write_archive(hashing, manifest_bytes, members, compression, signature)  # type: ignore[arg-type]
        out.flush()
        digest = hashing.sha256.hexdigest()
    atomic_write_bytes(manifest_copy, manifest_bytes, archive.parent / ".tmp", mode=mode)
    if signature is not None:
        atomic_write_bytes(sig_copy, signature, archive.parent / ".tmp", mode=mode)
    else:
        with contextlib.suppress(FileNotFoundError):
            sig_copy.unlink()
    atomic_write_bytes(sha_file, f"{digest}  {archive.name}\n".encode(), archive.parent / ".tmp", mode=mode)
    with contextlib.suppress(OSError):
        (archive.parent / ".tmp").rmdir()
    return BundleOutput(label, archive, digest, archive.stat().st_size, True)


def build_bundles(root: Path, graph: TargetGraph, ag: ActionGraph, cache: LocalCache, results: Mapping[str, Any],
                  signing_key: Path | None = None) -> tuple[list[BundleOutput], list[str]]:
    """Every requested neuron_bundle whose graphs all built (have `results`); returns (outputs, one line per skipped
    bundle)."""
    outs: list[BundleOutput] = []
    skipped: list[str] = []
    for lbl in graph.requested:
        if lbl not in ag.bundles:  # (a bundle's analysis registers it; other requested targets are not bundles)
            continue
        try:
            outs.append(build_bundle(root, ag, cache, lbl, results, signing_key))
        except MissingResult as e:
            skipped.append(f"bundle {lbl} not written: {e}")
    return outs, skipped
