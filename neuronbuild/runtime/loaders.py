"""What a runtime loader is: how the serving runtime checks and loads the graphs of one artifact format.

The runtime names no format: a graph's manifest entry carries the `format` its toolchain wrote, and the runtime asks
the registry (`neuronbuild.plugins.loader_for`) for the loader registered under it. A toolchain declares the module
that registers its format's loader (`Toolchain.runtime_loader`); that module must import nothing of the build side
(only the runtime and the base layer), so a serving-only install (no `build` extra) can load its graphs. Built-in
loader modules are listed in `plugins.RUNTIME_BUILTIN`; out-of-tree ones are found among the modules of
$NEURONBUILD_PLUGINS (one that cannot be imported in this process, e.g. a build-side module on a serving host, is
skipped and named in the error of a graph needing it)."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from neuronbuild.runtime.host import Host, Mismatch
from neuronbuild.runtime.layout import FileRef, Graph
from neuronbuild.runtime.verified import Scratch, verified_path


@dataclass
class LoadRequest:
    """One graph to load from a deployed release, with the runtime's checked-file helpers."""

    graph: Graph
    release_dir: Path
    emulate: str | None  # the emulation mode the cache was opened with (None: run for real)
    weights: Callable[[FileRef], Any]  # a weights file's tensors, every byte checked, shared between graphs
    scratch: Scratch | None = None  # during a strict open: one reused memory file for private copies

    @contextmanager
    def verified(self, ref: FileRef, scratch: bool = False) -> Iterator[Path]:
        """A path to a private, checked copy of one of the graph's files (valid inside the block only); `scratch`:
        in the open's reused memory file (the loader must be done reading it when the block ends)."""
        with verified_path(self.release_dir / ref.path, ref, Path(tempfile.gettempdir()),
                           self.scratch if scratch else None) as path:
            yield path


@dataclass(frozen=True)
class Loaded:
    """A loaded graph: the callable running it, and whether it runs emulated (counted as `emulated`, not a hit)."""

    fn: Callable[..., Any]
    emulated: bool = False


class ArtifactLoader(Protocol):
    """The runtime half of a toolchain, registered with `plugins.register_loader` under its artifact format."""

    format: str

    def host_mismatches(self, g: Graph, host: Host, emulate: str | None) -> list[Mismatch]:
        """Every reason (besides the torch version, which the runtime checks) `g` cannot run on `host`."""
        ...

    def load(self, req: LoadRequest) -> Loaded:
        """Load `req.graph` (its files only through `req.verified` / `req.weights`); raise on failure."""
        ...

    def scratch_bytes(self, g: Graph) -> int:
        """The largest private copy loading `g` makes with `scratch=True` (0: none), to size the open's scratch."""
        ...
