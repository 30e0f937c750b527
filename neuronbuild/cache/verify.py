"""`cache verify`: re-hash every blob of a tier and check every record; optionally remove what is bad."""

from __future__ import annotations

from dataclasses import dataclass

import blake3

from neuronbuild.cache.action_cache import ActionResult
from neuronbuild.cache.tier import SharedTier

_CHUNK = 4 << 20


@dataclass(frozen=True)
class Problem:
    """One bad thing found: a corrupt blob, an unreadable record, or a record whose blobs are missing or corrupt."""

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


def verify_tier(tier: SharedTier, repair: bool = False) -> VerifyReport:
    """Re-hash every blob, check every record references intact blobs; with `repair`, remove bad blobs and records."""
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
    if repair:
        for fp in bad_records:
            tier.evict_record(fp)
        for digest in bad:
            tier.evict_blob(digest)
    return VerifyReport(tier.url, len(sizes), records, tuple(problems), repair)
