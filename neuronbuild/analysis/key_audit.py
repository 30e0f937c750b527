"""Key soundness (`neuronbuild audit-keys`): the inputs to vary one at a time, and the verdict per (input, action kind).

An input is varied (a target attribute, a source or data file, a toolchain setting, a caller variable, the workspace
path, HOME, the cache dir), the plan is made again and, in full mode, its actions run in a fresh scratch cache. Each
action of the variant is paired with the baseline's by identity; per action kind the verdict is
- `ok`: key and output agree (both changed, both kept, or the key changed only because an input action's did and the
  outputs it reads came out identical: early cutoff ends the rebuild there);
- `over-keyed`: the key changed, the output did not (a rebuild for nothing);
- `UNDER-KEYED`: the output changed, the key did not (a cache would serve a wrong artifact).
Quick mode only plans: an input declared to change outputs (a toolchain's option, a model's config, a tool version)
that changes no key is `unkeyed?` (under-keyed, or read only in some cases: full mode tells); one that must not reach outputs (paths, HOME, undeclared variables) that
changes a key is `over-keyed`."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from neuronbuild.loading.labels import Label
from neuronbuild.loading.target_graph import TargetGraph
from neuronbuild.plugin_api.actions import Action

OK, OVER, UNDER = "ok", "over-keyed", "UNDER-KEYED"
UNKEYED = "unkeyed?"  # quick mode: declared to change an output, changes no key (full mode judges: --only NAME)
NONDETERMINISTIC, FAILED, INVALID = "nondeterministic", "failed", "invalid"
# Why an over-keyed input must stay keyed (docs/introspection.md lists them): printed beside the verdict.
BY_DESIGN = {
    "source": "sources are keyed by their bytes (a comment or dead code cannot be told from what runs without running "
              "it): the actions that run them re-run, and early cutoff ends the rebuild there when their outputs come "
              "out identical",
    "declared": "a declared --action-env variable is keyed whether or not a step reads it: neuronbuild cannot know "
                "which variables a compiler reads (that is why it must be declared)",
}
_TYPE_SWAPS = {"int64": "int32", "int32": "int64", "float32": "bfloat16", "bfloat16": "float32", "float16": "float32"}


@dataclass(frozen=True)
class Variation:
    """One input changed one way. `how` says what the runner applies: `attr` (label, attr, value), `file` (path, data),
    `env` (caller variables set or removed), `action_env` (declared values), `tool` (a setting's resolved value),
    `toolchain` (a what-if version), `workspace`, `home`, `cache_dir`. `expect`: the action kinds whose output this
    input is declared to change ("*": any), or () when it must change none (`keep`), or None when unknown."""

    name: str
    how: str
    detail: str = ""
    expect: frozenset[str] | None = None
    keep: bool = False
    plan_only: bool = False  # cannot be run here (a fake tool version or path): judged by its keys alone
    by_design: str = ""  # key in BY_DESIGN
    label: Label | None = None
    attr: str = ""
    value: Any = None
    path: str = ""
    data: bytes = b""
    env: Mapping[str, str | None] = field(default_factory=dict)
    tool: tuple[str, Any] = ("", None)
    toolchain: tuple[str, str] = ("", "")


@dataclass(frozen=True)
class KindVerdict:
    """One action kind's result under one variation."""

    kind: str
    actions: int
    key_changed: int
    output_changed: int | None  # None: not run (quick mode, plan-only inputs)
    verdict: str
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "actions": self.actions, "key_changed": self.key_changed,
                "output_changed": self.output_changed, "verdict": self.verdict, "note": self.note}


@dataclass(frozen=True)
class InputResult:
    variation: Variation
    kinds: tuple[KindVerdict, ...] = ()
    error: str = ""  # the variant could not be planned or built

    @property
    def verdict(self) -> str:
        if self.error:
            return INVALID if self.variation.how == "attr" else FAILED
        order = (UNDER, UNKEYED, OVER, NONDETERMINISTIC, OK)
        return min((k.verdict for k in self.kinds), key=order.index, default=OK)

    def to_json(self) -> dict[str, Any]:
        v = self.variation
        return {"input": v.name, "how": v.how, "detail": v.detail, "verdict": self.verdict, "error": self.error,
                "kinds": [k.to_json() for k in self.kinds]}

    def lines(self) -> list[str]:
        v = self.variation
        head = f"{v.name}" + (f" ({v.detail})" if v.detail else "")
        if self.error:
            return [f"{self.verdict:<11} {head}: {self.error}"]
        out = [f"{self.verdict:<11} {head}"]
        for k in self.kinds:
            outs = "not run" if k.output_changed is None else f"output changed {k.output_changed}"
            note = f"  ({k.note})" if k.note else ""
            out.append(f"  {k.kind}: {k.verdict}: key changed {k.key_changed}/{k.actions}, {outs}{note}")
        return out


