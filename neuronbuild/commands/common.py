"""The flags every command shares (cache, shared tier, fingerprint settings) and turning them into a BuildContext."""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Iterator, Mapping, Sequence, ValuesView
from typing import TYPE_CHECKING, Any

from neuronbuild import envvars, streams
from neuronbuild.errors import EXIT_BAD_INPUT

if TYPE_CHECKING:
    from neuronbuild.context import BuildContext


def add_cache_args(p: argparse.ArgumentParser) -> None:
    """Flags naming the cache tiers a command reads (the `cache` sub-commands take only these); defaults from the
    command's environment (cli._parser keeps a parser per environment)."""
    cfg = envvars.current()
    p.add_argument("--cache-dir", help="cache directory (default: $NEURONBUILD_CACHE_DIR or ~/.cache/neuronbuild)")
    p.add_argument("--remote-cache", default=cfg.text("NEURONBUILD_REMOTE_CACHE"),
                   metavar="PATH|s3://bucket/prefix",
                   help="shared cache tier: a shared directory or an S3 prefix (default: $NEURONBUILD_REMOTE_CACHE)")
    p.add_argument("--remote-cache-readonly", action="store_true",
                   default=cfg.flag("NEURONBUILD_REMOTE_CACHE_READONLY"),
                   help="read from the shared tier but never upload to it")
    p.add_argument("--s3-endpoint-url", default=None,
                   help="S3-compatible endpoint for s3:// tiers (default: $NEURONBUILD_S3_ENDPOINT_URL or AWS's)")
    p.add_argument("--remote-cache-trusted-keys", metavar="FILE",
                   default=cfg.text("NEURONBUILD_REMOTE_CACHE_TRUSTED_KEYS"),
                   help="serve only shared-tier records signed by one of these Ed25519 public keys (ssh-ed25519 "
                        "lines or PEM; default: $NEURONBUILD_REMOTE_CACHE_TRUSTED_KEYS); others are rebuilt")
    p.add_argument("--remote-cache-trust-writers", action="store_true",
                   default=cfg.flag("NEURONBUILD_REMOTE_CACHE_TRUST_WRITERS"),
                   help="declare whoever can write the shared tier trusted: serve its records unsigned, without "
                        "the warning (Bazel's model; default: $NEURONBUILD_REMOTE_CACHE_TRUST_WRITERS)")
    p.add_argument("--remote-cache-signing-key", metavar="FILE",
                   default=cfg.text("NEURONBUILD_REMOTE_CACHE_SIGNING_KEY"),
                   help="sign the records this build uploads with this Ed25519 private key (default: "
                        "$NEURONBUILD_REMOTE_CACHE_SIGNING_KEY); keep it where actions cannot read it")


def add_context_args(p: argparse.ArgumentParser, *, what_if: bool = False) -> None:
    """Flags that decide which fingerprints a command computes and which cache tiers it reads: the same for every
    command that plans, so `plan`, `explain`, `validate` ... see exactly what `build` sees."""
    add_cache_args(p)
    p.add_argument("--action-env", action="append", metavar="NAME[=VALUE]",
                   help="pass this variable to actions (value from your environment, or VALUE); name and value "
                        "enter fingerprints. Repeatable")
    p.add_argument("--trust-workspace-rc", action="store_true",
                   help="let this workspace's .neuronbuildrc choose programs the build runs (--neuronx-cc): without "
                        "it such a setting is refused before anything runs; given once (on the command line or in "
                        "~/.neuronbuildrc, never a workspace's), it is remembered for those values")
    from neuronbuild import plugins

    for flag in plugins.settings_flags():  # what each toolchain's settings add (e.g. its compiler's path)
        p.add_argument(flag.name, dest=flag.dest, metavar=flag.metavar, type=flag.type or str, help=flag.help)
    if what_if:
        p.add_argument("--toolchain", action="append", metavar="COMPONENT=VERSION",
                       help=f"plan as if a toolchain component ({', '.join(plugins.toolchain_components())}, "
                            "...) had this version")


def add_limit_args(b: argparse.ArgumentParser) -> None:
    """Each action's limits (#49; execution/limits.py): on by default, scaled from its estimate."""
    b.add_argument("--action-timeout", default="auto", metavar="SECONDS",
                   help="fail an action (killing every process it started) after this many seconds; default auto: "
                        "10 x its estimate, at least 900 s for a trace or weights and 3600 s for a compile step "
                        "(auto*0.5 scales that); 0: none")
    b.add_argument("--action-memory", default="auto", metavar="SIZE",
                   help="fail an action whose processes use more memory: MB, 512M, 16G; default auto: 3 x its peak "
                        "estimate, at least 2048 MB (half the RAM until a run of the action is recorded; auto*2 scales that); 0: none")
    b.add_argument("--action-pids", default="auto", metavar="N",
                   help="fail an action that has more processes and threads at once; default auto: 16 per core, at "
                        "least 1024; 0: none")


def limit_settings(args: argparse.Namespace) -> Any:
    """The LimitSettings the limit flags ask for; ValueError (its message names the flag) when one is malformed."""
    from neuronbuild.execution.limits import LimitSettings, parse_memory, parse_pids, parse_timeout

    timeout, t_scale = parse_timeout(str(args.action_timeout))
    memory, m_scale = parse_memory(str(args.action_memory))
    return LimitSettings(timeout, t_scale, memory, m_scale, parse_pids(str(args.action_pids)))


def add_output_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output", choices=("text", "json"), default="text", help="output format (default text)")


