"""`neuronbuild completion bash|zsh|fish`: print a shell completion script generated from the CLI definition."""

from __future__ import annotations

import argparse

from neuronbuild import command, streams
from neuronbuild.commands.common import bad_input
from neuronbuild.errors import EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("completion", help="print a bash, zsh or fish completion script: source <(neuronbuild "
                                          "completion bash)")
    p.add_argument("shell", nargs="?", choices=("bash", "zsh", "fish"), help="the shell to complete for")
    p.add_argument("--labels", metavar="PREFIX", help=argparse.SUPPRESS)  # used by the scripts: label candidates


def run(args: argparse.Namespace) -> int:
    from neuronbuild import completion
    from neuronbuild.cli import make_parser

    if args.labels is not None:
        for cand in completion.label_candidates(args.labels, command.current().cwd):
            print(cand, file=streams.out())
        return EXIT_OK
    if args.shell is None:
        return bad_input("give a shell: neuronbuild completion bash|zsh|fish")
    parser, _ = make_parser()
    script = {"bash": completion.bash_script, "zsh": completion.zsh_script, "fish": completion.fish_script}
    print(script[args.shell](parser), end="", file=streams.out())
    return EXIT_OK
