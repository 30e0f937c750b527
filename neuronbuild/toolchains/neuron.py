"""The Neuron toolchain: per bucket, trace -> Lower (HLO module, shared by every Neuron platform and by option sets
with the same lowering options) -> Compile per platform and options (the exact neuronx-cc command line, and the NEFF
when a compiler is configured). Planning here; the worker steps in neuron_steps.py."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from neuronbuild import FORMAT_VERSION
from neuronbuild.errors import UserInputError
from neuronbuild.loading.schema import INT, STRING, STRING_LIST
from neuronbuild.plugin_api import registry as plugins
from neuronbuild.plugin_api.actions import (
    COMPILE,
    LIGHT,
    PROGRAM_CONSTANTS,
    TRACE_OUTPUT,
    Action,
    DepInput,
    make_action,
)
from neuronbuild.plugin_api.rules import Attr
from neuronbuild.plugin_api.toolchain import (
    WARM_UP,
    CompileRequest,
    OptionKey,
    PlanSettings,
    StepDirs,
    Toolchain,
    package_version,
)
from neuronbuild.toolchains import neuron_flags, neuron_runtime, neuron_settings
from neuronbuild.toolchains.neuron_settings import NAME as NEURONX_CC
from neuronbuild.toolchains.neuron_steps import FLAGS_FILE, HLO_FILE, LOWER_OUTPUTS, PARAMS_FILE
from neuronbuild.vocabulary import AUTO_CAST, NEURON_PLATFORMS, OPT_LEVELS

LOWER = "lower"
WEIGHTS_FILE = "constants.safetensors"
OUTPUTS = (*LOWER_OUTPUTS, FLAGS_FILE)  # the Compile's (+ the NEFF); it ships the weights action's file(s)
NEFF_OUTPUT = neuron_flags.NEFF_FILE  # when a neuronx-cc is configured
NEURON_CC_FLAGS_ENV = "NEURON_CC_FLAGS"
LOWERING_PACKAGES = ("torchax", "jax", "jaxlib")
# The compiler_options keys neuronx-cc reads (auto_cast_type and lnc: in the options only when set).
OPTION_KEYS = (
    OptionKey("opt_level", INT, "Optimisation level (neuronx-cc -O1/-O2/-O3).", neuron_flags.DEFAULT_OPT_LEVEL,
              OPT_LEVELS),
    OptionKey("auto_cast", STRING, "Cast matmuls ('matmult') or also convolutions ('all') to auto_cast_type; 'none'.",
              "none", AUTO_CAST),
    OptionKey("auto_cast_type", STRING, "The type auto_cast casts to: 'bf16' (default) or 'fp16'.",
              choices=neuron_flags.AUTO_CAST_TYPES),
    OptionKey("model_type", STRING, "Model family hint (neuronx-cc --model-type): generic, transformer, "
              "unet-inference.", None, neuron_flags.MODEL_TYPES),
    OptionKey("lnc", INT, "trn2 only: logical NeuronCore config (neuronx-cc --lnc), 1 or 2.", choices=(1, 2)),
    OptionKey("flags", STRING_LIST, "Extra compiler flags, appended after the deps' flags.", ()),
)


class NeuronToolchain(Toolchain):
    name = "neuron"
    platforms: tuple[str, ...] = NEURON_PLATFORMS
    artifact_format = neuron_runtime.FORMAT
    runtime_loader = "neuronbuild.toolchains.neuron_runtime"
    estimate_s = 4.0
    estimate_mb = 900.0
    option_keys: tuple[OptionKey, ...] = OPTION_KEYS
    target_attrs: tuple[Attr, ...] = ()  # the platform says it all
    # The degrees each platform's runtime accepts (NxD Inference feature guide).
    tp_degrees: Mapping[str, tuple[int, ...]] = {
        "trn2": (1, 2, 4, 8, 16, 32, 64),
        "trn3": (1, 2, 4, 8, 16, 32, 64),  # not in the guide: assumed as trn2
        "trn1": (1, 2, 8, 16, 32),
        "inf2": (1, 2, 4, 8, 24),
    }
    warm_up_shared = False  # the warm-up imports jax in the worker process: nothing other workers could reuse
    # Per plan, kept on the (registered, process-wide) toolchain object: lowering_versions' and _lowers' memos,
    # each with the settings (and `common`) it was made for.
    _lowering_versions: tuple[PlanSettings, dict[str, str]] | None = None
    _lower_memo: tuple[PlanSettings, Any, dict[tuple[str, Any, str], Action]] | None = None
    validate_note = ("Neuron targets: the exact model.hlo.pb run on XLA:CPU (checks the lowering, auto_cast and the "
                     "weights binding; not neuronx-cc, not the device)")

    def target_record(self, platform: str, attrs: Mapping[str, Any]) -> dict[str, Any]:
        return {"platform": platform}

    def describe_target(self, target: Mapping[str, Any]) -> str:
        return str(target["platform"])

    def lowering_versions(self, settings: PlanSettings) -> dict[str, str]:
        """The components the Lower step's output depends on: the trace's plus the pinned torchax/jax/jaxlib
        (computed once per settings object: a plan asks twice per bucket)."""
        known = self._lowering_versions
        if known is None or known[0] is not settings:
            known = self._lowering_versions = (settings, settings.override(
                {**settings.trace_toolchain(), **{p: package_version(p) for p in LOWERING_PACKAGES}}))
        return dict(known[1])

    def _lowers(self, req: CompileRequest) -> dict[tuple[str, Any, str], Action]:
        """One plan's Lower actions (one settings object, one `common`): the compiles of several targets and
        platforms share one. A Lower record is a function of the trace (whose record holds the model's inputs), the
        bucket, the lowering options, the settings and `common`, so that is the key; each reuse is checked against
        the record and spec it would get."""
        known = self._lower_memo
        if known is None or known[0] is not req.settings or known[1] is not req.common:
            known = self._lower_memo = (req.settings, req.common, {})
        return known[2]

    def versions(self, platform: str, settings: PlanSettings) -> dict[str, str]:
        tc = self.lowering_versions(settings)
        cc = settings.tool(NEURONX_CC)  # a configured neuronx-cc (neuron_settings: --neuronx-cc, $NEURONX_CC, PATH)
        if cc is not None:
            tc[NEURONX_CC] = str(cc["version"])
        return settings.override(tc)

    def plan(self, req: CompileRequest) -> list[Action]:
        assert req.trace is not None
        lowering = neuron_flags.lowering_options(req.options)
        try:
            # NEURON_CC_FLAGS counts only when declared (--action-env NEURON_CC_FLAGS): then its value is in every
            # record's env already (as a digest); an ambient one changes nothing and gets the undeclared-variable warning.
            env_flags = neuron_flags.neuron_cc_env_flags(dict(req.settings.action_env).get(NEURON_CC_FLAGS_ENV))
            neuron_flags.neuronx_cc_args(req.platform, req.options, env_flags)  # bad options fail at plan time
        except ValueError as exc:
            raise UserInputError(f"{req.label}: {exc}") from None
        inputs, bucket = dict(req.inputs), req.bucket.as_dict()
        tp = int(req.trace.record.get("tp_degree") or 1)
        # The Lower works on shapes, and so does the Compile: the weights are the module's parameters, so the NEFF
        # is a function of the module and the flags only. The model's weights action's file(s) (one, or one shard
        # per rank) ship beside the Compile's outputs (Action.ships) without being its input: a weights-only
        # change re-runs the weights action and nothing else.
        weights = req.weights_shipped()
        lower_record = {
            "format": FORMAT_VERSION,
            "action": LOWER,
            "trace": req.trace.fingerprint,
            "lowering": lowering,
            "bucket": bucket,
            "inputs": inputs,
            "toolchain": self.lowering_versions(req.settings),
            "weights": "shapes-2",  # no weights read; the program's own tensors in program_constants.safetensors
        } | dict(req.common)
        lower_spec = {"toolchain": self.name, "step": LOWER, "program": TRACE_OUTPUT, "inputs": inputs,
                      "bucket": bucket, "options": lowering}
        if tp > 1:  # one SPMD module for every rank; how its collectives look is neuron_collectives.FORM's
            from neuronbuild.toolchains.neuron_collectives import FORM

            tp_info = dict(req.trace.model.get("tp") or {})
            lower_record["tp"] = lower_spec["tp"] = tp_info | {"collectives": FORM}
        # Labelled by the model, like the trace: one Lower per (trace, lowering options), whatever the platform.
        lowers = self._lowers(req)
        key = (req.trace.fingerprint, req.bucket, repr(lowering))
        lower = lowers.get(key)
        if lower is None or lower.record != lower_record or lower.spec != lower_spec or lower.label != req.trace.label:
            lower = lowers[key] = make_action(LOWER, req.trace.label, req.bucket, lower_record, lower_spec,
                                              dep_inputs=(DepInput(req.trace.fingerprint, TRACE_OUTPUT,
                                                                           TRACE_OUTPUT),),
                                              outputs=LOWER_OUTPUTS)
        record = req.record(COMPILE, self.versions(req.platform, req.settings), lowering=lower.fingerprint,
                            weights="shipped-1",  # bound at load: the weights action's file(s), not read here
                            options=neuron_flags.compile_options(req.options))
        spec: dict[str, Any] = {"toolchain": self.name, "step": COMPILE, "platform": req.platform,
                                "options": dict(req.options), "env_flags": env_flags, "neuronx_cc": None}
        outputs: tuple[str, ...] = OUTPUTS
        if tp > 1:
            spec["tp_degree"] = tp
        cc = req.settings.tool(NEURONX_CC)
        if cc is not None:
            spec["neuronx_cc"] = dict(cc)
            outputs = (*outputs, NEFF_OUTPUT)
        else:  # the step only writes compile_flags.json: progress says so, estimates count it as nothing, and the
            spec["skipped"] = "no neuronx-cc"  # local executor runs it in the build process (actions.LIGHT)
            spec[LIGHT] = True
        compile_ = make_action(COMPILE, req.label, req.bucket, record, spec,
                               dep_inputs=tuple(DepInput(lower.fingerprint, f, f) for f in LOWER_OUTPUTS),
                               outputs=outputs, platform=req.platform, target=self.describe_target(req.target),
                               ships=weights)
        return [lower, compile_]

    def warm_up_key(self, spec: Mapping[str, Any]) -> dict[str, Any] | None:
        """Lowerings import jax (~1 s of a lowering's ~2 s), which every lowering's forked child did again: a worker
        imports it once (run(WARM_UP): neuron_torchax.import_jax) before its first lowering, and the lowerings forked
        from it find it imported. The same bytes either way (the lowering pins the platform and 32-bit mode)."""
        return {"import": "jax"} if spec.get("step") == LOWER else None

    def run(self, step: str, spec: Mapping[str, Any], sandbox: Path, out_dir: Path) -> dict[str, Any]:
        from neuronbuild.toolchains import neuron_steps

        if step == WARM_UP:
            from neuronbuild.toolchains.neuron_torchax import import_jax

            return import_jax()
        if step == LOWER:
            return neuron_steps.run_lower(spec, sandbox, out_dir)
        return neuron_steps.run_neuron_compile(spec, sandbox, out_dir)

    def prepare_worker(self) -> None:
        pass  # jax comes with the warm-up before a worker's first lowering (warm_up_key): a cpu-only build never needs it

    def step_dirs(self, spec: Mapping[str, Any]) -> StepDirs:
        """A configured neuronx-cc's installation is readable (the dir above its bin/: its Python and libraries)."""
        cc = spec.get("neuronx_cc")
        if not (isinstance(cc, Mapping) and isinstance(cc.get("path"), str) and os.path.isabs(cc["path"])):
            return StepDirs()
        exe = Path(os.path.realpath(cc["path"]))
        return StepDirs(read=(str(exe.parent.parent if exe.parent.name == "bin" else exe.parent),))

    def host_status(self) -> dict[str, str | None]:
        from neuronbuild.toolchains.neuronx_cc import neuronx_cc_version

        try:
            cc = neuron_settings.find_neuronx_cc(None)
            return {NEURONX_CC: neuronx_cc_version(cc) if cc else None}
        except Exception as e:  # noqa: BLE001 - a broken compiler is reported, not raised
            return {NEURONX_CC: f"broken ({e})"}

    def load_artifact(self, files: Mapping[str, Path]) -> Callable[..., Any]:
        from neuronbuild.runtime.aoti_loader import read_constants, with_draft, with_program_constants
        from neuronbuild.runtime.layout import DRAFT_WEIGHTS
        from neuronbuild.runtime.xla_cpu import load_graph

        own = files.get(PROGRAM_CONSTANTS)
        if WEIGHTS_FILE not in files:  # tensor-parallel: rank_<r>.safetensors, one per rank
            ranks = sorted((n for n in files if n.startswith("rank_")), key=lambda n: int(n[5:].split(".")[0]))
            return load_graph(files[HLO_FILE], files[PARAMS_FILE],
                              [with_program_constants(read_constants(files[n]), own) for n in ranks])
        weights = with_draft(read_constants(files[WEIGHTS_FILE]), files.get(DRAFT_WEIGHTS))  # (+ a fused graph's draft)
        return load_graph(files[HLO_FILE], files[PARAMS_FILE], with_program_constants(weights, own))

    def option_warnings(self, options: Mapping[str, Any]) -> list[str]:
        """Raw `flags` the neuronx-cc contract does not document (neuron_flags.DOCUMENTED_FLAGS): a typo would
        otherwise be found only where neuronx-cc runs."""
        return [f"flags: {flag!r} is not a documented neuronx-cc flag (a typo? it is passed to neuronx-cc as it is)"
                for flag in neuron_flags.unknown_flags([str(f) for f in options.get("flags", ())])]

    def notes(self, settings: PlanSettings) -> list[str]:
        if settings.tool(NEURONX_CC) is not None:
            return []
        return ["note: no neuronx-cc found (--neuronx-cc PATH, $NEURONX_CC or PATH): Neuron targets get HLO "
                "modules (model.hlo.pb) and their compile_flags.json only; NEFFs were not produced"]


TOOLCHAIN = plugins.register_toolchain(NeuronToolchain())
