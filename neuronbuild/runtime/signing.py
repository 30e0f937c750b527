"""Release signatures: Ed25519 over a bundle's manifest bytes (through the `cryptography` library), and trusted keys.

A bundle signed at build time carries `manifest.json.sig` right after `manifest.json`; the signature covers the exact
manifest bytes, and the manifest holds the sha256 of every other file, so one signature authenticates every byte of
the release. Keys are ordinary OpenSSH (`ssh-keygen -t ed25519`) or PEM Ed25519 keys; nothing here is home-made
crypto, only the framing (a domain-separation prefix and a small JSON envelope)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuronbuild import envvars

SIGNATURE = "manifest.json.sig"  # archive member / file next to manifest.json in a deployed release
SIGNING_KEY_ENV = "NEURONBUILD_SIGNING_KEY"  # build side: private key file bundles are signed with
TRUSTED_KEYS_ENV = "NEURONBUILD_TRUSTED_KEYS"  # runtime: public keys (one per line) a strict open accepts
_DOMAIN = b"neuronbuild-bundle-manifest-v1\x00"
_FORMAT = 1
MAX_SIGNATURE_BYTES = 4096
MAX_KEYS_FILE_BYTES = 1 << 20


class SignatureError(ValueError):
    """A key or signature that cannot be used, or a bundle that is unsigned or wrongly signed (one user-facing line)."""


@dataclass(frozen=True)
class TrustedKey:
    """An Ed25519 public key accepted for releases."""

    key_id: str  # "SHA256:<base64>", as `ssh-keygen -l` prints it
    raw: bytes  # the 32-byte public key
    comment: str = ""


def key_id(raw_public: bytes) -> str:
    """The OpenSSH-style fingerprint of a raw Ed25519 public key."""
    blob = b"".join(len(p).to_bytes(4, "big") + p for p in (b"ssh-ed25519", raw_public))
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


MAX_PRIVATE_KEY_BYTES = 64 << 10  # an OpenSSH Ed25519 key is about 400 bytes


def key_too_open(path: str | os.PathLike[str], mode: int | None = None) -> str | None:
    """Why a private key file is refused, as ssh refuses one: group or others may read or write it (any of 0o077);
    else None. (Public keys, trusted-keys files, are not checked.) A file that cannot be read is left to its reader."""
    if mode is None:
        try:
            mode = os.stat(path).st_mode
        except OSError:
            return None
    if mode & 0o077:
        return (f"signing key {path}: permissions {stat.S_IMODE(mode):04o} are too open (group or others may "
                f"read it): a private key must be readable by its owner only (chmod 600 {path})")
    return None


def _load_private(path: Path) -> Any:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    try:
        with open(path, "rb") as f:
            why = key_too_open(path, os.fstat(f.fileno()).st_mode)  # the file read, not the path's later state
            if why is not None:
                raise SignatureError(why)
            data = f.read(MAX_PRIVATE_KEY_BYTES + 1)
    except OSError as e:
        raise SignatureError(f"cannot read signing key {path}: {e.strerror or e}") from None
    if len(data) > MAX_PRIVATE_KEY_BYTES:
        raise SignatureError(f"signing key {path}: not a usable private key (over {MAX_PRIVATE_KEY_BYTES} bytes)")
    password = envvars.current().text("NEURONBUILD_SIGNING_KEY_PASSPHRASE")
    pw = password.encode() if password else None
    key: Any
    try:
        if b"BEGIN OPENSSH PRIVATE KEY" in data:
            key = serialization.load_ssh_private_key(data, password=pw)
        else:
            key = serialization.load_pem_private_key(data, password=pw)
    except (ValueError, TypeError, Exception) as e:  # noqa: BLE001 - cryptography raises several types
        hint = ""
        if pw is None and ("encrypted" in str(e) or "password" in str(e).lower()):
            hint = "; it is passphrase-protected: give the passphrase in $NEURONBUILD_SIGNING_KEY_PASSPHRASE"
        raise SignatureError(f"signing key {path}: not a usable private key ({type(e).__name__}: "
                             f"{str(e).splitlines()[0][:200] if str(e) else ''}){hint}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise SignatureError(f"signing key {path}: not an Ed25519 key (use `ssh-keygen -t ed25519`)")
    return key


def _raw_public(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return bytes(key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw))


class SigningKey:
    """A private Ed25519 key loaded once into this process (the file is not read again): what shared-cache records
    are signed with. Only the key id ever leaves it; never the key or its path."""

    def __init__(self, key_file: Path) -> None:
        self._key = _load_private(Path(key_file))
        self.key_id = key_id(_raw_public(self._key.public_key()))

    def sign(self, message: bytes) -> bytes:
        """The raw 64-byte Ed25519 signature of `message` (the caller adds its own domain-separation prefix)."""
        return bytes(self._key.sign(message))

    def __repr__(self) -> str:
        return f"SigningKey({self.key_id})"


class TrustedKeys:
    """Public keys whose signatures are accepted (a trusted-keys file, as for releases)."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self.keys = load_trusted_keys(path)

    def verify(self, message: bytes, signature: bytes) -> str | None:
        """The id of the trusted key that signed `message`, or None."""
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        if len(signature) != 64:
            return None
        for k in self.keys:
            try:
                Ed25519PublicKey.from_public_bytes(k.raw).verify(signature, message)
            except InvalidSignature:
                continue
            return k.key_id
        return None

    def knows(self, kid: str) -> bool:
        return any(k.key_id == kid for k in self.keys)


