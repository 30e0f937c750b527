"""The local cache: where it lives, and the interface the scheduler, sandboxes and materialisation use.

Interface (keep it when adding tiers): lookup, store_outputs, place_blob, copy_blob, record_failure, try_claim,
finish. TieredCache (cache/tiered.py) adds a shared tier behind the same interface."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from neuronbuild import envvars, streams
from neuronbuild.atomic import atomic_write_bytes, try_lock, unlock
from neuronbuild.cache.action_cache import ActionCache, ActionResult, OutputRef
from neuronbuild.cache.cas import BlobStore, CorruptBlob
from neuronbuild.cache.identity_index import CacheHistory, IdentityIndex
from neuronbuild.cache.stats import StatsCounter, persist

CACHE_ENV = "NEURONBUILD_CACHE_DIR"
LAYOUT = "v1"
# A hit touches its record (last use, for gc) unless it was touched this recently: back-to-back builds then leave the
# records alone. Well within gc.GRACE_S (600 s). A touch keeps the parsed copy action_cache.py holds (ActionCache.touch):
# a build after one that touched every record stats them, as one within the minute does, rather than re-parse them.
TOUCH_NS = 60 * 1_000_000_000


def default_cache_dir() -> Path:
    env = envvars.environ()  # (the command's)
    xdg = env.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path(env.get("HOME") or Path.home()) / ".cache"
    return base / "neuronbuild"


def resolve_cache_dir(flag: str | None) -> Path:
    """--cache-dir, else $NEURONBUILD_CACHE_DIR, else a per-user default (~/.cache/neuronbuild)."""
    if flag:
        return Path(flag).expanduser().resolve()
    env = envvars.current().text(CACHE_ENV)
    if env:
        return Path(env).expanduser().resolve()
    return default_cache_dir()


class LocalCache:
    """A cache directory shared by any number of workspaces and concurrent builds.

    Every blob an entry references is checked on lookup (cheaply, see BlobStore.check) and fully re-hashed when read;
    a corrupt blob is evicted, reported once, and its entry treated as a miss so the action re-runs."""

    def __init__(self, base: Path, report: Callable[[str], None] | None = None) -> None:
        self.base = base
        self.report = report or (lambda msg: print(msg, file=streams.err(), flush=True))
        self.stats = StatsCounter()
        self._reported: set[str] = set()
        self._complete: dict[str, ActionResult] = {}  # entries found complete during this build
        self._touched: set[str] = set()
        self.root = base / LAYOUT
        self.blobs = BlobStore(self.root)
        self.actions = ActionCache(self.root)
        self.logs = self.root / "logs"
        self.locks = self.root / "locks"
        self.failures = self.root / "failures"
        self.scratch = self.root / "sandbox"
        self.toolchain_tmp = self.root / "toolchain-tmp"

    def warn_once(self, key: str, msg: str) -> None:
        if key not in self._reported:
            self._reported.add(key)
            self.report(msg)

    def corrupt(self, tier: str, digest: str, what: str) -> None:
        """Count and report (once per blob and tier) a corrupt blob that has been evicted or skipped."""
        self._complete.clear()
        self.stats.errors += 1
        self.warn_once(f"corrupt:{tier}:{digest}",
                       f"warning: cache: blob {digest[:16]} ({what}) in the {tier} cache is corrupt; not served")

    def lookup_local(self, fp: str) -> tuple[ActionResult | None, list[str]]:
        """The local record for `fp` (None if absent or unreadable) and the digests of its missing/corrupt blobs.

        A complete entry found once is remembered for the rest of this build (a build looks each action up several
        times); any corruption report forgets them all, and blobs are verified again whenever they are read."""
        found = self._complete.get(fp)
        if found is not None:
            return found, []
        res = self.actions.get(fp)
        if res is None:
            return None, []
        bad: list[str] = []
        for name, out in res.outputs.items():
            state = self.blobs.check(out.digest, out.size)
            if state == "corrupt":
                self.blobs.evict(out.digest)
                self.corrupt("local", out.digest, f"output '{name}' of action {fp[:12]}")
            if state != "ok":
                bad.append(out.digest)
        if not bad:
            self._complete[fp] = res
        return res, bad

    def lookup(self, fp: str) -> ActionResult | None:
        """The cached result of an action, only if every output blob is present and intact."""
        res, bad = self.lookup_local(fp)
        if res is None or bad:
            self.stats.miss(fp)
            return None
        self._hit(fp, "local")
        return res

    def put_file(self, path: Path, scratch: bool = False) -> tuple[str, int]:
        """Store a file's content (hashing while copying; `scratch`: the caller's scratch file, linked rather than
        copied when it can be, see BlobStore.put_file); (digest, size)."""
        return self.blobs.put_file(path, scratch)

    def has_blob(self, digest: str) -> bool:
        return self.blobs.has(digest)

    def history(self) -> CacheHistory:
        """Past results of this cache (records + the per-identity history store)."""
        return CacheHistory(self.root)

    def peek(self, fp: str) -> bool:
        """Whether a lookup would hit, without counting it or fetching anything."""
        res, bad = self.lookup_local(fp)
        return res is not None and not bad

    def peek_many(self, fps: Sequence[str]) -> set[str]:
        """Those of `fps` whose peek() is true (a plan's probe of every action, which writes no record): the record
        shards are listed once (ActionCache.candidates) instead of a stat per fingerprint."""
        peek = self.peek
        return {fp for fp in self.actions.candidates(fps) if peek(fp)}

    def _hit(self, fp: str, tier: str) -> None:
        self.stats.hit(fp, tier)
        if fp not in self._touched:  # record mtime = last use, for LRU garbage collection (to within TOUCH_NS)
            self._touched.add(fp)
            used = self.actions.mtimes.get(fp)
            if used is None or time.time_ns() - used > TOUCH_NS:
                self.actions.touch(fp)  # (its parsed copy stays valid: the next build does not parse it again)

    def finish(self) -> None:
        """End of a build: persist this build's counters."""
        if not self.stats.empty:
            with contextlib.suppress(OSError):
                persist(self.root, self.stats.snapshot(self.shared_url()))

    def shared_url(self) -> str:
        return ""

    def shared_record(self, data: bytes) -> bytes | None:
        """A record's JSON as this build writes it to a shared tier (TieredCache: signed with its key), or None when
        it must write none there. Without a shared tier of its own, no key is configured: `data` as it is."""
        return data

    def store_outputs(self, fp: str, identity: str, record: Mapping[str, Any], out_dir: Path,
                      names: Sequence[str], duration_s: float, metadata: Mapping[str, Any],
                      expect: Mapping[str, str] | None = None, scratch: bool = False,
                      sign: Callable[[bytes], bytes | None] | None = None) -> ActionResult:
        """Put an action's outputs into the CAS, then (last, atomically) its record: no partial entry is visible.
        `sign`: as record_outputs'.

        `scratch`: `out_dir` is the caller's scratch (an action's sandbox), removed afterwards: its files are linked
        into the CAS rather than copied where they can be. `expect` ({name: digest}): the outputs are another
        store's blobs (a farm worker's, in the farm's store): each is verified against its digest (CorruptBlob, and
        nothing recorded, if one does not match) and adopted by a hard link where the files allow (BlobStore.adopt):
        not copied and synced a second time."""
        outputs: dict[str, OutputRef] = {}
        local: list[str] = []  # outputs this store hashes itself: put together (one group commit of their syncs)
        for name in names:
            p = out_dir / name
            if not p.is_file():
                raise FileNotFoundError(f"the action did not produce its declared output '{name}'")
            want = expect.get(name) if expect is not None else None
            if want is not None:
                size = self.blobs.adopt(p, want)
                if size is None:
                    raise CorruptBlob(f"output '{name}' does not match the digest its worker reported "
                                      f"({want[:16]}): corrupt in the farm's store", want)
                outputs[name] = OutputRef(want, size)
            else:
                local.append(name)
        for name, (digest, size) in zip(local, self.blobs.put_files([out_dir / n for n in local], scratch),
                                        strict=True):
            outputs[name] = OutputRef(digest, size)
        outputs = {name: outputs[name] for name in names}  # (in the declared order, as before)
        return self.record_outputs(fp, identity, record, outputs, duration_s, metadata, sign)

    def record_outputs(self, fp: str, identity: str, record: Mapping[str, Any], outputs: Mapping[str, OutputRef],
                       duration_s: float, metadata: Mapping[str, Any],
                       sign: Callable[[bytes], bytes | None] | None = None) -> ActionResult:
        """The record of an action whose output blobs are in this CAS already (a farm worker put them there).
        `sign`: this store is a shared tier of other builds (a farm's store): the record is written as `sign` makes
        it (the writing build's shared_record: signed), or not at all when that gives None."""
        res = ActionResult(fp, identity, dict(outputs), record, duration_s, dict(metadata), time.time())
        data = sign(res.to_json()) if sign is not None else None
        if sign is not None and data is None:
            return res  # (not written)
        # Not synced (#53): the record names blobs synced already (put_files), so whatever a crash leaves of it is
        # a complete entry, a miss (the action runs again) or an unreadable file (a miss, removed: ActionCache.get).
        self.actions.put(res, data, durable=sign is not None)
        self._complete.pop(fp, None)  # (a record found earlier in this build, e.g. an unverified copy, is replaced)
        IdentityIndex(self.root).record(res)  # explain/plan/upgrade-impact: this identity's most recent result
        self.stats.save(fp)
        self._touched.add(fp)
        with contextlib.suppress(OSError):
            os.unlink(self.failure_path(fp))
        return res

    def record_stored(self, fp: str, identity: str, record: Mapping[str, Any], outputs: Mapping[str, tuple[str, int]],
                      duration_s: float, metadata: Mapping[str, Any],
                      sign: Callable[[bytes], bytes | None] | None = None) -> ActionResult:
        """`record_outputs` for callers outside the cache package (the farm): outputs as {name: (digest, size)}."""
        refs = {name: OutputRef(str(d), int(n)) for name, (d, n) in outputs.items()}
        return self.record_outputs(fp, identity, record, refs, duration_s, metadata, sign)

    def place_blob(self, digest: str, dest: Path) -> None:
        """A verified read-only copy of a blob at `dest`, for sandbox inputs (never a link: BlobStore.copy_read_only)."""
        try:
            self.blobs.copy_read_only(digest, dest)
        except CorruptBlob:
            self._complete.clear()  # the blob was evicted: entries using it are no longer complete
            raise

    def link_blob(self, digest: str, dest: Path) -> None:
        """`dest` named as blob `digest` without reading it (a hard link, else a copy), for a caller that verifies
        it itself (store_outputs' `expect`): a farm client fetching a worker's outputs from the farm's store."""
        self.blobs.link_unverified(digest, dest)

    def link_out(self, digest: str, dest: Path) -> int | None:
        """A read-only hard link of a blob at `dest` for an output target, verified (BlobStore.link_out); None where
        the filesystem cannot link (then copy_blob)."""
        try:
            return self.blobs.link_out(digest, dest)
        except CorruptBlob:
            self._complete.clear()
            raise

    def copy_blob(self, digest: str, dest: Path, verified_size: int | None = None) -> int:
        """A verified, atomically written copy of a blob at `dest`, for outputs users see (`verified_size`: the
        caller verified this blob moments ago; see BlobStore.copy_out)."""
        try:
            return self.blobs.copy_out(digest, dest, verified_size)
        except CorruptBlob:
            self._complete.clear()
            raise

    def record_failure(self, fp: str, identity: str, record: Mapping[str, Any], error: str, log: Path) -> None:
        """Keep a failure (with its log and toolchain) for reports; it is never replayed as a result."""
        try:
            log_text = log.read_text(encoding="utf-8", errors="replace")[-200_000:]
        except OSError:
            log_text = ""
        data = json.dumps({"fingerprint": fp, "identity": identity, "record": record, "error": error,
                           "toolchain": record.get("toolchain"), "log": log_text, "created": time.time()},
                          sort_keys=True, indent=1).encode()
        with contextlib.suppress(OSError):
            atomic_write_bytes(self.failure_path(fp), data, self.root / "tmp")

    def failure_path(self, fp: str) -> Path:
        return self.failures / fp[:2] / f"{fp}.json"
    def try_claim(self, fp: str) -> Claim | None:
        """Claim the right to execute action `fp`, so concurrent builds execute it once.

        Returns None while another build holds the claim (the caller waits and looks the result up again)."""
        fd = try_lock(self.locks / f"{fp}.lock", blocking=False)
        return None if fd is None else Claim(fd)


class Claim:
    """An exclusive, process-lifetime-bound claim on one action (an flock: released if the process dies)."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            unlock(self._fd)
            self._fd = None
