"""The core's own steps, trace and weights, as a built-in step provider (plugin_api/toolchain.py StepProvider),
registered like a toolchain's steps and run through the same dispatch (registry.run_step): the trace exports a model
at one bucket's static shape (torch.export), the weights action streams its checkpoint into the weights file(s). The
actions are planned by analysis (AnalysisContext.trace/weights), whose specs name this provider (`provider`). A
toolchain starting from a front end of its own plans its own first step instead, run by its own `run`.

Imports no torch here (the build process loads the plug-ins): toolchains/trace.py is imported by the step, and by
each worker once (prepare_worker)."""

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
        from neuronbuild.toolchains import trace

        if step == TRACE:
            return trace.run_trace(dict(spec), sandbox, out_dir)
        if step == WEIGHTS:
            return trace.run_weights(dict(spec), sandbox, out_dir)
        raise ValueError(f"step provider {self.name!r} has no step {step!r} (its steps: {TRACE}, {WEIGHTS})")

    def prepare_worker(self) -> None:
        import neuronbuild.toolchains.trace  # noqa: F401  (torch, torch.export, the model import helpers)


STEPS = registry.register_steps(TorchExportSteps())
