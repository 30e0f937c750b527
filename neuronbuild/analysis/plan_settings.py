"""Plan-wide settings that enter fingerprints (`PlanSettings`: the plug-in API's, plugin_api/toolchain.py) read from the command line: declared action env, what toolchains' settings resolve to (e.g. a configured
compiler, from their flags: ToolSettings), toolchain overrides."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from neuronbuild import envvars
from neuronbuild.errors import UserInputError
from neuronbuild.plugin_api import registry as plugins
from neuronbuild.plugin_api.toolchain import PlanSettings, secret_digest

_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_DIST_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")  # a distribution a model imports (recorded per trace)


def redact_action_env(items: list[str]) -> list[str]:
    """--action-env words as a report shows them: NAME stays, NAME=VALUE becomes NAME=<sha256:12 hex digits>."""
    out = []
    for item in items:
        name, eq, value = str(item).partition("=")
        out.append(f"{name}=<{secret_digest(value)[:19]}>" if eq else name)
    return out


def parse_action_env(items: list[str] | None) -> tuple[tuple[str, str | None], ...]:
    """`--action-env NAME` (value from the caller's environment) or `--action-env NAME=VALUE`; sorted by name."""
    environ = envvars.environ()  # (the command's)
    out: dict[str, str | None] = {}
    for item in items or ():
        name, eq, value = item.partition("=")
        if not _ENV_NAME_RE.match(name):
            raise UserInputError(f"--action-env: invalid variable name {name!r} (expected NAME or NAME=VALUE)")
        out[name] = value if eq else environ.get(name)
    return tuple(sorted(out.items()))


def parse_toolchain_overrides(items: list[str] | None) -> dict[str, str]:
    """`--toolchain torch=2.14.1` (repeatable) -> {"torch": "2.14.1"}."""
    out: dict[str, str] = {}
    for item in items or ():
        name, eq, value = item.partition("=")
        if not eq or not value:
            raise UserInputError(f"--toolchain: expected COMPONENT=VERSION, got {item!r}")
        known = plugins.toolchain_components()
        if name not in known and not _DIST_NAME_RE.match(name):
            raise UserInputError(f"--toolchain: unknown component {name!r} (known: {', '.join(known)}, "
                                 f"or a distribution a model imports, e.g. transformers)")
        out[name] = value
    return out


def tool_values(args: Any) -> dict[str, Any]:
    """The values of every toolchain settings flag in parsed arguments (None: absent, or a command without them)."""
    return {f.dest: getattr(args, f.dest, None) for f in plugins.settings_flags()}


def check_tool_settings(values: Mapping[str, Any]) -> None:
    """Every toolchain's checks of its settings flags that need no subprocess (before the no-op fast path)."""
    for s in plugins.tool_settings():
        s.check(values)


def resolve_settings(action_env: list[str] | None = None, tool_flags: Mapping[str, Any] | None = None,
                     toolchain: list[str] | None = None) -> PlanSettings:
    """Settings from command-line values (bad values raise UserInputError: exit 2). `tool_flags`: the toolchain
    settings flags' values by dest (tool_values); absent ones are None (each toolchain's defaults then apply)."""
    values = dict(tool_flags or {})
    tools = []
    for s in plugins.tool_settings():
        own = {f.dest: values.get(f.dest) for f in s.flags}
        s.check(own)
        value = s.resolve(own)
        if value is not None:
            tools.append((s.name, value))
    return PlanSettings(parse_action_env(action_env), tuple(sorted(tools, key=lambda t: t[0])),
                        parse_toolchain_overrides(toolchain))
