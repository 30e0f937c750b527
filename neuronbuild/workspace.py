"""Finding the workspace root (the directory holding WORKSPACE.neuronbuild) and the shipped rules/ directory."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from neuronbuild.errors import UserInputError

MARKER = "WORKSPACE.neuronbuild"
BUILD_FILE = "BUILD"
OUTPUT_DIR = "neuronbuild-out"


@dataclass(frozen=True)
class Workspace:
    """A workspace: its absolute root and the package the user's cwd is in."""

    root: Path
    cwd_package: str = ""


def find_workspace(start: Path | None = None) -> Workspace:
    """Walk up from `start` (default: cwd) to the first directory holding the marker file, as Bazel does."""
    cwd = Path(start or os.getcwd()).resolve()
    for d in (cwd, *cwd.parents):
        if (d / MARKER).is_file():
            rel = cwd.relative_to(d).as_posix()
            return Workspace(d, "" if rel == "." else rel)
    raise UserInputError(f"not inside a neuronbuild workspace: no {MARKER} in {cwd} or any parent directory")


def builtin_rules_dir() -> Path:
    """Where `@neuronbuild//rules:*.bzl` files live: the installed package data, else the source tree's rules/."""
    here = Path(__file__).resolve().parent
    for cand in (here / "rules", here.parent / "rules"):
        if cand.is_dir() and any(cand.glob("*.bzl")):
            return cand
    return here.parent / "rules"
