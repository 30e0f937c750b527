"""A toolchain with two deliberate key bugs, for `neuronbuild audit-keys` (tests/test_audit_keys.py): platform "leaky"
summarizes a traced program, scaled by option `leak_scale`, which changes the output but is left out of the action's
record (under-keyed), and keys option `leak_revision`, which the output ignores (over-keyed)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from neuronbuild import FORMAT_VERSION, plugins
from neuronbuild.loading.schema import INT
from neuronbuild.plugin_api.actions import TRACE_OUTPUT, Action, DepInput, make_action
from neuronbuild.plugin_api.rules import Attr
from neuronbuild.plugin_api.toolchain import CompileRequest, OptionKey, PlanSettings, StepDirs


class LeakyToolchain:
    name = "leaky"
    platforms: tuple[str, ...] = ("leaky",)
    artifact_format = "leaky-summary"
    runtime_loader = ""
    estimate_s = 1.0
    estimate_mb = 300.0
    validate_note = ""
    option_keys: tuple[OptionKey, ...] = (OptionKey("leak_scale", INT, "multiplies the summary's node count (NOT in the key: the bug)", 1),
                   OptionKey("leak_revision", INT, "a revision number the output ignores (keyed all the same)", 0))
    target_attrs: tuple[Attr, ...] = ()
    tp_degrees: Mapping[str, tuple[int, ...]] = {}
    warm_up_shared = False

    def target_record(self, platform: str, attrs: Mapping[str, Any]) -> dict[str, Any]:
        return {"platform": platform}

    def describe_target(self, target: Mapping[str, Any]) -> str:
        return "leaky"

    def versions(self, platform: str, settings: PlanSettings) -> dict[str, str]:
        return settings.override({**settings.trace_toolchain(), "leaky": "1.0"})

    def plan(self, req: CompileRequest) -> list[Action]:
        assert req.trace is not None
        keyed = {k: v for k, v in req.options.items() if k != "leak_scale"}  # the deliberate under-keying
        record = {"format": FORMAT_VERSION, "action": "summarize", "trace": req.trace.fingerprint,
                  "target": dict(req.target), "options": keyed, "bucket": req.bucket.as_dict(),
                  "toolchain": self.versions(req.platform, req.settings)} | dict(req.common)
        spec = {"toolchain": self.name, "step": "summarize", "program": TRACE_OUTPUT,
                "scale": req.options["leak_scale"]}
        return [make_action("summarize", req.label, req.bucket, record, spec,
                            dep_inputs=(DepInput(req.trace.fingerprint, TRACE_OUTPUT, TRACE_OUTPUT),),
                            outputs=("summary.json",), platform=req.platform, target="leaky")]

    def run(self, step: str, spec: Mapping[str, Any], sandbox: Path, out_dir: Path) -> dict[str, Any]:
        import torch

        ep = torch.export.load(str(sandbox / spec["program"]))
        out_dir.mkdir(parents=True, exist_ok=True)
        nodes = len(ep.graph.nodes) * int(spec["scale"])
        (out_dir / "summary.json").write_text(json.dumps({"step": step, "nodes": nodes}))
        return {"nodes": nodes}

    def warm_up_key(self, spec: Mapping[str, Any]) -> dict[str, Any] | None:
        return None

    def prepare_worker(self) -> None:
        pass

    def step_dirs(self, spec: Mapping[str, Any]) -> StepDirs:
        return StepDirs()

    def host_status(self) -> dict[str, str | None]:
        return {"leaky": "1.0"}

    def load_artifact(self, files: Mapping[str, Path]) -> Callable[..., Any]:
        raise NotImplementedError("leaky summaries do not run")

    def notes(self, settings: PlanSettings) -> list[str]:
        return []


plugins.register_toolchain(LeakyToolchain())
