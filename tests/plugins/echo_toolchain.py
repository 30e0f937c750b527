"""A third, trivial toolchain registered from outside neuronbuild/ (tests/test_plugins.py): platform "echo" turns a
traced program into a summary of its graph (node count and op names) with one action per bucket."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from neuronbuild import FORMAT_VERSION, plugins
from neuronbuild.plugin_api.actions import TRACE_OUTPUT, Action, DepInput, make_action
from neuronbuild.plugin_api.toolchain import CompileRequest, PlanSettings, StepDirs


class EchoToolchain:
    name = "echo"
    platforms = ("echo",)
    artifact_format = "echo-summary"
    runtime_loader = ""
    estimate_s = 1.0
    estimate_mb = 300.0
    validate_note = ""
    option_keys = ()  # reads no compiler option
    target_attrs = ()
    tp_degrees: dict[str, tuple[int, ...]] = {}  # never sharded
    warm_up_shared = False

    def target_record(self, platform: str, attrs: Mapping[str, Any]) -> dict[str, Any]:
        return {"platform": platform}

    def describe_target(self, target: Mapping[str, Any]) -> str:
        return "echo!"

    def versions(self, platform: str, settings: PlanSettings) -> dict[str, str]:
        return settings.override({**settings.trace_toolchain(), "echo": "1.0"})

    def plan(self, req: CompileRequest) -> list[Action]:
        assert req.trace is not None
        record = {"format": FORMAT_VERSION, "action": "summarize", "trace": req.trace.fingerprint,
                  "target": dict(req.target), "options": dict(req.options), "bucket": req.bucket.as_dict(),
                  "toolchain": self.versions(req.platform, req.settings)} | dict(req.common)
        spec = {"toolchain": self.name, "step": "summarize", "program": TRACE_OUTPUT}
        return [make_action("summarize", req.label, req.bucket, record, spec,
                            dep_inputs=(DepInput(req.trace.fingerprint, TRACE_OUTPUT, TRACE_OUTPUT),),
                            outputs=("summary.json",), platform=req.platform, target="echo!")]

    def run(self, step: str, spec: Mapping[str, Any], sandbox: Path, out_dir: Path) -> dict[str, Any]:
        import torch

        ep = torch.export.load(str(sandbox / spec["program"]))
        ops = sorted({str(n.target) for n in ep.graph.nodes if n.op == "call_function"})
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "summary.json").write_text(json.dumps({"step": step, "nodes": len(ep.graph.nodes), "ops": ops}))
        return {"ops": len(ops)}

    def warm_up_key(self, spec: Mapping[str, Any]) -> dict[str, Any] | None:
        return None  # nothing to warm

    def prepare_worker(self) -> None:
        pass

    def step_dirs(self, spec: Mapping[str, Any]) -> StepDirs:
        return StepDirs()

    def host_status(self) -> dict[str, str | None]:
        return {"echo": "1.0"}

    def load_artifact(self, files: Mapping[str, Path]) -> Callable[..., Any]:
        raise NotImplementedError("echo summaries do not run")

    def notes(self, settings: PlanSettings) -> list[str]:
        return ["note: echo summaries are not runnable"]


plugins.register_toolchain(EchoToolchain())
