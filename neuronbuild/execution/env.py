"""The environment actions run with: an allow-list, never the caller's ambient variables."""

from __future__ import annotations

import os
from pathlib import Path

# Variables passed through from the caller. PATH only locates tools (g++); their versions enter fingerprints.
PASSTHROUGH = ("PATH",)


def action_environment(toolchain_tmp: Path, home: Path) -> dict[str, str]:
    env = {k: os.environ[k] for k in PASSTHROUGH if k in os.environ}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    env.update({
        "HOME": str(home),
        "TMPDIR": str(toolchain_tmp),  # AOTInductor's precompiled headers live under TMPDIR: keep them across builds
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONHASHSEED": "0",
        "OMP_NUM_THREADS": "1",  # one worker per core; codegen does not follow this (the toolchain pins threads)
        "AOTI_RUNTIME_CHECK_INPUTS": "1",
    })
    return env
