"""`neuronbuild deploy BUNDLE --cache-dir DIR`: check every digest of a bundle and install it atomically."""

from __future__ import annotations

import argparse
import sys

from neuronbuild.errors import EXIT_BAD_INPUT, EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    d = sub.add_parser("deploy", help="install a release bundle into a serving directory (atomic, digest-checked)")
    d.add_argument("bundle", help="a bundle archive (neuronbuild-out/<pkg>/<name>.tar.zst)")
    d.add_argument("--cache-dir", required=True, help="the serving directory production opens with open_cache()")
    d.add_argument("--sha256", help="refuse the bundle unless the archive has this sha256 (from <bundle>.sha256)")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from neuronbuild.packaging.deploy import BundleError, deploy

    try:
        res = deploy(Path(args.bundle), Path(args.cache_dir), args.sha256)
    except BundleError as e:
        print(f"neuronbuild: error: {e} (nothing was installed)", file=sys.stderr)
        return EXIT_BAD_INPUT
    state = "already installed; made current" if res.already else "installed"
    print(f"{res.label}: release {res.id} {state} in {res.dir} ({res.files} files)")
    return EXIT_OK
