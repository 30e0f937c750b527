"""Signed action records for shared tiers: who wrote a record, and whether a reader trusts that writer.

A shared tier (a directory many machines mount, an S3 bucket, a cache two users share) is written by whoever has
write access to it. A record there says "action F produced outputs with digests D"; blobs are verified against their
digests on every read, so a swapped blob is caught already, but a well-formed forged record naming other blobs (the
attacker's program, uploaded beside it) would be served as F's result. So a writer holding a private key
(`--remote-cache-signing-key`) signs every record it uploads, and a reader declaring the keys it trusts
(`--remote-cache-trusted-keys`) serves only records one of them signed (docs/security.md).

Format: the record's JSON gains `"writer": "<key id>"` and `"signature": "<base64 Ed25519>"`. The signature covers a
fixed prefix plus the canonical JSON (sorted keys, no whitespace) of every other field of the record: the fingerprint,
its input record, every output's digest and size, the metadata and the writer, so changing any of them (or naming
another blob) breaks it. Readers that predate signing ignore the two fields.

The keys themselves live in runtime/signing.py (Ed25519 through `cryptography`, the format releases use); this module
only frames records, and takes the key objects from its caller (the cache never imports the runtime)."""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any, Protocol

from neuronbuild import jsondata

DOMAIN = b"neuronbuild-action-record-v1\x00"
# The writer of a local record copied down from a shared tier without checking a signature (no trusted keys then): a
# build that trusts keys does not serve it from the local tier, it asks the shared tier again. ("" : built here.)
UNVERIFIED = "unverified"


class RecordSigner(Protocol):
    """A private key held by this process (runtime.signing.SigningKey)."""

    key_id: str

    def sign(self, message: bytes) -> bytes: ...


class RecordVerifier(Protocol):
    """The public keys a reader trusts (runtime.signing.TrustedKeys)."""

    path: str

    def verify(self, message: bytes, signature: bytes) -> str | None: ...

    def knows(self, key_id: str) -> bool: ...


def _message(d: dict[str, Any]) -> bytes:
    return DOMAIN + json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sign_record(data: bytes, signer: RecordSigner) -> bytes:
    """A record's JSON (ActionResult.to_json) with its writer and signature added."""
    d = json.loads(data)
    d.pop("signature", None)
    d["writer"] = signer.key_id
    d["signature"] = base64.b64encode(signer.sign(_message(d))).decode()
    return json.dumps(d, sort_keys=True, indent=1).encode()


def check_record(data: bytes, trusted: RecordVerifier) -> tuple[str, str | None]:
    """(the id of the trusted key that signed the record, None), or ("", why not: one short phrase)."""
    try:
        d = jsondata.loads(data)
    except ValueError:
        return "", "unreadable"
    if not isinstance(d, dict):
        return "", "unreadable"
    sig = d.pop("signature", None)
    if sig is None:
        return "", "not signed"
    writer = d.get("writer")
    named = f"writer {writer[:60]!r}" if isinstance(writer, str) else "no writer"
    try:
        raw = base64.b64decode(str(sig), validate=True) if isinstance(sig, str) else b""
    except (ValueError, binascii.Error):
        raw = b""
    if len(raw) != 64:
        return "", f"signed malformedly ({named})"
    try:
        message = _message(d)
    except (TypeError, ValueError):
        return "", "unreadable"
    signer = trusted.verify(message, raw)
    if signer is not None:
        return signer, None
    if isinstance(writer, str) and trusted.knows(writer):
        return "", f"not what its writer signed (altered after signing; {named})"
    return "", f"not signed by a trusted key (it names {named})"
