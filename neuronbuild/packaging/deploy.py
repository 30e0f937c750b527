"""Reading bundle archives safely (refusing hostile members) and installing them atomically into a deploy directory."""

from __future__ import annotations

import contextlib
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
from typing import IO

from neuronbuild.atomic import atomic_write_bytes, fsync_path, try_lock, unlock
from neuronbuild.packaging.envfile import EnvFileError, render_env
from neuronbuild.runtime.layout import (
    DEPLOY_FORMAT,
    ENV_FILE,
    INDEX,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    RELEASES,
    LayoutError,
    Manifest,
    parse_manifest,
    read_index,
    safe_path,
    sha256_file,
    sha256_of,
)
from neuronbuild.runtime.signing import MAX_SIGNATURE_BYTES, SIGNATURE, SignatureError, TrustedKey, verify_manifest
from neuronbuild.runtime.verified import BadWeights, weights_mismatch

_CHUNK = 1 << 20
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_GZIP_MAGIC = b"\x1f\x8b"
MAX_HEADER_BYTES = 64 << 10  # GNU long-name and PAX extended headers: more than any path neuronbuild writes
MAX_TRAILING_BYTES = 2 * tarfile.RECORDSIZE  # zero padding after the end-of-archive marker; anything else is refused
STAGING_PREFIX = ".staging-"


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
    repaired: bool = False  # the release was installed but damaged; its files were replaced
    downgraded_from: str | None = None  # the release of this label it replaced as current, deployed after this one


def safe_member_path(name: str) -> str:
    """The member's path if it is a plain relative path inside the bundle; BundleError otherwise."""
    try:
        return str(PurePosixPath(safe_path(name)))
    except LayoutError as e:
        raise BundleError(str(e)) from None


class _CappedTarInfo(tarfile.TarInfo):
    """Tar headers whose GNU long-name/long-link or PAX extended data is larger than MAX_HEADER_BYTES are refused
    before that data is read (tarfile would otherwise read it whole into memory)."""

    def _proc_gnulong(self, tarfile: tarfile.TarFile) -> tarfile.TarInfo:  # type: ignore[override]
        if self.size > MAX_HEADER_BYTES:
            raise BundleError(f"refusing a GNU long-name header of {self.size} bytes (limit {MAX_HEADER_BYTES})")
        return super()._proc_gnulong(tarfile)  # type: ignore[misc, no-any-return]

    def _proc_pax(self, tarfile: tarfile.TarFile) -> tarfile.TarInfo:  # type: ignore[override]
        if self.size > MAX_HEADER_BYTES:
            raise BundleError(f"refusing a PAX header of {self.size} bytes (limit {MAX_HEADER_BYTES})")
        return super()._proc_pax(tarfile)  # type: ignore[misc, no-any-return]


def check_env_file(manifest: Manifest) -> None:
    """neuronbuild.env must be exactly what neuronbuild writes for this manifest (operators source it)."""
    ref = manifest.files.get(ENV_FILE)
    try:
        expected = render_env(manifest.raw)
    except EnvFileError as e:
        raise BundleError(str(e)) from None
    except (KeyError, TypeError, AttributeError) as e:
        raise BundleError(f"{MANIFEST}: malformed manifest ({type(e).__name__}: {str(e)[:200]})") from None
    if ref is None or ref.sha256 != hashlib.sha256(expected).hexdigest() or ref.size != len(expected):
        raise BundleError(f"refusing {ENV_FILE}: it differs from what neuronbuild writes for this manifest "
                          "(operators source this file)")


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


