"""`neuronbuild audit-keys PATTERNS [--quick] [--determinism]`: vary each input of the selected targets' actions one at a
time and check that their keys change exactly when their outputs do (analysis/key_audit.py judges)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neuronbuild import streams
from neuronbuild.commands.common import add_context_args, add_output_arg, bad_input
from neuronbuild.errors import EXIT_BUILD_FAILED, EXIT_OK

if TYPE_CHECKING:
    from neuronbuild.analysis.action_graph import ActionGraph
    from neuronbuild.analysis.key_audit import Variation
    from neuronbuild.context import BuildContext
    from neuronbuild.loading.target_graph import TargetGraph

# Caller variables an action must never see (the action environment sets or drops them): each varied in turn.
CALLER_VARS = {"LANG": "C", "LC_ALL": "C", "PYTHONHASHSEED": "1", "OMP_NUM_THREADS": "2",
               "AOTI_RUNTIME_CHECK_INPUTS": "0", "NEURON_CC_FLAGS": "-O1", "TORCHINDUCTOR_FREEZING": "1"}


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("audit-keys", help="vary each input of the selected actions one at a time: is every key "
                                          "changed exactly when its output is? (UNDER-KEYED: exit 1)")
    p.add_argument("patterns", nargs="*", help="target patterns (default //...)")
    p.add_argument("--quick", action="store_true", help="plan only (keys): judge by what each input is declared "
                                                        "to change, run nothing")
    p.add_argument("--determinism", action="store_true",
                   help="only build every selected action twice from scratch and report outputs that differ")
    p.add_argument("--only", action="append", metavar="TEXT",
                   help="vary only inputs whose name or change contains TEXT (repeatable)")
    p.add_argument("--jobs", "-j", type=int, default=None, help="actions run at once in each scratch build")
    p.add_argument("--scratch", metavar="DIR", help="where the scratch workspaces and caches go (default: a new "
                                                    "temporary directory, removed afterwards)")
    add_output_arg(p)
    add_context_args(p)


def run(args: argparse.Namespace) -> int:
    from neuronbuild.analysis.key_audit import AuditReport
    from neuronbuild.commands.common import bad_jobs, context_from_args

    if err := bad_jobs(args):
        return bad_input(err)
    ctx = context_from_args(args)
    if args.scratch and (Path(args.scratch) / "ws").exists():
        return bad_input(f"--scratch {args.scratch}: holds an earlier audit's files; give an empty or new directory")
    scratch = Path(args.scratch).resolve() if args.scratch else Path(tempfile.mkdtemp(prefix="neuronbuild-audit-"))
    try:
        audit = _Audit(ctx, scratch, tuple(args.patterns), args.jobs)
        report: AuditReport = audit.determinism() if args.determinism else audit.run(args.quick, args.only or ())
    except _BaselineFailed as e:
        print(f"neuronbuild: error: audit-keys: the baseline build failed (nothing to compare with): {e}",
              file=streams.err())
        return EXIT_BUILD_FAILED
    finally:
        if not args.scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    if args.output == "json":
        print(json.dumps(report.to_json(), indent=1, sort_keys=True), file=streams.out())
    else:
        print("\n".join(report.lines()), file=streams.out())
    return EXIT_BUILD_FAILED if report.under_keyed or report.nondeterministic else EXIT_OK


class _BaselineFailed(Exception):
    """The selected targets do not build as they are."""


def _progress(msg: str) -> None:
    print(f"audit-keys: {msg}", file=streams.err(), flush=True)


class _Audit:
    """One audit: a scratch copy of the workspace, the baseline plan, and a fresh scratch cache per run."""

    def __init__(self, ctx: BuildContext, scratch: Path, patterns: tuple[str, ...], jobs: int | None) -> None:
        from neuronbuild.execution.env import default_jobs
        from neuronbuild.workspace import OUTPUT_DIR

        self.user, self.scratch, self.patterns = ctx, scratch, patterns
        self.jobs = jobs or default_jobs()
        self.ws = scratch / "ws"
        shutil.copytree(ctx.workspace.root, self.ws, symlinks=True,
                        ignore=shutil.ignore_patterns(OUTPUT_DIR, "__pycache__", ".git"))
        self.runs = 0
        self.ctx = self._context(self.ws, self._cache())
        self.graph = self.ctx.load(patterns)
        self.ag = self.ctx.plan(self.graph)

    def _cache(self) -> Path:
        self.runs += 1
        return self.scratch / "caches" / str(self.runs)

    def _context(self, root: Path, cache: Path, settings: Any = None) -> BuildContext:
        from neuronbuild.context import QUIET, BuildContext, CacheConfig
        from neuronbuild.workspace import Workspace

        return BuildContext(Workspace(root, self.user.workspace.cwd_package), CacheConfig(cache),
                            settings if settings is not None else self.user.settings, QUIET)

    def _build(self, ctx: BuildContext, ag: ActionGraph) -> tuple[dict[str, dict[str, str]], dict[str, str], str]:
        """Run every action of `ag` in ctx's (fresh) cache: ({identity: {output: digest}}, {fingerprint: cutoff
        key}, the first failure or "")."""
        from neuronbuild.build import BuildRequest, make_executor
        from neuronbuild.execution.cutoff import cutoff_key
        from neuronbuild.execution.events import EventBus
        from neuronbuild.execution.scheduler import Scheduler, SchedulerOptions

        cache = ctx.open_cache()
        try:
            executor = make_executor(ctx, BuildRequest(self.patterns, self.jobs), cache)
            try:
                result = Scheduler(ctx.workspace.root, cache, executor, SchedulerOptions(keep_going=True),
                                   EventBus([])).run(ag)
            finally:
                executor.shutdown()
            outputs, keys = {}, {}
            for fp, a in ag.actions.items():
                res = cache.lookup(fp)
                if res is not None:
                    outputs[a.identity] = {n: o.digest for n, o in sorted(res.outputs.items())}
                    keys[fp] = cutoff_key(a, cache) or ""
        finally:
            cache.finish()
        error = f"{result.failures[0].action.describe()}: {result.failures[0].error}" if result.failures else ""
        return outputs, keys, error.splitlines()[0] if error else ""

    def determinism(self) -> Any:
        from neuronbuild.analysis.key_audit import AuditReport

        return AuditReport((), False, self._twice()[1])

    def _twice(self) -> tuple[dict[str, dict[str, str]], tuple[str, ...], dict[str, str]]:
        """The baseline built twice from scratch (two caches, two worker pools): its outputs and cutoff keys, and the
        actions whose outputs differed."""
        runs = []
        for i in (1, 2):
            _progress(f"baseline build {i} of 2 ({len(self.ag.actions)} actions, a fresh cache)")
            outputs, keys, error = self._build(self._context(self.ws, self._cache()), self.ag)
            if error:
                raise _BaselineFailed(error)
            runs.append((outputs, keys))
        (first, keys), (second, _k) = runs
        differ = tuple(a.describe() for a in self.ag.actions.values() if first.get(a.identity) != second.get(a.identity))
        for d in differ:
            _progress(f"nondeterministic: {d}")
        return first, differ, keys

    def run(self, quick: bool, only: tuple[str, ...] | list[str]) -> Any:
        from neuronbuild.analysis.key_audit import AuditReport

        variations, skipped = self.variations()
        if only:
            variations = [v for v in variations if any(t in f"{v.name} ({v.detail})" for t in only)]
        base_out: dict[str, dict[str, str]] | None = None
        base_keys: dict[str, str] = {}
        noisy: tuple[str, ...] = ()
        noisy_ids: set[str] = set()
        if not quick:
            base_out, noisy, base_keys = self._twice()
            noisy_ids = {a.identity for a in self.ag.actions.values() if a.describe() in noisy}
        results = []
        for i, v in enumerate(variations, 1):
            results.append(self._one(v, quick, base_out, base_keys, noisy_ids))
            _progress(f"[{i}/{len(variations)}] {v.name} ({v.detail}): {results[-1].verdict}")
        return AuditReport(tuple(results), quick, noisy, tuple(skipped))

    def _one(self, v: Variation, quick: bool, base_out: Any, base_keys: Mapping[str, str], noisy: set[str]) -> Any:
        """The variation applied, planned and (unless quick or plan-only) built, and judged."""
        from neuronbuild.analysis.key_audit import InputResult, identity_pairs, judge
        from neuronbuild.errors import UserInputError

        try:
            with self._applied(v) as (ctx, graph):
                ag = ctx.plan(graph)
                pairs = identity_pairs(self.ag.actions, ag.actions)
                if quick or v.plan_only:
                    return InputResult(v, judge(v, pairs, None, None, set(), noisy))
                outputs, keys, error = self._build(ctx, ag)
        except UserInputError as e:
            return InputResult(v, error=str(e).splitlines()[0])
        if error:
            return InputResult(v, error=f"the variant's build failed: {error}")
        by_identity = {a.identity: a.fingerprint for a in self.ag.actions.values()}
        cut = {a.fingerprint for a, b in pairs if b is not None and a.fingerprint != b.fingerprint and
               keys.get(a.fingerprint) and keys.get(a.fingerprint) == base_keys.get(by_identity[a.identity])}
        return InputResult(v, judge(v, pairs, outputs, base_out, cut, noisy))

    @contextlib.contextmanager
    def _applied(self, v: Variation) -> Iterator[tuple[BuildContext, TargetGraph]]:
        """The context and target graph with `v` applied (and undone afterwards)."""
        fresh = self._cache()
        if v.how == "attr":
            assert v.label is not None
            t = self.graph.targets[v.label]
            targets = {**self.graph.targets, v.label: dataclasses.replace(t, attrs={**t.attrs, v.attr: v.value})}
            yield self._context(self.ws, fresh), dataclasses.replace(self.graph, targets=targets)
        elif v.how == "file":
            path = self.ws / v.path
            original = path.read_bytes()
            try:
                path.write_bytes(v.data)
                ctx = self._context(self.ws, fresh)
                yield ctx, ctx.load(self.patterns)
            finally:
                path.write_bytes(original)
        elif v.how in ("env", "home"):  # the command's environment changed: what it plans and runs sees it
            from neuronbuild.command import current

            with current().with_env(v.env).active():
                ctx = self._context(self.ws, fresh)
                yield ctx, ctx.load(self.patterns)
        elif v.how == "workspace":
            moved = self.scratch / "moved" / "elsewhere" / "ws"
            if not moved.exists():
                shutil.copytree(self.ws, moved, symlinks=True)
            ctx = self._context(moved, fresh)
            yield ctx, ctx.load(self.patterns)
        elif v.how == "cache_dir":
            ctx = self._context(self.ws, fresh)
            yield ctx, ctx.load(self.patterns)
        else:  # settings: declared variables, a toolchain setting, a what-if version
            s = self.user.settings
            if v.how == "action_env":
                s = dataclasses.replace(s, action_env=tuple((n, dict(v.env).get(n, val)) for n, val in s.action_env))
            elif v.how == "tool":
                s = dataclasses.replace(s, tools=tuple((n, v.tool[1] if n == v.tool[0] else val) for n, val in s.tools))
            else:
                s = dataclasses.replace(s, toolchain_overrides={v.toolchain[0]: v.toolchain[1]})
            yield self._context(self.ws, fresh, s), self.graph

    def variations(self) -> tuple[list[Variation], list[str]]:
        from neuronbuild import plugins
        from neuronbuild.analysis.key_audit import (
            Variation,
            attr_variations,
            file_variations,
            tool_variations,
            toolchain_variations,
        )
        from neuronbuild.loading.schema import label_values
        from neuronbuild.plugin_api.toolchain import UNSET

        declared: dict[Any, frozenset[str]] = {}
        defaults: dict[Any, Any] = {}
        for ct in self.ag.compiles:
            t = self.graph.targets.get(ct.label)
            if t is None:
                continue
            tc = plugins.toolchain(ct.toolchain)
            kinds = frozenset(self.ag.actions[fp].kind for _b, fp in ct.buckets)
            for attr, names in (("options", [k.name for k in tc.option_keys]),
                                ("target", ["platform", *(a.name for a in tc.target_attrs)])):
                for lbl in label_values(t.attrs.get(attr)) if t.attrs.get(attr) is not None else []:
                    for name in names:
                        declared[lbl, name] = declared.get((lbl, name), frozenset()) | kinds
                    for k in tc.option_keys if attr == "options" else ():
                        defaults[lbl, k.name] = None if k.default is UNSET else k.default
        models = frozenset(ct.model for ct in self.ag.compiles)
        out, skipped = attr_variations(self.graph, declared, defaults, models)
        files = [f.path for a in self.ag.actions.values() for f in a.files]
        fv, fskipped = file_variations(files, lambda p: (self.ws / p).read_bytes())
        out += fv
        skipped += fskipped
        out += tool_variations(self.user.settings.tools)
        out += toolchain_variations(self.ag.actions, plugins.toolchain_components())
        for name, value in self.user.settings.action_env:
            out.append(Variation(f"action-env {name}", "action_env", "declared value changed",
                                 expect=frozenset({"*"}), by_design="declared", env={name: f"{value or ''}-audit"}))
        bin_dir = self.scratch / "bin"
        bin_dir.mkdir(exist_ok=True)
        out.append(Variation("env PATH", "env", "an empty directory first", keep=True,
                             env={"PATH": f"{bin_dir}:{os.environ.get('PATH', '')}"}))
        declared_names = {n for n, _v in self.user.settings.action_env}
        for name, value in CALLER_VARS.items():
            if name not in declared_names:
                out.append(Variation(f"env {name}", "env", f"set to {value!r} by the caller", keep=True,
                                     env={name: value}))
        tmp = self.scratch / "tmp"
        tmp.mkdir(exist_ok=True)
        out.append(Variation("env TMPDIR", "env", "another directory", keep=True, env={"TMPDIR": str(tmp)}))
        out.append(Variation("HOME", "home", "another home directory", keep=True,
                             env={"HOME": str(self.scratch / "home")}))
        out.append(Variation("workspace path", "workspace", "the workspace copied elsewhere", keep=True))
        out.append(Variation("cache dir", "cache_dir", "another cache directory", keep=True))
        return out, skipped
