"""The `neuronbuild` command line: argument parsing, dispatch to commands, one-line errors and exit codes."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from neuronbuild.errors import EXIT_BAD_INPUT, EXIT_BUILD_FAILED, EXIT_INTERRUPTED, EXIT_OK, NeuronBuildError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"neuronbuild: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-dir", help="cache directory (default: $NEURONBUILD_CACHE_DIR or ~/.cache/neuronbuild)")


def make_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="neuronbuild", description="Bazel-style builds of model graphs for accelerators.")
    parser.add_argument("-C", dest="directory", help="run as if started in this directory")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    b = sub.add_parser("build", help="build targets (default //...)")
    b.add_argument("patterns", nargs="*", help="target patterns: //pkg:name, //pkg/..., //pkg:all, //...")
    b.add_argument("--jobs", "-j", type=int, default=None, help="parallel workers (default: min(8, cores))")
    b.add_argument("--keep-going", "-k", action="store_true", help="continue independent actions after a failure")
    _add_common(b)
    return parser


def _cmd_build(args: argparse.Namespace) -> int:
    from neuronbuild.build import BuildRequest, default_jobs, patterns_or_default, print_report, run_build
    from neuronbuild.cache.local import resolve_cache_dir
    from neuronbuild.workspace import find_workspace

    if args.jobs is not None and args.jobs < 1:
        print("neuronbuild: error: --jobs must be at least 1", file=sys.stderr)
        return EXIT_BAD_INPUT
    ws = find_workspace()
    req = BuildRequest(patterns_or_default(args.patterns), resolve_cache_dir(args.cache_dir),
                       args.jobs or default_jobs(), args.keep_going)
    result = run_build(ws, req, print_report)
    print(result.summary(), flush=True)
    if result.failures:
        for f in result.failures:
            print(f"  FAILED {f.action.describe()}: {f.error}\n    log: {f.log}", file=sys.stderr)
        return EXIT_BUILD_FAILED
    return EXIT_OK


COMMANDS = {"build": _cmd_build}


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        if args.directory:
            os.chdir(Path(args.directory))
        return COMMANDS[args.command](args)
    except NeuronBuildError as e:
        print(str(e), file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("neuronbuild: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OSError as e:
        print(f"neuronbuild: error: {e}", file=sys.stderr)
        return EXIT_BUILD_FAILED


if __name__ == "__main__":
    raise SystemExit(main())
