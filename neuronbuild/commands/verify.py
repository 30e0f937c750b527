"""`neuronbuild verify BUNDLE [--host]`: offline checks that a bundle is intact and that this host can use it."""

from __future__ import annotations

import argparse

from neuronbuild import envvars, streams
from neuronbuild.commands.common import bad_input
from neuronbuild.errors import EXIT_BUILD_FAILED, EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    v = sub.add_parser("verify", help="check a bundle's digests and (with --host) that this host can run every graph")
    v.add_argument("bundle", help="a bundle archive (.tar.zst / .tar.gz)")
    v.add_argument("--host", action="store_true",
                   help="also check torch version, CPU ISA (cpu graphs) and Neuron platform (Neuron graphs)")
    v.add_argument("--num-blocks", metavar="N|LABEL=N,...",
                   help="with --host: the KV block count this host serves block-layout models with (default: "
                        "$NEURONBUILD_NUM_BLOCKS); a model compiled for another count is refused, naming both")
    v.add_argument("--trusted-keys", metavar="FILE",
                   help="also require the manifest to be signed by one of these Ed25519 public keys")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from neuronbuild.packaging.deploy import BundleError, check_bundle
    from neuronbuild.runtime.block_layout import NUM_BLOCKS_ENV, block_count_mismatches, parse_num_blocks
    from neuronbuild.runtime.host import check_graph, current_host
    from neuronbuild.runtime.signing import SignatureError, load_trusted_keys

    source = "--num-blocks" if args.num_blocks is not None else f"${NUM_BLOCKS_ENV}"
    try:
        asked = parse_num_blocks(args.num_blocks if args.num_blocks is not None else envvars.current().text(NUM_BLOCKS_ENV),
                                 source)
    except ValueError as e:
        return bad_input(str(e))
    try:
        keys = load_trusted_keys(args.trusted_keys) if args.trusted_keys else None
        manifest, _ = check_bundle(Path(args.bundle), keys)
    except (BundleError, SignatureError) as e:
        return bad_input(str(e))
    print(f"{manifest.label}: {len(manifest.graphs)} graph(s), {len(manifest.files) + 1} files, every digest matches"
          + (", signed by a trusted key" if keys else ""), file=streams.out())
    if not args.host:
        return EXIT_OK
    host = current_host()
    mismatches = [m for g in manifest.graphs for m in check_graph(g, host)]
    mismatches += block_count_mismatches(manifest.graphs, asked, source)  # (the block layout, #46)
    if mismatches:
        print(f"this host ({host.describe()}) cannot use {len(mismatches)} graph check(s):", file=streams.err())
        for m in mismatches:
            print(f"  {m}", file=streams.err())
        return EXIT_BUILD_FAILED
    print(f"this host ({host.describe()}) can use every graph", file=streams.out())
    return EXIT_OK
