"""Wires the persistent speed-ups around one build: the load cache, the on-disk digest cache and the no-op stamp."""

from __future__ import annotations

import atexit
import contextlib
import gc
import hashlib
import os
import time
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
        _memos.clear()
        _peeks.clear()
    elif _kept is None:
        _kept = {}


def kept_count() -> int:
    return len(_kept or {})


# Per (workspace, settings): memoised per-target analyses (analysis/planner.AnalysisMemo), kept by the build server.
_memos: dict[tuple[str, str], Any] = {}


def analysis_memo(root: Path, settings: Any) -> Any:
    """The build server's analysis memo for this workspace and settings, or None in batch mode (nothing is kept)."""
    if _kept is None:
        return None
    from neuronbuild.analysis.planner import AnalysisMemo, settings_key

    key = (str(root), settings_key(settings))
    memo = _memos.pop(key, None) or AnalysisMemo()
    while len(_memos) >= _KEEP_AT_MOST:
        del _memos[next(iter(_memos))]
    _memos[key] = memo  # most recently used last
    return memo


def memo_stats() -> dict[str, int]:
    return {"analysis_memos": len(_memos), "memoised_targets": sum(len(m.entries) for m in _memos.values()),
            "memoised_peeks": sum(len(m.verdicts) for m in _peeks.values())}


class PeekMemo:
    """The build server's memo of `peek` verdicts (is this action cached locally?) for `plan` and dry runs.

    The cache can change under the server (other builds, `cache gc`, `cache clean`), so a verdict is kept only with
    the state of every directory it depends on: the record's shard `ac/<xx>` and, when the record exists, the shards
    `cas/<xx>` of its output blobs. A record or blob can only appear or go by a rename or unlink in its shard, which
    changes that directory's mtime; so before each command every shard directory is stat'ed (512 stats) and a
    verdict is reused only while all of its directories are unchanged. A directory modified within the racy window of
    the stat (one timestamp tick could hide a second change) makes its verdicts unusable. Only a local cache without
    a shared tier is memoised (a remote tier is not watched); `build` itself always looks every action up."""

    def __init__(self, layout_root: Path) -> None:
        self.root = str(layout_root)
        self.state: dict[str, int | None] = {}
        self.verdicts: dict[str, tuple[bool, tuple[tuple[str, int], ...]]] = {}
        self.listings: dict[str, frozenset[str] | None] = {}  # this command's listings of record shards `ac/<xx>`
        self.estimates: dict[tuple[str, str], Any] = {}  # (fingerprint, identity) -> plan's Estimate
        self._estimates_key: Any = None
        self.needed: Any = None  # the last plan's needed_actions, for needed_actions() to patch

    def estimates_now(self) -> dict[tuple[str, str], Any] | None:
        """`plan`'s estimates memoised by earlier commands, kept only while every record shard and the identity
        history (its directory and each group's) are exactly as then: a stored result or a history entry written
        since clears them. None when a directory changed within the racy window of its stat (then nothing is kept)."""
        hist = self._history_state()
        key = None if hist is None or any(m is None for m in self.state.values()) else \
            (tuple(self.state.items()), hist)
        if key is None or key != self._estimates_key or len(self.estimates) > _MAX_PEEKS:
            self.estimates = {}
        self._estimates_key = key
        return self.estimates if key is not None else None

    def _history_state(self) -> tuple[tuple[str, int], ...] | None:
        """The mtimes of the identity history's directory and of each group directory in it (an entry is written by
        an atomic rename into its group's directory), or None if one changed within the racy window."""
        now = time.time_ns()
        top = f"{self.root}/identities"
        try:
            names = sorted(os.listdir(top))
        except FileNotFoundError:
            return (("", -1),)  # nothing recorded yet: creating the directory changes this
        except OSError:
            return None
        try:
            out = [("", os.stat(top).st_mtime_ns)]
            out.extend((n, os.stat(f"{top}/{n}").st_mtime_ns) for n in names)
        except OSError:  # (a directory gone meanwhile: changing now, nothing is kept)
            return None
        if any(m >= now - digests.RACY_NS for _n, m in out):
            return None
        return tuple(out)

    def listed(self, shard: str) -> frozenset[str] | None:
        """The names in record shard `ac/<shard>` (listed once per command, after its state was taken: a record
        appearing later changes the state the next command sees); None if it cannot be listed."""
        names = self.listings.get(shard, _UNLISTED)
        if names is _UNLISTED:
            try:
                names = frozenset(os.listdir(f"{self.root}/ac/{shard}"))
            except FileNotFoundError:
                names = frozenset()
            except OSError:
                names = None
            self.listings[shard] = names
        return names  # type: ignore[return-value]

    def nothing_recorded(self, fps: Any) -> bool:
        """True when no record shard's listing of this command names a record of any of `fps` (a container): then
        no peek of them can find one (a first plan of 160,000 unbuilt actions: 256 listings, no peek per action).
        False when some does, or a shard cannot be listed."""
        for i in range(256):
            names = self.listed(f"{i:02x}")
            if names is None:
                return False
            for n in names:
                if n[:-5] in fps and n.endswith(".json"):
                    return False
        return True

    def refresh(self) -> None:
        now = time.time_ns()
        state: dict[str, int | None] = {}
        for top in ("ac", "cas"):
            for i in range(256):
                d = f"{top}/{i:02x}"
                try:
                    m: int | None = os.stat(f"{self.root}/{d}").st_mtime_ns
                except FileNotFoundError:
                    m = -1  # absent: creating it (to put a file there) changes this state
                except OSError:
                    m = None
                state[d] = None if m is not None and m >= now - digests.RACY_NS else m
        self.state = state
        self.listings = {}
        if len(self.verdicts) > _MAX_PEEKS:
            self.verdicts.clear()


