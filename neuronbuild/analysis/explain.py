"""Why an action would execute: no previous result for its identity, or the exact record fields that changed."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from neuronbuild.analysis.action_graph import ActionGraph
from neuronbuild.analysis.providers import CompileTarget
from neuronbuild.history import History, LatestEntry
from neuronbuild.loading.target_graph import TargetGraph, locate
from neuronbuild.plugin_api.actions import COMPILE, TRACE, WEIGHTS, Action

NEW = "new"  # no previous result for this identity
CHANGED = "changed"  # fields changed against the identity's most recent result
OUTPUTS_MISSING = "outputs-missing"  # same fingerprint as the most recent result, but its outputs are gone
PREVIOUS_EVICTED = "previous-evicted"  # the most recent result's record is gone: nothing to compare with


class _Absent:
    def __repr__(self) -> str:
        return "(unset)"


ABSENT: Any = _Absent()


@dataclass(frozen=True)
class Change:
    """One changed field of an input record: its path, old and new value (ABSENT when missing on one side)."""

    path: tuple[str, ...]
    old: Any = field(hash=False, compare=False)
    new: Any = field(hash=False, compare=False)
    text: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"field": ".".join(self.path), "old": None if self.old is ABSENT else self.old,
                "new": None if self.new is ABSENT else self.new, "text": self.text}


@dataclass(frozen=True)
class Explanation:
    """Why one action would execute."""

    action: Action
    reason: str
    previous: str | None = None  # fingerprint compared with
    compared_bucket: str | None = None  # set when compared with another (no longer built) bucket of the same target
    changes: tuple[Change, ...] = ()

    def summary(self) -> str:
        if self.reason == NEW:
            return "no previous result for this action identity"
        if self.reason == OUTPUTS_MISSING:
            return "its result is no longer complete in the cache (outputs evicted or deleted)"
        if self.reason == PREVIOUS_EVICTED:
            return (f"the most recent result of this identity ({(self.previous or '')[:12]}) is no longer in the "
                    "cache; nothing to compare with")
        if self.compared_bucket:
            return f"no previous result for this bucket; compared with [{self.compared_bucket}], no longer built"
        return f"changed against the most recent result ({(self.previous or '')[:12]})"

    @property
    def may_cut_off(self) -> bool:
        """Whether early cutoff can skip it: only an action with an earlier result of its own identity (a changed
        one) may find that result again when its inputs re-run to identical outputs."""
        return self.reason == CHANGED and not self.compared_bucket

    def lines(self) -> list[str]:
        out = [f"{self.action.describe()}  ({self.action.fingerprint[:12]})"]
        if self.reason != CHANGED or self.compared_bucket:
            out.append(f"  {self.summary()}")
        out.extend(f"  {c.text}" for c in self.changes)
        if self.reason == CHANGED and not self.changes:
            out.append("  (no field differs: the fingerprint scheme changed)")
        return out

    def to_json(self) -> dict[str, Any]:
        a = self.action
        return {"identity": a.identity, "description": a.describe(), "fingerprint": a.fingerprint, "kind": a.kind,
                "label": str(a.label), "bucket": a.bucket.as_dict(), "platform": a.platform or None,
                "reason": self.reason, "summary": self.summary(), "previous": self.previous,
                "compared_bucket": self.compared_bucket, "changes": [c.to_json() for c in self.changes]}


def diff(old: Any, new: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any, Any]]:
    """Leaf-level differences of two JSON records: [(path, old, new)], ABSENT for a missing key."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[tuple[tuple[str, ...], Any, Any]] = []
        for k in sorted(set(old) | set(new), key=str):
            out.extend(diff(old.get(k, ABSENT), new.get(k, ABSENT), (*path, str(k))))
        return out
    if old is ABSENT and isinstance(new, dict) and new:
        return diff({}, new, path)
    if new is ABSENT and isinstance(old, dict) and old:
        return diff(old, {}, path)
    return [] if old == new else [(path, old, new)]


def _fmt(v: Any) -> str:
    if v is ABSENT or v is None:
        return "(unset)" if v is ABSENT else "(none)"
    if isinstance(v, str):
        return v
    return json.dumps(v, sort_keys=True)


