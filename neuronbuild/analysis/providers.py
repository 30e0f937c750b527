"""Providers: the typed values a rule kind's analysis hands to the targets that depend on it (as in Buck2)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from neuronbuild.loading.labels import Label
from neuronbuild.plugin_api.actions import Bucket, DepInput, FileInput


@dataclass(frozen=True)
class ModelInfo:
    """A model as traces see it: its canonical record (sources by digest, config, weights, inputs) and its files."""

    label: Label
    record: Mapping[str, Any] = field(hash=False, compare=False)
    files: tuple[FileInput, ...] = ()
    dims: tuple[str, ...] = ()  # bucket dimensions the inputs use, in first-use order
    # Graph families (neuron_model's `graphs`): name -> the graph as a model of its own (same weights and sources,
    # its own entry, inputs, outputs, aliases); empty for a one-graph model.
    graphs: tuple[tuple[str, ModelInfo], ...] = field(default=(), hash=False, compare=False)


@dataclass(frozen=True)
class BucketsInfo:
    """Input shapes: one {dimension: size} dict per bucket, in declaration order."""

    shapes: tuple[Mapping[str, int], ...] = ()


@dataclass(frozen=True)
class PlatformInfo:
    """A compile target platform: the toolchain serving it and the target record entering fingerprints."""

    platform: str
    toolchain: str
    target: Mapping[str, Any] = field(hash=False, compare=False)
    description: str = ""  # e.g. "cpu/x86-64-v3" or "trn2"


@dataclass(frozen=True)
class OptionsInfo:
    """A compiler option set merged with its deps (defaults not filled in)."""

    merged: Mapping[str, Any] = field(hash=False, compare=False)


@dataclass(frozen=True)
class CompileTarget:
    """A compile target's graphs: per bucket, the primary action (its outputs are the artifacts) and the trace."""

    label: Label
    model: Label
    platform: str
    toolchain: str
    target: Mapping[str, Any] = field(hash=False, compare=False)  # the target record (platform, isa, ...)
    description: str = ""  # the target as progress lines name it
    options: Mapping[str, Any] = field(default_factory=dict, hash=False, compare=False)
    buckets: tuple[tuple[Bucket, str], ...] = ()  # (bucket, primary action fingerprint)
    tolerance: float = 1e-4  # accepted max abs error against eager (validate)
    artifact_format: str = ""
    graph_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict, hash=False, compare=False)
    ignored_options: tuple[str, ...] = ()  # options set for it that its toolchain does not read (they change nothing)
    option_warnings: tuple[str, ...] = ()  # what its toolchain warns of in the options it reads (unknown raw flags)
    # Per bucket (as `buckets`), what this target's primary action ships beside its outputs (its model's weights):
    # this target's own, where the action (shared by fingerprint with another model's identical graph: the compile
    # never reads weights) holds the first registrant's in `Action.ships`
    ships: tuple[tuple[DepInput, ...], ...] = field(default=(), hash=False, compare=False)

    def ships_of(self, fp: str) -> tuple[DepInput, ...] | None:
        """What this target ships beside primary action `fp`'s outputs, or None when it does not say."""
        for (_b, f), sh in zip(self.buckets, self.ships, strict=False):
            if f == fp:
                return sh
        return None

    def options_of(self, graph: str) -> Mapping[str, Any]:
        """The effective options one graph family was compiled with (per-graph options, else the target's)."""
        return self.graph_options.get(graph, self.options)


@dataclass(frozen=True)
class BundleInfo:
    """A release bundle: the compile targets it ships."""

    srcs: tuple[Label, ...] = ()
    compression: str = "zstd"
