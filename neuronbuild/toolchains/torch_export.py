"""The core's own steps, trace (torch.export at one bucket's static shape) and weights (the checkpoint streamed into the
weights file(s)): a built-in step provider, registered like a toolchain's steps and run through the same dispatch
(registry.run_step). Analysis plans them (AnalysisContext.trace/weights: their specs name this provider); a toolchain
starting from a front end of its own plans its own first step instead. No torch here (the build process loads it)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from neuronbuild.plugin_api import registry
from neuronbuild.plugin_api.actions import CORE_STEPS, TRACE, WEIGHTS
from neuronbuild.plugin_api.toolchain import StepProvider


class TorchExportSteps(StepProvider):
    name = CORE_STEPS

    def run(self, step: str, spec: Mapping[str, Any], sandbox: Path, out_dir: Path) -> dict[str, Any]:
        if step not in (TRACE, WEIGHTS):
            raise ValueError(f"step provider {self.name!r} has no step {step!r} (its steps: {TRACE}, {WEIGHTS})")
        from neuronbuild.toolchains import trace

        return (trace.run_trace if step == TRACE else trace.run_weights)(dict(spec), sandbox, out_dir)

    def prepare_worker(self) -> None:
        import neuronbuild.toolchains.trace  # noqa: F401  (torch, torch.export, the model import helpers)


registry.register_steps(TorchExportSteps())
