"""Reading bundle archives safely (refusing hostile members) and installing them atomically into a deploy directory."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import shutil
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Any

from neuronbuild.atomic import atomic_write_bytes
from neuronbuild.runtime.layout import (
    DEPLOY_FORMAT,
    INDEX,
    MANIFEST,
    RELEASES,
    LayoutError,
    Manifest,
    parse_manifest,
    read_index,
)

_CHUNK = 1 << 20
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_GZIP_MAGIC = b"\x1f\x8b"
MAX_MEMBER_PATH = 400


class BundleError(Exception):
    """A bundle that is refused (malformed, hostile, tampered or truncated); the message is one user-facing line."""


@dataclass(frozen=True)
class Deployed:
    """The result of a deploy: the release id and directory, and whether it was already installed."""

    id: str
    dir: Path
    label: str
    files: int
    already: bool


def safe_member_path(name: str) -> str:
    """The member's path if it is a plain relative path inside the bundle; BundleError otherwise."""
    if not name or len(name) > MAX_MEMBER_PATH or "\x00" in name or "\\" in name:
        raise BundleError(f"refusing member {name!r}: bad path")
    if name.startswith("/"):
        raise BundleError(f"refusing member {name!r}: absolute path")
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise BundleError(f"refusing member {name!r}: path with '..', '.' or an empty component")
    return str(PurePosixPath(*parts))


@contextlib.contextmanager
def _decompressed(archive: Path) -> Iterator[IO[bytes]]:
    with open(archive, "rb") as raw:
        magic = raw.read(4)
        raw.seek(0)
        if magic.startswith(_ZSTD_MAGIC):
            import zstandard

            with zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True) as zr:
                yield zr  # type: ignore[misc]
        elif magic.startswith(_GZIP_MAGIC):
            import gzip

            with gzip.GzipFile(fileobj=raw, mode="rb") as gz:
                yield gz  # type: ignore[misc]
        else:
            raise BundleError(f"{archive.name}: not a bundle (neither zstd nor gzip data)")


def read_bundle(archive: Path, sink: Callable[[str, IO[bytes], int], tuple[str, int]]) -> tuple[Manifest, bytes]:
    """Stream every member through `sink(path, data, size) -> (sha256, size)` and check it against the manifest.

    manifest.json must come first; every other member must be a regular file listed there with its sha256 and
    size, and every listed file must be present. Links, devices, directories, absolute or '..' paths, duplicates
    and truncated or corrupt data are refused with BundleError."""
    archive = Path(archive)
    manifest: Manifest | None = None
    manifest_bytes = b""
    seen: set[str] = set()
    try:
        with _decompressed(archive) as stream, tarfile.open(fileobj=stream, mode="r|") as tar:
            for m in tar:
                path = safe_member_path(m.name)
                if not m.isreg():
                    kind = ("symlink" if m.issym() else "hard link" if m.islnk() else "directory" if m.isdir()
                            else "device" if (m.ischr() or m.isblk()) else "fifo" if m.isfifo() else "special file")
                    raise BundleError(f"refusing member {m.name!r}: {kind} (bundles hold regular files only)")
                if path in seen:
                    raise BundleError(f"refusing member {m.name!r}: appears twice")
                seen.add(path)
                f = tar.extractfile(m)
                assert f is not None
                if manifest is None:
                    if path != MANIFEST:
                        raise BundleError(f"{archive.name}: the first member must be {MANIFEST}, got {path!r}")
                    manifest_bytes = f.read()
                    if len(manifest_bytes) != m.size:
                        raise BundleError(f"{archive.name}: truncated archive (in {MANIFEST})")
                    manifest = parse_manifest(manifest_bytes, f"{archive.name}:{MANIFEST}")
                    _check_references(manifest)
                    sink(path, io.BytesIO(manifest_bytes), m.size)
                    continue
                ref = manifest.files.get(path)
                if ref is None:
                    raise BundleError(f"refusing member {path!r}: not listed in the manifest")
                if m.size != ref.size:
                    raise BundleError(f"{path}: size {m.size} differs from the manifest's {ref.size} (tampered)")
                sha, size = sink(path, f, m.size)
                if size != ref.size:
                    raise BundleError(f"{archive.name}: truncated archive (in {path})")
                if sha != ref.sha256:
                    raise BundleError(f"{path}: sha256 differs from the manifest (tampered or corrupt)")
            # The rest of the stream must decode (a cut-off zstd/gzip frame raises here).
            while stream.read(_CHUNK):
                pass
    except BundleError:
        raise
    except LayoutError as e:
        raise BundleError(str(e)) from None
    except (tarfile.TarError, EOFError, OSError, ValueError) as e:
        raise BundleError(f"{archive.name}: truncated or corrupt archive ({type(e).__name__}: {e})") from None
    except Exception as e:  # zstandard.ZstdError and friends
        if type(e).__module__.startswith("zstandard") or "zstd" in type(e).__name__.lower():
            raise BundleError(f"{archive.name}: truncated or corrupt archive ({e})") from None
        raise
    if manifest is None:
        raise BundleError(f"{archive.name}: empty or truncated archive (no {MANIFEST})")
    absent = sorted(set(manifest.files) - seen)
    if absent:
        raise BundleError(f"{archive.name}: truncated archive: {len(absent)} listed file(s) missing, e.g. {absent[0]}")
    return manifest, manifest_bytes


