"""Maps effective compiler options to neuronx-cc command-line arguments (no torch import here)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from neuronbuild.vocabulary import AUTO_CAST, NEURON_PLATFORMS, OPT_LEVELS

DEFAULT_OPT_LEVEL = 2


def neuronx_cc_args(platform: str, options: Mapping[str, Any]) -> list[str]:
    """neuronx-cc arguments for `options` (missing keys take defaults), spelled like the real CLI.

    e.g. ["--target", "trn2", "--optlevel", "2", "--auto-cast", "matmult", "--model-type", "transformer", *flags].
    The input file, --framework and --output are the caller's business.
    """
    if platform not in NEURON_PLATFORMS:
        raise ValueError(f"not a Neuron platform: {platform!r} (expected one of {', '.join(NEURON_PLATFORMS)})")
    opt_level = int(options.get("opt_level", DEFAULT_OPT_LEVEL))
    if opt_level not in OPT_LEVELS:
        raise ValueError(f"opt_level must be 1, 2 or 3 for neuronx-cc, got {opt_level}")
    auto_cast = str(options.get("auto_cast", "none"))
    if auto_cast not in AUTO_CAST:
        raise ValueError(f"auto_cast must be one of {', '.join(AUTO_CAST)}, got {auto_cast!r}")
    args = ["--target", platform, "--optlevel", str(opt_level)]
    if auto_cast != "none":
        args += ["--auto-cast", auto_cast]
    model_type = options.get("model_type")
    if model_type:
        args += ["--model-type", str(model_type)]
    args += [str(flag) for flag in options.get("flags", ())]
    return args
