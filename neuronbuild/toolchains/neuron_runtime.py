"""The Neuron toolchain's runtime half: how the serving runtime checks and loads "neuron-hlo" graphs (model.hlo.pb +
params.json + weights, + model.neff when built with neuronx-cc). A graph runs on a Neuron device of its platform
(its NEFF through the Neuron runtime), or, with `emulate="xla-cpu"`, its exact HLO module on XLA:CPU on any host
(counted as emulated). Registered by importing this module (plugins.RUNTIME_BUILTIN); imports nothing of the build
side."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from neuronbuild import plugins
from neuronbuild.runtime.host import Host, Mismatch
from neuronbuild.runtime.layout import Graph
from neuronbuild.runtime.loaders import Loaded, LoadRequest

FORMAT = "neuron-hlo"
XLA_CPU = "xla-cpu"


class NeuronRuntimeUnavailable(RuntimeError):
    """A Neuron graph asked to run for real where that cannot happen."""


class NeuronHloLoader:
    format = FORMAT

    def host_mismatches(self, g: Graph, host: Host, emulate: str | None) -> list[Mismatch]:
        if emulate == XLA_CPU or g.platform == host.neuron_platform:
            return []  # emulated on XLA:CPU: no device needed
        return [Mismatch(g.describe(), "target.platform", g.platform,
                         host.neuron_platform or "no Neuron device; open_cache(..., emulate='xla-cpu') runs its HLO on "
                         "XLA:CPU instead, counted as emulated")]

    def load(self, req: LoadRequest) -> Loaded:
        g = req.graph
        if req.emulate != XLA_CPU:
            return Loaded(_load_neff(g))
        from neuronbuild.runtime.xla_cpu import load_graph

        shards = g.rank_weights  # tensor-parallel: one shard per rank, each rank's device fed its own
        if g.weights is None and not shards:
            raise RuntimeError("the manifest names no weights file for this Neuron graph")
        weights = [req.weights(r) for r in shards] if shards else req.weights(g.weights)  # type: ignore[arg-type]
        with req.verified(g.artifacts["model.hlo.pb"]) as hlo_path, req.verified(g.artifacts["params.json"]) as params:
            return Loaded(load_graph(hlo_path, params, weights), emulated=True)

    def scratch_bytes(self, g: Graph) -> int:
        return 0


def _load_neff(g: Graph) -> Callable[..., Any]:
    """A Neuron graph on a Neuron host: its NEFF through the Neuron runtime. Not available in this runtime: the Neuron
    runtime (libnrt) cannot be installed or tested here, so this fails with the reason instead of running anything."""
    if "model.neff" not in g.artifacts:
        raise NeuronRuntimeUnavailable("the bundle has no model.neff for this graph (built without neuronx-cc); "
                                       "open with emulate='xla-cpu' to run its HLO on XLA:CPU")
    raise NeuronRuntimeUnavailable("running a NEFF needs the Neuron runtime (libnrt), which this runtime does not "
                                   "load; open with emulate='xla-cpu' to run the graph's HLO on XLA:CPU")


LOADER = plugins.register_loader(NeuronHloLoader())
