"""Action values: one trace per (model, bucket), one compile per (trace, target, effective options)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from neuronbuild.loading.labels import Label

TRACE = "trace"
COMPILE = "compile"
TRACE_OUTPUT = "program.pt2"


@dataclass(frozen=True, order=True)
class Bucket:
    """One static input shape: ordered (dimension, size) pairs."""

    dims: tuple[tuple[str, int], ...]

    @property
    def name(self) -> str:
        return "_".join(f"{k}{v}" for k, v in self.dims)

    def as_dict(self) -> dict[str, int]:
        return dict(self.dims)

    def __str__(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.dims)


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
    platform: str = ""  # compile only: "cpu" or a Neuron platform
    isa: str = ""  # compile only, cpu: the resolved ISA level

    @property
    def deps(self) -> tuple[str, ...]:
        return tuple(d.action for d in self.dep_inputs)

    @property
    def identity(self) -> str:
        """What a user calls "the same action" across edits: label + bucket (+ target for compiles)."""
        base = f"{self.kind} {self.label} [{self.bucket}]"
        return f"{base} for {self.platform}" if self.kind == COMPILE else base

    def describe(self) -> str:
        if self.kind == TRACE:
            return f"Trace {self.label} [{self.bucket}]"
        tgt = f"cpu/{self.isa}" if self.platform == "cpu" else self.platform
        return f"Compile {self.label} [{self.bucket}] for {tgt}"
