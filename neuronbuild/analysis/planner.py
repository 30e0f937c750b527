"""Turns a TargetGraph into an ActionGraph by asking each requested target's rule kind (neuronbuild.plugins) for its
analysis: kinds return providers and register actions here; one trace per (model, graph, bucket) is shared by all."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import networkx as nx

from neuronbuild import FORMAT_VERSION, plugins
from neuronbuild.analysis.actions import TRACE, TRACE_OUTPUT, Action, Bucket, make_action
from neuronbuild.analysis.plan_settings import PlanSettings
from neuronbuild.analysis.providers import BundleInfo, CompileTarget, ModelInfo
from neuronbuild.loading.labels import Label
from neuronbuild.loading.target_graph import TargetGraph
from neuronbuild.loading.targets import Target

__all__ = ["ActionGraph", "AnalysisContext", "CompileTarget", "plan"]


@dataclass(frozen=True)
class ActionGraph:
    """Every action needed for the requested targets; edges run from producer to consumer."""

    actions: Mapping[str, Action] = field(hash=False)
    graph: nx.DiGraph = field(hash=False, compare=False)
    compiles: tuple[CompileTarget, ...] = ()
    bundles: Mapping[Label, BundleInfo] = field(default_factory=dict, hash=False, compare=False)

    def topological(self) -> list[Action]:
        return [self.actions[fp] for fp in nx.lexicographical_topological_sort(self.graph)]

    def trace_of(self, fp: str) -> Action:
        """Provenance: the trace action an action's outputs derive from (itself for a trace)."""
        a = self.actions[fp]
        while a.kind != TRACE:
            a = self.actions[a.deps[0]]
        return a

    def closure(self, fp: str) -> set[str]:
        """The action and every action it depends on."""
        return {fp} | nx.ancestors(self.graph, fp)

    @property
    def toolchains(self) -> tuple[str, ...]:
        """Names of the toolchains the compile targets use, in first-use order."""
        return tuple(dict.fromkeys(ct.toolchain for ct in self.compiles))


class AnalysisContext:
    """What a rule kind's analysis sees: targets, settings, other targets' providers, and where to add actions."""

    def __init__(self, graph: TargetGraph, settings: PlanSettings) -> None:
        self.graph = graph
        self.settings = settings
        self.common: dict[str, Any] = {"env": settings.env_record()} if settings.action_env else {}
        self.actions: dict[str, Action] = {}
        self.g = nx.DiGraph()
        self.compiles: list[CompileTarget] = []
        self.bundles: dict[Label, BundleInfo] = {}
        self._providers: dict[Label, Any] = {}

    def target(self, label: Label) -> Target:
        return self.graph.targets[label]

    def provider(self, label: Label) -> Any:
        """The provider of `label` (its kind's analysis runs once per plan)."""
        if label not in self._providers:
            t = self.graph.targets[label]
            self._providers[label] = plugins.rule(t.kind).analyze(self, t)
        return self._providers[label]

    def add(self, action: Action) -> Action:
        """Register an action (once per fingerprint) with edges from the actions it reads outputs of."""
        if action.fingerprint not in self.actions:
            self.actions[action.fingerprint] = action
            self.g.add_node(action.fingerprint)
            for dep in action.deps:
                self.g.add_edge(dep, action.fingerprint)
        return self.actions[action.fingerprint]

    def trace(self, model: ModelInfo, bucket: Bucket) -> Action:
        """The trace of `model` at `bucket`: one per (model, bucket), shared by every compile that needs it."""
        rec = model.record
        record = {
            "format": FORMAT_VERSION,
            "action": TRACE,
            "model": rec,
            "bucket": bucket.as_dict(),
            # + the third-party distributions the model imports (what-if versions applied like torch's)
            "toolchain": self.settings.trace_toolchain() | self.settings.override(dict(rec.get("imports") or {})),
        } | self.common
        spec = {"model": {k: rec[k] for k in ("package", "entry", "config", "seed")}
                | {"srcs": list(rec["srcs"]), "weights": rec["weights"], "weights_prefix": rec.get("weights_prefix", ""),
                   "libraries": sorted(rec.get("deps") or {})},
                "inputs": rec["inputs"], "outputs": rec.get("outputs") or [], "bucket": bucket.as_dict()}
        return self.add(make_action(TRACE, model.label, bucket, record, spec, files=model.files,
                                    outputs=(TRACE_OUTPUT,)))


def plan(graph: TargetGraph, settings: PlanSettings | None = None) -> ActionGraph:
    """Analyse every requested target whose kind plans actions (compiles; bundles and the compiles they ship).

    `settings` adds declared --action-env values (to every record, when any), toolchain configuration (e.g. the
    neuronx-cc version) and toolchain overrides (what-if plans for explain and upgrade-impact)."""
    ctx = AnalysisContext(graph, settings or PlanSettings())
    for lbl in graph.requested:
        if plugins.rule(graph.targets[lbl].kind).plans_actions:
            ctx.provider(lbl)
    return ActionGraph(ctx.actions, ctx.g, tuple(ctx.compiles), ctx.bundles)
