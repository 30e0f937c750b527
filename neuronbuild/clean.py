"""Removing a workspace's outputs (neuronbuild-out) and, for `clean --expunge`, its own state in a cache directory."""

from __future__ import annotations

import contextlib
import json
import marshal
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from neuronbuild.workspace import OUTPUT_DIR


@dataclass(frozen=True)
class Removed:
    """What `clean` removed."""

    path: Path
    files: int
    bytes: int


def clean_outputs(root: Path) -> Removed | None:
    """Remove <root>/neuronbuild-out (a symlink there is unlinked, never followed); None when there is none."""
    out = root / OUTPUT_DIR
    if out.is_symlink():
        out.unlink()
        return Removed(out, 0, 0)
    if not out.is_dir():
        return None
    files = size = 0
    for dirpath, _dirs, names in os.walk(out):
        for n in names:
            with contextlib.suppress(OSError):
                size += os.lstat(os.path.join(dirpath, n)).st_size
                files += 1
    shutil.rmtree(out)
    return Removed(out, files, size)


def _stamp_root(p: Path) -> str | None:
    try:
        data = marshal.loads(p.read_bytes())
        return str(json.loads(data["key"])["root"])
    except (OSError, EOFError, ValueError, TypeError, KeyError):
        return None


def workspace_state(root: Path, cache_dir: Path) -> list[Path]:
    """Files under cache_dir that belong to the workspace at `root` alone: its load and digest caches, its no-op
    stamps, its build roots (what gc keeps for it) and its bundles' GC pins. Never blobs or action records (other
    workspaces may share them)."""
    from neuronbuild.cache.roots import _path as roots_file
    from neuronbuild.incremental import _digest_cache_file as digest_cache_file
    from neuronbuild.loading.labels import Label
    from neuronbuild.loading.load_cache import cache_file
    from neuronbuild.packaging.bundle import pin_name

    state = cache_dir / "v1" / "state"
    roots = roots_file(cache_dir / "v1", root)
    found = [p for p in (cache_file(cache_dir, root), digest_cache_file(cache_dir, root), roots,
                         roots.with_suffix(".lock")) if p.is_file()]
    if state.is_dir():
        found += [p for p in sorted(state.glob("noop-*.marshal")) if _stamp_root(p) == str(root)]
    ws_key = pin_name(root, Label("p", "n")).rsplit("-", 1)[1]
    pins = cache_dir / "v1" / "pins"
    if pins.is_dir():
        found += sorted(pins.glob(f"bundle-*-{ws_key}.json"))
    return found


def expunge_state(root: Path, cache_dir: Path) -> list[Path]:
    files = workspace_state(root, cache_dir)
    for p in files:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
    return files