@dataclass(frozen=True)
class AuditReport:
    results: tuple[InputResult, ...]
    quick: bool
    nondeterministic: tuple[str, ...] = ()  # descriptions of actions whose two scratch builds differed
    skipped: tuple[str, ...] = ()  # inputs not varied, and why

    @property
    def under_keyed(self) -> list[InputResult]:
        return [r for r in self.results if r.verdict == UNDER]

    def to_json(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for r in self.results:
            counts[r.verdict] = counts.get(r.verdict, 0) + 1
        return {"mode": "quick" if self.quick else "full", "inputs": [r.to_json() for r in self.results],
                "nondeterministic": list(self.nondeterministic), "not_varied": list(self.skipped),
                "counts": counts}

    def lines(self) -> list[str]:
        out = [line for r in self.results for line in r.lines()]
        for d in self.nondeterministic:
            out.append(f"nondeterministic: {d}: two builds from scratch produced different outputs")
        for s in self.skipped:
            out.append(f"not varied: {s}")
        counts = self.to_json()["counts"]
        out.append(f"{len(self.results)} inputs varied ({'quick: keys only' if self.quick else 'full'}): "
                   + ", ".join(f"{n} {v}" for v, n in sorted(counts.items())))
        return out


def attr_variations(graph: TargetGraph, declared: Mapping[tuple[Label, str], frozenset[str]],
                    defaults: Mapping[tuple[Label, str], Any] | None = None,
                    models: frozenset[Label] = frozenset()) -> tuple[list[Variation], list[str]]:
    """A valid value of the same type for every attribute of every loaded target (labels aside: another label is
    another target). `declared`: per (compiler_options or neuron_target label, attribute) a compile's toolchain
    reads, the action kinds of that toolchain (their outputs are declared to depend on it); `defaults`: the value
    that toolchain fills in for such an attribute left unset (an unset attribute with choices is set to another);
    `models`: the compiles' models (their `config`, `seed` and `inputs` are declared to change their graphs)."""
    from neuronbuild.loading.schema import RULES

    out: list[Variation] = []
    skipped: list[str] = []
    for label in sorted(graph.targets, key=str):
        t = graph.targets[label]
        schema = RULES.get(t.kind)
        if schema is None:
            continue
        for a in schema.attrs:
            value = t.attrs.get(a.name)
            if value is None and a.choices and (label, a.name) in declared:
                default = (defaults or {}).get((label, a.name))
                other = [c for c in a.choices if c != default]
                if other:
                    out.append(Variation(f"{label} {a.name}", "attr", f"unset ({default!r}) -> {other[0]!r}",
                                         expect=declared[label, a.name], label=label, attr=a.name, value=other[0]))
                continue
            if a.name == "name" or value in (None, "", (), [], {}) or a.kinds or \
                    a.type.name in ("label", "label_list", "graph_labels", "graph_label"):
                continue
            if a.name == "tags":
                out.append(Variation(f"{label} tags", "attr", "+ audit-keys", keep=True, label=label, attr="tags",
                                     value=(*value, "audit-keys")))
                continue
            found = False
            for detail, new in _variants(a.type.name, value, a.choices):
                found = True
                expect = _attr_expect(a.name, label, declared, models)
                out.append(Variation(f"{label} {a.name}", "attr", detail, expect=expect, label=label, attr=a.name,
                                     value=new))
            if not found:
                skipped.append(f"{label} {a.name} ({a.type.name}: no valid value of the same type to try)")
    return out, skipped


def _attr_expect(attr: str, label: Label, declared: Mapping[tuple[Label, str], frozenset[str]],
                 models: frozenset[Label]) -> frozenset[str] | None:
    if (label, attr) in declared:  # an option or target attribute a toolchain declares: its compiles depend on it
        return declared[label, attr]
    if label in models and attr in ("config", "seed", "inputs"):
        return frozenset({"*"})
    return None


def _variants(type_name: str, value: Any, choices: Sequence[Any]) -> list[tuple[str, Any]]:
    """(what changed, the new value) for one attribute value; nested dicts one entry at a time."""
    if choices:
        other = [c for c in choices if c != value]
        return [(f"{value!r} -> {other[0]!r}", other[0])] if other else []
    if type_name == "dims" and isinstance(value, Mapping):
        return [(f"{k}: {list(v)} -> {[*v[:-1], v[-1] * 2]}", {**value, k: (*v[:-1], v[-1] * 2)})
                for k, v in value.items() if v]
    if type_name in ("inputs", "outputs") and isinstance(value, Mapping):
        out = []
        for k, spec in value.items():
            dtype = str(spec).split("[", 1)[0].strip()
            if dtype in _TYPE_SWAPS:
                new = str(spec).replace(dtype, _TYPE_SWAPS[dtype], 1)
                out.append((f"{k}: {spec} -> {new}", {**value, k: new}))
        return out
    if isinstance(value, Mapping):
        return [(f"{k}: {d}", {**value, k: new}) for k, v in value.items() for d, new in _leaf(v)]
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, Mapping) for v in value):  # shapes
        last = value[-1]
        return [(f"{dict(last)} -> {k}: {d}", (*value[:-1], {**last, k: new}))
                for k, v in last.items() for d, new in _leaf(v)]
    return _leaf(value)


