"""The plug-in registry: rule kinds, toolchains, step providers, their settings and runtime loaders, each registered by
its module when imported. This module names no plug-in and imports none: `neuronbuild.plugins.load()` (called by
every command before it loads or plans, by workers, and by the runtime for loaders) imports the built-in and
$NEURONBUILD_PLUGINS modules, and the lookups here answer from what they registered, so loading, analysis and the
runtime, which ask, never import a plug-in (tests/test_layering.py: no import circle)."""

from __future__ import annotations

import sys
import types
from _thread import RLock  # (threading's RLock; importing threading costs the build server's client milliseconds)

from neuronbuild import envvars
from neuronbuild.plugin_api.flag import Flag as Flag  # (plugins.Flag, for the settings modules)
from neuronbuild.plugin_api.flag import SettingsDefaults

TYPE_CHECKING = False  # (not typing's: the build server's client imports this module for toolchain settings)
if TYPE_CHECKING:
    from collections.abc import Mapping
    from pathlib import Path
    from typing import Any

    from neuronbuild.plugin_api.loader import ArtifactLoader
    from neuronbuild.plugin_api.rules import Rule
    from neuronbuild.plugin_api.toolchain import StepProvider, Toolchain, ToolSettings

_rules: dict[str, Rule] = {}  # kind name -> its rule kind
_toolchains: dict[str, Toolchain] = {}  # toolchain name -> Toolchain
_platforms: dict[str, str] = {}  # platform -> toolchain name
_steps: dict[str, StepProvider] = {}  # step provider name -> it (every toolchain, and the core's trace and weights)
_loaders: dict[str, ArtifactLoader] = {}  # artifact format -> the runtime's loader for it
_settings: dict[str, ToolSettings] = {}  # settings name -> a toolchain's settings
lock = RLock()
_TABLES: dict[str, dict[str, Any]] = {"rules": _rules, "toolchains": _toolchains, "platforms": _platforms,
                                      "steps": _steps, "loaders": _loaders, "settings": _settings}  # (snapshot)


class Loaded:
    """What plugins.load has imported in this process: the build-side plug-ins (`build`), the settings modules
    (`settings`: the built-ins' at least)."""

    build = False
    settings = False


PLUGINS_ENV, PLUGIN_PATH_ENV = "NEURONBUILD_PLUGINS", "NEURONBUILD_PLUGIN_PATH"


def add_plugin_path() -> None:
    """$NEURONBUILD_PLUGIN_PATH's directories appended to sys.path (plugins.load and loaders.loader_for import)."""
    for d in envvars.current().words(PLUGIN_PATH_ENV):
        if d and d not in sys.path:
            sys.path.append(d)


def _complete(obj: object, required: tuple[str, ...], defaults: type, what: str) -> None:
    """TypeError naming what `obj` lacks of `required` (`what` names it, with {!r} for its name); then the optional
    members it leaves out, filled from `defaults` and its bases (a capability's "nothing": no warm-up, no flags...)."""
    missing = [m for m in required if not hasattr(obj, m)]
    if missing:
        raise TypeError(
            what.format(getattr(obj, "name", getattr(obj, "format", obj))) + f": missing {', '.join(missing)}"
        )
    for member, value in {k: v for c in reversed(defaults.__mro__) for k, v in vars(c).items()}.items():
        if not member.startswith("_") and not hasattr(obj, member):
            value = types.MethodType(value, obj) if callable(value) else value
            try:
                setattr(obj, member, value)
            except AttributeError:  # (a frozen dataclass)
                object.__setattr__(obj, member, value)


def register_rule(kind: Rule) -> Rule:
    """Register a rule kind (plugin_api/rules.py Rule, e.g. a RuleKind); returns it."""
    from neuronbuild.plugin_api.rules import RULE_REQUIRED, RuleDefaults

    _complete(kind, RULE_REQUIRED, RuleDefaults, "rule kind {!r} does not implement Rule (plugin_api/rules.py)")
    with lock:
        _rules[kind.name] = kind
    return kind


def register_toolchain(tc: Toolchain) -> Toolchain:
    """Register a toolchain (plugin_api/toolchain.py Toolchain; the members with a default there are optional);
    returns it."""
    from neuronbuild.plugin_api import toolchain as api

    _complete(
        tc,
        api.TOOLCHAIN_REQUIRED,
        api.Toolchain,
        "toolchain {!r} does not implement the Toolchain protocol (plugin_api/toolchain.py)",
    )
    with lock:
        for p in tc.platforms:
            owner = _platforms.get(p)
            if owner is not None and owner != tc.name:
                raise ValueError(f"platform {p!r} is served by toolchain {owner!r} already; {tc.name!r} cannot")
            _platforms[p] = tc.name
        _toolchains[tc.name] = tc
        _steps[tc.name] = tc
    return tc


def register_steps(provider: StepProvider) -> StepProvider:
    """Register a step provider that is not a toolchain (plugin_api/toolchain.py StepProvider), e.g. the core's trace
    and weights (toolchains/torch_export.py); returns it."""
    from neuronbuild.plugin_api import toolchain as api

    _complete(provider, api.STEPS_REQUIRED, api.Steps, "step provider {!r} does not implement StepProvider")
    with lock:
        if provider.name in _toolchains:
            raise ValueError(f"step provider {provider.name!r}: a toolchain has that name already")
        _steps[provider.name] = provider
    return provider


