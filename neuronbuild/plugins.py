"""The plug-in registry: rule kinds and toolchains, discovered by module name (built-ins + $NEURONBUILD_PLUGINS).

A rule kind is one module under neuronbuild/kinds/ holding its attribute schema and its analysis implementation; a
toolchain is one module under neuronbuild/toolchains/ implementing the Toolchain protocol (analysis/toolchain_api.py).
Each registers itself here when imported. The engine (loading, analysis, execution) asks this registry and never
imports a kind or toolchain module, so adding one is one file plus its name in BUILTIN (or in $NEURONBUILD_PLUGINS,
a comma-separated list of importable modules, for out-of-tree plug-ins, found on sys.path or in the directories of
$NEURONBUILD_PLUGIN_PATH; worker processes import the same list)."""

from __future__ import annotations

import importlib
import os
import sys
import threading
from typing import Any

from neuronbuild.errors import UserInputError

BUILTIN = ("neuronbuild.kinds", "neuronbuild.toolchains.cpu", "neuronbuild.toolchains.neuron")
PLUGINS_ENV = "NEURONBUILD_PLUGINS"
PLUGIN_PATH_ENV = "NEURONBUILD_PLUGIN_PATH"

_rules: dict[str, Any] = {}  # kind name -> RuleKind (kinds/base.py)
_toolchains: dict[str, Any] = {}  # toolchain name -> Toolchain
_platforms: dict[str, str] = {}  # platform -> toolchain name
_lock = threading.RLock()
_loaded = False


def plugin_modules() -> tuple[str, ...]:
    extra = tuple(m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(",") if m.strip())
    return BUILTIN + extra


def _ensure() -> None:
    global _loaded
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        _loaded = True
        for d in os.environ.get(PLUGIN_PATH_ENV, "").split(os.pathsep):
            if d and d not in sys.path:
                sys.path.append(d)
        for name in plugin_modules():
            try:
                importlib.import_module(name)
            except ImportError as e:
                _loaded = False
                raise UserInputError(f"${PLUGINS_ENV}: cannot import plug-in module {name!r}: {e}") from None


def register_rule(kind: Any) -> Any:
    """Register a rule kind (an object with .name, .schema and .analyze); returns it."""
    with _lock:
        _rules[kind.name] = kind
    return kind


def register_toolchain(tc: Any) -> Any:
    """Register a toolchain (an object with .name and .platforms, see analysis/toolchain_api.py); returns it."""
    with _lock:
        for p in tc.platforms:
            owner = _platforms.get(p)
            if owner is not None and owner != tc.name:
                raise ValueError(f"platform {p!r} is served by toolchain {owner!r} already; {tc.name!r} cannot")
            _platforms[p] = tc.name
        _toolchains[tc.name] = tc
    return tc


def rules() -> dict[str, Any]:
    _ensure()
    return _rules


def rule(kind: str) -> Any:
    return rules()[kind]


def toolchains() -> dict[str, Any]:
    _ensure()
    return _toolchains


def toolchain(name: str) -> Any:
    return toolchains()[name]


def platforms() -> tuple[str, ...]:
    _ensure()
    return tuple(_platforms)


def toolchain_for(platform: str) -> Any:
    """The toolchain serving `platform`; UserInputError naming the known platforms otherwise."""
    _ensure()
    name = _platforms.get(platform)
    if name is None:
        raise UserInputError(f"no toolchain serves platform {platform!r} (known: {', '.join(_platforms)})")
    return _toolchains[name]
