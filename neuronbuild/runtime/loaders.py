"""The runtime's loaders: finding the one registered for an artifact format (importing the built-in loader modules,
RUNTIME_BUILTIN, and those of $NEURONBUILD_PLUGINS), and the request the runtime hands one, its files only through
the runtime's checked copies. What a loader is (`ArtifactLoader`, `LoadRequest`, `Loaded`) is the plug-in API's
(plugin_api/loader.py)."""

from __future__ import annotations

import importlib
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from neuronbuild import envvars
from neuronbuild.plugin_api import registry
from neuronbuild.plugin_api.loader import ArtifactLoader, LoadRequest
from neuronbuild.runtime.layout import FileRef, Graph
from neuronbuild.runtime.verified import Scratch, verified_path

# The built-in toolchains' runtime halves (their `runtime_loader` modules): importable without the build side.
RUNTIME_BUILTIN = ("neuronbuild.toolchains.cpu_runtime", "neuronbuild.toolchains.neuron_runtime")
_tried: dict[str, str | None] = {}  # module -> None (imported) or why it could not be


def load_request(graph: Graph, release_dir: Path, emulate: str | None, weights: Callable[[FileRef], Any],
                 scratch: Scratch | None = None) -> LoadRequest:
    """The request loading `graph` from a deployed release; `scratch`: during a strict open, one reused memory file
    for the private copies a loader asks for with `scratch=True`."""

    @contextmanager
    def verified(ref: FileRef, in_scratch: bool) -> Iterator[Path]:
        with verified_path(release_dir / ref.path, ref, Path(tempfile.gettempdir()),
                           scratch if in_scratch else None) as path:
            yield path

    return LoadRequest(graph, release_dir, emulate, weights, verified)


def loader_for(fmt: str) -> ArtifactLoader | None:
    """The runtime loader registered for artifact format `fmt`, importing the built-in loader modules and those of
    $NEURONBUILD_PLUGINS not tried yet (never a toolchain registry: the serving runtime has no build side); None
    when none registers it (`loader_problems` says which modules could not be imported)."""
    found = registry.loader(fmt)
    if found is not None:
        return found
    with registry.lock:
        registry.add_plugin_path()
        for name in RUNTIME_BUILTIN + envvars.current().words(registry.PLUGINS_ENV):
            if name in _tried:
                continue
            try:
                importlib.import_module(name)
                _tried[name] = None
            except Exception as e:  # noqa: BLE001 - e.g. a build-side plug-in on a serving-only host
                _tried[name] = f"{type(e).__name__}: {e}"
            if registry.loader(fmt) is not None:
                break
        return registry.loader(fmt)


def loader_problems() -> list[str]:
    """The plug-in modules the runtime could not import while looking for loaders, with why."""
    return [f"{m} ({why})" for m, why in _tried.items() if why is not None]
