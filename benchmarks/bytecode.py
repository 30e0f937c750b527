"""Byte-compile the neuronbuild checkout a Python runs, before measuring it.

A user's install reads byte code (pip compiles a wheel's modules; an editable install writes them on first import).
Where PYTHONDONTWRITEBYTECODE is set (this project's CI machines and sandboxes) a checkout whose sources changed since
`make setup` compiled them would compile every changed module in every process it starts, which is not what users
run (~35 ms per client start, ~0.2 s of CPU per batch command: measured 2026-12-06)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def ensure(*pythons: str | Path) -> None:
    """Compile (quietly, only what changed) the `neuronbuild` package each of these interpreters imports."""
    for py in pythons:
        subprocess.run([str(py), "-c", "import compileall, os, neuronbuild; "
                        "compileall.compile_dir(os.path.dirname(neuronbuild.__file__), quiet=1)"],
                       check=True, capture_output=True)
