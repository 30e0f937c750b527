"""Versions of the toolchain components that enter fingerprints, read from package metadata (never importing torch)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterable, Mapping
from importlib import metadata

from neuronbuild.plugin_api.toolchain import package_version


@functools.cache
def _packages_distributions() -> Mapping[str, list[str]]:
    return metadata.packages_distributions()


def distributions_of(modules: Iterable[str]) -> dict[str, str]:
    """Installed distributions (name -> version) providing these top-level modules; torch is in every trace record
    already, modules no distribution provides (the standard library, the workspace's own) are left out."""
    wanted = [m for m in modules if m not in sys.stdlib_module_names and m not in ("torch", "neuronbuild")]
    if not wanted:
        return {}  # (no scan of every installed distribution: ~1 s per process with torch's environment)
    dists = _packages_distributions()
    out: dict[str, str] = {}
    for mod in wanted:
        for dist in dists.get(mod, ()):
            name = dist.lower().replace("_", "-")
            if name != "torch":
                out[name] = package_version(dist)
    return dict(sorted(out.items()))
