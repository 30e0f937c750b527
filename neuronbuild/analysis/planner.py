"""Turns a TargetGraph into an ActionGraph: trace and compile actions, their fingerprints and dependency edges."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import networkx as nx

from neuronbuild import FORMAT_VERSION
from neuronbuild.analysis.actions import COMPILE, TRACE, TRACE_OUTPUT, Action, Bucket, DepInput, FileInput
from neuronbuild.analysis.digests import digest_file
from neuronbuild.analysis.fingerprint import fingerprint
from neuronbuild.analysis.options import effective_options
from neuronbuild.analysis.plan_settings import PlanSettings
from neuronbuild.analysis.platforms import resolve_isa
from neuronbuild.errors import UserInputError
from neuronbuild.loading.labels import Label
from neuronbuild.loading.schema import parse_input_spec
from neuronbuild.loading.target_graph import TargetGraph, locate
from neuronbuild.loading.targets import Target

CPU_OUTPUTS = ("model.pt2", "constants.safetensors")
NEURON_OUTPUTS = ("lowered.pt2", "compile_flags.json")
NEFF_OUTPUT = "model.neff"  # Neuron compiles, when a neuronx-cc is configured


@dataclass(frozen=True)
class CompileTarget:
    """A requested neuron_compile target and its compile actions, one per bucket (in bucket order)."""

    label: Label
    platform: str
    isa: str
    options: Mapping[str, Any] = field(hash=False, compare=False)
    buckets: tuple[tuple[Bucket, str], ...] = ()  # (bucket, compile action fingerprint)


@dataclass(frozen=True)
class ActionGraph:
    """Every action needed for the requested targets; edges run from producer to consumer."""

    actions: Mapping[str, Action] = field(hash=False)
    graph: nx.DiGraph = field(hash=False, compare=False)
    compiles: tuple[CompileTarget, ...] = ()

    def topological(self) -> list[Action]:
        return [self.actions[fp] for fp in nx.lexicographical_topological_sort(self.graph)]


def _buckets(graph: TargetGraph, compile_t: Target, model: Target) -> list[Bucket]:
    inputs = {k: parse_input_spec(v) for k, v in model.attrs["inputs"].items()}
    needed: list[str] = []
    for _dtype, dims in inputs.values():
        for d in dims:
            if d not in needed:
                needed.append(d)
    shapes: list[dict[str, int]] = []
    for lbl in compile_t.attrs["buckets"]:
        b = graph.targets[lbl]
        if b.attrs.get("dims") is not None:
            names = list(b.attrs["dims"])
            for combo in itertools.product(*(b.attrs["dims"][n] for n in names)):
                shapes.append(dict(zip(names, combo, strict=True)))
        else:
            shapes.extend(dict(s) for s in b.attrs["shapes"])
    out: list[Bucket] = []
    for s in shapes:
        missing = [d for d in needed if d not in s]
        extra = [d for d in s if d not in needed]
        if missing or extra:
            what = (f"has no size for dimension '{missing[0]}' used by the inputs of {model.label}" if missing
                    else f"has dimension '{extra[0]}', which no input of {model.label} uses")
            raise UserInputError(f"bucket {s} {what}", locate(graph, compile_t))
        bucket = Bucket(tuple((d, s[d]) for d in needed))
        if bucket not in out:
            out.append(bucket)
    return out


def _model_record(graph: TargetGraph, model: Target) -> tuple[dict[str, Any], tuple[FileInput, ...]]:
    root = graph.root
    files: list[FileInput] = []
    srcs: dict[str, str] = {}
    for lbl in model.attrs["srcs"]:
        d = digest_file(root / lbl.path)
        srcs[lbl.path] = d
        files.append(FileInput(lbl.path, d))
    weights = None
    if model.attrs.get("weights") is not None:
        w = model.attrs["weights"]
        wd = digest_file(root / w.path)
        weights = {"path": w.path, "digest": wd}
        files.append(FileInput(w.path, wd))
    inputs = {k: {"dtype": dt, "dims": list(dims)}
              for k, (dt, dims) in ((k, parse_input_spec(v)) for k, v in model.attrs["inputs"].items())}
    record = {
        "package": model.label.package,
        "srcs": srcs,
        "entry": model.attrs["entry"],
        "config": dict(model.attrs["config"]),
        "weights": weights,
        "seed": model.attrs["seed"],
        "inputs": inputs,
    }
    return record, tuple(files)


def compile_labels(graph: TargetGraph) -> list[Label]:
    """Requested neuron_compile targets, then those that requested neuron_bundle targets ship (deduplicated)."""
    out: list[Label] = [lbl for lbl in graph.requested if graph.targets[lbl].kind == "neuron_compile"]
    for lbl in graph.requested:
        if graph.targets[lbl].kind == "neuron_bundle":
            out.extend(src for src in graph.targets[lbl].attrs["srcs"] if src not in out)
    return out


def plan(graph: TargetGraph, settings: PlanSettings | None = None) -> ActionGraph:
    """One trace per (model, bucket), shared by every compile that needs it; one compile per (trace, target, options).

    `settings` adds declared --action-env values (to every record, when any), the configured neuronx-cc's version
    (Neuron compiles) and toolchain overrides (what-if plans for explain and upgrade-impact)."""
    settings = settings or PlanSettings()
    env_rec = {"env": settings.env_record()} if settings.action_env else {}
    actions: dict[str, Action] = {}
    g = nx.DiGraph()
    compiles: list[CompileTarget] = []
    model_cache: dict[Label, tuple[dict[str, Any], tuple[FileInput, ...]]] = {}
    for lbl in compile_labels(graph):
        t = graph.targets[lbl]
        model = graph.targets[t.attrs["model"]]
        target = graph.targets[t.attrs["target"]]
        if model.label not in model_cache:
            model_cache[model.label] = _model_record(graph, model)
        model_rec, files = model_cache[model.label]
        platform = target.attrs["platform"]
        isa = resolve_isa(target.attrs.get("isa")) if platform == "cpu" else ""
        opts = effective_options(graph.targets, t.attrs.get("options"))
        entries: list[tuple[Bucket, str]] = []
        for bucket in _buckets(graph, t, model):
            trace_rec = {
                "format": FORMAT_VERSION,
                "action": TRACE,
                "model": model_rec,
                "bucket": bucket.as_dict(),
                "toolchain": settings.trace_toolchain(),
            } | env_rec
            trace_fp = fingerprint(trace_rec)
            if trace_fp not in actions:
                spec = {"model": {k: model_rec[k] for k in ("package", "entry", "config", "seed")}
                        | {"srcs": list(model_rec["srcs"]),
                           "weights": model_rec["weights"]["path"] if model_rec["weights"] else None},
                        "inputs": model_rec["inputs"], "bucket": bucket.as_dict()}
                actions[trace_fp] = Action(trace_fp, TRACE, model.label, bucket, trace_rec, spec, files, (),
                                           (TRACE_OUTPUT,))
                g.add_node(trace_fp)
            target_rec: dict[str, Any] = {"platform": platform}
            if platform == "cpu":
                target_rec["isa"] = isa
            compile_rec = {
                "format": FORMAT_VERSION,
                "action": COMPILE,
                "trace": trace_fp,
                "target": target_rec,
                "options": opts,
                "bucket": bucket.as_dict(),
                "inputs": model_rec["inputs"],
                "toolchain": settings.compile_toolchain(platform),
            } | env_rec
            compile_fp = fingerprint(compile_rec)
            if compile_fp not in actions:
                spec = {"platform": platform, "isa": isa or None, "options": opts, "inputs": model_rec["inputs"],
                        "bucket": bucket.as_dict(), "program": TRACE_OUTPUT}
                outputs: tuple[str, ...] = CPU_OUTPUTS if platform == "cpu" else NEURON_OUTPUTS
                if platform != "cpu" and settings.neuronx_cc is not None:
                    spec["neuronx_cc"] = settings.neuronx_cc.spec()
                    outputs = (*outputs, NEFF_OUTPUT)
                actions[compile_fp] = Action(compile_fp, COMPILE, lbl, bucket, compile_rec, spec, (),
                                             (DepInput(trace_fp, TRACE_OUTPUT, TRACE_OUTPUT),), outputs, platform, isa)
                g.add_edge(trace_fp, compile_fp)
            entries.append((bucket, compile_fp))
        compiles.append(CompileTarget(lbl, platform, isa, opts, tuple(entries)))
    return ActionGraph(actions, g, tuple(compiles))
