"""Local cache + optional shared tier behind LocalCache's interface: read local -> shared (copy down), upload results.

A shared tier that fails (unreachable, read-only) costs one warning and is then ignored for the rest of the process;
it never fails the build. Blobs fetched from it are verified before they enter the local store; a corrupt one is
evicted from the shared tier (when writable), reported once and treated as a miss.

Who wrote a shared record (cache/record_auth.py): with `trusted` keys, only records one of them signed are served
(anything else is an error and a miss, one warning per record: the action runs again; with the default trust set, the
user's own key, one warning per process: cache/user_key.py); with none, records are served unauthenticated (one
warning per process, unless the tier is declared trusted: `trust_writers`). With a `signer`,
every record uploaded is signed; a reader that trusts keys but holds none uploads nothing (readers like it would
refuse its unsigned records)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from neuronbuild.cache.action_cache import ActionResult
from neuronbuild.cache.cas import CorruptBlob
from neuronbuild.cache.local import Claim, LocalCache
from neuronbuild.cache.record_auth import UNVERIFIED, RecordSigner, RecordVerifier, check_record, sign_record
from neuronbuild.cache.tier import Lease, SharedTier, TierReadOnly
from neuronbuild.errors import UserInputError


class TieredClaim:
    """A local claim (flock) plus a lease on the shared tier; releasing releases both."""

    def __init__(self, local: Claim, lease: Lease) -> None:
        self._local = local
        self._lease: Lease | None = lease

    def release(self) -> None:
        if self._lease is not None:
            with contextlib.suppress(Exception):
                self._lease.release()
            self._lease = None
        self._local.release()


class TieredCache(LocalCache):
    """A LocalCache with a shared tier under it."""

    def __init__(self, base: Path, shared: SharedTier, readonly: bool = False,
                 report: Callable[[str], None] | None = None, *, signer: RecordSigner | None = None,
                 trusted: RecordVerifier | None = None, trust_writers: bool = False) -> None:
        super().__init__(base, report)
        self.shared: SharedTier | None = shared
        self.readonly = readonly
        self.signer = signer
        self.trusted = trusted
        self.trust_writers = trust_writers

    def shared_url(self) -> str:
        return self.shared.url if self.shared is not None else ""

    def shared_record(self, data: bytes) -> bytes | None:
        """A record's JSON as this build writes it to any shared tier (its --remote-cache, a farm's store): signed
        with its key (--remote-cache-signing-key); as it is without one; None (after one note) when the build trusts
        only signed records and holds no key (readers like it would refuse its unsigned records)."""
        if not self._may_write_shared():
            return None
        return data if self.signer is None else sign_record(data, self.signer)

    def _may_write_shared(self) -> bool:
        if self.signer is None and self.trusted is not None:
            where = self.shared_url() or "the farm's store"
            self.warn_once("unsigned-upload", f"note: not uploading to the shared cache {where}: this build trusts "
                           "only signed records and has no --remote-cache-signing-key to sign its own")
            return False
        return True

    # -- tier failures ------------------------------------------------------------------------------------------
    def _unreachable(self, e: BaseException) -> None:
        self.stats.errors += 1
        self.warn_once("shared-unreachable", f"warning: shared cache {self.shared_url()} is unavailable ({e}); "
                       "continuing without it")
        self.shared = None

    def _read_only(self, e: BaseException) -> None:
        self.warn_once("shared-readonly", f"warning: shared cache {self.shared_url()} is read-only ({e}); "
                       "results are kept locally only")
        self.readonly = True

    def _remote(self, fn: Callable[..., Any], *args: Any, write: bool = False) -> Any:
        """Call the shared tier; None (after one warning) when it is unavailable or refuses a write."""
        if self.shared is None or (write and self.readonly):
            return None
        try:
            return fn(*args)
        except TierReadOnly as e:
            self._read_only(e)
        except Exception as e:  # noqa: BLE001 - a shared tier never fails the build
            self._unreachable(e)
        return None

    # -- who wrote a record ---------------------------------------------------------------------------------------
    def _shared_record(self, fp: str, data: bytes, warn: bool) -> ActionResult | None:
        """A record read from the shared tier, if this reader takes it: well-formed, of `fp` (its input record hashes
        to it), and signed by a trusted key when keys are trusted. Else None (with `warn`: counted, one warning)."""
        try:
            res = ActionResult.from_json(data)
        except (ValueError, KeyError, TypeError, RecursionError):
            if warn:
                self.stats.errors += 1
                self.warn_once(f"record:{fp}", f"warning: cache: record {fp[:12]} in the shared cache "
                               f"{self.shared_url()} is unreadable; ignored")
            return None
        if res.fingerprint != fp or res.derived_fingerprint() != fp:  # another action's record (copied here)
            if warn:
                self.warn_once(f"record:{fp}", f"warning: cache: record {fp[:12]} in the shared cache "
                               f"{self.shared_url()} holds another action's input record; ignored")
            return None
        if self.trusted is not None:
            signer, why = check_record(data, self.trusted)
            if why is None:
                return dataclasses.replace(res, writer=signer)
            if warn and getattr(self.trusted, "implicit", False):  # the default: one note per process (#49)
                self.warn_once("untrusted-default", f"warning: shared cache {self.shared_url()}: record {fp[:12]} "
                               f"({res.identity[:120]}) is {why}, so it is not served and the action runs here (so "
                               "is any other record not signed by a trusted key). Trusted: "
                               f"{self.trusted.path}; declare your team's public keys with "
                               "--remote-cache-trusted-keys FILE (e.g. in ~/.neuronbuildrc; yours is in "
                               "~/.config/neuronbuild/record-key.pub), or serve every record with "
                               "--remote-cache-trust-writers (docs/security.md)")
            elif warn:
                self.stats.errors += 1
                self.warn_once(f"record:{fp}", f"warning: cache: record {fp[:12]} ({res.identity[:120]}) in the "
                               f"shared cache {self.shared_url()} is {why}; not served (--remote-cache-trusted-keys "
                               f"{self.trusted.path}): running the action")
            return None
        if not self.trust_writers:
            self.warn_once("unauthenticated", f"warning: shared cache {self.shared_url()}: serving records no "
                           "trusted key signed (whoever can write the tier chooses these outputs); declare the "
                           "writers' keys with --remote-cache-trusted-keys FILE, or the tier trusted with "
                           "--remote-cache-trust-writers (docs/security.md)")
        return dataclasses.replace(res, writer=UNVERIFIED)  # (what it names was not checked)

    def _local_entry(self, fp: str) -> tuple[ActionResult | None, list[str]]:
        """lookup_local, less a record copied down from a shared tier that these trusted keys did not sign (copied
        by a build trusting no keys, or signed by a key no longer trusted): the shared tier is asked again."""
        res, bad = self.lookup_local(fp)
        if res is not None and res.writer and self.trusted is not None and not self.trusted.knows(res.writer):
            return None, []
        return res, bad

    # -- reads ----------------------------------------------------------------------------------------------------
    def lookup(self, fp: str) -> ActionResult | None:
        res, bad = self._local_entry(fp)
        if res is not None and not bad:
            self._hit(fp, "local")
            return res
        fetched = self._fetch_entry(fp, res)
        if fetched is None:
            self.stats.miss(fp)
            return None
        self._hit(fp, "shared")
        return fetched

    def peek(self, fp: str) -> bool:
        """A hit in the local tier, or a record in the shared tier that lookup() would take (readable, of `fp`)
        whose every blob is there."""
        res, bad = self._local_entry(fp)
        if res is not None and not bad:
            return True
        if self.shared is None:
            return False
        if res is None:
            data = self._remote(self.shared.get_record, fp)
            if data is None:
                return False
            res = self._shared_record(fp, data, warn=False)  # (as lookup() would take it; lookup() warns)
            if res is None:
                return False
        shared = self.shared
        return all(self.blobs.check(o.digest, o.size) == "ok" or bool(self._remote(shared.has_blob, o.digest, o.size))
                   for o in res.outputs.values())

    def peek_many(self, fps: Sequence[str]) -> set[str]:
        """Those of `fps` whose peek() is true: only those with a record in the local tier (its shard listings) or
        the shared one (SharedTier.records_among: one listing per shard, not a request per fingerprint) are
        peeked."""
        if self.shared is None:
            return super().peek_many(fps)
        local = set(self.actions.candidates(fps))
        rest = [fp for fp in fps if fp not in local]
        shared = self._remote(self.shared.records_among, rest) if rest else None
        maybe = local | (shared or set())
        peek = self.peek  # (a local record with a blob missing asks the shared tier for it)
        return {fp for fp in fps if fp in maybe and peek(fp)}

    def _fetch_entry(self, fp: str, local: ActionResult | None) -> ActionResult | None:
        """Copy an entry down from the shared tier (its record unless we have one, and every blob we lack)."""
        if self.shared is None:
            return None
        res = local
        if res is None:
            data = self._remote(self.shared.get_record, fp)
            if data is None:
                return None
            res = self._shared_record(fp, data, warn=True)
            if res is None:
                return None
        for name, out in res.outputs.items():
            if self.blobs.check(out.digest, out.size) == "ok":
                continue
            if not self._fetch_blob(out.digest, f"output '{name}' of action {fp[:12]}"):
                return None
        if local is None:
            self.actions.put(res)
        return res

    def _fetch_blob(self, digest: str, what: str) -> bool:
        """Download a blob into the local store, verifying it; False if absent, corrupt or the tier failed."""
        shared = self.shared
        if shared is None:
            return False

        def fetch() -> int | None:
            with shared.open_blob(digest) as src:
                return self.blobs.ingest(src, digest)

        try:
            size = fetch()
        except FileNotFoundError:
            return False
        except TierReadOnly as e:
            self._read_only(e)
            return False
        except Exception as e:  # noqa: BLE001 - a shared tier never fails the build
            self._unreachable(e)
            return False
        if size is None:
            self.corrupt("shared", digest, what)
            if not self.readonly:
                shared.evict_blob(digest)
            return False
        return True

    def place_blob(self, digest: str, dest: Path) -> None:
        try:
            super().place_blob(digest, dest)
        except (CorruptBlob, FileNotFoundError):
            if not self._fetch_blob(digest, "sandbox input"):
                raise
            super().place_blob(digest, dest)

    def copy_blob(self, digest: str, dest: Path, verified_size: int | None = None) -> int:
        try:
            return super().copy_blob(digest, dest, verified_size)
        except (CorruptBlob, FileNotFoundError):
            if not self._fetch_blob(digest, "output"):
                raise
            return super().copy_blob(digest, dest)

    # -- writes ---------------------------------------------------------------------------------------------------
    def store_outputs(self, fp: str, identity: str, record: Mapping[str, Any], out_dir: Path,
                      names: Sequence[str], duration_s: float, metadata: Mapping[str, Any],
                      expect: Mapping[str, str] | None = None, scratch: bool = False,
                      sign: Callable[[bytes], bytes | None] | None = None) -> ActionResult:
        """Stored locally, then uploaded (a farm's outputs, `expect`, are in the shared tier already: only their
        record is written there). A farm output that does not match its digest is evicted from the shared tier."""
        try:
            res = super().store_outputs(fp, identity, record, out_dir, names, duration_s, metadata, expect, scratch,
                                        sign)
        except CorruptBlob as e:
            if expect and e.digest and self.shared is not None and not self.readonly:
                self._remote(self.shared.evict_blob, e.digest, write=True)
            raise
        self.upload(res)
        return res

    def upload(self, res: ActionResult) -> bool:
        """Blobs first, then the record: a record visible on the shared tier implies its blobs are there."""
        shared = self.shared
        if shared is None or self.readonly:
            return False
        if not self._may_write_shared():
            return False
        for out in res.outputs.values():
            present = self._remote(shared.has_blob, out.digest, out.size)
            if present is None:
                return False
            if not present:
                self._remote(shared.put_blob, out.digest, self.blobs.path(out.digest), write=True)
                if self.shared is None or self.readonly:
                    return False
        data = self.shared_record(res.to_json())
        if data is None:
            return False
        self._remote(shared.put_record, res.fingerprint, data, write=True)
        if self.shared is None or self.readonly:
            return False
        self.stats.uploaded.add(res.fingerprint)
        return True

    def try_claim(self, fp: str) -> Claim | TieredClaim | None:  # type: ignore[override]
        """Local claim first (cheap, same machine), then the shared tier's lease (other machines)."""
        local = super().try_claim(fp)
        if local is None or self.shared is None or self.readonly:
            return local
        lease = self._remote(self.shared.try_claim, fp)
        if lease is None and self.shared is not None and not self.readonly:  # another machine holds it
            local.release()
            return None
        return local if lease is None else TieredClaim(local, lease)  # (the tier failed: this machine's claim)


def open_shared(url: str, s3_endpoint_url: str | None = None) -> SharedTier:
    """A shared tier from --remote-cache: s3://bucket/prefix or a directory path."""
    if url.startswith("s3://"):
        from neuronbuild.cache.s3 import S3Tier

        try:
            return S3Tier(url, s3_endpoint_url)
        except ValueError as e:
            raise UserInputError(f"--remote-cache: {e}") from e
    from neuronbuild.cache.shared_fs import SharedDirTier

    return SharedDirTier(Path(url).expanduser().absolute())


def open_cache(cache_dir: Path, remote: str | None = None, readonly: bool = False,
               s3_endpoint_url: str | None = None, report: Callable[[str], None] | None = None, *,
               signer: RecordSigner | None = None, trusted: RecordVerifier | None = None,
               trust_writers: bool = False) -> LocalCache:
    """The cache a build uses: local only, or local + shared tier (with who signs and whose records are taken)."""
    if not remote:
        return LocalCache(cache_dir, report)
    return TieredCache(cache_dir, open_shared(remote, s3_endpoint_url), readonly, report, signer=signer,
                       trusted=trusted, trust_writers=trust_writers)
