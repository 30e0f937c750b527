"""The Neuron toolchain's settings: neuronx-cc. Its flags (--neuronx-cc PATH, --neuronx-cc-timeout SECONDS), the
variable read when the flag is absent ($NEURONX_CC, else neuronx-cc on PATH), the executable the no-op and server
stamps watch, and what enters the Neuron compiles' fingerprints (its version; path and timeout reach the step's
spec). A toolchain settings declaration (plugin_api/toolchain.ToolSettings): built-in modules only at import (the
command-line parser and the build server's client read it)."""

from __future__ import annotations

import os

from neuronbuild import envvars
from neuronbuild.plugin_api import registry as plugins

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any

NAME = "neuronx-cc"  # the settings' and the toolchain component's name (and the executable's name on PATH)
ENV = "NEURONX_CC"  # path of the neuronx-cc executable (else --neuronx-cc, else PATH)
FLAG = "--neuronx-cc"
TIMEOUT_FLAG = "--neuronx-cc-timeout"
DEFAULT_TIMEOUT_S = 3600.0


def find_neuronx_cc(flag: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """--neuronx-cc PATH, else $NEURONX_CC, else neuronx-cc on PATH, else None. Absolute path of an executable."""
    import shutil

    environ = envvars.environ() if environ is None else environ  # (the command's)
    explicit = flag or environ.get(ENV)
    if explicit:
        found = shutil.which(explicit, path=environ.get("PATH")) if os.sep not in explicit else explicit
        if not found or not os.path.isfile(found) or not os.access(found, os.X_OK):
            from neuronbuild.errors import UserInputError

            source = FLAG if flag else f"${ENV}"
            raise UserInputError(f"{source}: {explicit!r} is not an executable file")
        return os.path.abspath(found)
    found = shutil.which(NAME, path=environ.get("PATH"))
    return os.path.abspath(found) if found else None


class NeuronxCcSettings:
    name = NAME
    flags = (plugins.Flag(FLAG, "neuronx-cc executable for Neuron targets (default: $NEURONX_CC, else neuronx-cc on "
                                "PATH)", metavar="PATH"),
             plugins.Flag(TIMEOUT_FLAG, "kill neuronx-cc and fail the action after this long (default 3600)",
                          metavar="SECONDS", type=float))
    tools: tuple[str, ...] = (NAME, f"${ENV}")
    components: tuple[str, ...] = (NAME,)

    def check(self, values: Mapping[str, Any]) -> None:
        timeout = values.get("neuronx_cc_timeout")
        if timeout is not None and timeout <= 0:
            from neuronbuild.errors import UserInputError

            raise UserInputError(f"{TIMEOUT_FLAG} must be a positive number of seconds")
        find_neuronx_cc(values.get("neuronx_cc"))

    def resolve(self, values: Mapping[str, Any]) -> dict[str, Any] | None:
        """The configured neuronx-cc: {"path", "version" (enters fingerprints), "timeout_s"}, or None."""
        path = find_neuronx_cc(values.get("neuronx_cc"))
        if path is None:
            return None
        from neuronbuild.toolchains.neuronx_cc import neuronx_cc_version

        return {"path": path, "version": neuronx_cc_version(path),
                "timeout_s": float(values.get("neuronx_cc_timeout") or DEFAULT_TIMEOUT_S)}

    def worker_versions(self, expect: Mapping[str, str]) -> dict[str, str]:
        return {}  # the step runs the compiler its spec names (path and version checked there: toolchains/neuronx_cc.py)


SETTINGS = plugins.register_settings(NeuronxCcSettings())