_MAX_PEEKS = 2_000_000
_UNLISTED: Any = object()
_peeks: dict[str, PeekMemo] = {}


class _PeekingCache:
    """A command's cache with `peek` answered from the server's PeekMemo where it is still valid."""

    def __init__(self, cache: Any, memo: PeekMemo) -> None:
        self._cache = cache
        self._memo = memo

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)

    def peek(self, fp: str) -> bool:
        memo = self._memo
        state = memo.state
        v = memo.verdicts.get(fp)
        if v is not None:
            seen = v[1]
            if len(seen) == 1:  # (no record: its shard only, 100,000s of these in a first plan's memo)
                if state.get(seen[0][0]) == seen[0][1]:
                    return v[0]
            elif all(state.get(d) == m for d, m in seen):
                return v[0]
        shard = fp[:2]
        names = memo.listed(shard)
        if names is not None and f"{fp}.json" not in names:  # no record (a first plan: no failed open per action)
            d = f"ac/{shard}"
            m = state.get(d)
            if m is not None:
                memo.verdicts[fp] = (False, ((d, m),))
            return False
        res, bad = self._cache.lookup_local(fp)
        verdict = res is not None and not bad
        dirs = [f"ac/{fp[:2]}"]
        if res is not None:
            dirs.extend(f"cas/{o.digest[:2]}" for o in res.outputs.values())
        states = tuple((d, state.get(d)) for d in dirs)
        if all(m is not None for _d, m in states):
            memo.verdicts[fp] = (verdict, states)  # type: ignore[assignment]
        return verdict


class _Needed:
    """What `plan`'s needed_actions found for one graph with the cache's shards in one state."""

    __slots__ = ("actions", "cached", "need", "state", "candidates", "base", "changed")

    def __init__(self, actions: Any, cached: set[str], need: set[str], state: dict[str, int | None],
                 candidates: set[str], base: _Needed | None = None, changed: set[str] | None = None) -> None:
        self.actions, self.cached, self.need, self.state = actions, cached, need, state
        self.candidates = candidates  # actions whose inputs are all cached: early cutoff may be asked (not memoised)
        # when patched: the answer it was patched from, and every action whose cached or needed status may differ
        # from that answer's (added, removed, or needed now and not then or the reverse)
        self.base, self.changed = base, changed


