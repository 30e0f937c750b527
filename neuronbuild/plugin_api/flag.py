"""A command-line flag a toolchain's settings add (plain data of the settings protocol, plugin_api/toolchain.py
`ToolSettings`). Imports nothing: the build server's thin client reads the built-in settings' flags."""

from __future__ import annotations

TYPE_CHECKING = False  # (not typing's: the thin client imports this module)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any


class Flag:
    """A command-line flag a toolchain's settings add to every command that plans (build, plan, explain, validate,
    upgrade-impact; `cache` reads its settings from the environment only): it is accepted in rc files like any
    flag, and its value reaches the settings' `check` and `resolve` under `dest` (`--neuronx-cc` -> `neuronx_cc`)."""

    __slots__ = ("name", "help", "metavar", "type")

    def __init__(
        self, name: str, help: str, metavar: str | None = None, type: Callable[[str], Any] | None = None
    ) -> None:
        if not name.startswith("--"):
            raise ValueError(f"a toolchain flag is a long option (--name), not {name!r}")
        self.name, self.help, self.metavar, self.type = name, help, metavar, type

    @property
    def dest(self) -> str:
        return self.name[2:].replace("-", "_")


class SettingsDefaults:
    """What a toolchain's settings (ToolSettings) have unless they say otherwise: no flags, tools or components, no
    checks, nothing resolved, no worker versions. The registry fills what a registered object leaves out."""

    flags: tuple[Flag, ...] = ()
    tools: tuple[str, ...] = ()
    components: tuple[str, ...] = ()

    def check(self, values: Any) -> None:
        return None

    def resolve(self, values: Any) -> Any:
        return None

    def worker_versions(self, expect: Any) -> dict[str, str]:
        return {}
