"""The cpu toolchain's runtime half: how the serving runtime checks and loads "aoti" graphs (AOTInductor packages).
Registered under the format by importing this module (runtime/loaders.RUNTIME_BUILTIN); imports nothing of the build side."""

from __future__ import annotations

import platform

from neuronbuild.plugin_api import registry as plugins
from neuronbuild.plugin_api.loader import Host, Loaded, LoadRequest, Mismatch
from neuronbuild.runtime.layout import Graph
from neuronbuild.vocabulary import X86_LEVELS as ISA_LEVELS

FORMAT = "aoti"  # AOTInductor packages: model.pt2 (+ the weights file, as constants)
PACKAGE = "model.pt2"


class AotiLoader:
    """Loads an AOTInductor package from a private checked copy, with its weights as constants. `format` is what
    it is registered under: a toolchain writing the same package under a format of its own registers another."""

    def __init__(self, fmt: str = FORMAT) -> None:
        self.format = fmt

    def host_mismatches(self, g: Graph, host: Host, emulate: str | None) -> list[Mismatch]:
        """A cpu package: the host's ISA level must cover the one it was built for."""
        isa = str(g.isa or "")
        if platform.machine() not in ("x86_64", "AMD64") or host.isa not in ISA_LEVELS:
            return [Mismatch(g.describe(), "target.isa", isa, host.isa)]
        if isa not in ISA_LEVELS or ISA_LEVELS.index(isa) > ISA_LEVELS.index(host.isa):
            return [Mismatch(g.describe(), "target.isa", isa, host.isa)]
        return []

    def load(self, req: LoadRequest) -> Loaded:
        from neuronbuild.runtime.aoti_loader import load_package

        g = req.graph
        weights = req.weights(g.weights) if g.weights else None
        # The C++ loader needs a path: it gets a private copy of the checked bytes, so the shared library it loads
        # is the one checked (a file swapped after the check never reaches it).
        with req.verified(g.artifacts[PACKAGE], scratch=True) as checked:
            return Loaded(load_package(checked, constants=weights or {}))

    def scratch_bytes(self, g: Graph) -> int:
        ref = g.artifacts.get(PACKAGE)
        return ref.size if ref is not None else 0


LOADER = plugins.register_loader(AotiLoader())
