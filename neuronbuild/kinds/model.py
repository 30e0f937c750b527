"""The neuron_model rule: a torch module factory in Python sources, its config, inputs and optional weights."""

from __future__ import annotations

import ast
from collections.abc import Mapping
from typing import Any

from neuronbuild.analysis.actions import FileInput
from neuronbuild.analysis.planner import AnalysisContext
from neuronbuild.analysis.providers import ModelInfo
from neuronbuild.analysis.toolchain_versions import distributions_of
from neuronbuild.digests import digest_file
from neuronbuild.kinds.base import RuleKind
from neuronbuild.loading.schema import (
    CONST_DIMS,
    DICT,
    ENTRY_RE,
    INPUTS,
    INT,
    INT_RANGES,
    LABEL,
    LABEL_LIST,
    NAME,
    OUTPUTS,
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
    for name in a["input_ranges"]:
        if name not in a["inputs"]:
            raise AttrError(f"attribute 'input_ranges': '{name}' is not an input (inputs: {', '.join(a['inputs'])})")
        dtype = parse_input_spec(a["inputs"][name])[0]
        if dtype.startswith("float") or dtype.startswith("bfloat") or dtype == "bool":
            raise AttrError(f"attribute 'input_ranges': input '{name}' is {dtype}, not an integer input")


SCHEMA = RuleSchema(
    "neuron_model",
    "A torch model: a module factory in Python sources, its config and optional weights.",
    (
        NAME,
        Attr("srcs", LABEL_LIST, "Python sources of the model (files in this package).", required=True,
             kinds=("file",)),
        Attr("entry", STRING, "'module:function' building the nn.Module from the config dict.", required=True),
        Attr("config", DICT, "Config dict passed to the factory.", default={}),
        Attr("inputs", INPUTS, "Positional inputs in order: name -> 'dtype[dim, ...]'; a dim is a bucket dimension, a "
             "named constant from `dims`, or a literal int.", required=True),
        Attr("dims", CONST_DIMS, "Named constant dims usable in input/output specs, e.g. {'head_dim': 16} (never "
             "bucket dims, never in bucket names).", default={}),
        Attr("outputs", OUTPUTS, "Optional names of the flattened outputs, in order: name -> 'dtype[dim, ...]'; dims "
             "named like a bucket dim follow it (are un-padded), others are free names, constants or ints.",
             default={}),
        Attr("input_ranges", INT_RANGES, "Value range [low, high) per integer input for validate's random inputs "
             "(default: from config keys vocab_size / type_vocab_size, else [0, 100)).", default={}),
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
    consts: Mapping[str, int] = model.attrs["dims"]
    parsed = [(k, parse_input_spec(v)) for k, v in model.attrs["inputs"].items()]
    # An ordered list of [name, spec] pairs: input order is positional, so it enters the fingerprint (a dict's keys
    # would be sorted by canonical JSON). Named constants are resolved to their sizes.
    inputs = [[k, {"dtype": dt, "dims": [consts.get(d, d) if isinstance(d, str) else d for d in ds]}]
              for k, (dt, ds) in parsed]
    dims = tuple(dict.fromkeys(d for _k, spec in inputs for d in spec["dims"] if isinstance(d, str)))
    outputs = [[k, {"dtype": dt, "dims": [consts.get(d, d) if isinstance(d, str) else d for d in ds]}]
               for k, (dt, ds) in ((k, parse_input_spec(v)) for k, v in model.attrs["outputs"].items())]
    record: dict[str, Any] = {
        "package": model.label.package,
        "srcs": srcs,
        "entry": model.attrs["entry"],
        "config": dict(model.attrs["config"]),
        "weights": weights,
        "seed": model.attrs["seed"],
        "inputs": inputs,
    }
    if outputs:
        record["outputs"] = outputs
    imports = distributions_of(_imported_modules(root, [lbl.path for lbl in model.attrs["srcs"]]))
    if imports:  # third-party distributions the sources import, at their installed (or what-if) versions
        record["imports"] = imports
    if model.attrs["input_ranges"]:
        record["input_ranges"] = {k: list(v) for k, v in model.attrs["input_ranges"].items()}
    return ModelInfo(model.label, record, tuple(files), dims)


def _imported_modules(root: Any, paths: list[str]) -> list[str]:
    """Top-level names of the modules the sources import (absolute imports; the sources' own modules left out)."""
    local = {p.rsplit("/", 1)[-1].removesuffix(".py") for p in paths}
    found: dict[str, None] = {}
    for p in paths:
        try:
            tree = ast.parse((root / p).read_bytes())
        except (SyntaxError, ValueError, OSError):
            continue  # the trace reports it
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    found.setdefault(alias.name.split(".")[0], None)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.setdefault(node.module.split(".")[0], None)
    return [m for m in found if m not in local]


KIND = RuleKind(SCHEMA, analyze)