def read_bundle(archive: Path, sink: Callable[[str, IO[bytes], int], tuple[str, int]],
                trusted_keys: list[TrustedKey] | None = None,
                on_manifest: Callable[[Manifest], None] | None = None) -> tuple[Manifest, bytes]:
    """Stream every member through `sink(path, data, size) -> (sha256, size)` and check it against the manifest.

    manifest.json must come first (at most MAX_MANIFEST_BYTES), then optionally its signature; every other member
    must be a regular file listed there with its sha256 and size, and every listed file must be present. With
    `trusted_keys`, the manifest must be signed by one of them, checked before any other member is read.
    `on_manifest` is called once the manifest is accepted (e.g. to check free space). Links, devices, directories,
    absolute or '..' paths, duplicates, oversized headers, trailing data and truncated or corrupt data are refused
    with BundleError."""
    archive = Path(archive)
    manifest: Manifest | None = None
    manifest_bytes = b""
    signature: bytes | None = None
    accepted = False
    seen: set[str] = set()

    def accept() -> None:
        nonlocal accepted
        assert manifest is not None
        if trusted_keys is not None:
            try:
                verify_manifest(manifest_bytes, signature, trusted_keys, archive.name)
            except SignatureError as e:
                raise BundleError(str(e)) from None
        check_env_file(manifest)
        if on_manifest is not None:
            on_manifest(manifest)
        sink(MANIFEST, io.BytesIO(manifest_bytes), len(manifest_bytes))
        if signature is not None:
            sink(SIGNATURE, io.BytesIO(signature), len(signature))
        accepted = True

    try:
        with _decompressed(archive) as stream, \
                tarfile.open(fileobj=stream, mode="r|", tarinfo=_CappedTarInfo) as tar:
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
                    if m.size > MAX_MANIFEST_BYTES:
                        raise BundleError(f"{archive.name}: {MANIFEST} is {m.size} bytes (limit {MAX_MANIFEST_BYTES})")
                    manifest_bytes = f.read(m.size)
                    if len(manifest_bytes) != m.size:
                        raise BundleError(f"{archive.name}: truncated archive (in {MANIFEST})")
                    manifest = parse_manifest(manifest_bytes, f"{archive.name}:{MANIFEST}")  # (checks references)
                    continue
                if path == SIGNATURE and not accepted and signature is None:
                    if m.size > MAX_SIGNATURE_BYTES:
                        raise BundleError(f"{archive.name}: {SIGNATURE} is {m.size} bytes (limit {MAX_SIGNATURE_BYTES})")
                    signature = f.read(m.size)
                    continue
                if not accepted:
                    accept()
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
            if manifest is not None and not accepted:
                accept()
            # Only the end-of-archive padding may follow, and the compressed stream must end there (a cut-off
            # frame raises; extra frames of data are refused without decompressing them all).
            trailing = 0
            while chunk := stream.read(_CHUNK if trailing == 0 else MAX_TRAILING_BYTES):
                trailing += len(chunk)
                if trailing > MAX_TRAILING_BYTES or chunk.count(0) != len(chunk):
                    raise BundleError(f"{archive.name}: refusing trailing data after the end of the archive")
    except BundleError:
        raise
    except LayoutError as e:
        raise BundleError(str(e)) from None
    except (tarfile.TarError, EOFError, OSError, ValueError) as e:
        raise BundleError(f"{archive.name}: truncated or corrupt archive ({type(e).__name__}: {str(e)[:200]})") from None
    except Exception as e:  # zstandard.ZstdError and friends
        if type(e).__module__.startswith("zstandard") or "zstd" in type(e).__name__.lower():
            raise BundleError(f"{archive.name}: truncated or corrupt archive ({str(e)[:200]})") from None
        raise
    if manifest is None:
        raise BundleError(f"{archive.name}: empty or truncated archive (no {MANIFEST})")
    absent = sorted(set(manifest.files) - seen)
    if absent:
        raise BundleError(f"{archive.name}: truncated archive: {len(absent)} listed file(s) missing, e.g. {absent[0]}")
    return manifest, manifest_bytes


def check_bundle(archive: Path, trusted_keys: list[TrustedKey] | None = None) -> tuple[Manifest, bytes]:
    """Verify every digest (and, with trusted keys, the signature) of a bundle without writing anything."""
    return read_bundle(archive, lambda _path, f, _size: sha256_of(f), trusted_keys)


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


def _damaged(release_dir: Path, manifest: Manifest, manifest_bytes: bytes) -> list[str]:
    """Files of an installed release that are missing or differ from its manifest (hashing every byte)."""
    bad = []
    try:
        if (release_dir / MANIFEST).is_symlink() or (release_dir / MANIFEST).read_bytes() != manifest_bytes:
            bad.append(MANIFEST)
    except OSError:
        bad.append(MANIFEST)
    for ref in manifest.files.values():
        p = release_dir / ref.path
        try:
            if p.is_symlink() or (ref.size, ref.sha256) != sha256_file(p)[::-1]:
                bad.append(ref.path)
        except OSError:
            bad.append(ref.path)
    return bad


def _reclaim_staging(dest: Path) -> None:
    """Remove staging directories left by deploys that were killed (we hold the directory's exclusive lock, so no
    other deploy is using one)."""
    with os.scandir(dest) as it:
        for e in it:
            if e.name.startswith(STAGING_PREFIX) and e.is_dir(follow_symlinks=False):
                shutil.rmtree(e.path, ignore_errors=True)


def _accept(manifest: Manifest, dest: Path, check: Callable[[Manifest], None] | None) -> None:
    if check is not None:
        check(manifest)
    need = sum(f.size for f in manifest.files.values())
    free = shutil.disk_usage(dest).free
    if need > free:
        raise BundleError(f"not enough free space in {dest}: the bundle needs {need} bytes, {free} are free")


