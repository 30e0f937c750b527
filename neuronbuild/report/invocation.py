"""One command's invocation, from its start to its record and page: what `build`, `plan` and the no-op fast path
call. Recording never fails the command it records (a full disk costs the page, not the build)."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neuronbuild import streams
from neuronbuild.report.store import InvocationStore, new_id, output_base

if TYPE_CHECKING:
    from neuronbuild.analysis.action_graph import ActionGraph
    from neuronbuild.cache.local import LocalCache
    from neuronbuild.report.record import InvocationRecorder

RENDER_UP_TO = 3000  # actions: a larger build's page is rendered by `neuronbuild report`, not at the build's end
EXIT = {"ok": 0, "failed": 1, "error": 2, "interrupted": 8}
# Flags that say how a command ran rather than what it asked (left out of the record's flags).
_SKIP_FLAGS = ("command", "patterns", "func", "directory", "norc", "batch")


def command_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The flags this command was given: those whose value differs from the command's default."""
    defaults: dict[str, Any] = {}
    try:
        from neuronbuild.cli import _parser

        defaults = vars(_parser()[0].parse_args([str(args.command)]))
    except (Exception, SystemExit):  # noqa: BLE001 - without defaults, every flag is listed
        pass
    flags = {k: v for k, v in sorted(vars(args).items())
             if k not in _SKIP_FLAGS and not callable(v) and (k not in defaults or defaults[k] != v)}
    if flags.get("action_env"):  # values may be secrets: reports show their digests
        from neuronbuild.analysis.plan_settings import redact_action_env

        flags["action_env"] = redact_action_env(flags["action_env"])
    return flags


def command_line(command: str, patterns: Sequence[str], flags: Mapping[str, Any]) -> list[str]:
    """The command as typed, near enough (also in a build server, whose own argv is not the command's): the
    patterns and every flag that was set (an .neuronbuildrc's included)."""
    out = ["neuronbuild", command, *patterns]
    for k, v in flags.items():
        if v in (None, False, [], ()) or k in ("output_user_root", "max_idle_secs"):
            continue
        name = "--" + k.replace("_", "-")
        if v is True:
            out.append(name)
        elif isinstance(v, (list, tuple)):
            for x in v:
                out += [name, str(x)]
        else:
            out += [name, str(v)]
    return out


class Invocation:
    """A build or plan being recorded. `page` is where its report is (or will be) once finished."""

    def __init__(self, command: str, argv: Sequence[str], patterns: Sequence[str], flags: Mapping[str, Any],
                 workspace: Path, cache_dir: Path, output_user_root: str | None = None) -> None:
        self.started = time.time()
        self.id = new_id(self.started)
        self.command = command
        self.argv = list(argv)
        self.patterns = list(patterns)
        self.flags = dict(flags)
        self.workspace = workspace
        self.cache_dir = cache_dir
        self.store = InvocationStore(output_base(workspace, output_user_root))
        self._recorder: InvocationRecorder | None = None
        self.ag: ActionGraph | None = None
        self.cache: LocalCache | None = None
        self.page: Path | None = None

    @property
    def recorder(self) -> InvocationRecorder:
        if self._recorder is None:
            from neuronbuild.report.record import InvocationRecorder

            self._recorder = InvocationRecorder()
        return self._recorder

    @classmethod
    def from_args(cls, command: str, args: argparse.Namespace, workspace: Path, cache_dir: Path,
                  patterns: Sequence[str]) -> Invocation:
        flags = command_flags(args)
        return cls(command, command_line(command, getattr(args, "patterns", None) or [], flags), patterns, flags,
                   workspace, cache_dir, getattr(args, "output_user_root", None))

    def _base(self, outcome: str) -> dict[str, Any]:
        return {"inv_id": self.id, "command": self.command, "argv": self.argv, "patterns": self.patterns,
                "flags": self.flags, "workspace": self.workspace, "cache_dir": self.cache_dir, "outcome": outcome,
                "exit_code": EXIT.get(outcome, 1), "started": self.started}

    def finish(self, outcome: str, not_started: Iterable[str] = (), planned: Mapping[str, str] | None = None,
               noop_key: str | None = None, render: bool = True,
               results: Mapping[str, Any] | None = None) -> Path | None:
        """Write the record (its page is rendered after the answer, for up to RENDER_UP_TO actions: render_soon);
        the page's path, None if nothing could be written. `results`: the build's (BuildResult.results), when it
        returned."""
        from neuronbuild.report.record import build_record

        try:
            rec = build_record(**self._base(outcome), ag=self.ag, recorder=self.recorder, cache=self.cache,
                               not_started=not_started, planned=planned, results=results)
            self.store.write(rec)
            if noop_key is not None and outcome == "ok":
                self.store.set_base(noop_key, self.id)
            self.page = self.store.page(self.id)
            if render and rec["total"] <= RENDER_UP_TO:
                render_soon(self.store, rec)
            return self.page
        except Exception as e:  # noqa: BLE001 - recording never fails the build it records
            print(f"warning: the invocation record was not written: {e}", file=streams.err())
            self.page = None
            return None


