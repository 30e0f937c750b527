"""The plug-in registry: rule kinds and toolchains, discovered by module name (built-ins + $NEURONBUILD_PLUGINS).

A rule kind is one module under neuronbuild/kinds/ holding its attribute schema and its analysis implementation; a
toolchain is one module under neuronbuild/toolchains/ implementing the Toolchain protocol (analysis/toolchain_api.py).
Each registers itself here when imported. The engine (loading, analysis, execution) asks this registry and never
imports a kind or toolchain module, so adding one is one file plus its name in BUILTIN (or in $NEURONBUILD_PLUGINS,
a comma-separated list of importable modules, for out-of-tree plug-ins, found on sys.path or in the directories of
$NEURONBUILD_PLUGIN_PATH; worker processes import the same list)."""

from __future__ import annotations

import importlib
import sys
from _thread import RLock  # (threading's RLock; importing threading costs the build server's client milliseconds)

from neuronbuild import envvars

TYPE_CHECKING = False  # (not typing's: the build server's client imports this module for toolchain settings)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from neuronbuild.analysis.toolchain_api import Toolchain, ToolSettings
    from neuronbuild.runtime.loaders import ArtifactLoader

BUILTIN = ("neuronbuild.kinds", "neuronbuild.toolchains.cpu", "neuronbuild.toolchains.neuron")
# The built-in toolchains' runtime halves (their `runtime_loader` modules): importable without the build side.
RUNTIME_BUILTIN = ("neuronbuild.toolchains.cpu_runtime", "neuronbuild.toolchains.neuron_runtime")
# The built-in toolchains' settings (flags, tool files, components: analysis/toolchain_api.ToolSettings), in modules
# importing built-in modules only: the command-line parser, the no-op stamp and the build server's client read them.
SETTINGS_BUILTIN = ("neuronbuild.toolchains.cpu_settings", "neuronbuild.toolchains.neuron_settings")
PLUGINS_ENV = "NEURONBUILD_PLUGINS"
PLUGIN_PATH_ENV = "NEURONBUILD_PLUGIN_PATH"

_rules: dict[str, Any] = {}  # kind name -> RuleKind (kinds/base.py)
_toolchains: dict[str, Toolchain] = {}  # toolchain name -> Toolchain
_platforms: dict[str, str] = {}  # platform -> toolchain name
_loaders: dict[str, ArtifactLoader] = {}  # artifact format -> the runtime's loader for it
_loader_modules_tried: dict[str, str | None] = {}  # module -> None (imported) or why it could not be
_settings: dict[str, ToolSettings] = {}  # settings name -> a toolchain's settings
_settings_modules_tried: set[str] = set()
_settings_import_errors: dict[str, str] = {}  # plug-in module -> why its settings could not be imported
_lock = RLock()
_loaded = False


def plugin_modules() -> tuple[str, ...]:
    extra = envvars.current().words(PLUGINS_ENV)
    return BUILTIN + extra


def _ensure() -> None:
    global _loaded
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        _loaded = True
        for d in envvars.current().words(PLUGIN_PATH_ENV):
            if d and d not in sys.path:
                sys.path.append(d)
        for name in plugin_modules():
            try:
                importlib.import_module(name)
            except ImportError as e:
                from neuronbuild.errors import UserInputError

                _loaded = False
                raise UserInputError(f"${PLUGINS_ENV}: cannot import plug-in module {name!r}: {e}") from None
            except (Exception, SystemExit) as e:  # noqa: BLE001 - a plug-in's own code failed: one line, exit 2
                from neuronbuild.errors import UserInputError

                _loaded = False
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


def register_rule(kind: Any) -> Any:
    """Register a rule kind (an object with .name, .schema and .analyze); returns it."""
    with _lock:
        _rules[kind.name] = kind
    return kind


# What a toolchain must have (analysis/toolchain_api.Toolchain; mypy checks the built-ins against it, this checks a
# plug-in at registration, so a missing member is one clear error naming it, not an AttributeError mid-build).
TOOLCHAIN_MEMBERS = ("name", "platforms", "artifact_format", "runtime_loader", "estimate_s", "estimate_mb", "validate_note",
                     "option_keys", "target_attrs", "tp_degrees", "warm_up_shared", "target_record", "describe_target", "versions", "plan", "run",
                     "warm_up_key", "prepare_worker", "step_dirs", "host_status", "load_artifact", "notes")


def _require_members(obj: object, members: tuple[str, ...], what: str) -> None:
    """TypeError naming what `obj` (its name in `what`'s {!r}) lacks of `members`, its protocol's."""
    missing = [m for m in members if not hasattr(obj, m)]
    if missing:
        raise TypeError(what.format(getattr(obj, "name", obj)) +
                        f" (analysis/toolchain_api.py): missing {', '.join(missing)}")


def register_toolchain(tc: Toolchain) -> Toolchain:
    """Register a toolchain (implementing analysis/toolchain_api.Toolchain); returns it."""
    _require_members(tc, TOOLCHAIN_MEMBERS, "toolchain {!r} does not implement the Toolchain protocol")
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
        from neuronbuild.errors import UserInputError

        raise UserInputError(f"no toolchain serves platform {platform!r} (known: {', '.join(_platforms)})")
    return _toolchains[name]


# What a runtime loader must have (runtime/loaders.ArtifactLoader), checked at registration.
LOADER_MEMBERS = ("format", "host_mismatches", "load", "scratch_bytes")


