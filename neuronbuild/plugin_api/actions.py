"""Action values: one trace per (model, bucket), one compile per (trace, target, effective options). Part of the plug-in
API (a toolchain plans Actions)."""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

from neuronbuild.digests import fingerprint

if TYPE_CHECKING:
    from neuronbuild.loading.labels import Label  # (a leaf value module: it never imports the plug-in API)

__all__ = ["COMPILE", "CORE_STEPS", "LIGHT", "PROGRAM_CONSTANTS", "PROVIDER", "TRACE", "TRACE_OUTPUT", "TRACE_WEIGHTS",
           "WEIGHTS", "Action", "Bucket", "DepInput", "FileInput", "is_light", "make_action", "provider_name",
           "rank_weights", "trace_weights"]

TRACE = "trace"
COMPILE = "compile"
WEIGHTS = "weights"  # one per (model, dtype, layout): the checkpoint streamed into the model's weights file(s)
TRACE_OUTPUT = "program.pt2"  # shapes only: no weight values inside
TRACE_WEIGHTS = "constants.safetensors"  # the model's weights action's output: its state by FQN (tied once)
# A graph's own tensors (non-persistent buffers, lifted constants: what the program computes, never a checkpoint's
# values), written beside the graph by the step that compiles or lowers its program; small.
PROGRAM_CONSTANTS = "program_constants.safetensors"
# A toolchain step whose spec sets LIGHT true runs no model code, reads its inputs as data and takes milliseconds (a
# Neuron compile without neuronx-cc: it re-emits the lowering's files and writes compile_flags.json). The local
# executor runs such a step in the build process, in the sandbox it made, instead of forking a confined action process
# from a worker (#53: the fork and the namespace cost more than the step). The spec is not in the fingerprint.
LIGHT = "light"
# Who runs an action's `step`: the step provider its spec names under PROVIDER (the core's trace and weights:
# CORE_STEPS, toolchains/torch_export.py), else its "toolchain" (a toolchain is the provider of its own steps).
PROVIDER, CORE_STEPS = "provider", "torch_export"


def provider_name(spec: Mapping[str, Any]) -> str:
    return str(spec.get(PROVIDER) or spec.get("toolchain") or "")


def rank_weights(rank: int) -> str:
    """A tensor-parallel trace's weights output for one rank (instead of TRACE_WEIGHTS): that rank's shard of every
    tensor the per-rank program holds."""
    return f"rank_{rank}.safetensors"


def trace_weights(tp_degree: int) -> tuple[str, ...]:
    """The weights files a weights action at `tp_degree` writes: the one file, or one per rank."""
    return (TRACE_WEIGHTS,) if tp_degree <= 1 else tuple(rank_weights(r) for r in range(tp_degree))


@dataclass(frozen=True, order=True)
class Bucket:
    """One static input shape: ordered (dimension, size) pairs, of one graph of the model ("" when it has one)."""

    dims: tuple[tuple[str, int], ...]
    graph: str = ""

    @cached_property
    def name(self) -> str:
        dims = "_".join(f"{k}{v}" for k, v in self.dims)
        return f"{self.graph}_{dims}" if self.graph else dims

    def as_dict(self) -> dict[str, int]:
        return dict(self.dims)

    @cached_property
    def _text(self) -> str:
        key = (self.dims, self.graph)
        s = _TEXTS.get(key)  # (equal buckets of other objects: each compile target has its own, 100,000s)
        if s is None:
            dims = ", ".join(f"{k}={v}" for k, v in self.dims)
            s = f"{self.graph}: {dims}" if self.graph else dims
            if len(_TEXTS) >= 1 << 16:
                _TEXTS.clear()
            _TEXTS[key] = s
        return s

    def __str__(self) -> str:
        return self._text


@dataclass(frozen=True)
class FileInput:
    """A declared source input: workspace-relative path (also its path in the sandbox) and content digest."""

    path: str
    digest: str


@dataclass(frozen=True)
class DepInput:
    """An output of another action placed in the sandbox: (producing action, its output name, sandbox path)."""

    action: str
    output: str
    path: str