def record_noop(args: argparse.Namespace, workspace: Path, cache_dir: Path, patterns: Sequence[str], key: str,
                line: str) -> Path | None:
    """The fast path's no-op: a small record standing for the actions of the last full build of the same request
    (its base); its page is rendered after the answer (render_soon). In the build server the record is written after
    the answer too (after_answer). The page's path, None if nothing could be written."""
    from neuronbuild import after_answer

    inv = Invocation.from_args("build", args, workspace, cache_dir, patterns)
    inv.page = inv.store.page(inv.id)
    after_answer.later(lambda: _write_noop(inv, workspace, cache_dir, key, line))
    return inv.page


def _write_noop(inv: Invocation, workspace: Path, cache_dir: Path, key: str, line: str) -> None:
    try:
        base_id = inv.store.base(key)
        base = next((e for e in inv.store.index() if e.get("id") == base_id), {})
        import re

        m = re.match(r"(\d+) actions: 0 executed, (\d+) cached", line)
        total, cached = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
        rec = {"format": 1, "id": inv.id, "command": "build", "argv": inv.argv, "patterns": inv.patterns,
               "flags": {k: v for k, v in inv.flags.items() if v not in (None, False, [], ())},
               "workspace": str(workspace), "cache_dir": str(cache_dir), "started": round(inv.started, 3),
               "finished": round(time.time(), 3), "outcome": "ok", "exit_code": 0, "noop": True,
               "same_as": base_id, "executor": "", "jobs": 0, "wall_s": 0.0,
               "total_s": round(time.time() - inv.started, 3), "cpu_s": 0.0, "busy_worker_s": 0.0,
               "utilisation": 0.0, "peak_rss_mb": 0.0, "saved_s": float(base.get("work_s") or 0.0), "total": total,
               "counts": {"cached_local": cached}, "actions": [], "compiles": [], "slices": []}
        inv.store.write(rec)
        render_soon(inv.store, rec)
    except Exception as e:  # noqa: BLE001 - recording never fails the build it records
        print(f"warning: the invocation record was not written: {e}", file=streams.err())
        inv.page = None


def _summaries(store: InvocationStore, upto: str) -> list[dict[str, Any]]:
    """The recorded invocations up to `upto`, as the trend plots need them (the store's index)."""
    return [e for e in store.index() if str(e.get("id")) <= upto]


def page_inputs(store: InvocationStore, rec: Mapping[str, Any], other_ref: str | None = None
                ) -> tuple[dict[str, Any], dict[str, Any] | None, list[dict[str, Any]]]:
    """(the invocation with a no-op's actions filled in, the one to compare it with, the trend history): compared
    with `other_ref` when given, else with the previous invocation of the same patterns."""
    from neuronbuild.report.view import with_base

    base = store.load(str(rec["same_as"])) if rec.get("noop") and rec.get("same_as") else None
    full = with_base(rec, base)
    if other_ref is not None:
        other_id = store.resolve(other_ref)
        other = store.load(other_id) if other_id else None
        if other is None:
            raise LookupError(f"no recorded invocation {other_ref!r}")
    else:
        other = None if rec.get("noop") else store.previous(full)
    if other is not None and other.get("noop"):
        other = with_base(other, store.load(str(other.get("same_as"))) if other.get("same_as") else None)
    return full, other, _summaries(store, str(rec["id"]))


def render_invocation(store: InvocationStore, rec: Mapping[str, Any], other_ref: str | None = None) -> Path:
    """Write `rec`'s page beside its record; its path."""
    from neuronbuild.report.render import render, write_page

    full, other, history = page_inputs(store, rec, other_ref)
    html = render(full, other, history)
    return write_page(store.page(str(rec["id"]), other["id"] if other_ref is not None and other else None), html)


