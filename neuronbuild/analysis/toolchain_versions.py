"""Versions of the toolchain components that enter fingerprints, read from package metadata (never importing torch)."""

from __future__ import annotations

import functools
import sys
from importlib import metadata


@functools.cache
def package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not-installed"


def trace_toolchain() -> dict[str, str]:
    return {"python": f"{sys.version_info.major}.{sys.version_info.minor}", "torch": package_version("torch")}
