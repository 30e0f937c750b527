"""`neuronbuild deploy BUNDLE --dest DIR`: check every digest of a bundle and install it atomically."""

from __future__ import annotations

import argparse
import signal

from neuronbuild import streams
from neuronbuild.commands.common import bad_input, raise_interrupt
from neuronbuild.errors import EXIT_BUILD_FAILED, EXIT_OK


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
    d.add_argument("--allow-downgrade", action="store_true",
                   help="make current again a release of a label that a later deploy replaced (with --trusted-keys a "
                        "downgrade is refused without it; without, it is made current with a warning)")
    d.add_argument("--host", action="store_true",
                   help="refuse the bundle (nothing is installed) unless this host can run every graph in it (torch "
                        "version, CPU ISA, Neuron platform), as `verify --host` checks; without it such a bundle is "
                        "installed with a warning")


class _HostCannotRun(Exception):
    """`deploy --host`: the bundle has graphs this host cannot run."""


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from neuronbuild.packaging.deploy import BundleError, deploy
    from neuronbuild.runtime.host import current_host, unrunnable
    from neuronbuild.runtime.layout import Manifest
    from neuronbuild.runtime.signing import SignatureError, load_trusted_keys

    host = current_host()
    report: list[tuple[int, int, list[str]]] = []  # (graphs this host cannot run, graphs, one line per label)

    def check_host(manifest: Manifest) -> None:  # before anything is extracted
        count, lines = unrunnable(manifest.graphs, host)
        report.append((count, len(manifest.graphs), lines))
        if count and args.host:
            raise _HostCannotRun(f"this host ({host.describe()}) cannot run {count} of {len(manifest.graphs)} "
                                 f"graph(s) of {manifest.label} (nothing was installed):\n  " + "\n  ".join(lines))

    try:
        keys = load_trusted_keys(args.trusted_keys) if args.trusted_keys else None
    except SignatureError as e:
        return bad_input(str(e))
    previous = signal.signal(signal.SIGTERM, raise_interrupt)  # `kill` cleans up like Ctrl-C does
    try:
        res = deploy(Path(args.bundle), Path(args.dest), args.sha256, keys, check=check_host,
                     allow_downgrade=True if args.allow_downgrade else None)
    except BundleError as e:
        return bad_input(f"{e} (nothing was installed)")
    except _HostCannotRun as e:
        print(f"neuronbuild: error: {e}", file=streams.err())
        return EXIT_BUILD_FAILED
    finally:
        signal.signal(signal.SIGTERM, previous)
    state = ("was damaged; repaired and made current" if res.repaired
             else "already installed; made current" if res.already else "installed")
    print(f"{res.label}: release {res.id} {state} in {res.dir} ({res.files} files)", file=streams.out())
    if res.downgraded_from and not args.allow_downgrade:
        print(f"neuronbuild: warning: a downgrade: {res.label}'s current release was {res.downgraded_from}, deployed "
              f"after {res.id}; --trusted-keys refuses this without --allow-downgrade", file=streams.err())
    count, total, lines = report[0] if report else (0, 0, [])
    if count:  # installed all the same: a serving directory may be prepared on another host than the one it serves
        print(f"neuronbuild: warning: this host ({host.describe()}) cannot run {count} of {total} graph(s) of this "
              f"release:\n  " + "\n  ".join(lines) + f"\n  it is now the newest release in {args.dest}: a strict "
              f"open_cache() on this host refuses those graphs (`deploy --host` refuses such a bundle; "
              f"`verify --host` checks one without installing it)", file=streams.err())
    return EXIT_OK
