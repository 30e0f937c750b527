"""Action records: fingerprint -> output digests, the full input record, timing; stored as JSON under <root>/ac."""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neuronbuild import jsondata
from neuronbuild.atomic import atomic_write_bytes
from neuronbuild.digests import StatMemo, fingerprint, stat_key

RECORD_VERSION = 1
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class OutputRef:
    """One output file of an action: its digest and size."""

    digest: str
    size: int


@dataclass(frozen=True)
class ActionResult:
    """A successful action's cached result."""

    fingerprint: str
    identity: str
    outputs: Mapping[str, OutputRef] = field(hash=False)
    record: Mapping[str, Any] = field(hash=False, compare=False)
    duration_s: float = 0.0
    metadata: Mapping[str, Any] = field(default_factory=dict, hash=False, compare=False)
    created: float = 0.0
    writer: str = field(default="", compare=False)  # the key id that signed it in a shared tier ("": unsigned)

    def to_json(self) -> bytes:
        extra = {"writer": self.writer} if self.writer else {}
        return json.dumps({**extra,
            "version": RECORD_VERSION,
            "fingerprint": self.fingerprint,
            "identity": self.identity,
            "outputs": {k: {"digest": v.digest, "size": v.size} for k, v in sorted(self.outputs.items())},
            "record": self.record,
            "duration_s": round(self.duration_s, 3),
            "metadata": self.metadata,
            "created": round(self.created, 3),
        }, sort_keys=True, indent=1).encode()

    @staticmethod
    def from_json(data: bytes) -> ActionResult:
        """Parse a record; ValueError for anything that is not exactly a record (records in a shared cache are
        untrusted: wrong types and deep nesting are misses, never exceptions further on)."""
        try:
            d = jsondata.loads(data)
        except RecursionError:
            raise ValueError("nested too deeply") from None
        if not isinstance(d, dict) or d.get("version") != RECORD_VERSION:
            raise ValueError("unknown record version")
        try:
            outputs = d["outputs"]
            if not isinstance(outputs, dict):
                raise ValueError("'outputs' is not an object")
            refs = {}
            for k, v in outputs.items():
                if not isinstance(v, dict) or not isinstance(v.get("digest"), str) or not _HEX64.match(v["digest"]) \
                        or isinstance(v.get("size"), bool) or not isinstance(v.get("size"), int) or v["size"] < 0:
                    raise ValueError(f"output {str(k)[:80]!r} is malformed")
                refs[k] = OutputRef(v["digest"], v["size"])
            fp, identity, record, meta = d["fingerprint"], d["identity"], d["record"], d.get("metadata", {})
            if not isinstance(fp, str) or not isinstance(identity, str) or not isinstance(record, dict) \
                    or not isinstance(meta, dict):
                raise ValueError("fingerprint, identity, record or metadata has the wrong type")
            writer = d.get("writer", "")
            return ActionResult(fp, identity, refs, record, float(d["duration_s"]), meta, float(d.get("created", 0.0)),
                                writer[:100] if isinstance(writer, str) else "")
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"malformed record ({type(e).__name__}: {str(e)[:100]})") from None

    def derived_fingerprint(self) -> str:
        """The fingerprint of the input record this record holds, as analysis computes it ("none" when it cannot be
        encoded canonically: no action made it). A record whose fingerprint differs is another action's."""
        try:
            return fingerprint(self.record)
        except (TypeError, ValueError):
            return "none"


# Records parsed by this process (a build server looks 2,375 up per build at 1,000 graphs: one stat each instead of an
# open, read and parse). ActionCache.touch keeps its parsed copy. At most 20,000: ~6 KiB each (a record holds its
# action's full input record), ~120 MiB.
_parsed: StatMemo[ActionResult] = StatMemo(20_000)


_LIST_ALL_OVER = 8192  # fingerprints asked beyond which every shard is listed at once


