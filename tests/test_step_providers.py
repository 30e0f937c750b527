"""Step providers: every action kind runs through one dispatch (plugin_api/registry.run_step). The core's trace and
weights are the steps of a built-in provider registered like a toolchain's steps (toolchains/torch_export.py); a
provider registered from outside neuronbuild/ (a front end of its own) runs in the worker the same way, in one file."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from neuronbuild import plugins
from neuronbuild.execution import worker
from neuronbuild.plugin_api.actions import CORE_STEPS, LIGHT, PROVIDER, TRACE, WEIGHTS, Bucket, is_light, make_action
from neuronbuild.plugin_api.toolchain import WARM_UP, StepDirs, warm_up_spec


class Onnxish:
    """A front end of its own: reads a declared file of the sandbox, writes a summary; no torch.export trace."""

    name = "onnxish"

    def run(self, step: str, spec: Mapping[str, Any], sandbox: Path, out_dir: Path) -> dict[str, Any]:
        if step != "import":
            raise ValueError(f"no step {step!r}")
        nodes = (sandbox / spec["graph"]).read_text().split()
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "graph.json").write_text(json.dumps({"nodes": nodes}))
        return {"nodes": len(nodes)}

    def step_dirs(self, spec: Mapping[str, Any]) -> StepDirs:
        return StepDirs(read=(str(spec["models_dir"]),))


@pytest.fixture()
def onnxish() -> Onnxish:
    """Registered for one test (tests/conftest.py restores the registry after each)."""
    return plugins.register_steps(Onnxish())  # type: ignore[arg-type,return-value]


def test_an_out_of_tree_step_provider_runs_through_the_workers_dispatch(onnxish: Onnxish, tmp_path: Path) -> None:
    inputs, outputs = tmp_path / "in", tmp_path / "out"
    inputs.mkdir()
    (inputs / "m.graph").write_text("matmul relu matmul")
    spec = {PROVIDER: "onnxish", "step": "import", "graph": "m.graph", "models_dir": "/opt/models"}
    res = worker.run_action("import", spec, str(inputs), str(outputs), str(tmp_path / "a.log"))
    assert res["ok"], res
    assert res["metadata"] == {"nodes": 3}
    assert json.loads((outputs / "graph.json").read_text()) == {"nodes": ["matmul", "relu", "matmul"]}
    assert worker.step_dirs(spec) == StepDirs(read=("/opt/models",))  # its confinement grants what it declares
    assert onnxish.warm_up_key(spec) is None and onnxish.prepare_worker() is None  # the defaults, filled

    failed = worker.run_action("import", {**spec, "step": "export"}, str(inputs), str(outputs), str(tmp_path / "b.log"))
    assert not failed["ok"] and failed["error"].startswith("ValueError: no step 'export'"), failed


def test_the_core_trace_and_weights_are_a_registered_step_provider_and_never_light() -> None:
    core = plugins.step_providers()[CORE_STEPS]
    # workers prepare it (import the trace) first: the first provider (tests/conftest.py: the built-ins, in order)
    assert next(iter(plugins.step_providers())) == CORE_STEPS, list(plugins.step_providers())
    assert plugins.step_provider({PROVIDER: CORE_STEPS, "step": TRACE}) is core
    cpu = plugins.toolchain_for("cpu")
    assert plugins.step_provider({"toolchain": cpu.name, "step": "compile"}) is cpu
    assert worker.step_dirs({PROVIDER: CORE_STEPS, "step": TRACE}) == StepDirs()
    assert warm_up_spec(plugins.step_providers(), {PROVIDER: CORE_STEPS, "step": TRACE}) is None
    for kind in (TRACE, WEIGHTS):  # model code runs in them: never in the build process, whatever the spec says
        a = make_action(kind, None, Bucket(()), {"k": kind}, {PROVIDER: CORE_STEPS, "step": kind, LIGHT: True})  # type: ignore[arg-type]
        assert not is_light(a)
    with pytest.raises(ValueError, match="has no step 'compile'"):
        core.run("compile", {}, Path("/nonexistent"), Path("/nonexistent"))


class WarmOnnxish(Onnxish):
    """One whose steps share a per-machine artifact (files other workers reuse): a warm-up, as a toolchain's."""

    name = "warm_onnxish"
    warm_up_shared = True

    def warm_up_key(self, spec: Mapping[str, Any]) -> dict[str, Any] | None:
        return {"opset": spec["opset"]}


def test_a_step_provider_that_is_not_a_toolchain_gets_its_shared_warm_up_like_a_toolchain() -> None:
    from neuronbuild.execution.scheduler import warm_up_description, warm_ups

    plugins.register_steps(WarmOnnxish())  # type: ignore[arg-type]
    steps = [make_action("import", None, Bucket(()), {"graph": g},  # type: ignore[arg-type]
                         {PROVIDER: "warm_onnxish", "step": "import", "graph": g, "opset": 17}) for g in "ab"]
    trace = make_action(TRACE, None, Bucket(()), {"k": 1}, {PROVIDER: CORE_STEPS, "step": TRACE})  # type: ignore[arg-type]
    needs = warm_ups([trace, *steps])
    assert set(needs) == {a.fingerprint for a in steps}  # the trace's provider has no warm-up
    assert len({w.fingerprint for w in needs.values()}) == 1  # one per (provider, key)
    w = needs[steps[0].fingerprint]
    assert w.spec == {PROVIDER: "warm_onnxish", "step": WARM_UP, "key": {"opset": 17}}
    assert warm_up_spec(plugins.step_providers(), steps[1].spec) == w.spec  # what a worker warms before a step
    assert warm_up_description(w) == "Warm up warm_onnxish"


def test_a_step_provider_is_refused_without_run_or_under_a_toolchains_name() -> None:
    class NoRun:
        name = "norun"

    with pytest.raises(TypeError, match=r"step provider 'norun' .*missing run$"):
        plugins.register_steps(NoRun())  # type: ignore[arg-type]

    cpu = plugins.toolchain_for("cpu")

    class Cpu(Onnxish):
        name = cpu.name

    with pytest.raises(ValueError, match="a toolchain has that name"):
        plugins.register_steps(Cpu())  # type: ignore[arg-type]
    assert "norun" not in plugins.step_providers() and plugins.step_providers()[cpu.name] is cpu
