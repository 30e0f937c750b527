"""The cpu toolchain: AOTInductor packages for one x86-64 ISA level (planning here; the torch step in compile.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from neuronbuild.loading.schema import STRING
from neuronbuild.platforms import cxx_version, resolve_isa
from neuronbuild.plugin_api import registry as plugins
from neuronbuild.plugin_api.actions import COMPILE, PROGRAM_CONSTANTS, TRACE_OUTPUT, Action, DepInput, make_action
from neuronbuild.plugin_api.rules import Attr
from neuronbuild.plugin_api.toolchain import WARM_UP, CompileRequest, OptionKey, PlanSettings, StepDirs, Toolchain
from neuronbuild.toolchains import cpu_runtime, cpu_settings
from neuronbuild.vocabulary import AUTO_CAST, CPU_ISAS, CPU_PLATFORM

# the package (no weights inside) and the program's own tensors (non-persistent buffers, lifted constants); the model's
# weights by FQN (constants.safetensors) ship beside them from the weights action (Action.ships)
OUTPUTS = ("model.pt2", PROGRAM_CONSTANTS)
# What a compile of a graph with aliases does with them (its record's "in_place"): "input-mutation-1" = an aliased
# output that is one scatter into its input (compile._scatters_into_input) becomes an in-place update of that input
# in the exported program before AOTInductor compiles it, so the package writes into the caller's tensor and returns
# the other outputs (the runtime loader hands the input back); the package's metadata names what was done.
IN_PLACE_VERSION = "input-mutation-1"


class CpuToolchain(Toolchain):
    name = "aoti"
    platforms: tuple[str, ...] = (CPU_PLATFORM,)
    artifact_format = cpu_runtime.FORMAT
    runtime_loader = "neuronbuild.toolchains.cpu_runtime"
    estimate_s = 15.0
    estimate_mb = 1200.0
    validate_note = ""
    target_attrs: tuple[Attr, ...] = (
        Attr("isa", STRING, "cpu only: 'native' (this machine's level, resolved) or an x86-64 level.",
             choices=CPU_ISAS),)
    tp_degrees: Mapping[str, tuple[int, ...]] = {}  # cpu graphs are never sharded
    warm_up_shared = True  # inductor's precompiled headers, on disk: every worker of the machine reuses them
    # The only option the compile reads (an FX pass before AOTInductor, bf16 only): opt_level, flags and the other
    # neuronx-cc options change no cpu graph, so they enter no cpu fingerprint.
    option_keys: tuple[OptionKey, ...] = (OptionKey("auto_cast", STRING, "Cast matmuls ('matmult') or also convolutions ('all') to "
                             "auto_cast_type; 'none'.", "none", AUTO_CAST),)

    def target_record(self, platform: str, attrs: Mapping[str, Any]) -> dict[str, Any]:
        return {"platform": platform, "isa": resolve_isa(attrs.get("isa"))}

    def describe_target(self, target: Mapping[str, Any]) -> str:
        return f"{target['platform']}/{target['isa']}"

    def versions(self, platform: str, settings: PlanSettings) -> dict[str, str]:
        return settings.override({**settings.trace_toolchain(), cpu_settings.CXX: cxx_version()})

    def plan(self, req: CompileRequest) -> list[Action]:
        assert req.trace is not None
        # From shapes only: no weight value is inlined (compile.inductor_configs) and all are bound at load, so the
        # model's weights file ships beside the package (Action.ships) without being an input of the compile.
        # A graph declaring state (aliases: an output is the input it updates, e.g. kv -> kv) is compiled to write
        # that output into the caller's input tensor (no fresh copy per call): new artifact semantics, so it enters
        # the record (and the manifest, which carries the record); graphs without aliases keep their fingerprints.
        in_place = in_place_pairs(req.trace.model)
        record = req.record(COMPILE, self.versions(req.platform, req.settings), weights="shipped-1",
                            **({"in_place": [IN_PLACE_VERSION, in_place]} if in_place else {}))
        spec = {"toolchain": self.name, "step": COMPILE, "platform": req.platform, "isa": req.target["isa"],
                "options": dict(req.options), "inputs": dict(req.inputs), "bucket": req.bucket.as_dict(),
                "program": TRACE_OUTPUT, **({"in_place": in_place} if in_place else {})}
        return [make_action(COMPILE, req.label, req.bucket, record, spec,
                            dep_inputs=(DepInput(req.trace.fingerprint, TRACE_OUTPUT, TRACE_OUTPUT),),
                            outputs=OUTPUTS, platform=req.platform, target=self.describe_target(req.target),
                            ships=req.weights_shipped())]

    def run(self, step: str, spec: Mapping[str, Any], sandbox: Path, out_dir: Path) -> dict[str, Any]:
        if step == WARM_UP:
            return warm_up(spec["key"])
        from neuronbuild.toolchains.compile import run_cpu_compile

        return run_cpu_compile(dict(spec), sandbox, out_dir)

    def warm_up_key(self, spec: Mapping[str, Any]) -> dict[str, Any] | None:
        """Compiles for one ISA share inductor's precompiled headers (named on disk by the full compile command: ISA,
        flags, torch headers, g++ version); warming them is worth it only for compiles."""
        return {"isa": str(spec["isa"])} if spec.get("step") == COMPILE and spec.get("isa") else None

    def prepare_worker(self) -> None:
        import neuronbuild.toolchains.compile  # noqa: F401  (torch, inductor's codecache: every compile's imports)

    def step_dirs(self, spec: Mapping[str, Any]) -> StepDirs:
        from neuronbuild.toolchains.compile import inductor_dirs

        return inductor_dirs()

    def host_status(self) -> dict[str, str | None]:
        return {cpu_settings.CXX: cxx_version(), "isa": resolve_isa("native")}

    def load_artifact(self, files: Mapping[str, Path]) -> Callable[..., Any]:
        from neuronbuild.runtime.aoti_loader import load_package, read_constants, with_draft, with_program_constants
        from neuronbuild.runtime.layout import DRAFT_WEIGHTS

        return load_package(files["model.pt2"], constants=with_program_constants(
            with_draft(read_constants(files["constants.safetensors"]), files.get(DRAFT_WEIGHTS)),
            files.get(PROGRAM_CONSTANTS)))

    def notes(self, settings: PlanSettings) -> list[str]:
        return []


def in_place_pairs(model: Mapping[str, Any]) -> list[list[Any]]:
    """A trace's declared aliases as [output name, output index, input name, input index] (positions among the
    program's flattened outputs, which follow the declared order, and its inputs), sorted by output index."""
    aliases = dict(model.get("aliases") or {})
    if not aliases:
        return []
    outs = [str(n) for n, _s in model.get("outputs") or []]
    ins = [str(n) for n, _s in model.get("inputs") or []]
    pairs = []
    for out, inp in aliases.items():
        if out not in outs or inp not in ins:  # (kinds/model.py refuses such a declaration)
            raise ValueError(f"aliases {out!r} -> {inp!r}: not a declared output and input")
        pairs.append([out, outs.index(out), inp, ins.index(inp)])
    return sorted(pairs, key=lambda p: int(p[1]))


def warm_up(key: Mapping[str, Any]) -> dict[str, Any]:
    """In a worker (the process itself, so its in-memory memo is warm too; the headers persist on disk under its
    TMPDIR, the cache's toolchain-tmp, for every later worker and build using that cache): build inductor's
    precompiled headers for key["isa"] once, under inductor's per-header file lock."""
    from neuronbuild.toolchains.compile import warm_up_cpu

    return warm_up_cpu(str(key["isa"]))


TOOLCHAIN = plugins.register_toolchain(CpuToolchain())
