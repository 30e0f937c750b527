"""`neuronbuild deploy BUNDLE --dest DIR`: check every digest of a bundle and install it atomically."""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Any

from neuronbuild.errors import EXIT_BAD_INPUT, EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    d = sub.add_parser("deploy", help="install a release bundle into a serving directory (atomic, digest-checked)")
    d.add_argument("bundle", help="a bundle archive (neuronbuild-out/<pkg>/<name>.tar.zst)")
    d.add_argument("--dest", "--cache-dir", dest="dest", required=True, metavar="DIR",
                   help="the serving directory production opens with open_cache() (not a build cache; "
                        "--cache-dir is an older name of this flag)")
    d.add_argument("--sha256", help="refuse the bundle unless the archive has this sha256 (from <bundle>.sha256)")
    d.add_argument("--trusted-keys", metavar="FILE",
                   help="refuse the bundle unless its manifest is signed by one of these Ed25519 public keys "
                        "(OpenSSH lines as in authorized_keys, or PEM)")


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from neuronbuild.packaging.deploy import BundleError, deploy
    from neuronbuild.runtime.signing import SignatureError, load_trusted_keys

    try:
        keys = load_trusted_keys(args.trusted_keys) if args.trusted_keys else None
    except SignatureError as e:
        print(f"neuronbuild: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)  # `kill` cleans up like Ctrl-C does
    try:
        res = deploy(Path(args.bundle), Path(args.dest), args.sha256, keys)
    except BundleError as e:
        print(f"neuronbuild: error: {e} (nothing was installed)", file=sys.stderr)
        return EXIT_BAD_INPUT
    finally:
        signal.signal(signal.SIGTERM, previous)
    state = ("was damaged; repaired and made current" if res.repaired
             else "already installed; made current" if res.already else "installed")
    print(f"{res.label}: release {res.id} {state} in {res.dir} ({res.files} files)")
    return EXIT_OK