def _leaf(value: Any) -> list[tuple[str, Any]]:
    if isinstance(value, bool):
        return [(f"{value} -> {not value}", not value)]
    if isinstance(value, int):
        new = value * 2 if value else 1
        return [(f"{value} -> {new}", new)]
    if isinstance(value, float):
        half = value * 2 if value else 0.5
        return [(f"{value} -> {half}", half)]
    return []


def file_variations(paths: Iterable[str], read: Any) -> tuple[list[Variation], list[str]]:
    """For each file that reaches an action: a comment (sources) and a real change. `read(path) -> bytes`."""
    out: list[Variation] = []
    skipped: list[str] = []
    for path in sorted(set(paths)):
        data = read(path)
        if path.endswith((".py", ".bzl")):
            out.append(Variation(f"file {path}", "file", "comment", keep=True, by_design="source", path=path,
                                 data=data + b"\n# neuronbuild audit-keys\n"))
        changed = _changed(path, data)
        if changed is None:
            skipped.append(f"file {path} (no real change this audit knows how to make)")
        else:
            detail, new = changed
            out.append(Variation(f"file {path}", "file", detail, expect=frozenset({"*"}), by_design="source",
                                 path=path, data=new))
    return out, skipped


def _changed(path: str, data: bytes) -> tuple[str, bytes] | None:
    """A change that should reach outputs: a .py file's first numeric constant outside docstrings bumped, a JSON
    file's first number doubled, any other (binary) file's last byte flipped."""
    if path.endswith(".py"):
        text = data.decode("utf-8", "surrogateescape")
        try:
            tree = ast.parse(text)
        except SyntaxError:
            return None
        nums = [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and type(n.value) in (int, float)
                and n.end_col_offset is not None and n.lineno == n.end_lineno]
        if not nums:
            return None
        n = min(nums, key=lambda c: (c.lineno, c.col_offset))
        end = int(n.end_col_offset or 0)
        lines = text.splitlines(keepends=True)
        line = lines[n.lineno - 1].encode("utf-8", "surrogateescape")  # (ast's columns are UTF-8 byte offsets)
        seg = line[n.col_offset:end].decode()
        value = n.value
        assert isinstance(value, (int, float))
        new = str(value * 2 if value else 1)
        lines[n.lineno - 1] = (line[:n.col_offset] + new.encode() + line[end:]).decode("utf-8", "surrogateescape")
        return f"line {n.lineno}: {seg} -> {new}", "".join(lines).encode("utf-8", "surrogateescape")
    if path.endswith(".json"):
        m = re.search(rb"(?<=[:\[,\s])(\d+)(?=\s*[,}\]])", data)
        if m is None:
            return None
        doubled = str(int(m.group(1)) * 2 or 1).encode()
        return f"{m.group(1).decode()} -> {doubled.decode()}", data[:m.start()] + doubled + data[m.end():]
    if not data:
        return None
    return "last byte flipped", data[:-1] + bytes([data[-1] ^ 1])


def tool_variations(tools: Sequence[tuple[str, Any]]) -> list[Variation]:
    """Each field of what a toolchain setting resolved to: a version must change keys, a path must not."""
    out = []
    for name, resolved in tools:
        if not isinstance(resolved, Mapping):
            continue
        for k, v in resolved.items():
            if isinstance(v, bool) or not isinstance(v, (str, int, float)):
                continue
            new = f"{v}-audit" if isinstance(v, str) else v * 2 if v else 1
            expect: frozenset[str] | None = frozenset({"*"}) if k == "version" else None
            out.append(Variation(f"setting {name}.{k}", "tool", f"{v} -> {new}", expect=expect,
                                 keep=k == "path", plan_only=True, tool=(name, {**resolved, k: new})))
    return out


