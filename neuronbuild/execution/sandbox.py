"""Per-action scratch directories holding only the action's declared inputs, plus an output directory."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3

from neuronbuild.digests import StatKey, copy_hashing, stat_key
from neuronbuild.execution.cache_api import SpawnCache
from neuronbuild.plugin_api.actions import Action, FileInput

# Declared source files at least this big (a checkpoint) are not copied into the sandbox where Landlock can keep the
# action from writing them: a hard link of the workspace file in the sandbox's read-only sibling directory
# (`read_only_dir`: readable, never writable, by the action's policy), named in the sandbox by a symlink. The sandbox
# itself is writable, so a link there would let an action change the user's file (and a copy costs the checkpoint's
# size on disk again). Smaller files (sources) are copies: their paths are the ones tracebacks and programs name.
LINK_MIN_BYTES = 64 << 20
READ_ONLY_SUFFIX = "-ro"


class InputChanged(Exception):
    """A declared source file changed between analysis and execution."""


def read_only_dir(inputs: str | Path) -> Path:
    """The read-only sibling of the sandbox whose input directory is `inputs` (the worker's policy reads it)."""
    base = Path(inputs).parent
    return base.with_name(base.name + READ_ONLY_SUFFIX)


def private_dirs(inputs: str | Path) -> tuple[Path, Path]:
    """The action's own $HOME and $TMPDIR: fresh directories in its sandbox (beside `inputs` and the outputs), made
    by its process before the model runs and removed with the sandbox, so nothing one action leaves there is seen by
    another. Their paths differ per action and enter neither fingerprints nor outputs."""
    base = Path(inputs).parent
    return base / "home", base / "tmp"


def foreign_entry(outputs: str | Path, log: str | Path) -> str | None:
    """What an ended action left in its sandbox that the unconfined processes reading it after the action (the worker,
    the build process storing its outputs, a farm's Dask worker returning its log) must not follow: an output dir that
    is not a directory, or holds a symbolic link or anything but files and dirs (a link named as an output would make
    the build process copy the file it names, any file the user may read, into the cache, a shared tier and bundles),
    or a log (in a farm's sandbox) replaced by a link. Such a log is removed here. None when there is none; checked
    once the action's processes are all gone."""
    why = None
    try:
        if not stat.S_ISREG(os.lstat(log).st_mode):
            os.unlink(log)
            Path(log).write_text("[neuronbuild: the action replaced its log with something else; removed]\n")
            why = "its log replaced by a link or another file"
    except OSError:
        pass
    root = Path(outputs)
    try:
        if not stat.S_ISDIR(os.lstat(root).st_mode):
            return "its output directory replaced by a link or a file"
    except OSError:
        return "no output directory"
    for dirpath, dirnames, filenames in os.walk(root):  # (does not follow links to directories: they are listed)
        for name in (*dirnames, *filenames):
            p = Path(dirpath) / name
            try:
                mode = os.lstat(p).st_mode
            except OSError:
                continue
            if stat.S_ISLNK(mode):
                with_target = ""
                with contextlib.suppress(OSError):
                    with_target = f" to {os.readlink(p)!r}"
                return f"'{p.relative_to(root)}' in its outputs as a symbolic link{with_target}"
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                return f"'{p.relative_to(root)}' in its outputs, which is not a regular file"
    return why


@functools.cache
def _confined_read_only() -> bool:
    """Landlock can refuse writes and truncation to a path on this kernel (ABI >= 3: truncate is handled)."""
    from neuronbuild.execution.confine import landlock_abi

    return landlock_abi() >= 3


@dataclass(frozen=True)
class Sandbox:
    """Where one action runs: `inputs` (its cwd) and `outputs`, removed after the action. `linked`: the big source
    files placed as read-only links (workspace path, stat signature when hashed)."""

    base: Path
    inputs: Path
    outputs: Path
    linked: tuple[tuple[str, StatKey], ...] = ()
    linked_meta: tuple[tuple[str, int, int, int], ...] = ()  # (path, mode, atime_ns, mtime_ns) when linked

    def remove(self) -> None:
        shutil.rmtree(self.base, ignore_errors=True)
        shutil.rmtree(read_only_dir(self.inputs), ignore_errors=True)

    def restore_linked(self) -> list[str]:
        """Give the linked inputs (the user's files) back the mode and times they had when linked, where they differ:
        without its own mount namespace (no read-only bind mount) an action can chmod or utime them (no Landlock
        right covers either; it owns them). Returns the paths restored (their change also moved their ctime, so
        changed_input() names them too and the action's result is not stored)."""
        ro = read_only_dir(self.inputs)
        out = []
        for path, mode, atime, mtime in self.linked_meta:
            try:
                st = os.stat(ro / path)
                if stat.S_IMODE(st.st_mode) != mode:
                    os.chmod(ro / path, mode)
                    out.append(path)
                if st.st_mtime_ns != mtime:
                    os.utime(ro / path, ns=(atime, mtime))
                    out.append(path)
            except OSError:
                continue
        return list(dict.fromkeys(out))

    def changed_input(self) -> str | None:
        """A linked input whose file changed since it was hashed (the user edited it during the action), else None:
        the action may have read other bytes than its fingerprint names, so its result must not be stored."""
        ro = read_only_dir(self.inputs)
        for path, sig in self.linked:
            try:
                if stat_key(os.stat(ro / path)) != sig:
                    return path
            except OSError:
                return path
        return None


def _link_read_only(src: Path, ro: Path, dest: Path, f: FileInput) -> StatKey | None:
    """`src` hard-linked at `ro` (read-only for the action), hashed there and named at `dest` by a symlink; its stat
    signature. None when it is not a big regular file or cannot be linked (the caller copies)."""
    try:
        st = os.stat(src)
        if not stat.S_ISREG(st.st_mode) or st.st_size < LINK_MIN_BYTES:
            return None
        ro.parent.mkdir(parents=True, exist_ok=True)
        os.link(src, ro)
    except OSError:
        return None
    before = os.stat(ro)
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    h.update_mmap(str(ro))
    if h.hexdigest() != f.digest or stat_key(os.stat(ro)) != stat_key(before):
        raise InputChanged(f"input '{f.path}' changed during the build; run the build again")
    dest.symlink_to(ro)
    return stat_key(before)


def place_input(store: Any, digest: str, dest: Path) -> None:
    """Another action's output (blob `digest` of `store`: the local cache, or a farm's store on a Dask worker) as a
    sandbox input: a verified read-only copy (store.place_blob: hashed as it is written, 0444; a corrupt blob raises
    CorruptBlob and is evicted), never a link, since the sandbox is the action's and a linked blob could be made
    writable again (chmod is no Landlock right) and the store's bytes changed. Both executors place inputs here."""
    store.place_blob(digest, dest)


def prepare(action: Action, root: Path, cache: SpawnCache, parent: Path | None = None) -> Sandbox:
    """A sandbox under `parent` (default: the cache's scratch dir; executors pass a per-build dir they remove whole)."""
    parent = parent or cache.scratch
    parent.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(dir=parent, prefix=f"{action.fingerprint[:12]}-"))
    sb = Sandbox(base, base / "in", base / "out")
    linked: list[tuple[str, StatKey]] = []
    meta: list[tuple[str, int, int, int]] = []
    try:
        sb.inputs.mkdir()
        sb.outputs.mkdir()
        for f in action.files:
            dest = sb.inputs / f.path
            dest.parent.mkdir(parents=True, exist_ok=True)
            sig = _link_read_only(root / f.path, read_only_dir(sb.inputs) / f.path, dest, f) \
                if _confined_read_only() else None
            if sig is not None:
                linked.append((f.path, sig))
                st = os.stat(root / f.path)
                meta.append((f.path, stat.S_IMODE(st.st_mode), st.st_atime_ns, st.st_mtime_ns))
                continue
            with open(root / f.path, "rb") as src, open(dest, "wb") as out:
                digest, _size = copy_hashing(src, out)  # one read: the copy is hashed as it is written
            if digest != f.digest:
                raise InputChanged(f"input '{f.path}' changed during the build; run the build again")
        for d in action.dep_inputs:
            res = cache.lookup(d.action)
            if res is None or d.output not in res.outputs:
                raise InputChanged(f"output '{d.output}' of action {d.action[:12]} is missing from the cache")
            place_input(cache, res.outputs[d.output].digest, sb.inputs / d.path)
    except BaseException:  # including Ctrl-C: no half-built sandbox is left behind
        sb.remove()
        raise
    return Sandbox(sb.base, sb.inputs, sb.outputs, tuple(linked), tuple(meta)) if linked else sb