def deploy(archive: Path, dest: Path, expect_sha256: str | None = None,
           trusted_keys: list[TrustedKey] | None = None,
           check: Callable[[Manifest], None] | None = None, allow_downgrade: bool | None = None) -> Deployed:
    """Install a bundle into `dest` atomically: on any failure `dest` is left exactly as it was.

    With `trusted_keys`, only bundles whose manifest is signed by one of them are installed. `check(manifest)` is
    called once the manifest is accepted, before anything is extracted; it refuses the bundle by raising. Deploying a
    bundle that is already installed checks the installed files and replaces the release when any is damaged; its
    installed signature is replaced only by one the trusted keys verified. Making current again a release of a label
    that a later deploy replaced (a downgrade: an old, validly signed bundle replayed) is refused when
    `allow_downgrade` is False (default: False with trusted keys, True without) and reported in `downgraded_from`."""
    archive, dest = Path(archive), Path(dest).absolute()
    if not archive.is_file():
        raise BundleError(f"no bundle at {archive}")
    if expect_sha256:
        sha, _ = sha256_file(archive)
        if sha != expect_sha256.strip().lower():
            raise BundleError(f"{archive.name}: sha256 {sha} differs from the expected {expect_sha256}")
    if dest.is_symlink():
        raise BundleError(f"{dest} is a symlink; give the real directory")
    created = not dest.exists()
    if not created and not dest.is_dir():
        raise BundleError(f"{dest} exists and is not a directory")
    dest.mkdir(parents=True, exist_ok=True)
    releases = dest / RELEASES
    created_releases = False
    staging: Path | None = None
    lock_fd = try_lock(dest, directory=True)  # on the directory itself: no lock file is left behind
    assert lock_fd is not None
    try:
        if releases.is_symlink() or (releases.exists() and not releases.is_dir()):
            raise BundleError(f"{releases} is not a plain directory (a symlink or a file); refusing to install")
        if (dest / INDEX).is_symlink():
            raise BundleError(f"{dest / INDEX} is a symlink; refusing to install")
        try:
            index = read_index(dest)
        except LayoutError as e:
            raise BundleError(str(e)) from None
        _reclaim_staging(dest)
        staging = Path(tempfile.mkdtemp(dir=dest, prefix=STAGING_PREFIX))
        os.chmod(staging, 0o755)
        manifest, manifest_bytes = read_bundle(archive, _writer(staging), trusted_keys,
                                               lambda m: _accept(m, dest, check))
        for g in manifest.graphs:  # graphs and weights built apart (#51): the pair must fit before it is served
            try:
                why = weights_mismatch(g, staging)
            except BadWeights as e:
                why = str(e)
            if why is not None:
                raise BundleError(f"{archive.name}: {g.describe()}: weights do not match the graph: {why}")
        rid = release_id(manifest_bytes)
        target = releases / rid
        already = target.is_dir() and not target.is_symlink()
        # Each release keeps the order it was first installed in (`installed`): making current one that was installed
        # before the label's current release is a downgrade.
        seq = {str(r.get("id")): r.get("installed") for r in index}
        current = next((str(r.get("id")) for r in index if r.get("label") == manifest.label), None)
        mine, theirs = seq.get(rid), seq.get(current) if current is not None else None
        downgraded_from = current if (already and current != rid and isinstance(mine, int) and
                                      isinstance(theirs, int) and mine < theirs) else None
        if downgraded_from and not (trusted_keys is None if allow_downgrade is None else allow_downgrade):
            raise BundleError(f"{manifest.label}: release {rid} was deployed before the current {downgraded_from}; "
                              "making it current again is a downgrade (--allow-downgrade makes it current)")
        repaired = False
        if already and _damaged(target, manifest, manifest_bytes):
            old = Path(tempfile.mkdtemp(dir=dest, prefix=STAGING_PREFIX))
            os.rename(target, old / "damaged")
            os.rename(staging, target)
            staging = old
            already, repaired = False, True
        elif already:
            sig = staging / SIGNATURE
            # The same release, now signed (or signed by another key): the new signature replaces the installed one
            # only when the trusted keys verified it (an unchecked one could replace a valid signature with junk).
            if sig.is_file() and (trusted_keys is not None or not (target / SIGNATURE).exists()):
                os.replace(sig, target / SIGNATURE)
        else:
            created_releases = not releases.exists()
            releases.mkdir(exist_ok=True)
            if target.is_symlink() or target.exists():
                raise BundleError(f"{target} exists and is not a release directory; refusing to install")
            os.rename(staging, target)
            staging = None
        order = seq.get(rid) if isinstance(seq.get(rid), int) else \
            1 + max((n for n in seq.values() if isinstance(n, int)), default=0)
        entries = [{"id": rid, "label": manifest.label, "installed": order}] + [r for r in index if r.get("id") != rid]
        try:
            text = json.dumps({"format": DEPLOY_FORMAT, "releases": entries}, indent=1, sort_keys=True) + "\n"
            atomic_write_bytes(dest / INDEX, text.encode(), dest, mode=0o644)
        except BaseException:
            if not already and not repaired:
                shutil.rmtree(target, ignore_errors=True)
            raise
        fsync_path(dest)
        return Deployed(rid, target, manifest.label, len(manifest.files) + 1, already, repaired, downgraded_from)
    except BaseException:
        if created_releases:
            shutil.rmtree(releases, ignore_errors=True)
        raise
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        unlock(lock_fd)
        if created:
            with contextlib.suppress(OSError):
                if not any(dest.iterdir()):
                    dest.rmdir()