def render_soon(store: InvocationStore, rec: Mapping[str, Any]) -> Path:
    """An invocation's page, rendered by a detached interpreter spawned once the record is written, in batch mode and
    in the build server alike: the command answers without waiting for it (rendering the page of 2,624 actions took
    0.85 s of a warm server's no-op, which otherwise takes ~0.04 s), and a batch command never imports jinja2 (~50 ms
    of CPU). The build server spawns it once it idles (after_answer.when_idle: ten no-ops back to back took 0.18 s
    each beside their renderers, 0.04-0.05 s in its log without them). posix_spawn, not fork: no copy-on-write cost,
    and safe in the server's threaded process. The page appears shortly after the command's answer (a page opened at
    once may not be there yet); its path."""
    import os

    from neuronbuild import after_answer

    page = store.page(str(rec["id"]))
    if not hasattr(os, "posix_spawn"):
        return render_invocation(store, rec)
    after_answer.when_idle(lambda: _spawn_renderer(store, rec))  # (the build server: once it idles)
    return page


def _spawn_renderer(store: InvocationStore, rec: Mapping[str, Any]) -> None:
    import os

    pkg_parent = str(Path(__file__).resolve().parent.parent.parent)
    from neuronbuild import envvars

    env = dict(envvars.environ())  # (the command's)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_parent, env.get("PYTHONPATH", "")) if p)
    # -P and absolute sys.path entries only: `-c` would put the working directory (the workspace, the client's in the
    # build server) first on sys.path, and a cloned repo's json.py or argparse.py would run here, unconfined.
    code = ("import os, sys; sys.path[:] = [p for p in sys.path if os.path.isabs(p)]; "
            "from neuronbuild.report.invocation import render_stored; render_stored(sys.argv[1], sys.argv[2])")
    devnull = [(os.POSIX_SPAWN_OPEN, fd, os.devnull, os.O_RDWR, 0) for fd in (0, 1, 2)]
    try:  # off the caller's pipes (a caller reading them to EOF must not wait for it), in a session of its own
        os.posix_spawn(sys.executable, [sys.executable, "-P", "-c", code, str(store.dir), str(rec["id"])], env,
                       file_actions=devnull, setsid=True)
    except OSError:
        render_invocation(store, rec)


def render_noop(store: InvocationStore, rec: Mapping[str, Any]) -> Path | None:
    """A no-op's page from its base's no-op skeleton (render.noop_skeleton), made by the base's first no-op and
    kept beside the base's record: later no-ops of that base render no action again, only their id, time, command
    line and trends. None when the base is gone (render_invocation then says so on the page)."""
    from neuronbuild.atomic import atomic_write_bytes
    from neuronbuild.report import render

    base_id = str(rec.get("same_as") or "")
    if not base_id:
        return None
    part = store.skeleton(base_id)
    try:
        skeleton: str | None = part.read_text(encoding="utf-8")
    except (OSError, ValueError):
        skeleton = None
    history = _summaries(store, str(rec["id"]))
    html = render.from_skeleton(skeleton, rec, history) if skeleton is not None else None
    if html is None:
        base = store.load(base_id)
        if base is None:
            return None
        from neuronbuild.report.view import with_base

        skeleton = render.noop_skeleton(with_base(rec, base))
        if skeleton is None:
            return None
        with contextlib.suppress(OSError):
            atomic_write_bytes(part, skeleton.encode("utf-8"), part.parent, durable=False)
        html = render.from_skeleton(skeleton, rec, history)
        if html is None:
            return None
    return render.write_page(store.page(str(rec["id"])), html)


def render_stored(store_dir: str, inv_id: str) -> None:
    """The spawned renderer of an invocation's page (render_soon)."""
    store = InvocationStore(Path(store_dir).parent)
    rec = store.load(inv_id)
    if rec is not None and not (rec.get("noop") and render_noop(store, rec) is not None):
        render_invocation(store, rec)


def page_url(path: Path) -> str:
    return path.resolve().as_uri()


def note_line(page: Path | None) -> str | None:
    """The build summary's last line: where its invocation page is."""
    return f"Invocation: {page_url(page)}" if page is not None else None


