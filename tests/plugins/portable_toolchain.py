"""An out-of-tree toolchain in one module (tests/test_plugin_release.py): platform "cpu-portable" builds AOTInductor
packages for the x86-64 baseline only (they run on any x86-64 host), in an artifact format of its own
("aoti-x86-64"), which the runtime loads through the loader this module registers. Everything it means is declared
here: platform, target attributes (none), the options it reads and their defaults, its settings (a flag of its own,
`--portable-release NAME`, else $PORTABLE_RELEASE: a release name its compile records carry), its versions, its
actions and worker step, its warm-up, its validate loader, its runtime loader. Registration is this module's name in
$NEURONBUILD_PLUGINS (in the building process and in the serving one: the runtime finds its loader there).

(A plug-in served from a serving-only install, without the `build` extra, puts its runtime loader in a module of its
own that imports only neuronbuild.runtime, and names that module in `runtime_loader` and $NEURONBUILD_PLUGINS.)"""

from __future__ import annotations

import platform as host_platform
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from neuronbuild import plugins
from neuronbuild.loading.schema import STRING
from neuronbuild.plugin_api.actions import COMPILE, PROGRAM_CONSTANTS, TRACE_OUTPUT, Action, DepInput, make_action
from neuronbuild.plugin_api.loader import Host, Loaded, LoadRequest, Mismatch
from neuronbuild.plugin_api.rules import Attr
from neuronbuild.plugin_api.toolchain import WARM_UP, CompileRequest, OptionKey, PlanSettings, StepDirs
from neuronbuild.runtime.layout import Graph

ISA = "x86-64"  # the baseline every x86-64 machine runs
FORMAT = "aoti-x86-64"  # a format no built-in runtime loader knows
LOADED: list[str] = []  # graphs loaded through PortableLoader in this process (the test checks a load went here)


class PortableToolchain:
    name = "portable"
    platforms: tuple[str, ...] = ("cpu-portable",)
    artifact_format = FORMAT
    runtime_loader = __name__  # this module registers the runtime loader too (below)
    estimate_s = 15.0
    estimate_mb = 1200.0
    validate_note = ""
    option_keys: tuple[OptionKey, ...] = (
        OptionKey("auto_cast", STRING, "Cast matmuls ('matmult') or also convolutions ('all') to auto_cast_type; "
                  "'none'.", "none", ("none", "matmult", "all")),)
    target_attrs: tuple[Attr, ...] = ()
    tp_degrees: dict[str, tuple[int, ...]] = {}  # never sharded
    warm_up_shared = True  # inductor's precompiled headers for the baseline ISA, on disk for every worker

    def target_record(self, platform: str, attrs: Mapping[str, Any]) -> dict[str, Any]:
        return {"platform": platform, "isa": ISA}

    def describe_target(self, target: Mapping[str, Any]) -> str:
        return f"{target['platform']}/{ISA}"

    def versions(self, platform: str, settings: PlanSettings) -> dict[str, str]:
        from neuronbuild.platforms import cxx_version

        release = settings.tool(SETTINGS.name)  # (--portable-release: only this toolchain's records carry it)
        return settings.override({**settings.trace_toolchain(), "cxx": cxx_version(),
                                  **({SETTINGS.name: release} if release else {})})

    def plan(self, req: CompileRequest) -> list[Action]:
        assert req.trace is not None
        # As the cpu toolchain: the package holds no weight, the model's weights file ships beside it (bound at load).
        record = req.record(COMPILE, self.versions(req.platform, req.settings), weights="shipped-1")
        spec = {"toolchain": self.name, "step": COMPILE, "platform": req.platform, "isa": ISA,
                "options": dict(req.options), "inputs": dict(req.inputs), "bucket": req.bucket.as_dict(),
                "program": TRACE_OUTPUT}
        return [make_action(COMPILE, req.label, req.bucket, record, spec,
                            dep_inputs=(DepInput(req.trace.fingerprint, TRACE_OUTPUT, TRACE_OUTPUT),),
                            outputs=("model.pt2", PROGRAM_CONSTANTS), platform=req.platform,
                            target=self.describe_target(req.target), ships=req.weights_shipped())]

    def run(self, step: str, spec: Mapping[str, Any], sandbox: Path, out_dir: Path) -> dict[str, Any]:
        from neuronbuild.toolchains.compile import run_cpu_compile, warm_up_cpu

        if step == WARM_UP:  # in the worker, before its first compile: the headers compiles may only read
            return warm_up_cpu(ISA)
        return run_cpu_compile(dict(spec), sandbox, out_dir)

    def warm_up_key(self, spec: Mapping[str, Any]) -> dict[str, Any] | None:
        return {"isa": ISA} if spec.get("step") == COMPILE else None

    def prepare_worker(self) -> None:
        import neuronbuild.toolchains.compile  # noqa: F401  (torch, inductor's codecache: every compile's imports)

    def step_dirs(self, spec: Mapping[str, Any]) -> StepDirs:
        from neuronbuild.toolchains.compile import inductor_dirs

        return inductor_dirs()

    def host_status(self) -> dict[str, str | None]:
        from neuronbuild.platforms import cxx_version

        return {"cxx": cxx_version()}

    def load_artifact(self, files: Mapping[str, Path]) -> Callable[..., Any]:
        from neuronbuild.runtime.aoti_loader import load_package, read_constants, with_program_constants

        return load_package(files["model.pt2"], constants=with_program_constants(
            read_constants(files["constants.safetensors"]), files.get(PROGRAM_CONSTANTS)))

    def notes(self, settings: PlanSettings) -> list[str]:
        return []


