"""An out-of-tree toolchain in one module (tests/test_plugin_release.py): platform "cpu-portable" builds AOTInductor
packages for the x86-64 baseline only (they run on any x86-64 host), in the artifact format the runtime already
loads ("aoti"). Everything it means is declared here: platform, target attributes (none), the options it reads and
their defaults, its versions, its actions and worker step, its warm-up, its validate loader. Registration is
this module's name in $NEURONBUILD_PLUGINS."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from neuronbuild import plugins
from neuronbuild.analysis.actions import COMPILE, PROGRAM_CONSTANTS, TRACE_OUTPUT, Action, DepInput, make_action
from neuronbuild.analysis.plan_settings import PlanSettings
from neuronbuild.analysis.toolchain_api import WARM_UP, CompileRequest, OptionKey
from neuronbuild.loading.schema import STRING, Attr

ISA = "x86-64"  # the baseline every x86-64 machine runs


class PortableToolchain:
    name = "portable"
    platforms: tuple[str, ...] = ("cpu-portable",)
    artifact_format = "aoti"
    estimate_s = 15.0
    estimate_mb = 1200.0
    validate_note = ""
    option_keys: tuple[OptionKey, ...] = (
        OptionKey("auto_cast", STRING, "Cast matmuls ('matmult') or also convolutions ('all') to auto_cast_type; "
                  "'none'.", "none", ("none", "matmult", "all")),)
    target_attrs: tuple[Attr, ...] = ()
    warm_up_shared = True  # inductor's precompiled headers for the baseline ISA, on disk for every worker

    def target_record(self, platform: str, attrs: Mapping[str, Any]) -> dict[str, Any]:
        return {"platform": platform, "isa": ISA}

    def describe_target(self, target: Mapping[str, Any]) -> str:
        return f"{target['platform']}/{ISA}"

    def versions(self, platform: str, settings: PlanSettings) -> dict[str, str]:
        from neuronbuild.platforms import cxx_version

        return settings.override({**settings.trace_toolchain(), "cxx": cxx_version()})

    def plan(self, req: CompileRequest) -> list[Action]:
        assert req.trace is not None
        assert req.weights is not None
        record = req.record(COMPILE, self.versions(req.platform, req.settings), weights=req.weights.fingerprint)
        spec = {"toolchain": self.name, "step": COMPILE, "platform": req.platform, "isa": ISA,
                "options": dict(req.options), "inputs": dict(req.inputs), "bucket": req.bucket.as_dict(),
                "program": TRACE_OUTPUT}
        return [make_action(COMPILE, req.label, req.bucket, record, spec,
                            dep_inputs=(DepInput(req.trace.fingerprint, TRACE_OUTPUT, TRACE_OUTPUT),
                                        *req.weights_inputs()),
                            outputs=("model.pt2", "constants.safetensors", PROGRAM_CONSTANTS), platform=req.platform,
                            target=self.describe_target(req.target))]

    def run(self, step: str, spec: Mapping[str, Any], sandbox: Path, out_dir: Path) -> dict[str, Any]:
        from neuronbuild.toolchains.compile import run_cpu_compile, warm_up_cpu

        if step == WARM_UP:  # in the worker, before its first compile: the headers compiles may only read
            return warm_up_cpu(ISA)
        return run_cpu_compile(dict(spec), sandbox, out_dir)

    def warm_up_key(self, spec: Mapping[str, Any]) -> dict[str, Any] | None:
        return {"isa": ISA} if spec.get("step") == COMPILE else None

    def load_artifact(self, files: Mapping[str, Path]) -> Callable[..., Any]:
        from neuronbuild.runtime.aoti_loader import load_package, read_constants, with_program_constants

        return load_package(files["model.pt2"], constants=with_program_constants(
            read_constants(files["constants.safetensors"]), files.get(PROGRAM_CONSTANTS)))

    def notes(self, settings: PlanSettings) -> list[str]:
        return []


TOOLCHAIN = plugins.register_toolchain(PortableToolchain())
