"""The plug-ins: which modules register rule kinds, toolchains, step providers, toolchain settings and runtime loaders,
and loading them.

A rule kind is one module under neuronbuild/kinds/ holding its attribute schema and its analysis implementation; a
toolchain is one module under neuronbuild/toolchains/ implementing the Toolchain protocol (plugin_api/toolchain.py).
Each registers itself in the registry (plugin_api/registry.py) when imported. `load()` imports them: the built-ins
(BUILTIN) and $NEURONBUILD_PLUGINS, a comma-separated list of importable modules for out-of-tree plug-ins, found on
sys.path or in the directories of $NEURONBUILD_PLUGIN_PATH (worker processes load the same list). Loading, analysis
and execution ask the registry and never import a kind or toolchain module, so adding one is one file plus its name
in BUILTIN (or in $NEURONBUILD_PLUGINS). This module's lookups load first, then ask the registry; an out-of-tree
plug-in registers through the names re-exported here (plugins.register_toolchain, plugins.Flag, ...)."""

from __future__ import annotations

import importlib

from neuronbuild import envvars
from neuronbuild.plugin_api import registry
from neuronbuild.plugin_api.flag import Flag as Flag
from neuronbuild.plugin_api.registry import PLUGINS_ENV as PLUGINS_ENV
from neuronbuild.plugin_api.registry import register_loader as register_loader
from neuronbuild.plugin_api.registry import register_rule as register_rule
from neuronbuild.plugin_api.registry import register_settings as register_settings
from neuronbuild.plugin_api.registry import register_steps as register_steps
from neuronbuild.plugin_api.registry import register_toolchain as register_toolchain

TYPE_CHECKING = False  # (not typing's: the build server's client imports this module for toolchain settings)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import ParamSpec, TypeVar

    from neuronbuild.plugin_api.toolchain import ToolSettings

    P = ParamSpec("P")
    R = TypeVar("R")

# (the core's step provider first: workers prepare the providers in this order, its trace imports first)
BUILTIN = ("neuronbuild.kinds", "neuronbuild.toolchains.torch_export", "neuronbuild.toolchains.cpu",
           "neuronbuild.toolchains.neuron")
# The built-in toolchains' settings (flags, tool files, components: plugin_api/toolchain.ToolSettings), in modules
# importing built-in modules only: the command-line parser, the no-op stamp and the build server's client read them.
SETTINGS_BUILTIN = ("neuronbuild.toolchains.cpu_settings", "neuronbuild.toolchains.neuron_settings")

_settings_modules_tried: set[str] = set()
_settings_import_errors: dict[str, str] = {}  # plug-in module -> why its settings could not be imported


def plugin_modules() -> tuple[str, ...]:
    return BUILTIN + envvars.current().words(PLUGINS_ENV)


def load() -> None:
    """Import the built-in and $NEURONBUILD_PLUGINS modules (once per process): they register themselves. A module
    that cannot be imported, or raises while imported, is a one-line UserInputError naming it (exit 2)."""
    if registry.Loaded.build:
        return
    with registry.lock:
        if registry.Loaded.build:
            return
        load_settings()
        registry.add_plugin_path()
        from neuronbuild.errors import UserInputError

        registry.Loaded.build = True  # (a plug-in's import may ask for what registered before it)
        for name in plugin_modules():
            try:
                importlib.import_module(name)
            except ImportError as e:
                registry.Loaded.build = False
                raise UserInputError(f"${PLUGINS_ENV}: cannot import plug-in module {name!r}: {e}") from None
            except (Exception, SystemExit) as e:  # noqa: BLE001 - a plug-in's own code failed: one line, exit 2
                registry.Loaded.build = False
                raise UserInputError(f"${PLUGINS_ENV}: plug-in module {name!r} failed while it was imported"
                                     f"{_where(e)}: {_one_line(e)}") from None


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__


def _where(e: BaseException) -> str:
    """' (at file:line)' of the innermost frame of the traceback that is not importlib's, or ''."""
    import traceback

    frames = [f for f in traceback.extract_tb(e.__traceback__) if "importlib" not in f.filename]
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def load_settings(builtin_only: bool = False) -> None:
    """Import the modules registering toolchain settings: the built-ins' (SETTINGS_BUILTIN) and those of
    $NEURONBUILD_PLUGINS (one module declares a toolchain and its settings). `builtin_only`: not importing plug-ins
    (the build server's client, which must stay light; the server's stamp covers the plug-in files themselves). A
    plug-in that cannot be imported adds nothing here: `load` reports it when the command plans."""
    with registry.lock:
        extra = () if builtin_only else plugin_modules()[len(BUILTIN):]
        todo = [m for m in SETTINGS_BUILTIN + extra if m not in _settings_modules_tried]
        if extra and todo:
            registry.add_plugin_path()
        for name in todo:
            _settings_modules_tried.add(name)
            try:
                importlib.import_module(name)
                _settings_import_errors.pop(name, None)
            except (Exception, SystemExit) as e:  # noqa: BLE001 - reported by load, with the plug-in's name, when a command plans
                if name in SETTINGS_BUILTIN:
                    raise
                _settings_modules_tried.discard(name)
                _settings_import_errors[name] = f"{type(e).__name__}: {e}".splitlines()[0]
        registry.Loaded.settings = True


def settings_problems() -> dict[str, str]:
    """The $NEURONBUILD_PLUGINS modules that could not be imported when their settings (and flags) were looked for,
    with why: their flags are unknown to the command line."""
    with registry.lock:
        return dict(_settings_import_errors)


def _loading(lookup: Callable[P, R]) -> Callable[P, R]:
    """The registry's `lookup`, once the plug-ins are loaded."""

    def loaded_first(*args: P.args, **kwargs: P.kwargs) -> R:
        load()
        return lookup(*args, **kwargs)

    return loaded_first


rules = _loading(registry.rules)
rule = _loading(registry.rule)
kind_fits = _loading(registry.kind_fits)
toolchains = _loading(registry.toolchains)
toolchain = _loading(registry.toolchain)
platforms = _loading(registry.platforms)
toolchain_for = _loading(registry.toolchain_for)
step_providers = _loading(registry.step_providers)
step_provider = _loading(registry.step_provider)
run_step = _loading(registry.run_step)


def tool_settings(builtin_only: bool = False) -> list[ToolSettings]:
    """Every toolchain's settings (load_settings first)."""
    load_settings(builtin_only)
    return registry.tool_settings()


def settings_flags() -> list[Flag]:
    load_settings()
    return registry.settings_flags()


def toolchain_components() -> tuple[str, ...]:
    load_settings()
    return registry.toolchain_components()


def tool_files(builtin_only: bool = False) -> list[str]:
    load_settings(builtin_only)
    return registry.tool_files()