def describe_change(path: tuple[str, ...], old: Any, new: Any, new_record: Mapping[str, Any]) -> str:
    """The user-facing line: `options.opt_level: 2 -> 3`, `src models/llama.py: changed`, `bucket: seq 512 -> 1024`,
    `toolchain torch: 2.13.0 -> 2.14.1`, `env NAME: changed`."""
    status = "added" if old is ABSENT else "removed" if new is ABSENT else "changed"
    if path[:2] == ("model", "srcs") and len(path) == 3:
        return f"src {path[2]}: {status}"
    if path == ("model", "weights", "digest"):
        w = (new_record.get("model") or {}).get("weights") or {}
        return f"weights {w.get('path', '')}: changed".replace("  ", " ")
    if path == ("model", "weights"):  # weights added or removed
        def wpath(v: Any) -> str:
            return str(v.get("path")) if isinstance(v, dict) else _fmt(v)

        return f"weights: {wpath(old)} -> {wpath(new)}"
    if path == ("model", "weights", "path"):
        return f"weights: {_fmt(old)} -> {_fmt(new)}"
    if path == ("tp_degree",):  # absent: an unsharded graph
        return f"tp_degree: {1 if old is ABSENT else _fmt(old)} -> {1 if new is ABSENT else _fmt(new)}"
    if path[:1] == ("bucket",) and len(path) == 2:
        return f"bucket: {path[1]} {_fmt(old)} -> {_fmt(new)}"
    if path[:1] == ("env",) and len(path) == 2:  # values are digests (they may be secrets): say what happened
        def state(v: Any) -> str:
            return "(unset)" if v is ABSENT or v is None else "set"

        return f"env {path[1]}: " + ("changed" if state(old) == state(new) == "set" else f"{state(old)} -> {state(new)}")
    if path[:1] == ("toolchain",) and len(path) == 2:
        return f"{path[0]} {path[1]}: {_fmt(old)} -> {_fmt(new)}"
    if path in (("trace",), ("lowering",), ("weights",)):
        return f"{path[0]}: {str(old)[:12]} -> {str(new)[:12]} (the previous {path[0]}'s record is not in the cache)"
    return f"{'.'.join(path)}: {_fmt(old)} -> {_fmt(new)}"


# Record fields holding the fingerprint of the action whose outputs this one reads (a compile's trace, a Neuron
# compile's lowering; `weights`: a compile's before #28's shipped weights, "shipped-1" since): a change there is
# explained by that action's own changed fields, when its old record is cached.
DEP_FIELDS = ("trace", "lowering", "weights")


def caused_changes(old: Mapping[str, Any], new: Mapping[str, Any], old_record: Callable[[str], Mapping[str, Any] | None],
                   new_record: Callable[[str], Mapping[str, Any] | None],
                   depth: int = 0) -> list[tuple[tuple[str, ...], Any, Any]]:
    """The changed fields of two records (`diff`); a changed dependency fingerprint (DEP_FIELDS) is replaced by that
    dependency's own changed fields (the cause) when both its records are known (`old_record`/`new_record`: the record
    of a fingerprint, or None)."""
    found = diff(dict(old), dict(new))
    for dep in DEP_FIELDS:
        if depth > 3 or not any(p == (dep,) for p, _o, _n in found):
            continue
        prev, cur = old_record(str(old.get(dep))), new_record(str(new.get(dep)))
        if prev is None or cur is None:
            continue
        seen = {p for p, _o, _n in found}
        found = [c for c in found if c[0] != (dep,)]
        found += [c for c in caused_changes(prev, cur, old_record, new_record, depth + 1) if c[0] not in seen]
    found.sort(key=lambda c: c[0])
    return found


def record_changes(ag: ActionGraph, action: Action, old: Mapping[str, Any], history: History) -> tuple[Change, ...]:
    """Changed fields of `action`'s record against `old` (caused_changes: a dependency's old record from the cache,
    when it is still there, its new one from the plan)."""
    new = action.record
    found = (caused_changes(old, new, lambda fp: getattr(history.result(fp), "record", None),
                            lambda fp: getattr(ag.actions.get(fp), "record", None))
             if action.kind not in (TRACE, WEIGHTS) else diff(dict(old), dict(new)))
    return tuple(Change(p, o, n, describe_change(p, o, n, new)) for p, o, n in found)


def _bucket_sibling(action: Action, current: set[str], history: History) -> LatestEntry | None:
    """The closest bucket of the same label and target that the plan no longer builds (same dimension names,
    fewest differing sizes, then most recent)."""
    mine = action.bucket.as_dict()
    best: tuple[int, float, LatestEntry] | None = None
    for e in history.group(action.identity):
        if e.identity in current or set(e.bucket) != set(mine):
            continue
        key = (sum(1 for k in mine if e.bucket.get(k) != mine[k]), -e.created, e)
        if best is None or key[:2] < best[:2]:
            best = key
    return best[2] if best else None


