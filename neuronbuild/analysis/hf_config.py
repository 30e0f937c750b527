"""An hf_causal_lm config checked at analysis, without importing transformers: its `model_type` against the model
types the installed transformers registers (read from its auto-mapping source, found by import machinery that
imports nothing), so a misspelt type fails at its BUILD line before any action starts, in one short line."""

from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
import os
from pathlib import Path

from neuronbuild.analysis.tensor_parallel import HF_CAUSAL_LM

# Where transformers lists its model types: {model_type: config class} literals (5.x: auto_mappings.py, updated in
# configuration_auto.py; earlier: configuration_auto.py alone).
_SOURCES = ("models/auto/auto_mappings.py", "models/auto/configuration_auto.py")
_MAPPING = "CONFIG_MAPPING_NAMES"


def _types_in(source: str) -> set[str]:
    """The string keys of every dict or list-of-pairs literal assigned to or updated into CONFIG_MAPPING_NAMES."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        target = None
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == _MAPPING for t in node.targets):
            target = node.value
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update"
              and isinstance(node.func.value, ast.Name) and node.func.value.id == _MAPPING and node.args):
            target = node.args[0]
        if target is None:
            continue
        for sub in ast.walk(target):
            if isinstance(sub, ast.Dict):
                out.update(k.value for k in sub.keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
            elif isinstance(sub, ast.Tuple) and len(sub.elts) == 2 and isinstance(sub.elts[0], ast.Constant) \
                    and isinstance(sub.elts[0].value, str):
                out.add(sub.elts[0].value)
    return out


@functools.cache
def _known(stamp: tuple[tuple[str, int, int], ...]) -> frozenset[str] | None:
    types: set[str] = set()
    for path, _mtime, _size in stamp:
        try:
            types |= _types_in(Path(path).read_text(encoding="utf-8"))
        except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
            return None
    return frozenset(types) if types else None


def _stamp() -> tuple[tuple[str, int, int], ...] | None:
    """(path, mtime, size) of the installed transformers' auto-mapping sources (read again when the installation
    changes), or None when transformers is not installed or lays them out otherwise."""
    try:
        spec = importlib.util.find_spec("transformers")
    except (ImportError, ValueError):
        return None
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    if not roots:
        return None
    stamp = []
    for rel in _SOURCES:
        p = os.path.join(roots[0], rel)
        try:
            st = os.stat(p)
        except OSError:
            continue
        stamp.append((p, st.st_mtime_ns, st.st_size))
    return tuple(stamp) or None


def known_model_types() -> frozenset[str] | None:
    """The model types the installed transformers registers, or None when that cannot be told (not installed, or its
    sources laid out otherwise): then nothing is checked here and the trace says what is wrong."""
    stamp = _stamp()
    return _known(stamp) if stamp else None


def config_problem(entry: str, config: object) -> str | None:
    """Why an hf_causal_lm model's config cannot be built, as far as analysis tells without transformers: a model
    type transformers does not know (with the nearest ones). None otherwise."""
    if not entry.startswith(HF_CAUSAL_LM + ":") or not isinstance(config, dict):
        return None
    model_type = config.get("model_type")
    known = known_model_types()
    if not isinstance(model_type, str) or known is None:
        return None
    if model_type not in known:
        near = difflib.get_close_matches(model_type, sorted(known), n=3, cutoff=0.6)
        hint = f" (did you mean {', '.join(repr(n) for n in near)}?)" if near else ""
        return f"config field model_type: {model_type!r} is not a model type the installed transformers knows{hint}"
    return None

