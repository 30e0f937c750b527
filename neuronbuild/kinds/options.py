"""The compiler_options rule: a composable option set (deps merge in order, own values win, flags concatenate)."""

from __future__ import annotations

from typing import Any

from neuronbuild.analysis.planner import AnalysisContext
from neuronbuild.analysis.providers import OptionsInfo
from neuronbuild.kinds.base import RuleKind
from neuronbuild.loading.schema import INT, LABEL_LIST, NAME, STRING, STRING_LIST, TAGS, Attr, RuleSchema
from neuronbuild.loading.targets import Target
from neuronbuild.vocabulary import AUTO_CAST, OPT_LEVELS

# auto_cast_type and lnc have no default entry: effective options (and fingerprints) carry them only when set.
OPTION_KEYS = ("opt_level", "auto_cast", "auto_cast_type", "model_type", "lnc", "flags")
DEFAULTS: dict[str, Any] = {"opt_level": 2, "auto_cast": "none", "model_type": None, "flags": []}

SCHEMA = RuleSchema(
    "compiler_options",
    "A composable set of compiler options; deps merge in order and this target's own values win.",
    (
        NAME,
        Attr("deps", LABEL_LIST, "Option sets merged first, in order.", default=(), kinds=("compiler_options",)),
        Attr("opt_level", INT, "Optimisation level (neuronx-cc -O1/-O2/-O3).", choices=OPT_LEVELS),
        Attr("auto_cast", STRING, "Cast matmuls ('matmult') or also convolutions ('all') to auto_cast_type; 'none'.",
             choices=AUTO_CAST),
        Attr("auto_cast_type", STRING, "The type auto_cast casts to: 'bf16' (default) or 'fp16'.",
             choices=("bf16", "fp16")),
        Attr("model_type", STRING, "Model family hint (neuronx-cc --model-type): generic, transformer, unet-inference.",
             choices=("generic", "transformer", "unet-inference")),
        Attr("lnc", INT, "trn2 only: logical NeuronCore config (neuronx-cc --lnc), 1 or 2.", choices=(1, 2)),
        Attr("flags", STRING_LIST, "Extra compiler flags, appended after the deps' flags."),
        TAGS,
    ),
)


def analyze(ctx: AnalysisContext, t: Target) -> OptionsInfo:
    merged: dict[str, Any] = {}
    flags: list[str] = []
    for dep in t.attrs.get("deps") or ():
        d = ctx.provider(dep).merged
        flags.extend(d.get("flags", []))
        merged.update({k: v for k, v in d.items() if k != "flags"})
    own = {k: t.attrs[k] for k in OPTION_KEYS if t.attrs.get(k) is not None}
    flags.extend(own.pop("flags", ()))
    merged.update(own)
    if flags:
        merged["flags"] = flags
    return OptionsInfo(merged)


def effective(info: OptionsInfo | None) -> dict[str, Any]:
    """The resolved option set (defaults filled in) that enters fingerprints and that toolchains see."""
    out = dict(DEFAULTS)
    if info is not None:
        out.update(info.merged)
    out["flags"] = list(out.get("flags") or [])
    return out


KIND = RuleKind(SCHEMA, analyze)
