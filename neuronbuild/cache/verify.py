"""`cache verify`: re-hash every blob of a tier and check every record (its fingerprint re-derived from the input
record it holds, its outputs against the blobs, and, given trusted keys, its signature); optionally remove what is
bad."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import blake3

from neuronbuild.cache.action_cache import ActionResult
from neuronbuild.cache.cas import remove_entry
from neuronbuild.cache.record_auth import RecordVerifier, check_record
from neuronbuild.cache.tier import SharedTier

_CHUNK = 4 << 20
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_HEX2 = re.compile(r"^[0-9a-f]{2}$")


@dataclass(frozen=True)
class Problem:
    """One bad thing found: a corrupt blob, an unreadable record or one whose input record does not hash to its
    fingerprint, a record whose blobs are missing or corrupt, or a file in the store that does not belong (not a blob
    or record at its place: something wrote into the cache)."""

    kind: str
    name: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind} {self.name}: {self.detail}"


@dataclass(frozen=True)
class VerifyReport:
    """What verify looked at and found (and whether it removed the problems)."""

    tier: str
    blobs: int
    records: int
    problems: tuple[Problem, ...]
    repaired: bool

    @property
    def ok(self) -> bool:
        return not self.problems


def _hash_stream(tier: SharedTier, digest: str) -> str:
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    with tier.open_blob(digest) as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return str(h.hexdigest())


def foreign_files(root: Path) -> Iterator[Path]:
    """Everything under <root>/cas and <root>/ac that is not a blob (cas/xx/<digest starting xx>) or a record
    (ac/xx/<fingerprint starting xx>.json), in path order (writers stage in tmp/, so nothing else is ever there)."""
    for part, suffix in (("cas", ""), ("ac", ".json")):
        top = root / part
        if not top.is_dir() or top.is_symlink():
            continue
        for sub in sorted(top.iterdir()):
            if not (_HEX2.match(sub.name) and sub.is_dir() and not sub.is_symlink()):
                yield sub
                continue
            for p in sorted(sub.iterdir()):
                name = p.name[: -len(suffix)] if suffix and p.name.endswith(suffix) else ("" if suffix else p.name)
                if not (_HEX64.match(name) and name[:2] == sub.name) or p.is_symlink():
                    yield p
                # a directory where a blob or record belongs is reported (and repaired) as a corrupt blob / bad record


def verify_tier(tier: SharedTier, repair: bool = False, trusted: RecordVerifier | None = None) -> VerifyReport:
    """Re-hash every blob, check every record references intact blobs (and, with `trusted` keys, is signed by one of
    them: an `untrusted-record` otherwise); with `repair`, remove bad blobs and records. The default trust set (the
    user's own key only, cache/user_key.TrustSet.implicit) checks nothing here: other writers' records are not bad."""
    if trusted is not None and getattr(trusted, "implicit", False):
        trusted = None
    problems: list[Problem] = []
    sizes: dict[str, int] = {}
    bad: set[str] = set()
    for digest, size in tier.blobs():
        sizes[digest] = size
        try:
            got = _hash_stream(tier, digest)
        except FileNotFoundError:
            continue  # removed meanwhile (gc)
        except OSError as e:  # e.g. a directory where the blob belongs, or no permission
            bad.add(digest)
            problems.append(Problem("corrupt-blob", digest, f"unreadable ({e.strerror or e})"))
            continue
        if got != digest:
            bad.add(digest)
            problems.append(Problem("corrupt-blob", digest, f"content hashes to {got[:16]} ({size} bytes)"))
    records = 0
    bad_records: list[str] = []
    for fp, data in tier.records():
        records += 1
        try:
            res = ActionResult.from_json(data)
        except (ValueError, KeyError, TypeError) as e:
            problems.append(Problem("bad-record", fp, f"unreadable ({e})"))
            bad_records.append(fp)
            continue
        if res.fingerprint != fp:
            problems.append(Problem("bad-record", fp, f"holds fingerprint {res.fingerprint[:16]}"))
            bad_records.append(fp)
            continue
        derived = res.derived_fingerprint()
        if derived != fp:  # an action of another fingerprint (or none): its outputs are not this action's
            problems.append(Problem("bad-record", fp, f"its input record hashes to {derived[:16]}, not to its name"))
            bad_records.append(fp)
            continue
        why = check_record(data, trusted)[1] if trusted is not None else None
        if why is not None:  # a build trusting these keys does not serve it
            problems.append(Problem("untrusted-record", fp, f"{why} ({res.identity[:120]})"))
            bad_records.append(fp)
            continue
        for name, out in sorted(res.outputs.items()):
            if out.digest in bad:
                why = "is corrupt"
            elif out.digest not in sizes:
                if tier.has_blob(out.digest, out.size):
                    continue  # written after the blob scan (a concurrent build)
                why = "is missing"
            elif sizes[out.digest] != out.size:
                why = f"has {sizes[out.digest]} bytes, expected {out.size}"
            else:
                continue
            problems.append(Problem("broken-entry", fp, f"output '{name}' (blob {out.digest[:16]}) {why}"))
            bad_records.append(fp)
            break
    root = getattr(tier, "root", None)  # a directory tier (the local cache, a shared mount); S3 lists no strays
    foreign = list(foreign_files(root)) if isinstance(root, Path) else []
    for p in foreign:
        problems.append(Problem("foreign-file", str(p.relative_to(root)) if isinstance(root, Path) else str(p),
                                "does not belong in the store (not a blob or a record at its place)"))
    if repair:
        for p in foreign:
            remove_entry(p)
        for fp in bad_records:
            tier.evict_record(fp)
        for digest in bad:
            tier.evict_blob(digest)
    return VerifyReport(tier.url, len(sizes), records, tuple(problems), repair)
