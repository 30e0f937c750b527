"""Maps effective compiler options to the exact neuronx-cc command line (no torch import here)."""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from typing import Any

from neuronbuild.vocabulary import AUTO_CAST, NEURON_PLATFORMS, OPT_LEVELS

AUTO_CAST_VALUES = AUTO_CAST
AUTO_CAST_TYPES = ("bf16", "fp16")  # the types the HLO lowering can cast to (neuronx-cc also knows tf32, fp8_e4m3)
MODEL_TYPES = ("generic", "transformer", "unet-inference")
DEFAULT_OPT_LEVEL = 2
LNC_PLATFORMS = ("trn2",)
HLO_FILE = "model.hlo.pb"
NEFF_FILE = "model.neff"
# Flags of the frameworks' compile-cache wrapper that ride in NEURON_CC_FLAGS but never reach the compiler.
_WRAPPER_FLAGS = ("--cache_dir", "--no_cache", "--retry_failed_compilation", "--log_level")


# The neuronx-cc contract (the Neuron Compiler CLI reference, `neuronx-cc compile`): the flags it documents, and those
# of them the compiler options already set (a raw flag repeating one would fight the option the build records).
DOCUMENTED_FLAGS = frozenset({
    "--framework", "--target", "--model-type", "--auto-cast", "--auto-cast-type", "--native-int64",
    "--implicit-integer-downcast", "--distribution-strategy", "--logical-nc-config", "-lnc", "--lnc", "--optlevel",
    "-O", "--enable-mixed-precision-accumulation", "--enable-saturate-infinity", "--enable-fast-context-switch",
    "--enable-fast-loading-neuron-binaries", "--logfile", "--output", "--verbose", "--workdir", "--pipeline",
    "--tensorizer-options"})
INTERNAL_PREFIXES = ("--internal-",)  # what NxD Inference passes through (undocumented, version-specific)
SET_BY_OPTIONS = {"--target": "the target's platform", "--framework": "the build (XLA)", "--output": "the build",
                  "-O": "the option opt_level", "--optlevel": "the option opt_level",
                  "--auto-cast": "the option auto_cast", "--auto-cast-type": "the option auto_cast_type",
                  "--model-type": "the option model_type", "--lnc": "the option lnc", "-lnc": "the option lnc",
                  "--logical-nc-config": "the option lnc"}


def _flag_name(flag: str) -> str:
    if flag.startswith("-O") and flag[2:].isdigit():
        return "-O"
    return flag.split("=", 1)[0]


def flag_conflicts(flags: list[str]) -> list[str]:
    """The raw flags that set what the build's options set (an error: the recorded options would not be what ran)."""
    return [f"flags: {flag!r} sets what {SET_BY_OPTIONS[_flag_name(flag)]} sets; use that instead"
            for flag in flags if _flag_name(flag) in SET_BY_OPTIONS]


def unknown_flags(flags: list[str]) -> list[str]:
    """The raw flags the neuronx-cc contract does not document (a warning: a typo is found on the Neuron farm only)."""
    return [flag for flag in flags if flag.startswith("-") and _flag_name(flag) not in DOCUMENTED_FLAGS
            and not flag.startswith(INTERNAL_PREFIXES)]


def lowering_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The options that change the HLO module (and so the lowering action): auto_cast and its type only."""
    auto_cast = str(options.get("auto_cast") or "none")
    out: dict[str, Any] = {"auto_cast": auto_cast}
    if auto_cast != "none":
        out["auto_cast_type"] = str(options.get("auto_cast_type") or "bf16")
    return out


def compile_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The options as a Compile's record keys them: auto_cast_type left out when auto_cast is none, since neither
    the HLO nor the argv reads it then (`neuronbuild audit-keys` found it over-keyed); the rest as given."""
    if str(options.get("auto_cast") or "none") == "none":
        return {k: v for k, v in options.items() if k != "auto_cast_type"}
    return dict(options)


