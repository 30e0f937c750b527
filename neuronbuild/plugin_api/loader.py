"""What a runtime loader is (the plug-in API's serving half): how the serving runtime checks and loads the graphs of
one artifact format (registered under it: runtime/loaders.py finds it by the format a graph's manifest names), and the
plain data it is handed and returns. Its module imports nothing of the build side, so a serving-only install loads
those graphs."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # (a leaf value module: it never imports the plug-in API)
    from neuronbuild.runtime.layout import FileRef, Graph


@dataclass(frozen=True)
class Host:
    """The facts a graph's compatibility depends on."""

    torch: str
    isa: str
    neuron_platform: str | None  # None: not a Neuron host
    neuron_cores: int | None = None  # the NeuronCores libnrt makes visible (None: no libnrt here)

    def describe(self) -> str:
        cores = f" ({self.neuron_cores} NeuronCores visible to libnrt)" if self.neuron_cores is not None else ""
        return f"torch {self.torch}, cpu {self.isa}, neuron {self.neuron_platform or 'none'}{cores}"


@dataclass(frozen=True)
class Mismatch:
    """One reason a graph cannot be used here: the record field that differs, what it was built for, what we have."""

    graph: str
    field: str
    built: str
    here: str

    def __str__(self) -> str:
        return f"{self.graph}: {self.field} differs (built for {self.built}, this host has {self.here})"


@dataclass
class LoadRequest:
    """One graph to load from a deployed release, with the runtime's checked-file helpers."""

    graph: Graph
    release_dir: Path
    emulate: str | None  # the emulation mode the cache was opened with (None: run for real)
    weights: Callable[[FileRef], Any]  # a weights file's tensors, every byte checked, shared between graphs
    # (ref, scratch) -> a private, checked copy of one of the graph's files (runtime/verified.py; the open's)
    open_verified: Callable[[FileRef, bool], AbstractContextManager[Path]]

    def verified(self, ref: FileRef, scratch: bool = False) -> AbstractContextManager[Path]:
        """A path to a private, checked copy of one of the graph's files (valid inside the block only); `scratch`:
        in the open's reused memory file (the loader must be done reading it when the block ends)."""
        return self.open_verified(ref, scratch)


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


LOADER_MEMBERS = ("format", "host_mismatches", "load", "scratch_bytes")  # (all required: checked at registration)
