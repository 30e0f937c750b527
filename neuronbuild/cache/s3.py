"""S3 tier: the cache layout under s3://bucket/prefix/v1/ (any S3-compatible endpoint), with conditional-write leases.

Execute-once across machines uses S3 conditional writes: a lease object v1/locks/<fp>.lock is created with
If-None-Match: *, refreshed by its owner (If-Match: its ETag) every HEARTBEAT_S, taken over from a stale owner with
If-Match: the stale ETag (a compare-and-swap, so two breakers cannot both win), and deleted with If-Match on release."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from neuronbuild import envvars
from neuronbuild.cache.action_cache import ActionCache
from neuronbuild.cache.locks import HOST, MAX_SKEW_S, Owner, _pid_alive, heartbeat_s, stale_s
from neuronbuild.cache.tier import MAX_RECORD_BYTES, SharedTier, TierReadOnly, TierUnavailable

LAYOUT = "v1"
ENDPOINT_ENV = "NEURONBUILD_S3_ENDPOINT_URL"
MULTIPART_FROM = 1 << 30


def parse_url(url: str) -> tuple[str, str]:
    """s3://bucket/prefix -> (bucket, prefix without slashes at either end)."""
    rest = url[len("s3://"):]
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ValueError(f"'{url}' names no bucket (expected s3://bucket/prefix)")
    return bucket, prefix.strip("/")


class S3Lease:
    """A held lease object; its ETag changes with each heartbeat."""

    def __init__(self, tier: S3Tier, key: str, etag: str, owner: Owner) -> None:
        self.tier = tier
        self.key = key
        self.etag = etag
        self.owner = owner
        self.beats = 0
        self.held = True

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        self.tier._leases.discard(self)
        with contextlib.suppress(Exception):
            self.tier.client.delete_object(Bucket=self.tier.bucket, Key=self.key, IfMatch=self.etag)