def _check_references(manifest: Manifest) -> None:
    for p in manifest.files:
        safe_member_path(p)
    for g in manifest.graphs:
        for ref in [*g.artifacts.values(), *([g.weights] if g.weights else [])]:
            listed = manifest.files.get(ref.path)
            if listed is None or listed.sha256 != ref.sha256 or listed.size != ref.size:
                raise BundleError(f"{MANIFEST}: {g.describe()} refers to {ref.path!r}, which the file list does not hold")


def _hash_only(_path: str, f: IO[bytes], _size: int) -> tuple[str, int]:
    h, n = hashlib.sha256(), 0
    while chunk := f.read(_CHUNK):
        h.update(chunk)
        n += len(chunk)
    return h.hexdigest(), n


def check_bundle(archive: Path) -> tuple[Manifest, bytes]:
    """Verify every digest of a bundle without writing anything."""
    return read_bundle(archive, _hash_only)


def _writer(root: Path) -> Callable[[str, IO[bytes], int], tuple[str, int]]:
    """A sink writing members under `root` (fresh, ours): parents created one by one, files O_EXCL|O_NOFOLLOW."""

    def sink(path: str, f: IO[bytes], _size: int) -> tuple[str, int]:
        parts = path.split("/")
        d = root
        for p in parts[:-1]:
            d = d / p
            with contextlib.suppress(FileExistsError):
                os.mkdir(d, 0o755)
            if d.is_symlink() or not d.is_dir():
                raise BundleError(f"refusing member {path!r}: its directory is not a plain directory")
        fd = os.open(d / parts[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        h, n = hashlib.sha256(), 0
        with os.fdopen(fd, "wb") as out:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
                out.write(chunk)
                n += len(chunk)
            out.flush()
            os.fsync(out.fileno())
        return h.hexdigest(), n

    return sink


def release_id(manifest_bytes: bytes) -> str:
    """A release is named by its manifest's digest (which covers every file's digest)."""
    return hashlib.sha256(manifest_bytes).hexdigest()[:24]


def deploy(archive: Path, dest: Path, expect_sha256: str | None = None) -> Deployed:
    """Install a bundle into `dest` atomically: on any failure `dest` is left exactly as it was."""
    archive, dest = Path(archive), Path(dest).absolute()
    if not archive.is_file():
        raise BundleError(f"no bundle at {archive}")
    if expect_sha256:
        with open(archive, "rb") as f:
            sha, _ = _hash_only("", f, 0)
        if sha != expect_sha256.strip().lower():
            raise BundleError(f"{archive.name}: sha256 {sha} differs from the expected {expect_sha256}")
    created = not dest.exists()
    if not created and not dest.is_dir():
        raise BundleError(f"{dest} exists and is not a directory")
    dest.mkdir(parents=True, exist_ok=True)
    created_releases = False
    staging: Path | None = None
    lock_fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)  # on the directory itself: no lock file is left behind
        index = read_index(dest)
        staging = Path(tempfile.mkdtemp(dir=dest, prefix=".staging-"))
        os.chmod(staging, 0o755)
        manifest, manifest_bytes = read_bundle(archive, _writer(staging))
        rid = release_id(manifest_bytes)
        target = dest / RELEASES / rid
        already = target.is_dir()
        if not already:
            created_releases = not (dest / RELEASES).exists()
            (dest / RELEASES).mkdir(exist_ok=True)
            os.rename(staging, target)
            staging = None
        entries = [{"id": rid, "label": manifest.label}] + [r for r in index if r.get("id") != rid]
        try:
            _write_index(dest, entries)
        except BaseException:
            if not already:
                shutil.rmtree(target, ignore_errors=True)
            raise
        _fsync_dir(dest)
        return Deployed(rid, target, manifest.label, len(manifest.files) + 1, already)
    except BaseException:
        if created_releases:
            shutil.rmtree(dest / RELEASES, ignore_errors=True)
        raise
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        os.close(lock_fd)
        if created:
            with contextlib.suppress(OSError):
                if not any(dest.iterdir()):
                    dest.rmdir()


def _write_index(dest: Path, entries: list[dict[str, Any]]) -> None:
    data = (json.dumps({"format": DEPLOY_FORMAT, "releases": entries}, indent=1, sort_keys=True) + "\n").encode()
    atomic_write_bytes(dest / INDEX, data, dest, mode=0o644)


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