def needed_actions(ag: Any, cache: Any) -> tuple[list[Any], list[str]]:
    """`plan`'s scheduler.needed_actions(ag, cache, probe=True). In the build server (a cache from `peeking()`), when
    the graph's order was patched from the previous plan's graph (ActionGraph._patched) and no record or blob shard
    changed since that plan (so every kept action's peek verdict is the one it had), the previous answer is patched:
    the added actions are peeked, early cutoff is asked again for every action it may apply to (its entries are
    not in the watched shards), and "needed" is recomputed upwards from where the graph changed."""
    from neuronbuild.execution import scheduler

    if not isinstance(cache, _PeekingCache):
        return scheduler.needed_actions(ag, cache, probe=True)
    memo = cache._memo
    prev, memo.needed = memo.needed, None
    state = memo.state
    out = None
    todo: list[Any]
    cached_list: list[str]
    order = ag.topological_seq()
    if prev is not None and ag.__dict__.get("_patched_from") is prev.actions and prev.state == state and \
            None not in state.values():
        out = _patch_needed(ag, order, prev, cache)
    if out is None and (memo.nothing_recorded(ag.actions) or not any(map(cache.peek, ag.order_fingerprints()))):
        # nothing is cached (a first plan): no early cutoff either (it needs cached inputs), and every action is
        # needed (each leads to an action without consumers, all to execute): scheduler.needed_actions' answer
        todo, cached_list = list(order), []
        ag.__dict__["_todo_fps"] = (todo, ag.order_fingerprints())
        out = _Needed(ag.actions, set(), set(ag.actions), dict(state), set())
    elif out is None:
        todo, cached_list = scheduler.needed_actions(ag, cache, probe=True)
        cached = set(cached_list)
        succ, actions = ag.graph._succ, ag.actions
        candidates = {s for c in cached for s in succ[c]
                      if all(d.action in cached for d in actions[s].dep_inputs)}
        out = _Needed(ag.actions, cached, {a.fingerprint for a in todo}, dict(state), candidates)
    elif len(out.need) == len(order):  # (every action is needed: the need set holds only the graph's actions)
        todo, cached_list = list(order), []
        ag.__dict__["_todo_fps"] = (todo, ag.order_fingerprints())
    else:
        from itertools import compress

        fps = ag.order_fingerprints()
        mask = list(map(out.need.__contains__, fps))
        todo = list(compress(order, mask))
        ag.__dict__["_todo_fps"] = (todo, list(compress(fps, mask)))  # (for plan_report: no pass over the actions)
        ag.__dict__["_todo_mask"] = (todo, mask)  # (for its wall-time schedule by place)
        cached_list = list(compress(fps, map(out.cached.__contains__, fps))) if out.cached else []
    if None not in state.values():
        memo.needed = out
    ag.__dict__["_needed"] = out  # (for plan_report: what changed since the previous answer)
    return todo, cached_list


def _patch_needed(ag: Any, order: list[Any], prev: _Needed, cache: Any) -> _Needed | None:
    from neuronbuild.execution import cutoff

    added, removed = ag.__dict__["_diff"]
    actions, pred, succ = ag.actions, ag.graph._pred, ag.graph._succ

    def verdict(a: Any, cached: set[str]) -> bool:  # (scheduler.needed_actions with probe=True, for one action)
        if cache.peek(a.fingerprint):
            return True
        return bool(a.dep_inputs) and all(d.action in cached for d in a.dep_inputs) and \
            cutoff.peek(a, cache, probe=True) is not None

    cached = prev.cached - removed
    # early cutoff reads entries outside the watched shards: ask again wherever it may apply; a changed answer
    # changes what follows it, so then the whole pass runs (rare: an entry written since the last plan)
    candidates = prev.candidates - removed
    for fp in candidates:
        if verdict(actions[fp], cached) != (fp in cached):
            return None
    for fp in _dependencies_first(added, pred, succ):
        a = actions[fp]
        if verdict(a, cached):
            cached.add(fp)
        if a.dep_inputs and all(d.action in cached for d in a.dep_inputs):
            candidates.add(fp)
    need = prev.need  # (patched in place: the previous answer is not used again, only compared by identity)
    need -= removed
    prev.need = set()
    stack = list(added)
    stack.extend(p for d in added for p in pred[d] if p not in added)
    old = prev.actions
    stack.extend(dep for r in removed for dep in old[r].deps if dep in actions)
    changed = added | removed
    while stack:
        fp = stack.pop()
        consumers = succ[fp]
        v = fp not in cached and (not consumers or any(c in need for c in consumers))
        if v != (fp in need):
            changed.add(fp)
            if v:
                need.add(fp)
            else:
                need.discard(fp)
            stack.extend(pred[fp])
    return _Needed(actions, cached, need, prev.state, candidates, prev, changed)


