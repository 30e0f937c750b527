"""The query language over the target graph (networkx): deps, rdeps, kind, attr, filter, paths, set operators.

Grammar (binary operators are left-associative and of equal precedence, as in Bazel; use parentheses):
  expr    := primary (OP primary)*          OP: + union | - except | ^ intersect  (spaces around operators)
  primary := PATTERN | WORD '(' arg (',' arg)* ')' | set(PATTERN ...) | '(' expr ')'
Patterns are target patterns (//pkg:name, //pkg:all, //pkg/..., //...) or source file labels (//pkg:file.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import networkx as nx

from neuronbuild.errors import UserInputError
from neuronbuild.loading.labels import Label, LabelError, TargetPattern, json_value, parse_pattern
from neuronbuild.loading.schema import RULES, label_values
from neuronbuild.loading.target_graph import TargetGraph, load_targets

SOURCE_FILE = "source file"
_OPS = {"+": "union", "union": "union", "-": "except", "except": "except", "^": "intersect", "intersect": "intersect"}
_TOKEN_RE = re.compile(r"\s*(?:(?P<punct>[(),])|\"(?P<dq>[^\"]*)\"|'(?P<sq>[^']*)'|(?P<word>[^\s(),\"']+))")
# function name -> (argument kinds): e = expression, s = string (word or quoted), i = integer; trailing ? optional
_FUNCS: dict[str, tuple[str, ...]] = {
    "deps": ("e", "i?"), "rdeps": ("e", "e", "i?"), "kind": ("s", "e"), "attr": ("s", "s", "e"),
    "filter": ("s", "e"), "labels": ("s", "e"), "somepath": ("e", "e"), "allpaths": ("e", "e"),
}


class QueryError(UserInputError):
    """A query that does not parse or names something that does not exist (exit 2)."""

    def __init__(self, message: str) -> None:
        super().__init__(f"query: {message}")


# ------------------------------------------------------------------------------------------------------ parse


@dataclass(frozen=True)
class Node:
    """A parsed expression: ("pattern", text) | ("set", patterns) | ("op", name, left, right) | ("call", fn, args)."""

    kind: str
    value: Any = None
    args: tuple[Any, ...] = field(default=())


def _tokens(text: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos = 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN_RE.match(text, pos)
        if not m or m.end() == pos:
            raise QueryError(f"unexpected character at column {pos + 1}: {text[pos:pos + 10]!r}")
        pos = m.end()
        if m.group("punct"):
            out.append(("punct", m.group("punct")))
        elif m.group("word") is not None:
            out.append(("word", m.group("word")))
        else:
            out.append(("str", m.group("dq") if m.group("dq") is not None else m.group("sq") or ""))
    return out


MAX_NESTING = 100  # parentheses and calls inside one another (the parser and evaluator recurse on them)


class _Parser:
    def __init__(self, text: str) -> None:
        self.toks = _tokens(text)
        self.i = 0
        self.depth = 0

    def peek(self) -> tuple[str, str] | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, punct: str | None = None) -> tuple[str, str]:
        t = self.peek()
        if t is None:
            raise QueryError("unexpected end of expression" + (f" (expected '{punct}')" if punct else ""))
        if punct is not None and t != ("punct", punct):
            raise QueryError(f"expected '{punct}', got '{t[1]}'")
        self.i += 1
        return t

    def parse(self) -> Node:
        if not self.toks:
            raise QueryError("empty expression")
        node = self.expr()
        if (t := self.peek()) is not None:
            hint = ""
            if t[0] == "word" and len(t[1]) > 1 and t[1][0] in "-+^":
                hint = f" (set operators need spaces around them: '... {t[1][0]} {t[1][1:]}')"
            raise QueryError(f"unexpected '{t[1]}' after a complete expression{hint}")
        return node

    def expr(self) -> Node:
        node = self.primary()
        while (t := self.peek()) is not None and t[0] == "word" and t[1] in _OPS:
            self.i += 1
            node = Node("op", _OPS[t[1]], (node, self.primary()))
        return node

    def primary(self) -> Node:
        self.depth += 1
        try:
            return self._primary()
        finally:
            self.depth -= 1

    def _primary(self) -> Node:
        if self.depth > MAX_NESTING:
            raise QueryError(f"the expression nests parentheses and calls more than {MAX_NESTING} deep")
        t = self.take()
        if t == ("punct", "("):
            node = self.expr()
            self.take(")")
            return node
        if t[0] != "word" or t[1] in _OPS:
            raise QueryError(f"expected a target pattern or function, got '{t[1]}'")
        if self.peek() == ("punct", "("):
            return self.call(t[1])
        return Node("pattern", t[1])

    def call(self, name: str) -> Node:
        self.take("(")
        if name == "set":
            words = []
            while (t := self.take())[0] != "punct":
                words.append(t[1])
            if t[1] != ")":
                raise QueryError("set(...) takes target patterns separated by spaces")
            return Node("set", tuple(words))
        if name not in _FUNCS:
            raise QueryError(f"unknown function '{name}' (known: {', '.join(sorted([*_FUNCS, 'set']))})")
        kinds = _FUNCS[name]
        args: list[Any] = []
        for n, k in enumerate(kinds):
            if n:
                if k.endswith("?") and self.peek() != ("punct", ","):
                    break  # an optional argument left out
                self.take(",")
            if k.startswith("e"):
                args.append(self.expr())
            else:
                t = self.take()
                if t[0] == "punct":
                    raise QueryError(f"{name}(): argument {n + 1} must be a {'number' if k[0] == 'i' else 'word'}")
                if k.startswith("i"):
                    if not t[1].isdigit():
                        raise QueryError(f"{name}(): depth must be a non-negative integer, got '{t[1]}'")
                    args.append(int(t[1]))
                else:
                    args.append(t[1])
        self.take(")")
        return Node("call", name, tuple(args))


def parse_query(text: str) -> Node:
    return _Parser(text).parse()


def patterns_of(node: Node) -> list[str]:
    out: list[str] = []
    todo = [node]  # (a stack, not recursion: a chain of 5,000 set operators is a tree 5,000 deep)
    while todo:
        n = todo.pop()
        if n.kind == "pattern":
            out.append(n.value)
        elif n.kind == "set":
            out.extend(n.value)
        else:
            todo.extend(a for a in reversed(n.args) if isinstance(a, Node))
    return out


# --------------------------------------------------------------------------------------------------- the graph


@dataclass(frozen=True)
class QueryGraph:
    """Targets and source files as nodes (labels as strings), edges from a target to what it references."""

    root: Path
    graph: nx.DiGraph = field(hash=False, compare=False)
    kinds: Mapping[str, str] = field(hash=False, compare=False)
    attrs: Mapping[str, Mapping[str, Any]] = field(hash=False, compare=False)
    packages: frozenset[str] = frozenset()
    manual: frozenset[str] = frozenset()


def _label_values(v: Any) -> list[Label]:
    return label_values(v)


def query_graph(tg: TargetGraph) -> QueryGraph:
    g = nx.DiGraph()
    kinds: dict[str, str] = {}
    attrs: dict[str, Mapping[str, Any]] = {}
    manual: set[str] = set()
    for lbl, t in tg.targets.items():
        s = str(lbl)
        g.add_node(s)
        kinds[s] = t.kind
        attrs[s] = t.attrs
        if "manual" in t.tags:
            manual.add(s)
        for a in RULES[t.kind].attrs:
            if not a.kinds or t.attrs.get(a.name) is None:
                continue
            for dep in _label_values(t.attrs[a.name]):
                d = str(dep)
                if "file" in a.kinds and d not in kinds:
                    kinds[d] = SOURCE_FILE
                    attrs[d] = {}
                g.add_edge(s, d)
    return QueryGraph(tg.root, g, kinds, attrs, frozenset(tg.packages), frozenset(manual))


def load_query_graph(root: Path, patterns: Iterable[str], cwd_package: str = "") -> QueryGraph:
    """Load every package the patterns name, then (re)load until every referenced target is loaded."""
    load: list[str] = []
    for p in patterns:
        tp = _pattern(p, cwd_package)
        load.append(str(tp) if tp.recursive or tp.name is None else f"//{tp.package}:all")
    tg = load_targets(root, list(dict.fromkeys(load)), cwd_package, warn=None)
    for _round in range(100):
        missing = [d for t in tg.targets.values() for _a, d in t.label_deps if d not in tg.targets]
        if not missing:
            break
        tg = load_targets(root, [*dict.fromkeys(load), *(str(lbl) for lbl in tg.targets)], cwd_package,
                          warn=None)
    return query_graph(tg)


def _pattern(text: str, cwd_package: str) -> TargetPattern:
    try:
        return parse_pattern(text, cwd_package)
    except LabelError as e:
        raise QueryError(f"bad target pattern '{text}': {e}") from None


# ------------------------------------------------------------------------------------------------------ evaluate


def attr_string(v: Any) -> str:
    """An attribute value as `attr()` matches it: labels as //pkg:name, lists as [a, b], dicts as JSON."""
    if isinstance(v, Label):
        return str(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(attr_string(x) for x in v) + "]"
    if isinstance(v, dict):
        return json.dumps(v, sort_keys=True, default=str)
    if isinstance(v, bool):
        return "1" if v else "0"
    return "" if v is None else str(v)


class Evaluator:
    def __init__(self, qg: QueryGraph, cwd_package: str = "") -> None:
        self.qg = qg
        self.cwd = cwd_package

    def pattern(self, text: str) -> set[str]:
        tp = _pattern(text, self.cwd)
        kinds = self.qg.kinds
        if tp.recursive or tp.name is None:
            # As in Bazel's query (unlike build), patterns include targets tagged "manual".
            return {n for n, k in kinds.items() if k != SOURCE_FILE and tp.matches_package(n[2:].split(":", 1)[0])}
        s = str(Label(tp.package, tp.name))
        if s in kinds:
            return {s}
        if (self.qg.root / tp.package / tp.name).is_file():  # a source file no target references
            return {s}
        raise QueryError(f"no such target or source file '{s}'")

    def eval(self, node: Node) -> set[str]:
        if node.kind == "pattern":
            return self.pattern(node.value)
        if node.kind == "set":
            return set().union(*(self.pattern(p) for p in node.value)) if node.value else set()
        if node.kind == "op":  # a left-leaning chain (a + b - c ...), walked down its left side without recursion
            chain = []
            while node.kind == "op":
                chain.append(node)
                node = node.args[0]
            acc = self.eval(node)
            for op in reversed(chain):
                b = self.eval(op.args[1])
                acc = acc | b if op.value == "union" else acc - b if op.value == "except" else acc & b
            return acc
        return getattr(self, f"_f_{node.value}")(*node.args)

    def _reach(self, g: nx.DiGraph, start: set[str], depth: int | None) -> set[str]:
        seen = set(start)
        frontier = list(start)
        level = 0
        while frontier and (depth is None or level < depth):
            nxt = []
            for n in frontier:
                for m in g.successors(n):
                    if m not in seen:
                        seen.add(m)
                        nxt.append(m)
            frontier = nxt
            level += 1
        return seen

    def _known(self, nodes: set[str]) -> set[str]:
        g = self.qg.graph
        for n in nodes - set(g.nodes):
            g.add_node(n)  # an unreferenced source file
        return nodes

    def _f_deps(self, x: Node, depth: int | None = None) -> set[str]:
        return self._reach(self.qg.graph, self._known(self.eval(x)), depth)

    def _f_rdeps(self, universe: Node, x: Node, depth: int | None = None) -> set[str]:
        u = self._reach(self.qg.graph, self._known(self.eval(universe)), None)
        sub = self.qg.graph.subgraph(u).reverse(copy=False)
        return self._reach(sub, self.eval(x) & u, depth)

    def _f_kind(self, pattern: str, x: Node) -> set[str]:
        rx = self._regex(pattern)
        return {n for n in self.eval(x) if rx.search(self.qg.kinds.get(n, SOURCE_FILE))}

    def _f_attr(self, name: str, pattern: str, x: Node) -> set[str]:
        rx = self._regex(pattern)
        return {n for n in self.eval(x)
                if name in self.qg.attrs.get(n, {}) and rx.search(attr_string(self.qg.attrs[n][name]))}

    def _f_filter(self, pattern: str, x: Node) -> set[str]:
        rx = self._regex(pattern)
        return {n for n in self.eval(x) if rx.search(n)}

    def _f_labels(self, name: str, x: Node) -> set[str]:
        return {str(lbl) for n in self.eval(x) for lbl in _label_values(self.qg.attrs.get(n, {}).get(name))}

    def _f_allpaths(self, a: Node, b: Node) -> set[str]:
        g = self.qg.graph
        down = self._reach(g, self._known(self.eval(a)), None)
        up = self._reach(g.reverse(copy=False), self._known(self.eval(b)), None)
        return down & up

    def _f_somepath(self, a: Node, b: Node) -> set[str]:
        g = self.qg.graph
        targets = self._known(self.eval(b))
        for src in sorted(self._known(self.eval(a))):
            lengths, paths = nx.single_source_dijkstra(g, src)
            reach = sorted((lengths[t], t) for t in targets if t in lengths)
            if reach:
                return set(paths[reach[0][1]])
        return set()

    @staticmethod
    def _regex(pattern: str) -> re.Pattern[str]:
        try:
            return re.compile(pattern)
        except re.error as e:
            raise QueryError(f"bad regular expression {pattern!r}: {e}") from None


def evaluate(qg: QueryGraph, expr: str | Node, cwd_package: str = "") -> list[str]:
    """The result set as sorted label strings."""
    node = parse_query(expr) if isinstance(expr, str) else expr
    return sorted(Evaluator(qg, cwd_package).eval(node))


def run_query(root: Path, expr: str, cwd_package: str = "") -> tuple[QueryGraph, list[str]]:
    node = parse_query(expr)
    qg = load_query_graph(root, patterns_of(node), cwd_package)
    return qg, evaluate(qg, node, cwd_package)


# ------------------------------------------------------------------------------------------------------- output


def to_json(qg: QueryGraph, result: list[str]) -> list[dict[str, Any]]:
    return [{"label": n, "kind": qg.kinds.get(n, SOURCE_FILE), "attrs": json_value(dict(qg.attrs.get(n, {}))),
             "deps": sorted(qg.graph.successors(n)) if n in qg.graph else []} for n in result]


def to_dot(qg: QueryGraph, result: list[str]) -> str:
    """Graphviz dot of the result set and the edges among its members."""
    keep = set(result)
    lines = ["digraph neuronbuild {", "  node [shape=box];"]
    for n in result:
        shape = ", shape=note" if qg.kinds.get(n, SOURCE_FILE) == SOURCE_FILE else ""
        lines.append(f"  {json.dumps(n)} [label={json.dumps(n + chr(10) + qg.kinds.get(n, SOURCE_FILE))}{shape}];")
    for a in result:
        if a in qg.graph:
            for b in sorted(qg.graph.successors(a)):
                if b in keep:
                    lines.append(f"  {json.dumps(a)} -> {json.dumps(b)};")
    lines.append("}")
    return "\n".join(lines) + "\n"
