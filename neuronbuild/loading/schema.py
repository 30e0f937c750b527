"""Attribute types and validation of rule-call attributes against a kind's schema (`Attr`, `AttrType`, `RuleSchema`:
the plug-in API's, neuronbuild/plugin_api/rules.py).

The schemas themselves live with their rule kinds (neuronbuild/kinds/), registered in the plug-in registry;
`RULES` is the registry's view of them for loading."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from neuronbuild.loading.labels import Label, LabelError, parse_label
from neuronbuild.plugin_api import registry
from neuronbuild.plugin_api.rules import Attr, AttrError, AttrType, RuleSchema
from neuronbuild.vocabulary import DTYPES

_DIM = r"(?:[A-Za-z_][A-Za-z0-9_]*|[0-9]+)"
_INPUT_RE = re.compile(rf"^\s*([a-z0-9_]+)\s*\[\s*({_DIM}(\s*,\s*{_DIM})*)?\s*\]\s*$")
_DIM_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_ENTRY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")


def _json_value(attr: str, v: Any, path: str = "") -> Any:
    where = f"{attr}{path}"
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        if not math.isfinite(v):
            raise AttrError(f"attribute '{where}' holds a non-finite float")
        return v
    if isinstance(v, (list, tuple)):
        return [_json_value(attr, x, f"{path}[{i}]") for i, x in enumerate(v)]
    if isinstance(v, dict):
        out = {}
        for k, x in v.items():
            if not isinstance(k, str):
                raise AttrError(f"attribute '{where}' has a non-string key {k!r}")
            out[k] = _json_value(attr, x, f"{path}.{k}")
        return out
    raise AttrError(f"attribute '{where}' holds a value of unsupported type {type(v).__name__}")


def _type_name(v: Any) -> str:
    return {bool: "bool", int: "int", str: "string", float: "float", list: "list", tuple: "tuple", dict: "dict"}.get(
        type(v), type(v).__name__
    )


def _string(attr: str, v: Any, pkg: str) -> str:
    if not isinstance(v, str):
        raise AttrError(f"attribute '{attr}' must be a string, got {_type_name(v)}")
    return v


def _int(attr: str, v: Any, pkg: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise AttrError(f"attribute '{attr}' must be an int, got {_type_name(v)}")
    return v


def _float(attr: str, v: Any, pkg: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise AttrError(f"attribute '{attr}' must be a number, got {_type_name(v)}")
    if not math.isfinite(float(v)) or float(v) < 0:
        raise AttrError(f"attribute '{attr}' must be a finite non-negative number")
    return float(v)


def _string_list(attr: str, v: Any, pkg: str) -> tuple[str, ...]:
    if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) for x in v):
        raise AttrError(f"attribute '{attr}' must be a list of strings")
    return tuple(v)


def _label(attr: str, v: Any, pkg: str) -> Label:
    if not isinstance(v, str):
        raise AttrError(f"attribute '{attr}' must be a label string, got {_type_name(v)}")
    try:
        return parse_label(v, pkg)
    except LabelError as e:
        raise AttrError(f"attribute '{attr}': {e}") from None


def _label_list(attr: str, v: Any, pkg: str) -> tuple[Label, ...]:
    if not isinstance(v, (list, tuple)):
        raise AttrError(f"attribute '{attr}' must be a list of labels, got {_type_name(v)}")
    out = tuple(_label(attr, x, pkg) for x in v)
    if len(set(out)) != len(out):
        raise AttrError(f"attribute '{attr}' lists the same label twice")
    return out


def _json_dict(attr: str, v: Any, pkg: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise AttrError(f"attribute '{attr}' must be a dict, got {_type_name(v)}")
    return dict(_json_value(attr, v))


def _dims(attr: str, v: Any, pkg: str) -> dict[str, tuple[int, ...]]:
    if not isinstance(v, dict) or not v:
        raise AttrError(f"attribute '{attr}' must be a non-empty dict of dimension name -> list of sizes")
    out: dict[str, tuple[int, ...]] = {}
    for k, sizes in v.items():
        if not isinstance(k, str) or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", k):
            raise AttrError(f"attribute '{attr}': invalid dimension name {k!r}")
        if not isinstance(sizes, (list, tuple)) or not sizes:
            raise AttrError(f"attribute '{attr}': dimension '{k}' needs a non-empty list of sizes")
        for s in sizes:
            if isinstance(s, bool) or not isinstance(s, int) or s < 1:
                raise AttrError(f"attribute '{attr}': dimension '{k}' sizes must be positive ints, got {s!r}")
        if len(set(sizes)) != len(sizes):
            raise AttrError(f"attribute '{attr}': dimension '{k}' lists a size twice")
        out[k] = tuple(sizes)
    return out


def _shapes(attr: str, v: Any, pkg: str) -> tuple[dict[str, int], ...]:
    if not isinstance(v, (list, tuple)) or not v:
        raise AttrError(f"attribute '{attr}' must be a non-empty list of dicts (dimension name -> size)")
    out = []
    for i, shape in enumerate(v):
        if not isinstance(shape, dict) or not shape:
            raise AttrError(f"attribute '{attr}[{i}]' must be a non-empty dict of dimension name -> size")
        for k, s in shape.items():
            if not isinstance(k, str) or isinstance(s, bool) or not isinstance(s, int) or s < 1:
                raise AttrError(f"attribute '{attr}[{i}]': '{k}' must map to a positive int, got {s!r}")
        out.append(dict(shape))
    return tuple(out)


def parse_input_spec(spec: str) -> tuple[str, tuple[str | int, ...]]:
    """`"float32[batch, 3, head_dim]"` -> ("float32", ("batch", 3, "head_dim")): names (bucket or named constant
    dims) and literal positive ints, in order."""
    m = _INPUT_RE.match(spec)
    if not m:
        raise AttrError(f"input spec {spec!r} must look like 'int64[batch, seq]' (dims: names or positive ints)")
    dtype = m.group(1)
    if dtype not in DTYPES:
        raise AttrError(f"input spec {spec!r}: unknown dtype '{dtype}' (one of {', '.join(DTYPES)})")
    dims: list[str | int] = []
    for d in (x.strip() for x in (m.group(2) or "").split(",")):
        if not d:
            continue
        if d.isdigit():
            if int(d) < 1:
                raise AttrError(f"input spec {spec!r}: literal dim {d} must be a positive int")
            dims.append(int(d))
        else:
            dims.append(d)
    return dtype, tuple(dims)


def _const_dims(attr: str, v: Any, pkg: str) -> dict[str, int]:
    if not isinstance(v, dict):
        raise AttrError(f"attribute '{attr}' must be a dict of dimension name -> positive int, got {_type_name(v)}")
    out: dict[str, int] = {}
    for k, size in v.items():
        if not isinstance(k, str) or not _DIM_NAME_RE.match(k):
            raise AttrError(f"attribute '{attr}': invalid dimension name {k!r}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise AttrError(f"attribute '{attr}': dimension '{k}' must be a positive int, got {size!r}")
        out[k] = size
    return out


def _int_ranges(attr: str, v: Any, pkg: str) -> dict[str, tuple[int, int]]:
    if not isinstance(v, dict):
        raise AttrError(f"attribute '{attr}' must be a dict of input name -> [low, high], got {_type_name(v)}")
    out: dict[str, tuple[int, int]] = {}
    for k, r in v.items():
        ok = (isinstance(r, (list, tuple)) and len(r) == 2
              and all(isinstance(x, int) and not isinstance(x, bool) for x in r) and r[0] < r[1])
        if not isinstance(k, str) or not ok:
            raise AttrError(f"attribute '{attr}': '{k}' must map to [low, high) with ints low < high, got {r!r}")
        out[k] = (int(r[0]), int(r[1]))
    return out


def _inputs(attr: str, v: Any, pkg: str) -> dict[str, str]:
    if not isinstance(v, dict) or not v:
        raise AttrError(f"attribute '{attr}' must be a non-empty dict of name -> 'dtype[dims]'")
    for k, spec in v.items():
        if not isinstance(k, str) or not isinstance(spec, str):
            raise AttrError(f"attribute '{attr}' must map names to strings like 'int64[batch, seq]'")
        try:
            parse_input_spec(spec)
        except AttrError as e:
            raise AttrError(f"attribute '{attr}': {e}") from None
    return dict(v)


_GRAPH_KEYS = ("entry", "inputs", "outputs", "aliases", "config")


def _graphs(attr: str, v: Any, pkg: str) -> dict[str, dict[str, Any]]:
    """Graph families of one model: name -> {"entry", "inputs", "outputs", "aliases", "config"} (each optional; config:
    keys merged over the model's config for this graph alone)."""
    if not isinstance(v, dict) or not v:
        raise AttrError(f"attribute '{attr}' must be a non-empty dict of graph name -> dict")
    out: dict[str, dict[str, Any]] = {}
    for name, g in v.items():
        if not isinstance(name, str) or not _DIM_NAME_RE.match(name):
            raise AttrError(f"attribute '{attr}': invalid graph name {name!r}")
        if not isinstance(g, dict):
            raise AttrError(f"attribute '{attr}': graph '{name}' must be a dict, got {_type_name(g)}")
        bad = [k for k in g if k not in _GRAPH_KEYS]
        if bad:
            raise AttrError(f"attribute '{attr}': graph '{name}' has unknown key {bad[0]!r} "
                            f"(known: {', '.join(_GRAPH_KEYS)})")
        entry: dict[str, Any] = {}
        if g.get("entry") is not None:
            if not isinstance(g["entry"], str) or not _ENTRY_RE.match(g["entry"]):
                raise AttrError(f"attribute '{attr}': graph '{name}': entry must look like 'module:function'")
            entry["entry"] = g["entry"]
        for key in ("inputs", "outputs"):
            if g.get(key) is not None:
                entry[key] = _inputs(f"{attr}.{name}.{key}", g[key], pkg)
        if g.get("aliases") is not None:
            al = g["aliases"]
            if not isinstance(al, dict) or not all(isinstance(a, str) and isinstance(b, str) for a, b in al.items()):
                raise AttrError(f"attribute '{attr}': graph '{name}': aliases must map output names to input names")
            entry["aliases"] = dict(al)
        if g.get("config") is not None:
            entry["config"] = _json_dict(f"{attr}.{name}.config", g["config"], pkg)
        out[name] = entry
    return out


_T = TypeVar("_T")


def _per_graph(attr: str, v: Any, pkg: str, one: Callable[[str, Any, str], _T]) -> _T | dict[str, _T]:
    """`one` value (every graph), or graph name -> such a value."""
    if not isinstance(v, dict):
        return one(attr, v, pkg)
    out: dict[str, _T] = {}
    for name, x in v.items():
        if not isinstance(name, str) or not _DIM_NAME_RE.match(name):
            raise AttrError(f"attribute '{attr}': invalid graph name {name!r}")
        out[name] = one(f"{attr}.{name}", x, pkg)
    return out


def _graph_labels(attr: str, v: Any, pkg: str) -> tuple[Label, ...] | dict[str, tuple[Label, ...]]:
    """A list of labels (every graph), or graph name -> list of labels."""
    return _per_graph(attr, v, pkg, _label_list)


def _graph_label(attr: str, v: Any, pkg: str) -> Label | dict[str, Label]:
    """A label (every graph), or graph name -> label."""
    return _per_graph(attr, v, pkg, _label)


def label_values(v: Any) -> list[Label]:
    """Every label in an attribute value: a label, a tuple of labels, or a dict of graph name -> either."""
    if isinstance(v, dict):
        return [x for item in v.values() for x in label_values(item)]
    return [x for x in (v if isinstance(v, tuple) else (v,)) if isinstance(x, Label)]


STRING = AttrType("string", _string)
INT = AttrType("int", _int)
FLOAT = AttrType("float", _float)
STRING_LIST = AttrType("string_list", _string_list)
LABEL = AttrType("label", _label)
LABEL_LIST = AttrType("label_list", _label_list)
DICT = AttrType("dict", _json_dict)
DIMS = AttrType("dims", _dims)
SHAPES = AttrType("shapes", _shapes)
INPUTS = AttrType("inputs", _inputs)
OUTPUTS = AttrType("outputs", _inputs)
CONST_DIMS = AttrType("const_dims", _const_dims)
INT_RANGES = AttrType("int_ranges", _int_ranges)
GRAPHS = AttrType("graphs", _graphs)
GRAPH_LABELS = AttrType("graph_labels", _graph_labels)
GRAPH_LABEL = AttrType("graph_label", _graph_label)


NAME = Attr("name", STRING, "The target's name, unique in its package.", required=True)
TAGS = Attr("tags", STRING_LIST, "Free-form tags (e.g. 'manual' keeps a target out of //... and :all).", default=())
ENTRY_RE = _ENTRY_RE


class _Rules(Mapping[str, RuleSchema]):
    """Rule kind name -> schema, from the plug-in registry (kinds are discovered on first use)."""

    def __getitem__(self, kind: str) -> RuleSchema:
        return registry.rules()[kind].schema  # type: ignore[no-any-return]

    def __iter__(self) -> Iterator[str]:
        return iter(registry.rules())

    def __len__(self) -> int:
        return len(registry.rules())


RULES: Mapping[str, RuleSchema] = _Rules()


_TARGET_NAME_RE = re.compile(r"^[A-Za-z0-9_\-.+]+$")


def validate_call(kind: str, kwargs: Mapping[str, Any], package: str) -> dict[str, Any]:
    """Check a rule call's attributes and return them normalised (labels parsed, defaults filled)."""
    schema = RULES[kind]
    known = schema.attr_names
    for k in kwargs:
        if k not in known:
            import difflib

            # The nearest name, a required one not given first (`input` -> `inputs`, not `input_ranges`).
            missing = [a.name for a in schema.attrs if a.required and a.name not in kwargs]
            close = difflib.get_close_matches(k, missing, n=1, cutoff=0.7) or \
                difflib.get_close_matches(k, sorted(known), n=1) or [n for n in sorted(known) if n[:3] == k[:3]]
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise AttrError(f"{kind}() got an unknown attribute '{k}'{hint}")
    out: dict[str, Any] = {}
    for a in schema.attrs:
        # A value equal to the default is the default (it is valid by definition: e.g. a load-cache entry's `{}`);
        # not a bool standing for an int (True == 1 in Python: `tp_degree = True` is a type error, not 1).
        given = kwargs.get(a.name)
        if a.name not in kwargs or given is None or (not a.required and given == a.default and
                                                     isinstance(given, bool) == isinstance(a.default, bool)):
            if a.required:
                raise AttrError(f"{kind}() missing required attribute '{a.name}'")
            out[a.name] = a.default
            continue
        value = a.type.check(a.name, kwargs[a.name], package)
        if a.choices and value not in a.choices:
            raise AttrError(
                f"attribute '{a.name}' must be one of {', '.join(repr(c) for c in a.choices)}, got {value!r}"
            )
        out[a.name] = value
    if not _TARGET_NAME_RE.match(out["name"]):
        raise AttrError(f"invalid target name {out['name']!r}")
    if schema.check is not None:
        schema.check(out)
    return out