def _dependencies_first(nodes: set[str], pred: Any, succ: Any) -> list[str]:
    """`nodes` (closed under consumers) ordered so that each comes after those of its dependencies among them."""
    waiting = {n: sum(1 for p in pred[n] if p in nodes) for n in nodes}
    ready = sorted(n for n, k in waiting.items() if k == 0)
    out = []
    while ready:
        n = ready.pop()
        out.append(n)
        for s in succ[n]:
            waiting[s] -= 1
            if waiting[s] == 0:
                ready.append(s)
    return out


def estimate_memo(cache: Any) -> dict[tuple[str, str], Any] | None:
    """In the build server, for a cache from `peeking()`: the memo of `plan`'s estimates (PeekMemo.estimates_now);
    None in batch mode or with a shared tier."""
    return cache._memo.estimates_now() if isinstance(cache, _PeekingCache) else None


def peeking(cache: Any) -> Any:
    """In the build server, `cache` (a local cache without a shared tier) with memoised peeks; else `cache`."""
    from neuronbuild.cache.local import LocalCache

    if _kept is None or type(cache) is not LocalCache:
        return cache
    key = str(cache.root)
    memo = _peeks.pop(key, None) or PeekMemo(cache.root)
    while len(_peeks) >= _KEEP_AT_MOST:
        del _peeks[next(iter(_peeks))]
    _peeks[key] = memo
    memo.refresh()
    return _PeekingCache(cache, memo)


def open_caches(cache_dir: Path, root: Path) -> LoadCache:
    """Load the digest cache into this process and open the workspace's load cache."""
    file = cache_file(cache_dir, root)
    if _kept is not None and file in _kept:
        lc = _kept[file]
        lc.hits = lc.misses = 0
        return lc
    with analysis_gc():  # (reading 35,000 targets back at 100,000 graphs: the collector's passes cost ~40% of it)
        digests.load_persistent(_digest_cache_file(cache_dir, root))
        lc = LoadCache(file)
    if _kept is not None:
        lc.dirs = {}  # (directory listings kept with their mtimes: Loader.find_packages)
        while len(_kept) >= _KEEP_AT_MOST:
            del _kept[next(iter(_kept))]
        _kept[file] = lc
    return lc


_pending_saves: dict[tuple[Path, Path], LoadCache] = {}


def save_caches(cache_dir: Path, root: Path, load_cache: LoadCache) -> None:
    """Persist what this build learnt (failures to write only cost speed next time). The build server writes them
    after the command has answered its client (`flush_saves`). In batch mode the digest cache is written when the
    process ends (once), with the digests analysis made after loading (the model sources': without it every process
    hashed them again, 5,000 files at 100,000 graphs)."""
    if _kept is not None:
        _pending_saves[(cache_dir, root)] = load_cache
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


def flush_saves() -> None:
    while _pending_saves:
        (cache_dir, root), lc = _pending_saves.popitem()
        _save(cache_dir, root, lc)


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
                ag: Any, cache: Any, ok: bool, started_ns: int, where: str = "") -> bool:
    """After a build: write its no-op stamp if it succeeded, else drop any old one. Returns whether one was written.
    `where`: the summary's line saying where the outputs are, repeated by every no-op the stamp answers."""
    if not ok:
        noop.invalidate(cache_dir, key)  # (ignores OSError)
        return False
    from neuronbuild.packaging.materialize import MANIFEST, target_dir_str

    outputs: list[str] = []
    results = {fp: cache.lookup(fp) for fp in ag.actions}
    cached = 0
    for fp, res in results.items():
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
            outputs.extend(f"{out}/{bucket.name}/{n}" for n in res.outputs)
    inputs, dirs = stamp_inputs(root, cwd_package, patterns, graph)
    try:
        return noop.write(cache_dir, key, started_ns, inputs, dirs, outputs, len(ag.actions), cached, where)
    except OSError:
        return False  # a read-only cache (a mounted release cache): the stamp is only a speed-up


def flags_of(args: Any) -> dict[str, Any]:
    """The parsed command-line flags of a build command, as a plain dict (for noop.request_key)."""
    return {k: v for k, v in sorted(vars(args).items()) if not callable(v)}