def register_loader(loader: ArtifactLoader) -> ArtifactLoader:
    """Register the runtime loader of one artifact format (runtime/loaders.ArtifactLoader); returns it."""
    missing = [m for m in LOADER_MEMBERS if not hasattr(loader, m)]
    if missing:
        raise TypeError(f"runtime loader {getattr(loader, 'format', loader)!r} does not implement ArtifactLoader "
                        f"(runtime/loaders.py): missing {', '.join(missing)}")
    with _lock:
        owner = _loaders.get(loader.format)
        if owner is not None and owner is not loader and type(owner) is not type(loader):
            raise ValueError(f"artifact format {loader.format!r} has a runtime loader already")
        _loaders[loader.format] = loader
    return loader


def loader_for(fmt: str) -> ArtifactLoader | None:
    """The runtime loader registered for artifact format `fmt`, importing the built-in loader modules and those of
    $NEURONBUILD_PLUGINS not tried yet (never a toolchain registry: the serving runtime has no build side); None
    when none registers it (`loader_problems` says which modules could not be imported)."""
    found = _loaders.get(fmt)
    if found is not None:
        return found
    with _lock:
        for d in envvars.current().words(PLUGIN_PATH_ENV):
            if d and d not in sys.path:
                sys.path.append(d)
        for name in RUNTIME_BUILTIN + plugin_modules()[len(BUILTIN):]:
            if name in _loader_modules_tried:
                continue
            try:
                importlib.import_module(name)
                _loader_modules_tried[name] = None
            except Exception as e:  # noqa: BLE001 - e.g. a build-side plug-in on a serving-only host
                _loader_modules_tried[name] = f"{type(e).__name__}: {e}"
            if fmt in _loaders:
                break
        return _loaders.get(fmt)


def loader_problems() -> list[str]:
    """The plug-in modules the runtime could not import while looking for loaders, with why."""
    return [f"{m} ({why})" for m, why in _loader_modules_tried.items() if why is not None]


class Flag:
    """A command-line flag a toolchain's settings add to every command that plans (build, plan, explain, validate,
    upgrade-impact; `cache` reads its settings from the environment only): it is accepted in rc files like any
    flag, and its value reaches the settings' `check` and `resolve` under `dest` (`--neuronx-cc` -> `neuronx_cc`)."""

    __slots__ = ("name", "help", "metavar", "type")

    def __init__(self, name: str, help: str, metavar: str | None = None,
                 type: Callable[[str], Any] | None = None) -> None:
        if not name.startswith("--"):
            raise ValueError(f"a toolchain flag is a long option (--name), not {name!r}")
        self.name, self.help, self.metavar, self.type = name, help, metavar, type

    @property
    def dest(self) -> str:
        return self.name[2:].replace("-", "_")


SETTINGS_MEMBERS = ("name", "flags", "tools", "components", "check", "resolve", "worker_versions")


def register_settings(settings: ToolSettings) -> ToolSettings:
    """Register a toolchain's settings (analysis/toolchain_api.ToolSettings); returns them."""
    _require_members(settings, SETTINGS_MEMBERS, "toolchain settings {!r} do not implement ToolSettings")
    with _lock:
        taken = {f.name for other in _settings.values() if other.name != settings.name for f in other.flags}
        clash = [f.name for f in settings.flags if f.name in taken]
        if clash:
            raise ValueError(f"toolchain settings {settings.name!r}: flag {clash[0]} is declared already")
        _settings[settings.name] = settings
    return settings


def tool_settings(builtin_only: bool = False) -> list[ToolSettings]:
    """Every toolchain's settings: the built-ins' (SETTINGS_BUILTIN) and those the modules of $NEURONBUILD_PLUGINS
    register (one module declares a toolchain and its settings). `builtin_only`: not importing plug-ins (the build
    server's client, which must stay light; the server's stamp covers the plug-in files themselves). A plug-in that
    cannot be imported adds nothing here: the registry reports it when the command plans."""
    with _lock:
        extra = () if builtin_only else plugin_modules()[len(BUILTIN):]
        todo = [m for m in SETTINGS_BUILTIN + extra if m not in _settings_modules_tried]
        if todo:
            for d in envvars.current().words(PLUGIN_PATH_ENV) if extra else ():
                if d and d not in sys.path:
                    sys.path.append(d)
            for name in todo:
                _settings_modules_tried.add(name)
                try:
                    importlib.import_module(name)
                    _settings_import_errors.pop(name, None)
                except (Exception, SystemExit) as e:  # noqa: BLE001 - reported by _ensure, with the plug-in's name, when a command plans
                    if name in SETTINGS_BUILTIN:
                        raise
                    _settings_modules_tried.discard(name)
                    _settings_import_errors[name] = f"{type(e).__name__}: {e}".splitlines()[0]
        return list(_settings.values())


def settings_problems() -> dict[str, str]:
    """The $NEURONBUILD_PLUGINS modules that could not be imported when their settings (and flags) were looked for,
    with why: their flags are unknown to the command line."""
    with _lock:
        return dict(_settings_import_errors)


def settings_flags() -> list[Flag]:
    """The flags every toolchain's settings add, in registration order."""
    return [f for s in tool_settings() for f in s.flags]


def toolchain_components() -> tuple[str, ...]:
    """The toolchain components a what-if (--toolchain NAME=VERSION) may name: Python and torch (every trace) and
    what each toolchain's settings declare (e.g. its compiler)."""
    return ("python", "torch", *dict.fromkeys(c for s in tool_settings() for c in s.components))


def tool_files(builtin_only: bool = False) -> list[str]:
    """The executables whose files the no-op and server stamps watch, as declared by each toolchain's settings:
    names resolved on PATH, or `$VAR` for the executable a variable names (when set)."""
    out: list[str] = []
    for s in tool_settings(builtin_only):
        for t in s.tools:
            if t.startswith("$"):
                v = envvars.environ().get(t[1:])
                if v:
                    out.append(v)
            else:
                out.append(t)
    return list(dict.fromkeys(out))
