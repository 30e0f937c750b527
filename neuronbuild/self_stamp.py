"""A stat-based stamp of neuronbuild's own source files: persistent caches are keyed by it, so a code change empties them."""

from __future__ import annotations

import functools
import os
from pathlib import Path

from neuronbuild import FORMAT_VERSION, __version__


@functools.cache
def code_stamp() -> str:
    """Version, format and (path, size, mtime_ns) of every .py file of the neuronbuild package, as one string."""
    root = Path(__file__).resolve().parent
    parts = [__version__, FORMAT_VERSION]
    stack = [str(root)]
    while stack:
        d = stack.pop()
        with os.scandir(d) as it:
            for e in sorted(it, key=lambda e: e.name):
                if e.is_dir(follow_symlinks=False) and e.name != "__pycache__":
                    stack.append(e.path)
                elif e.name.endswith(".py"):
                    st = e.stat()
                    parts.append(f"{e.path}:{st.st_size}:{st.st_mtime_ns}")
    return "\n".join(parts)