def register_loader(loader: ArtifactLoader) -> ArtifactLoader:
    """Register the runtime loader of one artifact format (plugin_api/loader.py ArtifactLoader); returns it."""
    from neuronbuild.plugin_api.loader import LOADER_MEMBERS

    _complete(
        loader, LOADER_MEMBERS, object, "runtime loader {!r} does not implement ArtifactLoader (plugin_api/loader.py)"
    )
    with lock:
        owner = _loaders.get(loader.format)
        if owner is not None and owner is not loader and type(owner) is not type(loader):
            raise ValueError(f"artifact format {loader.format!r} has a runtime loader already")
        _loaders[loader.format] = loader
    return loader


def register_settings(settings: ToolSettings) -> ToolSettings:
    """Register a toolchain's settings (plugin_api/toolchain.py ToolSettings; all but `name` optional); returns
    them."""
    _complete(settings, ("name",), SettingsDefaults, "toolchain settings {!r} do not implement ToolSettings")
    with lock:
        taken = {f.name for other in _settings.values() if other.name != settings.name for f in other.flags}
        clash = [f.name for f in settings.flags if f.name in taken]
        if clash:
            raise ValueError(f"toolchain settings {settings.name!r}: flag {clash[0]} is declared already")
        _settings[settings.name] = settings
    return settings


def snapshot() -> dict[str, dict[str, Any]]:
    """A copy of what is registered now, table by table, for `restore` (the tests put the registry back after each
    test: tests/conftest.py)."""
    with lock:
        return {name: dict(table) for name, table in _TABLES.items()}


def restore(saved: Mapping[str, Mapping[str, Any]]) -> None:
    """Make the registry hold what `snapshot` returned, in its order (the tables stay the same objects: what
    `rules()`, `toolchains()`, ... returned before sees the change)."""
    with lock:
        for name, table in _TABLES.items():
            table.clear()
            table.update(saved[name])


def _build_side() -> None:
    if not Loaded.build:
        raise RuntimeError(
            "no plug-ins loaded: neuronbuild.plugins.load() imports them (every command does before it loads or plans)"
        )


def rules() -> dict[str, Rule]:
    _build_side()
    return _rules


def rule(kind: str) -> Rule:
    return rules()[kind]


def kind_fits(kind: str, wanted: tuple[str, ...]) -> bool:
    """Whether a `kind` target may be named by a label attribute that takes `wanted` kinds: it is one of them, or
    its rule kind declares that it stands for one (`stands_for`: it returns the same provider, e.g. an out-of-tree
    kind planning compiles stands for neuron_compile in a bundle's srcs)."""
    if kind in wanted:
        return True
    r = rules().get(kind)
    return r is not None and any(k in wanted for k in r.stands_for)


def toolchains() -> dict[str, Toolchain]:
    _build_side()
    return _toolchains


def toolchain(name: str) -> Toolchain:
    return toolchains()[name]


def step_providers() -> dict[str, StepProvider]:
    """Every step provider (every toolchain too), in registration order (plugins.BUILTIN: the core's first)."""
    _build_side()
    return _steps


def step_provider(spec: Mapping[str, Any]) -> StepProvider | None:
    """The provider of the step `spec` describes (plugin_api/actions.py provider_name); None: it names none."""
    from neuronbuild.plugin_api.actions import provider_name

    return step_providers()[provider_name(spec)] if provider_name(spec) else None


def run_step(spec: Mapping[str, Any], sandbox: Path, out_dir: Path) -> dict[str, Any]:
    """Run the step `spec` describes in this process: every action kind alike (execution/worker.py; light steps)."""
    from neuronbuild.plugin_api.actions import provider_name

    return step_providers()[provider_name(spec)].run(str(spec["step"]), spec, sandbox, out_dir)


def platforms() -> tuple[str, ...]:
    _build_side()
    return tuple(_platforms)


def toolchain_for(platform: str) -> Toolchain:
    """The toolchain serving `platform`; UserInputError naming the known platforms otherwise."""
    _build_side()
    name = _platforms.get(platform)
    if name is None:
        from neuronbuild.errors import UserInputError

        raise UserInputError(f"no toolchain serves platform {platform!r} (known: {', '.join(_platforms)})")
    return _toolchains[name]


def loader(fmt: str) -> ArtifactLoader | None:
    """The runtime loader registered for artifact format `fmt` (None: none registered yet)."""
    return _loaders.get(fmt)


def tool_settings() -> list[ToolSettings]:
    """Every toolchain's settings registered (plugins.load_settings imports their modules)."""
    if not Loaded.settings:
        raise RuntimeError("no toolchain settings loaded: neuronbuild.plugins.load_settings() imports them")
    return list(_settings.values())


def settings_flags() -> list[Flag]:
    """The flags every toolchain's settings add, in registration order."""
    return [f for s in tool_settings() for f in s.flags]


def toolchain_components() -> tuple[str, ...]:
    """The toolchain components a what-if (--toolchain NAME=VERSION) may name: Python and torch (every trace) and
    what each toolchain's settings declare (e.g. its compiler)."""
    return ("python", "torch", *dict.fromkeys(c for s in tool_settings() for c in s.components))


def tool_files() -> list[str]:
    """The executables whose files the no-op and server stamps watch, as declared by each toolchain's settings:
    names resolved on PATH, or `$VAR` for the executable a variable names (when set)."""
    out: list[str] = []
    for s in tool_settings():
        for t in s.tools:
            if t.startswith("$"):
                v = envvars.environ().get(t[1:])
                if v:
                    out.append(v)
            else:
                out.append(t)
    return list(dict.fromkeys(out))
