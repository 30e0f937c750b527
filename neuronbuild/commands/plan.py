"""`neuronbuild plan PATTERNS` (= `build --dry-run`): the bucket x target matrix, cached vs to build, estimated time.

Also owns the flags that change fingerprints (--action-env, --neuronx-cc, --neuronx-cc-timeout, --toolchain), shared
by build, plan, explain and upgrade-impact so that every command computes the same fingerprints."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from neuronbuild.commands.common import add_cache_args
from neuronbuild.errors import EXIT_BAD_INPUT, EXIT_OK

if TYPE_CHECKING:
    from neuronbuild.analysis.plan_settings import PlanSettings


def add_settings_args(p: argparse.ArgumentParser, what_if: bool = False) -> None:
    p.add_argument("--action-env", action="append", metavar="NAME[=VALUE]",
                   help="pass this variable to actions (value from your environment, or VALUE); name and value "
                        "enter fingerprints. Repeatable")
    p.add_argument("--neuronx-cc", metavar="PATH",
                   help="neuronx-cc executable for Neuron targets (default: $NEURONX_CC, else neuronx-cc on PATH)")
    p.add_argument("--neuronx-cc-timeout", type=float, metavar="SECONDS",
                   help="kill neuronx-cc and fail the action after this long (default 3600)")
    if what_if:
        p.add_argument("--toolchain", action="append", metavar="COMPONENT=VERSION",
                       help="plan as if a toolchain component (python, torch, cxx, neuronx-cc) had this version")


def check_settings_flags(args: argparse.Namespace) -> None:
    """The checks of the settings flags that need no subprocess (a no-op build makes them before its fast path)."""
    from neuronbuild.analysis.plan_settings import find_neuronx_cc, parse_action_env
    from neuronbuild.errors import UserInputError

    timeout = getattr(args, "neuronx_cc_timeout", None)
    if timeout is not None and timeout <= 0:
        raise UserInputError("--neuronx-cc-timeout must be a positive number of seconds")
    parse_action_env(getattr(args, "action_env", None))
    find_neuronx_cc(getattr(args, "neuronx_cc", None))


def settings_from_args(args: argparse.Namespace, toolchain: list[str] | None = None) -> PlanSettings:
    from neuronbuild.analysis.plan_settings import resolve_settings

    return resolve_settings(getattr(args, "action_env", None), getattr(args, "neuronx_cc", None),
                            getattr(args, "neuronx_cc_timeout", None),
                            toolchain if toolchain is not None else getattr(args, "toolchain", None))


def add_output_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output", choices=("text", "json"), default="text", help="output format (default text)")


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("plan", help="what a build would execute and what is cached, with time estimates")
    p.add_argument("patterns", nargs="*", help="target patterns (default //...)")
    p.add_argument("--jobs", "-j", type=int, default=None, help="workers assumed for the wall-time estimate")
    add_output_arg(p)
    add_cache_args(p)
    add_settings_args(p)


def load_plan(args: argparse.Namespace, settings: PlanSettings | None = None) -> tuple[Any, Any, Any]:
    """(ActionGraph, LocalCache, CacheHistory) for args.patterns, as `build` would plan them."""
    from neuronbuild.analysis.planner import plan
    from neuronbuild.build import patterns_or_default
    from neuronbuild.cache.identity_index import CacheHistory
    from neuronbuild.cache.local import LocalCache, resolve_cache_dir
    from neuronbuild.loading.target_graph import load_targets
    from neuronbuild.workspace import find_workspace

    ws = find_workspace()
    graph = load_targets(ws.root, patterns_or_default(args.patterns), ws.cwd_package)
    ag = plan(graph, settings if settings is not None else settings_from_args(args))
    cache = LocalCache(resolve_cache_dir(args.cache_dir))
    return ag, cache, CacheHistory(cache.root)


def run(args: argparse.Namespace) -> int:
    from neuronbuild.analysis.plan_report import plan_report
    from neuronbuild.build import default_jobs, settings_notes
    from neuronbuild.execution.scheduler import needed_actions

    if args.jobs is not None and args.jobs < 1:
        print("neuronbuild: error: --jobs must be at least 1", file=sys.stderr)
        return EXIT_BAD_INPUT
    settings = settings_from_args(args)
    ag, cache, history = load_plan(args, settings)
    for note in settings_notes(settings, False):  # the neuronx-cc note is the build's, once it made Neuron graphs
        print(note, file=sys.stderr)
    todo, cached = needed_actions(ag, cache)
    report = plan_report(ag, todo, cached, history, args.jobs or default_jobs())
    if getattr(args, "output", "text") == "json":
        print(json.dumps(report.to_json(), indent=1, sort_keys=True))
    else:
        print("\n".join(report.lines()))
    return EXIT_OK