@dataclass(frozen=True)
class Action:
    """A unit of cached work. `fingerprint` is the digest of `record`, which holds every input that can change it."""

    fingerprint: str
    kind: str
    label: Label  # the model (trace) or the compile target (compile)
    bucket: Bucket
    record: Mapping[str, Any] = field(hash=False, compare=False)
    spec: Mapping[str, Any] = field(hash=False, compare=False)  # what the toolchain receives; no absolute paths
    files: tuple[FileInput, ...] = ()
    dep_inputs: tuple[DepInput, ...] = ()
    outputs: tuple[str, ...] = ()
    platform: str = ""  # toolchain actions: the platform compiled for
    target: str = ""  # toolchain actions: how the target is named in progress lines (e.g. "cpu/x86-64-v3")
    # Outputs of other actions that reach users beside this action's own (output targets, bundles, validate), as
    # (action, output, name among this action's outputs): a compile's model weights, which the weights action
    # writes and the compile never reads. Not inputs: no sandbox file, no fingerprint field, no ordering, no cutoff;
    # they count in the closure (what a target is made of: gc roots, bundles' provenance).
    ships: tuple[DepInput, ...] = ()
    # The fingerprints of the actions this one reads (of dep_inputs, in order): a plain attribute, made with the
    # action (the wall-time schedule and the graph's consumers read it for every action of every plan)
    deps: tuple[str, ...] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "deps", tuple(map(_ACTION, self.dep_inputs)))

    @property
    def toolchain(self) -> str:
        """The registered toolchain that runs this action ("" for a trace)."""
        return str(self.spec.get("toolchain") or "")

    @property
    def versions(self) -> Mapping[str, str]:
        """The toolchain component versions in this action's fingerprint."""
        return self.record.get("toolchain") or {}

    @property
    def model(self) -> Mapping[str, Any]:
        """A trace's model record (package, srcs by digest, entry, config, seed, inputs) or a weights action's (+ the
        checkpoint: weights, weights_prefix; no graph, inputs or outputs); {} otherwise."""
        return self.record.get("model") or {} if self.kind in (TRACE, WEIGHTS) else {}

    @cached_property
    def identity(self) -> str:
        """What a user calls "the same action" across edits: label + bucket (+ target for compiles)."""
        base = f"{self.kind} {self.label}" if self.kind == WEIGHTS else f"{self.kind} {self.label} [{self.bucket}]"
        if self.kind == WEIGHTS and len(self.outputs) > 1:  # one per layout: a tensor-parallel one names its degree
            base += f" (tp {len(self.outputs)})"
        return f"{base} for {self.platform}" if self.platform else base

    def describe(self) -> str:
        base = f"{self.kind.capitalize()} {self.label}" + ("" if self.kind == WEIGHTS else f" [{self.bucket}]")
        return f"{base} for {self.target or self.platform}" if self.platform else base


def is_light(a: Action) -> bool:
    """A toolchain step its toolchain declared light (LIGHT; traces and weights actions run model code: never)."""
    return a.spec.get(LIGHT) is True and a.kind not in (TRACE, WEIGHTS)


def make_action(kind: str, label: Label, bucket: Bucket, record: Mapping[str, Any], spec: Mapping[str, Any], *,
                files: tuple[FileInput, ...] = (), dep_inputs: tuple[DepInput, ...] = (), outputs: tuple[str, ...] = (),
                platform: str = "", target: str = "", ships: tuple[DepInput, ...] = ()) -> Action:
    """An Action whose fingerprint is the digest of `record`."""
    # Action(...) as its dataclass __init__ and __post_init__ make it (the same fields in the same order), at a third
    # of the cost: one attribute set instead of a frozen set per field (160,000 actions at 100,000 graphs)
    a = _new(Action)
    _setattr(a, "__dict__", {"fingerprint": fingerprint(record), "kind": kind, "label": label, "bucket": bucket,
                             "record": record, "spec": spec, "files": files, "dep_inputs": dep_inputs,
                             "outputs": outputs, "platform": platform, "target": target, "ships": ships,
                             "deps": tuple(map(_ACTION, dep_inputs))})
    return a


_TEXTS: dict[tuple[Any, str], str] = {}  # Bucket.__str__ by value
_ACTION = operator.attrgetter("action")
_new = object.__new__
_setattr = object.__setattr__
