"""The Neuron toolchain: the CPU half of a Neuron compile (lowered graph + the exact neuronx-cc command line), and
the neuronx-cc hand-off for a NEFF when a compiler is configured (planning here; torch steps in compile.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from neuronbuild import plugins
from neuronbuild.analysis.actions import COMPILE, TRACE_OUTPUT, Action, DepInput, make_action
from neuronbuild.analysis.plan_settings import NEURONX_CC, PlanSettings
from neuronbuild.analysis.toolchain_api import CompileRequest
from neuronbuild.vocabulary import NEURON_PLATFORMS

OUTPUTS = ("lowered.pt2", "compile_flags.json")
NEFF_OUTPUT = "model.neff"  # when a neuronx-cc is configured


class NeuronToolchain:
    name = "neuron"
    platforms = NEURON_PLATFORMS
    artifact_format = "neuron-lowered"
    estimate_s = 4.0
    estimate_mb = 800.0
    validate_note = ("Neuron targets: the lowered program run by torch on CPU (checks the lowering and auto_cast, "
                     "not neuronx-cc)")

    def target_record(self, platform: str, attrs: Mapping[str, Any]) -> dict[str, Any]:
        return {"platform": platform}

    def describe_target(self, target: Mapping[str, Any]) -> str:
        return str(target["platform"])

    def versions(self, platform: str, settings: PlanSettings) -> dict[str, str]:
        tc = settings.trace_toolchain()
        if settings.neuronx_cc is not None:
            tc[NEURONX_CC] = settings.neuronx_cc.version
        return settings.override(tc)

    def plan(self, req: CompileRequest) -> list[Action]:
        assert req.trace is not None
        record = req.record(COMPILE, self.versions(req.platform, req.settings))
        spec: dict[str, Any] = {"toolchain": self.name, "step": COMPILE, "platform": req.platform, "isa": None,
                                "options": dict(req.options), "inputs": dict(req.inputs),
                                "bucket": req.bucket.as_dict(), "program": TRACE_OUTPUT}
        outputs: tuple[str, ...] = OUTPUTS
        if req.settings.neuronx_cc is not None:
            spec["neuronx_cc"] = req.settings.neuronx_cc.spec()
            outputs = (*outputs, NEFF_OUTPUT)
        return [make_action(COMPILE, req.label, req.bucket, record, spec,
                            dep_inputs=(DepInput(req.trace.fingerprint, TRACE_OUTPUT, TRACE_OUTPUT),),
                            outputs=outputs, platform=req.platform, target=self.describe_target(req.target))]

    def run(self, step: str, spec: Mapping[str, Any], sandbox: Path, out_dir: Path) -> dict[str, Any]:
        from neuronbuild.toolchains.compile import run_neuron_compile

        return run_neuron_compile(dict(spec), sandbox, out_dir)

    def load_artifact(self, files: Mapping[str, Path]) -> Callable[..., Any]:
        from neuronbuild.runtime.deployed import _load_lowered

        return _load_lowered(files["lowered.pt2"])

    def notes(self, settings: PlanSettings) -> list[str]:
        if settings.neuronx_cc is not None:
            return []
        return ["note: no neuronx-cc found (--neuronx-cc PATH, $NEURONX_CC or PATH): Neuron targets get "
                "lowered programs only; NEFFs were not produced"]


TOOLCHAIN = plugins.register_toolchain(NeuronToolchain())
