"""Wires the persistent speed-ups around one build: the load cache, the on-disk digest cache and the no-op stamp."""

from __future__ import annotations

import contextlib
import gc
import hashlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from neuronbuild import digests, noop
from neuronbuild.loading.load_cache import LoadCache, cache_file
from neuronbuild.loading.schema import RULES
from neuronbuild.workspace import MARKER, builtin_rules_dir


@contextlib.contextmanager
def analysis_gc() -> Iterator[None]:
    """Loading and analysis allocate ~10 long-lived objects per action and almost no cyclic garbage: the collector's
    full passes over that growing heap cost ~half the analysis time at 100,000 graphs. Pause it meanwhile, then freeze
    what survived (gc.freeze) so the first collection afterwards does not scan it all (~1 s at 100,000 graphs)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was:
            gc.enable()


def _digest_cache_file(cache_dir: Path, root: Path) -> Path:
    key = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:20]
    return cache_dir / "v1" / "state" / f"digests-{key}.marshal"


# The build server keeps load caches in memory between its commands (their entries are checked by digest on every
# use, as those read from disk are); None: every command reads them from disk (batch mode).
_kept: dict[Path, LoadCache] | None = None
_KEEP_AT_MOST = 4


def keep_in_memory(on: bool) -> None:
    global _kept
    if not on:
        _kept = None
    elif _kept is None:
        _kept = {}


def kept_count() -> int:
    return len(_kept or {})


def open_caches(cache_dir: Path, root: Path) -> LoadCache:
    """Load the digest cache into this process and open the workspace's load cache."""
    file = cache_file(cache_dir, root)
    if _kept is not None and file in _kept:
        lc = _kept[file]
        lc.hits = lc.misses = 0
        return lc
    digests.load_persistent(_digest_cache_file(cache_dir, root))
    lc = LoadCache(file)
    if _kept is not None:
        while len(_kept) >= _KEEP_AT_MOST:
            del _kept[next(iter(_kept))]
        _kept[file] = lc
    return lc


def save_caches(cache_dir: Path, root: Path, load_cache: LoadCache) -> None:
    """Persist what this build learnt (failures to write only cost speed next time)."""
    try:
        load_cache.save()
        digests.save_persistent(_digest_cache_file(cache_dir, root), root.resolve())
    except OSError:
        pass


def _file_path(root: Path, display: str) -> str:
    if display.startswith("@"):  # @neuronbuild//rules/sub:x.bzl
        pkg, name = display.split("//", 1)[1].split(":", 1)
        return str(builtin_rules_dir().joinpath(*pkg.split("/")[1:], name))
    return str(root / display)


def stamp_inputs(root: Path, cwd_package: str, patterns: Sequence[str], graph: Any) -> tuple[list[str], list[str]]:
    """(files, directories) whose change could change what loading and analysis produce."""
    out = [str(root / MARKER)]
    dirs: list[str] = []
    d = root / cwd_package if cwd_package else root
    while True:  # a new marker between the cwd and the root would change the workspace
        dirs.append(str(d))
        if d == root:
            break
        d = d.parent
    for pkg in graph.packages.values():
        out.extend(_file_path(root, f) for f in pkg.files)
    for t in graph.targets.values():
        for a in RULES[t.kind].attrs:
            v = t.attrs.get(a.name)
            if "file" in a.kinds and v is not None:
                out.extend(str(root / lbl.path) for lbl in (v if isinstance(v, tuple) else (v,)))
    if any("..." in p for p in patterns):
        dirs.extend(noop.workspace_dirs(root))
    return out, dirs


def record_noop(key: str, root: Path, cwd_package: str, patterns: Sequence[str], cache_dir: Path, graph: Any,
                ag: Any, cache: Any, ok: bool, started_ns: int) -> bool:
    """After a build: write its no-op stamp if it succeeded, else drop any old one. Returns whether one was written."""
    if not ok:
        noop.invalidate(cache_dir, key)  # (ignores OSError)
        return False
    from neuronbuild.packaging.materialize import MANIFEST, target_dir

    outputs: list[str] = []
    results = {fp: cache.lookup(fp) for fp in ag.actions}
    cached = 0
    for fp, res in results.items():
        if res is None:
            continue
        cached += 1
        outputs.append(str(cache.actions.path(fp)))
        outputs.extend(str(cache.blobs.path(o.digest)) for o in res.outputs.values())
    for ct in ag.compiles:
        out = target_dir(root, ct)
        outputs.append(str(out / MANIFEST))
        for bucket, fp in ct.buckets:
            res = results.get(fp)
            if res is None:
                noop.invalidate(cache_dir, key)
                return False
            outputs.extend(str(out / bucket.name / n) for n in res.outputs)
    inputs, dirs = stamp_inputs(root, cwd_package, patterns, graph)
    try:
        return noop.write(cache_dir, key, started_ns, inputs, dirs, outputs, len(ag.actions), cached)
    except OSError:
        return False  # a read-only cache (a mounted release cache): the stamp is only a speed-up


def flags_of(args: Any) -> dict[str, Any]:
    """The parsed command-line flags of a build command, as a plain dict (for noop.request_key)."""
    return {k: v for k, v in sorted(vars(args).items()) if not callable(v)}

