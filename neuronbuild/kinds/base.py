"""What a rule kind is: its attribute schema plus its analysis (target -> provider, registering actions)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from neuronbuild.loading.schema import RuleSchema


@dataclass(frozen=True)
class RuleKind:
    """A registered rule kind. `analyze(ctx, target)` returns the target's provider (analysis/providers.py) and may
    add actions through ctx (analysis/analysis_context.AnalysisContext); `plans_actions` kinds are analysed when requested."""

    schema: RuleSchema
    analyze: Callable[[Any, Any], Any] = field(compare=False)
    plans_actions: bool = False
    stands_for: tuple[str, ...] = ()  # kinds whose place its targets may take in label attributes (same provider)
    # Its analysis reads the machine (e.g. a target record resolving isa = "native"): never memoised, its provider is
    # computed afresh by every plan and compared with what memoised dependants saw (analysis/analysis_nodes.py).
    volatile: bool = False

    @property
    def name(self) -> str:
        return self.schema.kind