class S3Tier(SharedTier):
    """A shared cache in an S3 bucket. boto3 is imported only when an s3:// tier is used."""

    def __init__(self, url: str, endpoint_url: str | None = None) -> None:
        self.url = url
        self.bucket, prefix = parse_url(url)
        self.prefix = f"{prefix}/{LAYOUT}" if prefix else LAYOUT
        self.endpoint_url = endpoint_url or envvars.current().text(ENDPOINT_ENV)
        self._client: Any = None
        self._errors: Any = None
        self._leases: set[S3Lease] = set()
        self._seen: dict[str, tuple[float, str]] = {}
        self._hb: threading.Thread | None = None

    @property
    def client(self) -> Any:
        if self._client is None:
            try:
                import boto3
                import botocore.config
                import botocore.exceptions
            except ImportError as e:
                raise TierUnavailable("boto3 is not installed (pip install 'neuronbuild[s3]')") from e
            self._errors = botocore.exceptions
            env = envvars.environ()  # (the command's)
            region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1"
            cfg = botocore.config.Config(connect_timeout=3, read_timeout=60, region_name=region,
                                         retries={"max_attempts": 2, "mode": "standard"})
            # the command's credentials (a build server's process environment is another client's)
            session = boto3.session.Session(aws_access_key_id=env.get("AWS_ACCESS_KEY_ID") or None,
                                            aws_secret_access_key=env.get("AWS_SECRET_ACCESS_KEY") or None,
                                            aws_session_token=env.get("AWS_SESSION_TOKEN") or None,
                                            profile_name=env.get("AWS_PROFILE") or None)
            self._client = session.client("s3", endpoint_url=self.endpoint_url, config=cfg)
        return self._client

    def key(self, *parts: str) -> str:
        return "/".join((self.prefix, *parts))

    def record_key(self, fp: str) -> str:
        return self.key("ac", fp[:2], f"{fp}.json")

    def blob_key(self, digest: str) -> str:
        return self.key("cas", digest[:2], digest)

    def _code(self, e: Exception) -> str:
        if isinstance(e, self._errors.ClientError):
            return str(e.response.get("Error", {}).get("Code", ""))
        return ""

    def _call(self, write: bool, fn: str, **kw: Any) -> Any:
        """One S3 call; absent keys raise FileNotFoundError, other failures TierUnavailable / TierReadOnly."""
        client = self.client
        try:
            return getattr(client, fn)(Bucket=self.bucket, **kw)
        except self._errors.ClientError as e:
            code = self._code(e)
            if code in ("NoSuchKey", "404", "NotFound"):
                raise FileNotFoundError(kw.get("Key", "")) from e
            if code in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
                raise
            if write and code in ("AccessDenied", "403", "AllAccessDisabled"):
                raise TierReadOnly(f"{self.url}: {code}") from e
            raise TierUnavailable(f"{self.url}: {code or e}") from e
        except self._errors.BotoCoreError as e:
            raise TierUnavailable(f"{self.url}: {e}") from e

    def _read_record(self, key: str) -> bytes:
        """A record object's bytes; b"" (unreadable) when it is over MAX_RECORD_BYTES (not downloaded)."""
        r = self._call(False, "get_object", Key=key)
        body = r["Body"]
        try:
            if int(r.get("ContentLength") or 0) > MAX_RECORD_BYTES:
                return b""
            data = bytes(body.read(MAX_RECORD_BYTES + 1))
            return b"" if len(data) > MAX_RECORD_BYTES else data
        finally:
            body.close()

    def get_record(self, fp: str) -> bytes | None:
        try:
            return self._read_record(self.record_key(fp))
        except FileNotFoundError:
            return None

    def records_among(self, fps: Sequence[str]) -> set[str]:
        """From one listing (LIST pages of 1,000 keys) of each shard asked, once more than ActionCache.LISTING_AFTER
        are asked: a GET per fingerprint is a round trip each."""
        if len(fps) <= ActionCache.LISTING_AFTER:
            return set(fps)
        wanted: dict[str, set[str]] = {}
        for fp in fps:
            wanted.setdefault(fp[:2], set()).add(fp)
        out: set[str] = set()
        for shard, asked in wanted.items():
            for obj in self._list(f"ac/{shard}"):
                fp = obj["Key"].rsplit("/", 1)[-1].removesuffix(".json")
                if fp in asked:
                    out.add(fp)
        return out

    @contextlib.contextmanager
    def open_blob(self, digest: str) -> Iterator[BinaryIO]:
        body = self._call(False, "get_object", Key=self.blob_key(digest))["Body"]
        try:
            yield body
        finally:
            body.close()

    def has_blob(self, digest: str, size: int) -> bool:
        try:
            return int(self._call(False, "head_object", Key=self.blob_key(digest))["ContentLength"]) == size
        except FileNotFoundError:
            return False

    def put_blob(self, digest: str, src: Path) -> None:
        if src.stat().st_size < MULTIPART_FROM:
            with open(src, "rb") as f:
                self._call(True, "put_object", Key=self.blob_key(digest), Body=f)
            return
        try:  # multipart (objects over 5 GB need it); the object appears atomically when it completes
            self.client.upload_file(str(src), self.bucket, self.blob_key(digest))
        except Exception as e:  # noqa: BLE001 - S3UploadFailedError wraps the service error
            if "AccessDenied" in str(e):
                raise TierReadOnly(f"{self.url}: {e}") from e
            raise TierUnavailable(f"{self.url}: {e}") from e

    def put_record(self, fp: str, data: bytes) -> None:
        self._call(True, "put_object", Key=self.record_key(fp), Body=data)

    def evict_blob(self, digest: str) -> None:
        with contextlib.suppress(FileNotFoundError, TierUnavailable, TierReadOnly):
            self._call(True, "delete_object", Key=self.blob_key(digest))

    def evict_record(self, fp: str) -> None:
        with contextlib.suppress(FileNotFoundError, TierUnavailable, TierReadOnly):
            self._call(True, "delete_object", Key=self.record_key(fp))

    def _list(self, sub: str) -> Iterator[dict[str, Any]]:
        token: str | None = None
        while True:
            kw: dict[str, Any] = {"Prefix": self.key(sub) + "/"}
            if token:
                kw["ContinuationToken"] = token
            page = self._call(False, "list_objects_v2", **kw)
            yield from page.get("Contents", [])
            if not page.get("IsTruncated"):
                return
            token = page.get("NextContinuationToken")

    def records(self) -> Iterator[tuple[str, bytes]]:
        for obj in self._list("ac"):
            fp = obj["Key"].rsplit("/", 1)[-1].removesuffix(".json")
            with contextlib.suppress(FileNotFoundError):
                yield fp, self._read_record(obj["Key"])

    def blobs(self) -> Iterator[tuple[str, int]]:
        for obj in self._list("cas"):
            yield obj["Key"].rsplit("/", 1)[-1], int(obj["Size"])

    # -- leases -------------------------------------------------------------------------------------------------
    def try_claim(self, fp: str) -> S3Lease | None:
        key = self.key("locks", f"{fp}.lock")
        owner = Owner(HOST, os.getpid(), uuid.uuid4().hex, time.time())
        try:
            r = self._call(True, "put_object", Key=key, Body=owner.to_json(), IfNoneMatch="*")
            return self._held(key, r["ETag"], owner)
        except self._errors.ClientError:
            pass  # held by someone: is it stale?
        try:
            head = self._call(False, "get_object", Key=key)
        except FileNotFoundError:
            return None  # released meanwhile: the caller polls again
        etag = head["ETag"]
        held_by = Owner.from_json(head["Body"].read())
        now = time.monotonic()
        first, seen_etag = self._seen.get(key, (now, etag))
        if seen_etag != etag:
            first = now
        self._seen[key] = (first, etag)
        age = time.time() - head["LastModified"].timestamp()
        dead = held_by is not None and held_by.host == HOST and not _pid_alive(held_by.pid)
        if not (dead or now - first >= stale_s() or age > stale_s() + MAX_SKEW_S):
            return None
        try:
            r = self._call(True, "put_object", Key=key, Body=owner.to_json(), IfMatch=etag)
        except self._errors.ClientError:
            return None  # someone else took it over first
        self._seen.pop(key, None)
        return self._held(key, r["ETag"], owner)

    def _held(self, key: str, etag: str, owner: Owner) -> S3Lease:
        lease = S3Lease(self, key, etag, owner)
        self._leases.add(lease)
        if self._hb is None:
            self._hb = threading.Thread(target=self._heartbeat, name="neuronbuild-s3-lease", daemon=True)
            self._hb.start()
        return lease

    def _heartbeat(self) -> None:
        while True:
            time.sleep(heartbeat_s())
            for lease in list(self._leases):
                lease.beats += 1
                body = json.dumps({**json.loads(lease.owner.to_json()), "beat": lease.beats}).encode()
                try:
                    r = self.client.put_object(Bucket=self.bucket, Key=lease.key, Body=body, IfMatch=lease.etag)
                    lease.etag = r["ETag"]
                except Exception:  # noqa: BLE001 - lost or unreachable: stop refreshing it
                    self._leases.discard(lease)
