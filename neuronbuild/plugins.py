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
from typing import TYPE_CHECKING, Any

from neuronbuild.errors import UserInputError

if TYPE_CHECKING:
    from neuronbuild.analysis.toolchain_api import Toolchain

BUILTIN = ("neuronbuild.kinds", "neuronbuild.toolchains.cpu", "neuronbuild.toolchains.neuron")
PLUGINS_ENV = "NEURONBUILD_PLUGINS"
PLUGIN_PATH_ENV = "NEURONBUILD_PLUGIN_PATH"

_rules: dict[str, Any] = {}  # kind name -> RuleKind (kinds/base.py)
_toolchains: dict[str, Toolchain] = {}  # toolchain name -> Toolchain
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


# What a toolchain must have (analysis/toolchain_api.Toolchain; mypy checks the built-ins against it, this checks a
# plug-in at registration, so a missing member is one clear error naming it, not an AttributeError mid-build).
TOOLCHAIN_MEMBERS = ("name", "platforms", "artifact_format", "estimate_s", "estimate_mb", "validate_note",
                     "option_keys", "target_attrs", "warm_up_shared", "target_record", "describe_target", "versions", "plan", "run",
                     "warm_up_key", "load_artifact", "notes")


def register_toolchain(tc: Toolchain) -> Toolchain:
    """Register a toolchain (implementing analysis/toolchain_api.Toolchain); returns it."""
    missing = [m for m in TOOLCHAIN_MEMBERS if not hasattr(tc, m)]
    if missing:
        raise TypeError(f"toolchain {getattr(tc, 'name', tc)!r} does not implement the Toolchain protocol "
                        f"(analysis/toolchain_api.py): missing {', '.join(missing)}")
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


def kind_fits(kind: str, wanted: tuple[str, ...]) -> bool:
    """Whether a `kind` target may be named by a label attribute that takes `wanted` kinds: it is one of them, or
    its rule kind declares that it stands for one (`stands_for`: it returns the same provider, e.g. an out-of-tree
    kind planning compiles stands for neuron_compile in a bundle's srcs)."""
    if kind in wanted:
        return True
    r = rules().get(kind)
    return r is not None and any(k in wanted for k in getattr(r, "stands_for", ()))


def toolchains() -> dict[str, Toolchain]:
    _ensure()
    return _toolchains


def toolchain(name: str) -> Toolchain:
    return toolchains()[name]


def platforms() -> tuple[str, ...]:
    _ensure()
    return tuple(_platforms)


def toolchain_for(platform: str) -> Toolchain:
    """The toolchain serving `platform`; UserInputError naming the known platforms otherwise."""
    _ensure()
    name = _platforms.get(platform)
    if name is None:
        raise UserInputError(f"no toolchain serves platform {platform!r} (known: {', '.join(_platforms)})")
    return _toolchains[name]
