"""The neuron_model rule: a torch module factory in Python sources, its config, inputs and optional weights."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from neuronbuild.analysis.actions import FileInput
from neuronbuild.analysis.planner import AnalysisContext
from neuronbuild.analysis.providers import ModelInfo
from neuronbuild.digests import digest_file
from neuronbuild.kinds.base import RuleKind
from neuronbuild.loading.schema import (
    DICT,
    ENTRY_RE,
    INPUTS,
    INT,
    LABEL,
    LABEL_LIST,
    NAME,
    STRING,
    TAGS,
    Attr,
    AttrError,
    RuleSchema,
    parse_input_spec,
)
from neuronbuild.loading.targets import Target


def _check(a: Mapping[str, Any]) -> None:
    if not ENTRY_RE.match(a["entry"]):
        raise AttrError("attribute 'entry' must look like 'module:function' (e.g. 'llama:build_model')")
    if not a["srcs"]:
        raise AttrError("attribute 'srcs' must list at least one .py file")
    for src in a["srcs"]:
        if not src.name.endswith(".py"):
            raise AttrError(f"attribute 'srcs': '{src}' is not a .py file")


SCHEMA = RuleSchema(
    "neuron_model",
    "A torch model: a module factory in Python sources, its config and optional weights.",
    (
        NAME,
        Attr("srcs", LABEL_LIST, "Python sources of the model (files in this package).", required=True,
             kinds=("file",)),
        Attr("entry", STRING, "'module:function' building the nn.Module from the config dict.", required=True),
        Attr("config", DICT, "Config dict passed to the factory.", default={}),
        Attr("inputs", INPUTS, "Positional inputs in order: name -> 'dtype[dim, ...]' (dims named by buckets).",
             required=True),
        Attr("weights", LABEL, "Optional safetensors file; without it the factory's seeded init is used.",
             kinds=("file",)),
        Attr("seed", INT, "torch.manual_seed value used before calling the factory.", default=0),
        TAGS,
    ),
    _check,
)


def analyze(ctx: AnalysisContext, model: Target) -> ModelInfo:
    """The model's canonical record: sources and weights by workspace-relative path and content digest."""
    root = ctx.graph.root
    files: list[FileInput] = []
    srcs: dict[str, str] = {}
    for lbl in model.attrs["srcs"]:
        d = digest_file(root / lbl.path)
        srcs[lbl.path] = d
        files.append(FileInput(lbl.path, d))
    weights = None
    if model.attrs.get("weights") is not None:
        w = model.attrs["weights"]
        wd = digest_file(root / w.path)
        weights = {"path": w.path, "digest": wd}
        files.append(FileInput(w.path, wd))
    parsed = [(k, parse_input_spec(v)) for k, v in model.attrs["inputs"].items()]
    inputs = {k: {"dtype": dt, "dims": list(dims)} for k, (dt, dims) in parsed}
    dims = tuple(dict.fromkeys(d for _k, (_dt, ds) in parsed for d in ds))
    record = {
        "package": model.label.package,
        "srcs": srcs,
        "entry": model.attrs["entry"],
        "config": dict(model.attrs["config"]),
        "weights": weights,
        "seed": model.attrs["seed"],
        "inputs": inputs,
    }
    return ModelInfo(model.label, record, tuple(files), dims)


KIND = RuleKind(SCHEMA, analyze)