def neuron_cc_env_flags(value: str | None) -> list[str]:
    """NEURON_CC_FLAGS as the frameworks read it: shell-split, the cache wrapper's own flags (and their values)
    removed; what is left goes to the compiler after the options' flags."""
    if not value:
        return []
    try:
        words = shlex.split(value)
    except ValueError as exc:
        raise ValueError(f"NEURON_CC_FLAGS cannot be parsed: {exc}") from None
    out: list[str] = []
    skip_value = False
    for w in words:
        if skip_value:
            skip_value = False
            if not w.startswith("-"):
                continue
        name = w.split("=", 1)[0]
        if name in _WRAPPER_FLAGS:
            skip_value = "=" not in w and name in ("--cache_dir", "--log_level")
            continue
        out.append(w)
    return out


def neuronx_cc_args(platform: str, options: Mapping[str, Any], env_flags: list[str] | None = None) -> list[str]:
    """neuronx-cc arguments for `options` (missing keys take defaults), spelled like the real CLI.

    e.g. ["--target", "trn2", "-O2", "--auto-cast", "matmult", "--auto-cast-type", "bf16", "--model-type",
    "transformer", "--lnc", "2", *flags, *env_flags]. --auto-cast is always explicit: neuronx-cc's own default is
    matmult, which would not match the fp32 module the build validated. The input file, --framework and --output are
    the caller's business."""
    if platform not in NEURON_PLATFORMS:
        raise ValueError(f"not a Neuron platform: {platform!r} (expected one of {', '.join(NEURON_PLATFORMS)})")
    opt_level = int(options.get("opt_level", DEFAULT_OPT_LEVEL))
    if opt_level not in OPT_LEVELS:
        raise ValueError(f"opt_level must be 1, 2 or 3 for neuronx-cc, got {opt_level}")
    auto_cast = str(options.get("auto_cast") or "none")
    if auto_cast not in AUTO_CAST_VALUES:
        raise ValueError(f"auto_cast must be one of {', '.join(AUTO_CAST_VALUES)}, got {auto_cast!r}")
    args = ["--target", platform, f"-O{opt_level}", "--auto-cast", auto_cast]
    if auto_cast != "none":
        cast_type = str(options.get("auto_cast_type") or "bf16")
        if cast_type not in AUTO_CAST_TYPES:
            raise ValueError(f"auto_cast_type must be one of {', '.join(AUTO_CAST_TYPES)}, got {cast_type!r}")
        args += ["--auto-cast-type", cast_type]
    model_type = options.get("model_type")
    if model_type:
        if model_type not in MODEL_TYPES:
            raise ValueError(f"model_type must be one of {', '.join(MODEL_TYPES)}, got {model_type!r}")
        args += ["--model-type", str(model_type)]
    lnc = options.get("lnc")
    if lnc is not None:
        if platform not in LNC_PLATFORMS:
            raise ValueError(f"lnc (logical NeuronCore config) applies to trn2 only, not {platform}")
        if int(lnc) not in (1, 2):
            raise ValueError(f"lnc must be 1 or 2, got {lnc}")
        args += ["--lnc", str(int(lnc))]
    flags = [str(flag) for flag in options.get("flags", ())]
    conflicts = flag_conflicts(flags)
    if conflicts:
        raise ValueError(conflicts[0])
    args += flags
    args += list(env_flags or ())
    return args


def neuronx_cc_argv(exe: str, platform: str, options: Mapping[str, Any], env_flags: list[str] | None = None
                    ) -> list[str]:
    """The full contract argv, run in a scratch dir holding model.hlo.pb:
    `<exe> compile model.hlo.pb --framework XLA --target P --output model.neff <flags>`."""
    args = neuronx_cc_args(platform, options, env_flags)
    assert args[:2] == ["--target", platform]
    return [exe, "compile", HLO_FILE, "--framework", "XLA", "--target", platform, "--output", NEFF_FILE, *args[2:]]
