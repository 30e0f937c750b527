"""The `neuronbuild` command line: argument parsing, dispatch to command modules, one-line errors and exit codes."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from neuronbuild.commands import COMMAND_MODULES
from neuronbuild.errors import EXIT_BAD_INPUT, EXIT_BUILD_FAILED, EXIT_INTERRUPTED, NeuronBuildError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"neuronbuild: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)


def make_parser() -> tuple[argparse.ArgumentParser, dict[str, str]]:
    parser = _Parser(prog="neuronbuild", description="Bazel-style builds of model graphs for accelerators.")
    parser.add_argument("-C", dest="directory", help="run as if started in this directory")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    owners: dict[str, str] = {}
    for name in COMMAND_MODULES:
        mod = importlib.import_module(f"neuronbuild.commands.{name}")
        before = set(sub.choices)
        mod.register(sub)
        for cmd in set(sub.choices) - before:
            owners[cmd] = name
    return parser, owners


def main(argv: Sequence[str] | None = None) -> int:
    parser, owners = make_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        if args.directory:
            os.chdir(Path(args.directory))
        mod = importlib.import_module(f"neuronbuild.commands.{owners[args.command]}")
        return int(mod.run(args))
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
