"""Wires the persistent speed-ups around one build: the load cache, the on-disk digest cache and the no-op stamp."""

from __future__ import annotations

import atexit
import contextlib
import gc
import hashlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from neuronbuild import after_answer, digests, noop
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


class Session:
    """What the build server keeps between its commands (server/warm.py WarmState.session, handed to each command as
    `Command.session`): per workspace, its load cache with its loading engine (packages, listings, graph check), and
    per (workspace, settings) the analysis engine's state (analysis/analysis_nodes.AnalysisMemo); the caches to write
    once the answer is sent (`flush_saves`). A batch command has none: everything starts from disk and the engine
    starts empty. Nothing else outlives a command, so forgetting it all is dropping this object."""

    KEEP_AT_MOST = 4

    def __init__(self) -> None:
        self.load_caches: dict[Path, LoadCache] = {}
        self.memos: dict[tuple[str, str], Any] = {}  # (workspace, settings key) -> AnalysisMemo, most recent last
        self.pending_saves: dict[tuple[Path, Path], LoadCache] = {}

    def analysis_memo(self, root: Path, settings: Any) -> Any:
        """The analysis engine's state for this workspace and settings (analysis/planner.plan)."""
        from neuronbuild.analysis.analysis_nodes import AnalysisMemo, settings_key

        key = (str(root), settings_key(settings))
        memo = self.memos.pop(key, None) or AnalysisMemo()
        while len(self.memos) >= self.KEEP_AT_MOST:
            del self.memos[next(iter(self.memos))]
        self.memos[key] = memo  # most recently used last
        return memo

    def last_plans(self) -> list[Any]:
        """The action graph each kept analysis memo planned last (the server warms what they need)."""
        return [m.last for m in self.memos.values() if m.last is not None]

    def stats(self) -> dict[str, int]:
        return {"load_caches": len(self.load_caches), "analysis_memos": len(self.memos),
                "memoised_targets": sum(m.memoised_targets() for m in self.memos.values())}

    def flush_saves(self) -> None:
        """Write the load and digest caches the commands since the last flush used (after their answers)."""
        while self.pending_saves:
            (cache_dir, root), lc = self.pending_saves.popitem()
            _save(cache_dir, root, lc)


_process: Session | None = None  # keep_in_memory(True): this process's session, for commands that bring none


def keep_in_memory(on: bool) -> None:
    """Library and test use: a session for this process (as the build server keeps one), used by commands whose
    Command brings none, and the work the user does not wait for (records, pages, no-op stamps) left for after the
    answer (after_answer); off: forgotten, and what was left runs now."""
    global _process
    after_answer.defer(on)
    _process = (_process or Session()) if on else None


def session(command: Any = None) -> Session | None:
    """The session a command's caches live in: its own (`Command.session`: the build server's), else this process's
    (keep_in_memory), else None (batch)."""
    own = getattr(command, "session", None) if command is not None else None
    return own if own is not None else _process


def analysis_memo(root: Path, settings: Any, command: Any = None) -> Any:
    """The kept analysis engine state for this workspace and settings, or None in batch mode (the engine then starts
    empty: analysis/planner.plan)."""
    kept = session(command)
    return kept.analysis_memo(root, settings) if kept is not None else None


def open_caches(cache_dir: Path, root: Path, command: Any = None) -> LoadCache:
    """Load the digest cache into this process and open the workspace's load cache (the session's, when kept)."""
    kept = session(command)
    file = cache_file(cache_dir, root)
    if kept is not None and file in kept.load_caches:
        lc = kept.load_caches[file]
        lc.hits = lc.misses = 0
        return lc
    with analysis_gc():  # (reading 35,000 targets back at 100,000 graphs: the collector's passes cost ~40% of it)
        digests.load_persistent(_digest_cache_file(cache_dir, root))
        lc = LoadCache(file, keep=kept is not None)  # (kept: with its engine, the packages, listings and graph check)
    if kept is not None:
        while len(kept.load_caches) >= kept.KEEP_AT_MOST:
            del kept.load_caches[next(iter(kept.load_caches))]
        kept.load_caches[file] = lc
    return lc


def save_caches(cache_dir: Path, root: Path, load_cache: LoadCache, command: Any = None) -> None:
    """Persist what this build learnt (failures to write only cost speed next time). A kept session writes them
    after the command has answered its client (`Session.flush_saves`). In batch mode the digest cache is written
    when the process ends (once), with the digests analysis made after loading (the model sources': without it
    every process hashed them again, 5,000 files at 100,000 graphs)."""
    kept = session(command)
    if kept is not None:
        kept.pending_saves[(cache_dir, root)] = load_cache
        return
    _save(cache_dir, root, load_cache, with_digests=False)  # (the digests: once, at exit, with analysis's too)
    if not _exit_saves:
        atexit.register(_save_digests_at_exit)
    _exit_saves.add((cache_dir, root))


_exit_saves: set[tuple[Path, Path]] = set()


def _save_digests_at_exit() -> None:
    for cache_dir, root in _exit_saves:
        file = _digest_cache_file(cache_dir, root)
        with contextlib.suppress(OSError):
            if file.parent.is_dir():  # (a temporary cache removed meanwhile is not made again)
                digests.save_persistent(file, root.resolve())


def _save(cache_dir: Path, root: Path, load_cache: LoadCache, with_digests: bool = True) -> None:
    try:
        load_cache.save()
        if with_digests:
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
                ag: Any, cache: Any, results: Mapping[str, Any], ok: bool, started_ns: int, where: str = "") -> bool:
    """After a build: write its no-op stamp if it succeeded, else drop any old one. Returns whether one was written.
    `results`: the build's (BuildResult.results). `where`: the summary's line saying where the outputs are, repeated
    by every no-op the stamp answers."""
    if not ok:
        noop.invalidate(cache_dir, key)  # (ignores OSError)
        return False
    from neuronbuild.packaging.materialize import MANIFEST, target_dir_str

    outputs: list[str] = []
    cached = 0
    for fp in ag.actions:
        res = results.get(fp)
        if res is None:
            continue
        cached += 1
        outputs.append(cache.actions.path_str(fp))  # (str paths: pathlib's joins cost 0.2 s at 1,000 graphs)
        outputs.extend(cache.blobs.path_str(o.digest) for o in res.outputs.values())
    for ct in ag.compiles:
        out = target_dir_str(root, ct)
        outputs.append(f"{out}/{MANIFEST}")
        for bucket, fp in ct.buckets:
            res = results.get(fp)
            if res is None:
                noop.invalidate(cache_dir, key)
                return False
            ships = ct.ships_of(fp)  # (the target's own: a fused speculation graph's draft weights too)
            ships = ag.actions[fp].ships if ships is None else ships
            outputs.extend(f"{out}/{bucket.name}/{n}" for n in (*res.outputs, *(s.path for s in ships)))
    if ag.bundles:  # a bundle's archive, its manifest copy and sha256 file: one deleted is rebuilt, not a no-op
        from neuronbuild.packaging.bundle import bundle_paths

        for lbl, info in ag.bundles.items():
            outputs.extend(map(str, bundle_paths(root, lbl, info.compression)))
    inputs, dirs = stamp_inputs(root, cwd_package, patterns, graph)
    try:
        return noop.write(cache_dir, key, started_ns, inputs, dirs, outputs, len(ag.actions), cached, where)
    except OSError:
        return False  # a read-only cache (a mounted release cache): the stamp is only a speed-up