def listed_records(ac_dir: str, fps: Sequence[str]) -> list[str]:
    """Those of `fps` (in their order) that may have a record in the record directory `ac_dir` (<first two hex>/
    <fingerprint>.json), from one listing of each shard directory asked (of every shard, when more than
    _LIST_ALL_OVER are asked: each is then answered by one set lookup). A shard that is absent holds none; one that
    cannot be listed (permissions, I/O) may hold any of them: they are all kept, for a lookup to decide."""
    if len(fps) > _LIST_ALL_OVER:  # (most shards asked: every shard listed, then one membership test per fp)
        try:
            shards = os.listdir(ac_dir)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError:
            shards = None
        if shards is not None:
            every: set[str] = set()
            unlisted = False
            for shard in shards:
                try:
                    every.update(n[:-5] for n in os.listdir(f"{ac_dir}/{shard}") if n.endswith(".json"))
                except (FileNotFoundError, NotADirectoryError):
                    pass
                except OSError:
                    unlisted = True
            if not unlisted:
                return [fp for fp in fps if fp in every] if every else []
    listed: dict[str, frozenset[str] | None] = {}
    out = []
    for fp in fps:
        shard = fp[:2]
        if shard not in listed:
            try:
                listed[shard] = frozenset(n[:-5] for n in os.listdir(f"{ac_dir}/{shard}") if n.endswith(".json"))
            except (FileNotFoundError, NotADirectoryError):
                listed[shard] = frozenset()
            except OSError:
                listed[shard] = None
        names = listed[shard]
        if names is None or fp in names:
            out.append(fp)
    return out


class ActionCache:
    """Records under <root>/ac/<first two hex>/<fingerprint>.json; an unreadable record counts as a miss."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.dir = root / "ac"
        self._dir = str(self.dir)
        self.tmp = root / "tmp"
        self.mtimes: dict[str, int] = {}  # fingerprint -> mtime_ns of its record as get() found it

    LISTING_AFTER = 512  # fingerprints asked at once beyond which shards are listed (fewer: a stat each costs less)

    def candidates(self, fps: Sequence[str]) -> list[str]:
        """Those of `fps` that may have a record: from one listing of each shard directory asked (made now), once
        more than LISTING_AFTER are asked; else all of them. For a pass of this process that writes no record (a
        plan's probe of every action); a record another process writes meanwhile may be missed, as one written just
        after a stat is."""
        if len(fps) <= self.LISTING_AFTER:
            return list(fps)
        return listed_records(self._dir, fps)

    def path(self, fp: str) -> Path:
        return self.dir / fp[:2] / f"{fp}.json"

    def path_str(self, fp: str) -> str:
        return f"{self._dir}/{fp[:2]}/{fp}.json"  # (a str: pathlib's joins cost more than the read at 100,000s)

    def get(self, fp: str) -> ActionResult | None:
        p = f"{self._dir}/{fp[:2]}/{fp}.json"
        try:
            st = os.stat(p)
        except OSError:
            return None
        known = _parsed.get(p, stat_key(st))
        if known is not None:
            self.mtimes[fp] = st.st_mtime_ns
            return known
        now = time.time_ns()
        try:
            with open(p, "rb") as f:
                st = os.fstat(f.fileno())  # the file read (a rename since the stat above is a new inode)
                data = f.read()
        except OSError:
            return None
        try:
            res = ActionResult.from_json(data)
        except (ValueError, KeyError, TypeError):
            with contextlib.suppress(OSError):
                os.unlink(p)
            return None
        if res.fingerprint != fp:
            return None
        self.mtimes[fp] = st.st_mtime_ns
        _parsed.put(p, stat_key(st), res, now)
        return res

    def touch(self, fp: str) -> None:
        """Mark `fp`'s record used now (its mtime: last use, for gc). A parsed copy this process keeps stays valid
        (re-keyed to the touched file's stat) when the file touched is the one parsed: same inode, same stat key up to
        the utime, made and read back through one descriptor (a rename meanwhile leaves another inode under the name,
        whose key differs); otherwise the next get() parses it again, as after anyone's touch."""
        p = f"{self._dir}/{fp[:2]}/{fp}.json"
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            return
        try:
            before = os.fstat(fd)
            os.utime(fd)
            after = os.fstat(fd)
        except OSError:
            return
        finally:
            os.close(fd)
        self.mtimes[fp] = after.st_mtime_ns
        known = _parsed.get(p, stat_key(before))
        if known is not None:
            _parsed.put(p, stat_key(after), known, None)

    def put(self, result: ActionResult, data: bytes | None = None, durable: bool = True) -> None:
        """Write `result`'s record: its JSON, or `data` (the same record signed: record_auth.sign_record); synced
        unless not `durable` (a local cache's: LocalCache.record_outputs)."""
        atomic_write_bytes(self.path(result.fingerprint), result.to_json() if data is None else data, self.tmp,
                           durable=durable)
