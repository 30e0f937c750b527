"""`neuronbuild clean [--expunge]`: remove the workspace's neuronbuild-out; with --expunge also its state in the cache."""

from __future__ import annotations

import argparse

from neuronbuild import streams
from neuronbuild.errors import EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("clean", help="remove this workspace's outputs (neuronbuild-out); --expunge: also its state "
                                     "in the cache")
    p.add_argument("--expunge", action="store_true",
                   help="also remove this workspace's state in the cache directory (load and digest caches, no-op "
                        "stamps, build roots, bundle pins); cached results shared with other workspaces are kept")
    p.add_argument("--cache-dir", help="cache directory (default: $NEURONBUILD_CACHE_DIR or ~/.cache/neuronbuild)")


def run(args: argparse.Namespace) -> int:
    from neuronbuild import command
    from neuronbuild.cache.gc import human
    from neuronbuild.cache.local import resolve_cache_dir
    from neuronbuild.clean import clean_outputs, expunge_state
    from neuronbuild.workspace import find_workspace

    ws = find_workspace(command.current().cwd)
    removed = clean_outputs(ws.root)
    if removed is None:
        print(f"clean: no outputs in {ws.root}", file=streams.out())
    else:
        print(f"clean: removed {removed.path} ({removed.files} files, {human(removed.bytes)})", file=streams.out())
    if args.expunge:
        cache_dir = resolve_cache_dir(args.cache_dir)
        files = expunge_state(ws.root, cache_dir)
        print(f"clean: removed {len(files)} state file(s) of this workspace from {cache_dir} "
              f"(cached results are kept; `neuronbuild cache gc` bounds them)", file=streams.out())
    return EXIT_OK