def sign_manifest(manifest_bytes: bytes, key_file: Path) -> bytes:
    """The signature file for these manifest bytes (deterministic: the same key and manifest give the same bytes)."""
    key = _load_private(Path(key_file))
    sig = key.sign(_DOMAIN + manifest_bytes)
    env = {"format": _FORMAT, "algorithm": "ed25519", "key_id": key_id(_raw_public(key.public_key())),
           "signature": base64.b64encode(sig).decode()}
    return (json.dumps(env, sort_keys=True) + "\n").encode()


def load_trusted_keys(path: str | Path) -> list[TrustedKey]:
    """Public keys from a file: OpenSSH lines (`ssh-ed25519 AAAA... comment`, as in authorized_keys) or PEM blocks."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    p = Path(path)
    try:
        with open(p, "rb") as f:
            data = f.read(MAX_KEYS_FILE_BYTES + 1)
    except OSError as e:
        raise SignatureError(f"cannot read trusted keys {p}: {e.strerror or e}") from None
    if len(data) > MAX_KEYS_FILE_BYTES:
        raise SignatureError(f"trusted keys {p}: larger than {MAX_KEYS_FILE_BYTES} bytes")
    keys: list[TrustedKey] = []
    chunks: list[tuple[int, bytes, str]] = []
    text = data.decode("utf-8", "replace")
    if "-----BEGIN PUBLIC KEY-----" in text:
        for block in text.split("-----BEGIN PUBLIC KEY-----")[1:]:
            chunks.append((0, ("-----BEGIN PUBLIC KEY-----" + block.split("-----END PUBLIC KEY-----")[0]
                               + "-----END PUBLIC KEY-----\n").encode(), ""))
    else:
        for n, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if line and not line.startswith("#"):
                parts = line.split(None, 2)
                chunks.append((n, " ".join(parts[:2]).encode(), parts[2] if len(parts) > 2 else ""))
    for n, chunk, comment in chunks:
        try:
            key = (serialization.load_pem_public_key(chunk) if chunk.startswith(b"-----")
                   else serialization.load_ssh_public_key(chunk))
        except (ValueError, TypeError, Exception) as e:  # noqa: BLE001 - cryptography raises several types
            raise SignatureError(f"{p}:{n}: not a public key ({type(e).__name__})") from None
        if not isinstance(key, Ed25519PublicKey):
            raise SignatureError(f"{p}:{n}: not an Ed25519 key")
        raw = _raw_public(key)
        keys.append(TrustedKey(key_id(raw), raw, comment))
    if not keys:
        raise SignatureError(f"trusted keys {p}: no key in the file")
    return keys


def verify_manifest(manifest_bytes: bytes, signature: bytes | None, trusted: list[TrustedKey], source: str) -> str:
    """The key id that signed these manifest bytes; SignatureError when unsigned or not signed by a trusted key."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    if signature is None:
        raise SignatureError(f"{source}: the bundle is not signed ({SIGNATURE} is absent) and trusted keys are given")
    try:
        if len(signature) > MAX_SIGNATURE_BYTES:
            raise ValueError("too large")
        env = json.loads(signature)
        if not isinstance(env, dict) or env.get("format") != _FORMAT or env.get("algorithm") != "ed25519":
            raise ValueError("unknown signature format")
        sig = base64.b64decode(str(env["signature"]), validate=True)
        kid = str(env.get("key_id", ""))
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise SignatureError(f"{source}: malformed {SIGNATURE} ({e})") from None
    for k in trusted:
        try:
            Ed25519PublicKey.from_public_bytes(k.raw).verify(sig, _DOMAIN + manifest_bytes)
        except InvalidSignature:
            continue
        return k.key_id
    known = "one of the trusted keys" if any(k.key_id == kid for k in trusted) else f"an untrusted key ({kid[:60]!r})"
    raise SignatureError(f"{source}: bad signature: the manifest is not signed by a trusted key (it names {known})")
