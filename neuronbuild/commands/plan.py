"""`neuronbuild plan PATTERNS` (= `build --dry-run`): the bucket x target matrix, cached vs to build, estimated time."""

from __future__ import annotations

import argparse

from neuronbuild.commands.common import add_context_args, add_output_arg


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("plan", help="what a build would execute and what is cached, with time estimates")
    p.add_argument("patterns", nargs="*", help="target patterns (default //...)")
    p.add_argument("--jobs", "-j", type=int, default=None, help="workers assumed for the wall-time estimate")
    add_output_arg(p)
    add_context_args(p)


def run(args: argparse.Namespace) -> int:
    from neuronbuild.commands.common import run_plan

    return run_plan(args)