def context_from_args(args: argparse.Namespace, verbosity: int | None = None,
                      need_workspace: bool = True) -> BuildContext:
    """The one BuildContext of this command (bad values raise UserInputError: exit 2)."""
    from neuronbuild.analysis.plan_settings import tool_values
    from neuronbuild.context import make_context

    return make_context(
        cache_dir=getattr(args, "cache_dir", None),
        remote_cache=getattr(args, "remote_cache", None),
        remote_cache_readonly=bool(getattr(args, "remote_cache_readonly", False)),
        s3_endpoint_url=getattr(args, "s3_endpoint_url", None),
        remote_cache_trusted_keys=getattr(args, "remote_cache_trusted_keys", None),
        remote_cache_trust_writers=bool(getattr(args, "remote_cache_trust_writers", False)),
        remote_cache_signing_key=getattr(args, "remote_cache_signing_key", None),
        signing_key=getattr(args, "signing_key", None),
        action_env=getattr(args, "action_env", None),
        tool_flags=tool_values(args),
        toolchain=getattr(args, "toolchain", None),
        verbosity=verbosity,
        need_workspace=need_workspace,
    )


def bad_input(msg: str) -> int:
    """Say a command's bad input (a flag, an argument) in one line; returns its exit code."""
    print(f"neuronbuild: error: {msg}", file=streams.err())
    return EXIT_BAD_INPUT


def raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def bad_jobs(args: argparse.Namespace) -> str | None:
    jobs = getattr(args, "jobs", None)
    return "--jobs must be at least 1" if jobs is not None and jobs < 1 else None


def run_plan(args: argparse.Namespace) -> int:
    """`plan` and `build --dry-run`: what a build would execute, checked against every cache tier without fetching."""
    import json

    from neuronbuild.analysis.plan_report import plan_report
    from neuronbuild.build import settings_notes
    from neuronbuild.errors import EXIT_OK
    from neuronbuild.execution.env import default_jobs

    if err := bad_jobs(args):
        return bad_input(err)
    ctx = context_from_args(args)
    graph = ctx.load(args.patterns)
    ag = ctx.plan(graph)
    for note in settings_notes(ctx.settings, ag, toolchains=()):  # a plan makes no graphs: no toolchain notes
        print(note, file=streams.err())
    from neuronbuild.analysis.explain import ignored_option_warnings

    for note in ignored_option_warnings(graph, ag):
        print(note, file=streams.err())
    from neuronbuild import incremental
    from neuronbuild.execution.scheduler import needed_actions

    cache = ctx.open_cache()
    with incremental.analysis_gc():  # (100,000s of long-lived sets, estimates and lines: no collections meanwhile)
        todo, cached = needed_actions(ag, cache, probe=True)
        report = plan_report(ag, todo, cached, ctx.history(cache), args.jobs or default_jobs(),
                             incremental.analysis_memo(ctx.workspace.root, ctx.settings, ctx.command))
        if getattr(args, "output", "text") == "json":
            print(json.dumps(report.to_json(), indent=1, sort_keys=True), file=streams.out())
        else:  # (the matrix first: the build server sends it while the schedule for the summary is computed)
            matrix = report.matrix_lines()
            if matrix:
                streams.out().write("\n".join(matrix) + "\n")
            print(report.summary_line(), file=streams.out())
            if todo:
                from neuronbuild.execution.limits import defaults_line

                print(defaults_line(), file=streams.out())
    _record_plan(args, ctx, ag, cache, todo, cached)
    pools = ctx.command.pools if ctx.command is not None else None
    if pools is not None and pools.wanting:  # (the build server warms them)
        from neuronbuild.execution.local_executor import want_workers

        want_workers(pools, cache, args.jobs or default_jobs(), ctx.settings.action_env)
    return EXIT_OK


def _record_plan(args: argparse.Namespace, ctx: BuildContext, ag: Any, cache: Any, todo: Any, cached: Any) -> None:
    """A plan is an invocation too (neuronbuild/report/): recorded, its page rendered by `neuronbuild report`."""
    from neuronbuild.context import patterns_or_default
    from neuronbuild.report.invocation import Invocation

    inv = Invocation.from_args("plan", args, ctx.workspace.root, ctx.cache.dir, patterns_or_default(args.patterns))
    inv.ag, inv.cache = ag, cache
    inv.finish("ok", planned=_PlannedStates(todo, cached), render=False)


class _PlannedStates(Mapping[str, str]):
    """A plan's {fingerprint: to_build | cached} (the actions to execute and the cached ones: disjoint), made as a dict
    only when asked by key: the record of a large plan reads only its values, to count them (100,000s)."""

    def __init__(self, todo: Sequence[Any], cached: Sequence[str]) -> None:
        self.todo, self.cached = todo, cached
        self._states: dict[str, str] | None = None

    def _dict(self) -> dict[str, str]:
        from neuronbuild.report.states import CACHED, TO_BUILD

        if self._states is None:
            self._states = dict.fromkeys([a.fingerprint for a in self.todo], TO_BUILD)
            self._states.update(dict.fromkeys(self.cached, CACHED))
        return self._states

    def __getitem__(self, fp: str) -> str:
        return self._dict()[fp]

    def __iter__(self) -> Iterator[str]:
        return iter(self._dict())

    def __len__(self) -> int:
        return len(self._dict())

    def values(self) -> ValuesView[str]:
        return _StateValues(self)


class _StateValues(ValuesView[str]):
    """The states of a _PlannedStates without its dict: to build for each action to execute, then cached for each
    cached one."""

    def __init__(self, planned: _PlannedStates) -> None:
        super().__init__(planned)
        self.planned = planned

    def __iter__(self) -> Iterator[str]:
        from neuronbuild.report.states import CACHED, TO_BUILD

        todo, cached = len(self.planned.todo), len(self.planned.cached)
        return itertools.chain(itertools.repeat(TO_BUILD, todo), itertools.repeat(CACHED, cached))
