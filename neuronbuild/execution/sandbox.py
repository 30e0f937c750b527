"""Per-action scratch directories holding only the action's declared inputs, plus an output directory."""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from neuronbuild.analysis.actions import Action
from neuronbuild.digests import copy_hashing
from neuronbuild.execution.cache_api import SpawnCache


class InputChanged(Exception):
    """A declared source file changed between analysis and execution."""


@dataclass(frozen=True)
class Sandbox:
    """Where one action runs: `inputs` (its cwd) and `outputs`, removed after the action."""

    base: Path
    inputs: Path
    outputs: Path

    def remove(self) -> None:
        shutil.rmtree(self.base, ignore_errors=True)


def prepare(action: Action, root: Path, cache: SpawnCache, parent: Path | None = None) -> Sandbox:
    """A sandbox under `parent` (default: the cache's scratch dir; executors pass a per-build dir they remove whole)."""
    parent = parent or cache.scratch
    parent.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(dir=parent, prefix=f"{action.fingerprint[:12]}-"))
    sb = Sandbox(base, base / "in", base / "out")
    try:
        sb.inputs.mkdir()
        sb.outputs.mkdir()
        for f in action.files:
            dest = sb.inputs / f.path
            dest.parent.mkdir(parents=True, exist_ok=True)
            with open(root / f.path, "rb") as src, open(dest, "wb") as out:
                digest, _size = copy_hashing(src, out)  # one read: the copy is hashed as it is written
            if digest != f.digest:
                raise InputChanged(f"input '{f.path}' changed during the build; run the build again")
        for d in action.dep_inputs:
            res = cache.lookup(d.action)
            if res is None or d.output not in res.outputs:
                raise InputChanged(f"output '{d.output}' of action {d.action[:12]} is missing from the cache")
            cache.place_blob(res.outputs[d.output].digest, sb.inputs / d.path)
    except BaseException:  # including Ctrl-C: no half-built sandbox is left behind
        sb.remove()
        raise
    return sb
