"""The Neuron toolchain's runtime half: how the serving runtime checks and loads "neuron-hlo" graphs (model.hlo.pb +
params.json + weights, + model.neff when built with neuronx-cc). A graph runs on a Neuron device of its platform
(its NEFF through libnrt, the Neuron runtime's library: runtime/neff_graph.py), or, with `emulate="xla-cpu"`, its
exact HLO module on XLA:CPU on any host (counted as emulated). Registered by importing this module
(runtime/loaders.RUNTIME_BUILTIN); imports nothing of the build side."""

from __future__ import annotations

from typing import Any

from neuronbuild.plugin_api import registry as plugins
from neuronbuild.plugin_api.loader import Host, Loaded, LoadRequest, Mismatch
from neuronbuild.runtime.layout import FileRef, Graph

FORMAT = "neuron-hlo"
XLA_CPU = "xla-cpu"


class NeuronRuntimeUnavailable(RuntimeError):
    """A Neuron graph asked to run for real where that cannot happen."""


class NeuronHloLoader:
    format = FORMAT

    def host_mismatches(self, g: Graph, host: Host, emulate: str | None) -> list[Mismatch]:
        if emulate == XLA_CPU:
            return []  # emulated on XLA:CPU: no device needed
        if g.platform == host.neuron_platform:
            ranks = int(g.tp.get("degree") or 1)
            if host.neuron_cores is not None and ranks > host.neuron_cores:
                return [Mismatch(g.describe(), "tp_degree", f"{ranks} NeuronCores",
                                 f"{host.neuron_cores} visible to libnrt (NEURON_RT_VISIBLE_CORES)")]
            return []
        return [Mismatch(g.describe(), "target.platform", g.platform,
                         host.neuron_platform or "no Neuron device; open_cache(..., emulate='xla-cpu') runs its HLO on "
                         "XLA:CPU instead, counted as emulated")]

    def load(self, req: LoadRequest) -> Loaded:
        g = req.graph
        shards = g.rank_weights  # tensor-parallel: one shard per rank, each rank's device fed its own
        if req.emulate != XLA_CPU:
            _check_neff(g)
            from neuronbuild.runtime.neff_graph import load_neff_graph

            with req.verified(g.artifacts["model.neff"]) as neff, req.verified(g.artifacts["params.json"]) as params:
                neff_bytes, params_bytes = neff.read_bytes(), params.read_bytes()
            return Loaded(load_neff_graph(g.describe(), neff_bytes, params_bytes, g.outputs, g.aliases,
                                          _rank_weights(req, shards)))
        from neuronbuild.runtime.xla_cpu import load_graph

        weights = _rank_weights(req, shards)
        with req.verified(g.artifacts["model.hlo.pb"]) as hlo_path, req.verified(g.artifacts["params.json"]) as params:
            return Loaded(load_graph(hlo_path, params, weights if shards else weights[0]), emulated=True)

    def scratch_bytes(self, g: Graph) -> int:
        return 0


def _rank_weights(req: LoadRequest, shards: list[FileRef]) -> list[Any]:
    """The weights each rank binds: its shard, or the model's one weights file (one rank)."""
    if shards:
        return [req.weights(r) for r in shards]
    if req.graph.weights is None:
        raise RuntimeError("the manifest names no weights file for this Neuron graph")
    return [req.weights(req.graph.weights)]


def _check_neff(g: Graph) -> None:
    """A Neuron graph on a Neuron host runs its NEFF through libnrt: it needs one, and a libnrt."""
    if "model.neff" not in g.artifacts:
        raise NeuronRuntimeUnavailable("the bundle has no model.neff for this graph (built without neuronx-cc); "
                                       "open with emulate='xla-cpu' to run its HLO on XLA:CPU")
    from neuronbuild.runtime.libnrt import LibnrtUnavailable, load_library

    try:
        load_library()
    except LibnrtUnavailable as e:
        raise NeuronRuntimeUnavailable(f"{e}; open with emulate='xla-cpu' to run the graph's HLO on XLA:CPU") from None


LOADER = plugins.register_loader(NeuronHloLoader())
