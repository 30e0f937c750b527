"""The cpu (AOTInductor) toolchain's settings: the C++ compiler. No flags of its own; the executables the no-op and
server stamps watch (g++, c++, $CXX, $CC: what inductor may run), the `cxx` component a what-if may set, and the
version a farm worker compares with an action's. A toolchain settings declaration (plugin_api/toolchain.ToolSettings):
built-in modules only at import (the command-line parser and the build server's client read it)."""

from __future__ import annotations

from neuronbuild.plugin_api import registry as plugins

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any

CXX = "cxx"  # the component: the C++ compiler's version (platforms.cxx_version) in every cpu compile's record


class CxxSettings:
    name = CXX
    flags: tuple[plugins.Flag, ...] = ()
    tools: tuple[str, ...] = ("g++", "c++", "$CXX", "$CC")
    components: tuple[str, ...] = (CXX,)

    def check(self, values: Mapping[str, Any]) -> None:
        pass

    def resolve(self, values: Mapping[str, Any]) -> None:
        return None  # the compiler's version enters through the toolchain's versions(): nothing plan-wide

    def worker_versions(self, expect: Mapping[str, str]) -> dict[str, str]:
        if CXX not in expect:
            return {}
        from neuronbuild.platforms import cxx_version

        return {CXX: cxx_version()}


SETTINGS = plugins.register_settings(CxxSettings())
