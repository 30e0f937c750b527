"""`neuronbuild help [COMMAND]` and `neuronbuild version`: the help and version as commands (as `-h`/`--version`)."""

from __future__ import annotations

import argparse

from neuronbuild import streams
from neuronbuild.commands.common import bad_input
from neuronbuild.errors import EXIT_OK
from neuronbuild.rcfile import subparsers


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    h = sub.add_parser("help", help="show the commands, or one command's flags: neuronbuild help cache gc")
    h.add_argument("topic", nargs="*", metavar="COMMAND", help="a command (and sub-command) to show the flags of")
    sub.add_parser("version", help="print neuronbuild's version (= neuronbuild --version)")


def run(args: argparse.Namespace) -> int:
    if args.command == "version":
        from neuronbuild.cli import version_text

        print(version_text(), file=streams.out())
        return EXIT_OK
    import difflib

    from neuronbuild.cli import make_parser

    parser, _ = make_parser()
    target = parser
    for word in args.topic:
        subs = subparsers(target)
        if word not in subs:
            near = difflib.get_close_matches(word, list(subs), n=1)
            where = "neuronbuild" if target is parser else target.prog
            hint = f" (did you mean '{near[0]}'?)" if near else f" (commands: {', '.join(subs)})" if subs else ""
            return bad_input(f"{where} has no command '{word}'{hint}")
        target = subs[word]
    target.print_help()
    return EXIT_OK
