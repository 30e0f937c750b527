"""A stat-based stamp of neuronbuild's own source files: persistent caches are keyed by it, so a code change empties them.

Imported by the thin client (server/protocol.py): built-in modules only."""

from __future__ import annotations

import os
import sys

from neuronbuild import FORMAT_VERSION, __version__

_PKG_DIR = os.path.dirname(os.path.realpath(__file__))
_stamp: str | None = None  # computed once per process (a server's stamp covers its code: a change replaces it)


def code_stamp() -> str:
    """Version, format and (path, size, mtime_ns) of every .py file of the neuronbuild package, as one string."""
    global _stamp
    if _stamp is not None:
        return _stamp
    parts = [__version__, FORMAT_VERSION]
    stack = [_PKG_DIR]
    while stack:
        d = stack.pop()
        with os.scandir(d) as it:
            for e in sorted(it, key=lambda e: e.name):
                if e.is_dir(follow_symlinks=False) and e.name != "__pycache__":
                    stack.append(e.path)
                elif e.name.endswith(".py"):
                    st = e.stat()
                    parts.append(f"{e.path}:{st.st_size}:{st.st_mtime_ns}")
    _stamp = "\n".join(parts)
    return _stamp


def checkout_dir() -> str | None:
    """The source checkout neuronbuild runs from when it is on sys.path as a directory (a path-based editable install,
    `make setup`), else None. Its stat keys change with any file created at its top (an editor's swap file), and what
    of it builds use is neuronbuild's sources, which code_stamp covers: the no-op and server stamps leave it out."""
    parent = os.path.dirname(_PKG_DIR)
    if not os.path.isfile(os.path.join(parent, "pyproject.toml")):
        return None  # an installed package: its parent is site-packages, whose stat keys the stamps need
    return next((p for p in sys.path if p and os.path.realpath(p) == parent), None)
