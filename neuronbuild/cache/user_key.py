"""Each user's own record-signing key, made on first use, and the set of keys a reader of a shared tier trusts (#49).

With a shared tier and no choice made (neither `--remote-cache-trust-writers` nor an explicit signing key), a build
signs the records it uploads with the user's own key (made on the first such build: an Ed25519 key in
`$XDG_CONFIG_HOME/neuronbuild/record-key`, default `~/.config/neuronbuild/record-key`, mode 0600, with its public
half beside it in `record-key.pub`, an OpenSSH line to give a team), and serves only records signed by that key or
by a key the team declares (`--remote-cache-trusted-keys FILE`, in an rc file or on the command line): a record
anyone else wrote is re-run here, never an error (cache/tiered.py). `--remote-cache-trust-writers` serves every
record (Bazel's model: access control on the store is the boundary).

Uses `cryptography` directly (the cache never imports the runtime; runtime/signing.py loads keys the same way)."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neuronbuild import envvars
from neuronbuild.cache.record_auth import RecordVerifier

KEY_ENV = "NEURONBUILD_RECORD_KEY"  # a file to use (or make) instead of the default place


def default_key_path() -> Path:
    """Where the user's own record key lives: $NEURONBUILD_RECORD_KEY, else $XDG_CONFIG_HOME/neuronbuild/record-key
    (default ~/.config/neuronbuild/record-key)."""
    explicit = envvars.current().text(KEY_ENV)
    if explicit:
        return Path(explicit).expanduser()
    env = envvars.environ()  # (the command's)
    base = env.get("XDG_CONFIG_HOME", "").strip() or str(Path(env.get("HOME") or Path.home()) / ".config")
    return Path(base) / "neuronbuild" / "record-key"


def _key_id(raw_public: bytes) -> str:
    """The OpenSSH-style fingerprint of a raw Ed25519 public key (as runtime.signing.key_id)."""
    blob = b"".join(len(p).to_bytes(4, "big") + p for p in (b"ssh-ed25519", raw_public))
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def ensure_user_key(path: Path | None = None) -> tuple[Path, bool]:
    """The user's record key file, made when missing (an Ed25519 PEM private key, 0600, in a 0700 directory, and its
    OpenSSH public line in `<path>.pub`). Returns (path, whether it was made now). OSError when it cannot be made."""
    p = path if path is not None else default_key_path()
    if p.exists():
        return p, False
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, pem)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, p)  # (two first builds at once: the first link wins, both use it)
    except FileExistsError:
        return p, False
    finally:
        tmp.unlink(missing_ok=True)
    blob = b"".join(len(x).to_bytes(4, "big") + x for x in (b"ssh-ed25519", raw))
    user = envvars.environ().get("USER") or str(os.getuid())
    with contextlib.suppress(OSError):
        Path(f"{p}.pub").write_text(f"ssh-ed25519 {base64.b64encode(blob).decode()} neuronbuild-records-{user}\n")
    return p, True


@dataclass
class TrustSet:
    """The keys whose shared-tier records a build serves: its own signing key (`own`: (key id, raw public key)) plus
    the keys declared in a trusted-keys file (`declared`: runtime.signing.TrustedKeys, or None). `implicit`: no file
    was given (the default: the user's own key only), so `cache verify` does not call other writers' records bad."""

    own: Sequence[tuple[str, bytes]]
    declared: RecordVerifier | None = None
    implicit: bool = True
    path: str = field(init=False)

    def __post_init__(self) -> None:
        mine = ", ".join(k for k, _raw in self.own)
        self.path = (f"your own key {mine}" if self.declared is None else f"{self.declared.path} and your own key "
                     f"{mine}")

    def verify(self, message: bytes, signature: bytes) -> str | None:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        if len(signature) == 64:
            for kid, raw in self.own:
                try:
                    Ed25519PublicKey.from_public_bytes(raw).verify(signature, message)
                except InvalidSignature:
                    continue
                return kid
        return self.declared.verify(message, signature) if self.declared is not None else None

    def knows(self, key_id: str) -> bool:
        return any(k == key_id for k, _raw in self.own) or (self.declared is not None and self.declared.knows(key_id))


def public_of(private_key: Any) -> tuple[str, bytes]:
    """(key id, raw public key) of a cryptography Ed25519 private key."""
    from cryptography.hazmat.primitives import serialization

    raw = bytes(private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw))
    return _key_id(raw), raw