def toolchain_variations(base: Mapping[str, Action], components: Sequence[str]) -> list[Variation]:
    """A what-if version of each toolchain component: the kinds whose records hold it must change keys."""
    out = []
    for comp in components:
        kinds = frozenset(a.kind for a in base.values() if comp in a.versions)
        if kinds:
            out.append(Variation(f"toolchain {comp}", "toolchain", "what-if version 0.0.0+audit", expect=kinds,
                                 plan_only=True, toolchain=(comp, "0.0.0+audit")))
    return out


def identity_pairs(base: Mapping[str, Action], variant: Mapping[str, Action]) -> list[tuple[Action, Action | None]]:
    """Each variant action with the baseline action of the same identity (None: a new action)."""
    by_identity = {a.identity: a for a in base.values()}
    return [(a, by_identity.get(a.identity)) for a in variant.values()]


def judge(variation: Variation, pairs: Sequence[tuple[Action, Action | None]],
          outputs: Mapping[str, Mapping[str, str]] | None, base_outputs: Mapping[str, Mapping[str, str]] | None,
          cut_off: set[str], nondeterministic: set[str]) -> tuple[KindVerdict, ...]:
    """The verdict per action kind. `outputs`/`base_outputs`: {identity: {output: digest}} of the variant's and the
    baseline's runs (None: quick mode); `cut_off`: variant fingerprints whose key changed only through input
    actions whose outputs came out identical; `nondeterministic`: identities whose two baseline runs differed."""
    kinds: dict[str, list[tuple[Action, Action | None]]] = {}
    for a, b in pairs:
        kinds.setdefault(a.kind, []).append((a, b))
    any_key = any(b is None or a.fingerprint != b.fingerprint for a, b in pairs)
    out = []
    for kind, items in kinds.items():
        keyed = [(a, b) for a, b in items if b is None or a.fingerprint != b.fingerprint]
        if outputs is None or base_outputs is None or variation.plan_only:
            # (a key changed only where it names other actions' keys: early cutoff decides, not this key)
            own = [a for a, b in keyed if b is None or _own(a) != _own(b)]
            out.append(_quick(variation, kind, len(items), len(keyed), len(own), any_key))
            continue
        noisy = [a for a, _b in items if a.identity in nondeterministic]
        changed, under, over = 0, 0, 0
        for a, b in items:
            if a.identity in nondeterministic:
                continue
            new = b is None or a.fingerprint != b.fingerprint
            differs = outputs.get(a.identity) != base_outputs.get(a.identity)
            changed += differs
            if differs and not new:
                under += 1
            elif new and not differs and a.fingerprint not in cut_off:
                over += 1
        if under:
            verdict, note = UNDER, "the output changed under an unchanged key"
        elif over:
            verdict, note = OVER, BY_DESIGN.get(variation.by_design, "")
        elif noisy:
            verdict, note = NONDETERMINISTIC, f"{len(noisy)} action(s) not judged: their outputs are not reproducible"
        else:
            verdict = OK
            note = "early cutoff" if any(a.fingerprint in cut_off for a, _b in keyed) else ""
        out.append(KindVerdict(kind, len(items), len(keyed), changed, verdict, note))
    return tuple(out)


_FP = re.compile(r"^[0-9a-f]{64}$")


def _own(a: Action) -> dict[str, Any]:
    """The action's record without the fingerprints of other actions it names (as execution/cutoff.py drops them)."""
    return {k: v for k, v in a.record.items() if not (isinstance(v, str) and _FP.match(v))}


def _quick(v: Variation, kind: str, n: int, keyed: int, own: int, any_key: bool) -> KindVerdict:
    if own and v.keep:
        return KindVerdict(kind, n, keyed, None, OVER, BY_DESIGN.get(v.by_design, "declared not to change outputs"))
    if v.expect and (not any_key if "*" in v.expect else kind in v.expect and not keyed):
        return KindVerdict(kind, n, 0, None, UNKEYED, "declared to change this output, but no key changed: "
                                                      "under-keyed, or read only in some cases (full mode judges)")
    note = "re-keyed through its inputs: early cutoff reuses it if they come out identical" if keyed > own else ""
    return KindVerdict(kind, n, keyed, None, OK, note)