def explain_action(ag: ActionGraph, action: Action, history: History, current: set[str]) -> Explanation:
    latest = history.latest(action.identity)
    compared_bucket = None
    if latest is None:
        latest = _bucket_sibling(action, current, history)
        if latest is None:
            return Explanation(action, NEW)
        compared_bucket = ", ".join(f"{k}={latest.bucket[k]}" for k, _v in action.bucket.dims)
    if latest.fingerprint == action.fingerprint:
        return Explanation(action, OUTPUTS_MISSING, latest.fingerprint)
    prev = history.result(latest.fingerprint)
    if prev is None:
        if compared_bucket:
            return Explanation(action, NEW)
        return Explanation(action, PREVIOUS_EVICTED, latest.fingerprint)
    return Explanation(action, CHANGED, latest.fingerprint, compared_bucket,
                       record_changes(ag, action, prev.record, history))


def explain(ag: ActionGraph, todo: Sequence[Action], history: History) -> list[Explanation]:
    """An explanation for every action in `todo` (the actions a build would execute), in display_order."""
    current = {a.identity for a in ag.actions.values()}
    return [explain_action(ag, a, history, current) for a in display_order(ag, todo)]


# Within one bucket of a target: the trace, then the lowering (Neuron), then the compile (what reads what).
KIND_ORDER = {WEIGHTS: -1, TRACE: 0, "lower": 1, COMPILE: 2}


def target_actions(ag: ActionGraph, ct: CompileTarget) -> list[str]:
    """A compile target's actions as people read them: by graph family, then bucket, then trace -> lower -> compile."""
    out: dict[str, None] = {}
    for _bucket, fp in sorted(ct.buckets, key=lambda b: (b[0].graph, b[0].dims)):
        for a in sorted((ag.actions[x] for x in ag.closure(fp)),
                        key=lambda b: (KIND_ORDER.get(b.kind, 1), b.fingerprint)):
            out.setdefault(a.fingerprint, None)
    return list(out)


def display_order(ag: ActionGraph, actions: Iterable[Action]) -> list[Action]:
    """`actions` by target (label order), graph, bucket, then trace -> lower -> compile; an action several targets
    share (a trace) comes under the first of them. Actions of no compile target keep their order, at the end."""
    wanted = {a.fingerprint: a for a in actions}
    pos: dict[str, int] = {}
    for ct in sorted(ag.compiles, key=lambda c: str(c.label)):
        for fp in target_actions(ag, ct):
            if fp in wanted:
                pos.setdefault(fp, len(pos))
    rest = len(pos)
    return sorted(wanted.values(), key=lambda a: pos.get(a.fingerprint, rest))


def ignored_options(ag: ActionGraph) -> list[tuple[CompileTarget, str]]:
    """Compile targets with options set that their toolchain does not read, each with the sentence saying so (an
    ignored option enters none of that toolchain's fingerprints: changing it re-runs nothing)."""
    out = []
    for ct in sorted([c for c in ag.compiles if c.ignored_options], key=lambda c: str(c.label)):
        if ct.ignored_options:  # (sorting only those: the same order, a stable sort of fewer)
            keys = ", ".join(ct.ignored_options)
            out.append((ct, f"{ct.label}: toolchain '{ct.toolchain}' ({ct.description or ct.platform}) ignores "
                            f"option{'s' if len(ct.ignored_options) > 1 else ''} {keys}: "
                            f"{'they change' if len(ct.ignored_options) > 1 else 'it changes'} none of its graphs"))
    return out


MAX_OPTION_WARNINGS = 10  # located warnings per command (locating re-reads a BUILD file); the rest are counted


def ignored_option_warnings(graph: TargetGraph, ag: ActionGraph) -> list[str]:
    """`warning: FILE:LINE:COL: //pkg:t: toolchain 'aoti' (cpu/x86-64-v3) ignores option opt_level: ...`, at the
    compile targets' call sites; then what toolchains warn of in the options they read (`option_warnings`)."""
    found = ignored_options(ag)
    found += [(ct, f"{ct.label}: toolchain '{ct.toolchain}': {w}")
              for ct in sorted([c for c in ag.compiles if c.option_warnings], key=lambda c: str(c.label))
              for w in ct.option_warnings]
    out = []
    for ct, text in found[:MAX_OPTION_WARNINGS]:
        t = graph.targets.get(ct.label)
        where = f"{locate(graph, t)}: " if t is not None else ""
        out.append(f"warning: {where}{text}")
    if len(found) > MAX_OPTION_WARNINGS:
        out.append(f"warning: {len(found) - MAX_OPTION_WARNINGS} more warnings of compile targets' options "
                   "(`neuronbuild explain` lists the ignored ones)")
    return out