class PortableSettings:
    """Its settings (plugin_api/toolchain.ToolSettings): one flag, read by every command that plans and accepted in
    rc files; the value enters this toolchain's fingerprints (and no other's)."""

    name = "portable-release"
    flags = (plugins.Flag("--portable-release", "a release name the portable toolchain's compile records carry "
                          "(default: $PORTABLE_RELEASE)", metavar="NAME"),)
    tools: tuple[str, ...] = ()  # it runs the C++ compiler the built-in cpu settings watch already
    components: tuple[str, ...] = ()

    def check(self, values: Mapping[str, Any]) -> None:
        value = self.resolve(values)
        if value is not None and not value.replace("-", "").replace(".", "").isalnum():
            from neuronbuild.errors import UserInputError

            raise UserInputError(f"--portable-release: {value!r} is not a release name (letters, digits, - and .)")

    def resolve(self, values: Mapping[str, Any]) -> str | None:
        import os

        return values.get("portable_release") or os.environ.get("PORTABLE_RELEASE") or None

    def worker_versions(self, expect: Mapping[str, str]) -> dict[str, str]:
        return {}


class PortableLoader:
    """The runtime half: any x86-64 host runs these packages."""

    format = FORMAT

    def host_mismatches(self, g: Graph, host: Host, emulate: str | None) -> list[Mismatch]:
        machine = host_platform.machine()
        return [] if machine in ("x86_64", "AMD64") else [Mismatch(g.describe(), "machine", "x86-64", machine)]

    def load(self, req: LoadRequest) -> Loaded:
        from neuronbuild.runtime.aoti_loader import load_package

        g = req.graph
        constants = req.weights(g.weights) if g.weights else {}
        with req.verified(g.artifacts["model.pt2"], scratch=True) as package:
            fn = load_package(package, constants=constants)
        LOADED.append(f"{g.label}@{g.bucket_name}")
        return Loaded(fn)

    def scratch_bytes(self, g: Graph) -> int:
        return g.artifacts["model.pt2"].size


SETTINGS = plugins.register_settings(PortableSettings())
TOOLCHAIN = plugins.register_toolchain(PortableToolchain())
LOADER = plugins.register_loader(PortableLoader())
