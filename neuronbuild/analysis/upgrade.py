"""Upgrade impact: which fingerprints a toolchain change would invalidate, per compile target, and the recompile time."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from neuronbuild.analysis.action_graph import ActionGraph
from neuronbuild.analysis.estimate import Estimate, Estimator, wall_time
from neuronbuild.analysis.explain import target_actions
from neuronbuild.history import History
from neuronbuild.plugin_api.actions import Action


@dataclass(frozen=True)
class Invalidated:
    """One action whose fingerprint the change alters: current and new fingerprints, estimated recompile time."""

    action: Action
    new_fingerprint: str
    cached_now: bool
    estimate: Estimate

    def to_json(self) -> dict[str, Any]:
        return {"identity": self.action.identity, "description": self.action.describe(),
                "fingerprint": self.action.fingerprint, "new_fingerprint": self.new_fingerprint,
                "cached_now": self.cached_now, "estimate_s": self.estimate.seconds,
                "estimate_source": self.estimate.source}


@dataclass(frozen=True)
class TargetImpact:
    """One compile target: how many of its actions (its compiles and the traces they use) change."""

    label: str
    platform: str
    total: int
    changed: tuple[Invalidated, ...] = ()

    @property
    def seconds(self) -> float:
        return sum(i.estimate.seconds or 0.0 for i in self.changed)


@dataclass(frozen=True)
class UpgradeImpact:
    overrides: Mapping[str, str] = field(hash=False, compare=False)
    current: Mapping[str, list[str]] = field(hash=False, compare=False)  # component -> distinct current versions
    targets: tuple[TargetImpact, ...] = ()
    changed: tuple[Invalidated, ...] = ()  # every changed action once, in dependency order
    total: int = 0
    wall_s: float = 0.0
    jobs: int = 1

    @property
    def seconds(self) -> float:
        return sum(i.estimate.seconds or 0.0 for i in self.changed)

    def to_json(self) -> dict[str, Any]:
        return {
            "toolchain": {k: {"current": self.current.get(k, []), "new": v} for k, v in self.overrides.items()},
            "targets": [{"label": t.label, "platform": t.platform, "actions": t.total, "changed": len(t.changed),
                         "estimate_s": round(t.seconds, 3), "invalidated": [i.to_json() for i in t.changed]}
                        for t in self.targets],
            "total": {"actions": self.total, "changed": len(self.changed), "estimate_s": round(self.seconds, 3),
                      "wall_s": round(self.wall_s, 3), "jobs": self.jobs,
                      "unknown": sum(1 for i in self.changed if i.estimate.seconds is None)},
        }

    def lines(self) -> list[str]:
        out = []
        for k, v in self.overrides.items():
            cur = ", ".join(self.current.get(k, [])) or "not used by any action"
            out.append(f"toolchain {k}: {cur} -> {v}")
        for t in self.targets:
            out.append(f"{t.label} ({t.platform}): {len(t.changed)} of {t.total} actions change, "
                       f"est. recompile {t.seconds:.1f} s")
            for i in t.changed:
                s = "?" if i.estimate.seconds is None else f"{i.estimate.seconds:.1f} s"
                out.append(f"  {i.action.describe()}  {i.action.fingerprint[:12]} -> {i.new_fingerprint[:12]}  {s}")
        out.append(f"total: {len(self.changed)} of {self.total} actions change; est. {self.seconds:.1f} s of "
                   f"recompiles, ~{self.wall_s:.1f} s wall with -j {self.jobs}")
        return out


def upgrade_impact(base: ActionGraph, new: ActionGraph, overrides: Mapping[str, str], history: History,
                   cached: set[str], jobs: int) -> UpgradeImpact:
    """Pair the two plans' actions by identity; a changed fingerprint is an invalidated result."""
    new_by_identity = {a.identity: fp for fp, a in new.actions.items()}
    est = Estimator(history)
    inval: dict[str, Invalidated] = {}
    for a in base.topological():
        nfp = new_by_identity.get(a.identity, "")
        if nfp != a.fingerprint:
            inval[a.fingerprint] = Invalidated(a, nfp, a.fingerprint in cached, est.estimate(a))
    current: dict[str, list[str]] = {}
    for a in base.actions.values():
        for k, v in a.versions.items():
            if k in overrides and v not in current.setdefault(k, []):
                current[k].append(v)
    targets = []
    for ct in sorted(base.compiles, key=lambda c: str(c.label)):
        fps = target_actions(base, ct)  # by graph, bucket, then trace -> lower -> compile
        targets.append(TargetImpact(str(ct.label), ct.platform, len(fps),
                                    tuple(inval[fp] for fp in fps if fp in inval)))
    changed = tuple(inval.values())
    wall = wall_time(base.graph, [i.action for i in changed],
                     {fp: i.estimate.seconds or 0.0 for fp, i in inval.items()}, jobs)
    return UpgradeImpact(dict(overrides), current, tuple(targets), changed, len(base.actions), wall, jobs)
