"""The neuron_model rule: a torch module factory in Python sources, its config, inputs and optional weights."""

from __future__ import annotations

import ast
from collections.abc import Mapping
from typing import Any

from neuronbuild import jsondata
from neuronbuild.analysis.analysis_context import AnalysisContext
from neuronbuild.analysis.hf_config import config_problem
from neuronbuild.analysis.providers import ModelInfo
from neuronbuild.analysis.tensor_parallel import builtin_digest
from neuronbuild.digests import digest_bytes, digest_file
from neuronbuild.errors import Location, UserInputError
from neuronbuild.kinds import py_library
from neuronbuild.loading.labels import Label, parse_label
from neuronbuild.loading.schema import (
    CONST_DIMS,
    DICT,
    ENTRY_RE,
    GRAPHS,
    INPUTS,
    INT,
    INT_RANGES,
    LABEL_LIST,
    NAME,
    OUTPUTS,
    STRING,
    TAGS,
    parse_input_spec,
)
from neuronbuild.loading.target_graph import locate
from neuronbuild.loading.targets import Target
from neuronbuild.plugin_api.actions import FileInput
from neuronbuild.plugin_api.rules import Attr, AttrError, AttrType, RuleKind, RuleSchema
from neuronbuild.plugin_api.toolchain import distributions_of


def _weights(attr: str, v: Any, pkg: str) -> tuple[Label, ...]:
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, (list, tuple)) or not items:
        raise AttrError(f"attribute '{attr}' must be a label or a non-empty list of labels")
    labels = LABEL_LIST.check(attr, list(items), pkg)
    for lbl in labels:
        if not lbl.name.endswith((".safetensors", ".safetensors.index.json")):
            raise AttrError(f"attribute '{attr}': '{lbl}' is not a .safetensors file or a .safetensors.index.json")
    if any(lbl.name.endswith(".json") for lbl in labels) and len(labels) > 1:
        raise AttrError(f"attribute '{attr}': an index.json names its shards itself; list it alone")
    return tuple(labels)


WEIGHTS = AttrType("weights", _weights)


def _bool(attr: str, v: Any, pkg: str) -> bool:
    if not isinstance(v, bool):
        raise AttrError(f"attribute '{attr}' must be True or False, got {v!r}")
    return v


BOOL = AttrType("bool", _bool)
# The model record's `weights` of a graphs-only model (no checkpoint, no seeded init): its compiles plan no weights
# action and ship no weights; a model_weights target supplies them (kinds/weights.py). Traces and compiles never see
# a record's `weights` (a trace's record drops it), so a graphs-only model's graphs are those of the same model with a
# checkpoint, fingerprint and bytes.
GRAPHS_ONLY = {"graphs_only": True}


def graphs_only(record: Mapping[str, Any]) -> bool:
    """Whether a model record declares graphs only (neuron_model `graphs_only = True`)."""
    return record.get("weights") == GRAPHS_ONLY
_MAX_INDEX_BYTES = 64 << 20


# Entries in these modules are wrappers neuronbuild ships (e.g. hf_causal_lm's graphs): imported from the installed
# neuronbuild, fingerprinted by the module file's digest, no workspace sources needed.
BUILTIN_PREFIX = "neuronbuild.toolchains."


def is_builtin(entry: str) -> bool:
    return entry.startswith(BUILTIN_PREFIX)


def _check(a: Mapping[str, Any]) -> None:
    if not ENTRY_RE.match(a["entry"]):
        raise AttrError("attribute 'entry' must look like 'module:function' (e.g. 'llama:build_model')")
    entries = [a["entry"], *(g["entry"] for g in (a.get("graphs") or {}).values() if "entry" in g)]
    if a["srcs"] or not all(is_builtin(e) for e in entries):
        py_library.check_srcs(a)  # (srcs may be empty when every entry is a wrapper neuronbuild ships)
    for name, g in (a.get("graphs") or {}).items():
        inputs = g.get("inputs") or a["inputs"]
        outputs = g.get("outputs") or a["outputs"]
        for out, inp in (g.get("aliases") or {}).items():
            if inp not in inputs:
                raise AttrError(f"attribute 'graphs': graph '{name}' aliases output '{out}' to '{inp}', which is not "
                                f"one of its inputs ({', '.join(inputs)})")
            if outputs and out not in outputs:
                raise AttrError(f"attribute 'graphs': graph '{name}' aliases '{out}', which is not one of its "
                                f"outputs ({', '.join(outputs)})")
    if a.get("graphs_only") and a.get("weights"):
        raise AttrError("attribute 'graphs_only': a graphs-only model declares no `weights` (give the checkpoint to a "
                        "model_weights target instead)")
    for pattern, dim in (a.get("tp_plan") or {}).items():
        if not pattern or not isinstance(dim, int) or isinstance(dim, bool) or dim < 0:
            raise AttrError(f"attribute 'tp_plan': {pattern!r}: want a parameter name pattern -> a dim (an int >= 0), "
                            f"got {dim!r}")
    all_inputs = dict(a["inputs"])
    for g in (a.get("graphs") or {}).values():
        all_inputs.update(g.get("inputs") or {})  # ranges may name any graph family's inputs
    for name in a["input_ranges"]:
        if name not in all_inputs:
            raise AttrError(f"attribute 'input_ranges': '{name}' is not an input (inputs: {', '.join(all_inputs)})")
        dtype = parse_input_spec(all_inputs[name])[0]
        if dtype.startswith("float") or dtype.startswith("bfloat") or dtype == "bool":
            raise AttrError(f"attribute 'input_ranges': input '{name}' is {dtype}, not an integer input")


SCHEMA = RuleSchema(
    "neuron_model",
    "A torch model: a module factory in Python sources, its config and optional weights.",
    (
        NAME,
        Attr("srcs", LABEL_LIST, "Python sources of the model (files in this package); may be empty when every "
             "entry is a wrapper neuronbuild ships (neuronbuild.toolchains.*).", default=(), kinds=("file",),
             own_package=True),
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
        Attr("weights", WEIGHTS, "Optional safetensors weights: one file, a list of shards, or an HF "
             "'*.safetensors.index.json' (its shards are found next to it); without it the factory's seeded init is "
             "used. Tied weights may be absent from the files.", kinds=("file",)),
        Attr("graphs_only", BOOL, "True: the model's compiles build graphs only, from the config and shapes: no "
             "checkpoint is read or needed, no weights action runs and none ships beside the graphs; a model_weights "
             "target (built where the checkpoint lives) supplies the weights in a neuron_bundle. False (default): "
             "`weights`, else the factory's seeded initialisation, ship with every compile.", default=False),
        Attr("quantization", DICT, "Weight-only quantization of the module's nn.Linear layers (docs/quantization.md): "
             "{\"dtype\": int8 | float8_e4m3 | float8_e5m2, \"scheme\": per_tensor | per_channel (default) | "
             "blockwise, \"block_size\", \"modules_to_not_convert\": [name patterns]}; the weights action quantizes "
             "the checkpoint. Reaches the factory's config as its \"quantization\" key.", default={}),
        Attr("weights_prefix", STRING, "A prefix the weight files' keys carry and the module's do not (e.g. "
             "'model.'); stripped before loading.", default=""),
        Attr("data", LABEL_LIST, "Non-Python files the model reads (config.json, tokenizer files), placed in the "
             "sandbox at their workspace paths (read them relative to the module's __file__).", default=(),
             kinds=("file",)),
        Attr("deps", LABEL_LIST, "neuron_py_library targets the sources import (by workspace path).", default=(),
             kinds=("neuron_py_library",)),
        Attr("seed", INT, "torch.manual_seed value used before calling the factory.", default=0),
        Attr("tp_plan", DICT, "Tensor-parallel sharding plan, used by a neuron_compile with tp_degree > 1: parameter "
             "name pattern (fnmatch, e.g. 'blocks.*.up.*') -> the dim each rank holds 1/tp_degree of; unmatched "
             "parameters are replicated. An nn.Linear weight split along dim 1 (row-parallel) is followed by an "
             "all-reduce; any other layout must suit the model's code (validate checks it). Default: none (the "
             "model is not sharded).", default={}),
        Attr("graphs", GRAPHS, "Optional graph families sharing the weights, e.g. {'context': {}, 'token': {'entry': "
             "..., 'inputs': {...}, 'outputs': {...}, 'aliases': {'kv': 'kv'}}}; entry/inputs/outputs default to the "
             "model's own; aliases map an output to the input it updates (state fed back between calls); config: keys "
             "merged over the model's config for that graph alone.",
             default={}),
        TAGS,
    ),
    _check,
)


def _config_with_quantization(ctx: AnalysisContext, model: Target) -> dict[str, Any]:
    """The factory's config, with the `quantization` attribute checked and normalised as its "quantization" key
    (where hf_causal_lm's macro puts its own)."""
    config = dict(model.attrs["config"])
    raw = model.attrs.get("quantization")
    if not raw:
        return config
    from neuronbuild.analysis.quantization import normalize

    if "quantization" in config:
        raise UserInputError(f"{model.label}: quantization is given twice: as an attribute and as a config key",
                             locate(ctx.graph, model, "quantization"))
    try:
        return config | {"quantization": normalize(raw)}
    except ValueError as e:
        raise UserInputError(f"{model.label}: {e}", locate(ctx.graph, model, "quantization")) from None


def analyze(ctx: AnalysisContext, model: Target) -> ModelInfo:
    """The model's canonical record: sources and weights by workspace-relative path and content digest."""
    root = ctx.graph.root
    problem = config_problem(str(model.attrs["entry"]), model.attrs["config"])
    if problem is not None:  # (an hf_causal_lm's misspelt model_type, ...: at its BUILD line, before any action)
        raise UserInputError(f"{model.label}: {problem}", locate(ctx.graph, model))
    srcs = {lbl.path: digest_file(root / lbl.path) for lbl in model.attrs["srcs"]}
    files = [FileInput(lbl.path, srcs[lbl.path]) for lbl in model.attrs["srcs"]]
    weights = (weights_record(ctx, model, files) if model.attrs.get("weights")
               else dict(GRAPHS_ONLY) if model.attrs.get("graphs_only") else None)
    data = {lbl.path: digest_file(root / lbl.path) for lbl in model.attrs["data"]}
    files += [FileInput(lbl.path, data[lbl.path]) for lbl in model.attrs["data"]]
    lib_srcs, lib_files = py_library.collect(ctx, tuple(model.attrs["deps"]))
    files.extend(f for f in lib_files if f.path not in srcs)
    consts: Mapping[str, int] = model.attrs["dims"]

    def specs(declared: Mapping[str, str]) -> list[list[Any]]:
        # An ordered list of [name, spec] pairs: input order is positional, so it enters the fingerprint (a dict's
        # keys would be sorted by canonical JSON). Named constants are resolved to their sizes.
        return [[k, {"dtype": dt, "dims": [consts.get(d, d) if isinstance(d, str) else d for d in ds]}]
                for k, (dt, ds) in ((k, parse_input_spec(v)) for k, v in declared.items())]

    inputs = specs(model.attrs["inputs"])
    dims = tuple(dict.fromkeys(d for _k, spec in inputs for d in spec["dims"] if isinstance(d, str)))
    outputs = specs(model.attrs["outputs"])
    record: dict[str, Any] = {
        "package": model.label.package,
        "srcs": srcs,
        "entry": model.attrs["entry"],
        "config": _config_with_quantization(ctx, model),
        "weights": weights,
        "seed": model.attrs["seed"],
        "inputs": inputs,
    }
    if outputs:
        record["outputs"] = outputs
    if data:
        record["data"] = dict(sorted(data.items()))
    if lib_srcs:
        record["deps"] = lib_srcs  # library sources by path -> digest (their directory roots go on sys.path)
    if model.attrs.get("tp_plan"):  # (absent when unset: fingerprints of unsharded models unchanged)
        record["tp_plan"] = dict(model.attrs["tp_plan"])
    if model.attrs["weights_prefix"]:
        record["weights_prefix"] = model.attrs["weights_prefix"]
    modules = _imported_modules(root, [(lbl.path, srcs[lbl.path]) for lbl in model.attrs["srcs"]] +
                                list(lib_srcs.items()))
    graphs_attr: Mapping[str, Mapping[str, Any]] = model.attrs.get("graphs") or {}
    entries = [model.attrs["entry"], *(g["entry"] for g in graphs_attr.values() if "entry" in g)]
    builtin = {e.split(":")[0] for e in entries if is_builtin(e)}
    if builtin:
        record["builtin"] = {m: _builtin_digest(m) for m in sorted(builtin)}
        modules += [m for m in _BUILTIN_IMPORTS for b in builtin if b.endswith(_BUILTIN_IMPORTS[m])]
    imports = distributions_of(list(dict.fromkeys(modules)))
    if imports:  # third-party distributions the sources import, at their installed (or what-if) versions
        record["imports"] = imports
    graphs: list[tuple[str, ModelInfo]] = []
    for name, g in graphs_attr.items():
        grec = dict(record) | {"graph": name, "entry": g.get("entry", record["entry"])}
        if "inputs" in g:
            grec["inputs"] = specs(g["inputs"])
        if "outputs" in g:
            grec["outputs"] = specs(g["outputs"])
        if g.get("aliases"):
            grec["aliases"] = dict(g["aliases"])
        if g.get("config"):  # this graph's own config keys (e.g. hf_causal_lm's speculation): its fingerprint alone
            grec["config"] = dict(record["config"]) | dict(g["config"])
            _with_fused_draft(ctx, model, name, grec)
        gdims = tuple(dict.fromkeys(d for _k, spec in grec["inputs"] for d in spec["dims"] if isinstance(d, str)))
        graphs.append((name, ModelInfo(model.label, grec, tuple(files), gdims)))
    return ModelInfo(model.label, record, tuple(files), dims, tuple(graphs))


DRAFT_KV = "draft_kv"


def fused_draft(record: Mapping[str, Any]) -> Label | None:
    """The draft model a graph's record binds (hf_causal_lm speculation with fused = True), or None."""
    spec = (record.get("config") or {}).get("speculation")
    if not isinstance(spec, Mapping) or not spec.get("fused") or not isinstance(spec.get("draft"), str):
        return None
    return parse_label(spec["draft"], "")


def _with_fused_draft(ctx: AnalysisContext, model: Target, name: str, grec: dict[str, Any]) -> None:
    """A fused speculation graph (hf_causal_lm speculation fused = True) runs the draft model inside it: the draft's
    config joins the graph's config (`speculation_draft`: its fingerprint, and the module the trace builds) and its
    cache `draft_kv` joins the graph's inputs and outputs after `kv` (aliased), as the draft's own token graph declares
    it. The draft's weights are its own weights action's file, shipped beside the graph (kinds/compile.py)."""
    draft = fused_draft(grec)
    if draft is None:
        return
    where = locate(ctx.graph, model)
    if draft not in ctx.graph.targets:
        raise UserInputError(f"{model.label}: speculation draft {draft} is not a target here (declare it in a "
                             "package this build loads)", where)
    info: ModelInfo = ctx.provider(draft)
    token = dict(info.graphs).get("token") if isinstance(info, ModelInfo) else None
    kv = dict(token.record["inputs"]).get("kv") if token is not None else None
    if token is None or kv is None or "seq_ids" not in dict(token.record["inputs"]):
        raise UserInputError(f"{model.label}: speculation draft {draft} must be an hf_causal_lm with "
                             "continuous_batching = True (the fused graph runs its token steps on its cache lines)", where)
    grec["config"] = dict(grec["config"]) | {"speculation_draft": {"config": info.record["config"]}}

    def after_kv(pairs: list[list[Any]]) -> list[list[Any]]:
        out: list[list[Any]] = []
        for k, v in pairs:
            out.append([k, v])
            if k == "kv":
                out.append([DRAFT_KV, kv])
        return out

    grec["inputs"] = after_kv(grec["inputs"])
    grec["outputs"] = after_kv(grec["outputs"])
    grec["aliases"] = dict(grec.get("aliases") or {}) | {DRAFT_KV: DRAFT_KV}


# Third-party modules a shipped wrapper imports (the wrapper is not scanned: its imports are known).
_BUILTIN_IMPORTS = {"transformers": "hf_causal_lm"}


def _builtin_digest(module: str) -> str:
    try:
        return builtin_digest(module)
    except OSError:
        raise UserInputError(f"entry module {module} is not a module neuronbuild ships") from None


def weights_record(ctx: AnalysisContext, model: Target, files: list[FileInput],
                    labels: tuple[Label, ...] | None = None) -> dict[str, Any]:
    """One file: {"path", "digest"}; shards (a list, or an HF index.json's weight_map): + "shards" [[path, digest]],
    the digest then covering every shard (and the index). `labels`: the checkpoint (default: the model's `weights`;
    a model_weights target passes its own, located at itself)."""
    root = ctx.graph.root
    if labels is None:
        labels = model.attrs["weights"]
    paths = [lbl.path for lbl in labels]
    if len(labels) == 1 and labels[0].name.endswith(".json"):
        paths = [labels[0].path, *_index_shards(ctx, model, labels[0])]
    digests = []
    for p in paths:
        if not (root / p).is_file():
            raise UserInputError(f"weights file {p} does not exist", locate(ctx.graph, model))
        d = digest_file(root / p)
        digests.append([p, d])
        files.append(FileInput(p, d))
    if len(digests) == 1:
        return {"path": digests[0][0], "digest": digests[0][1]}
    from neuronbuild.digests import fingerprint

    return {"path": paths[0], "digest": fingerprint({"shards": digests}), "shards": digests}


def _index_shards(ctx: AnalysisContext, model: Target, index: Label) -> list[str]:
    """The shard files an HF *.safetensors.index.json names (next to it), in first-use order."""

    path = ctx.graph.root / index.path
    where = locate(ctx.graph, model)
    try:
        if path.stat().st_size > _MAX_INDEX_BYTES:
            raise UserInputError(f"weights index {index.path} is larger than 64 MB", where)
        data = jsondata.loads(path.read_bytes())
    except OSError as e:
        raise UserInputError(f"cannot read weights index {index.path}: {e.strerror or e}", where) from None
    except ValueError as e:
        raise UserInputError(f"weights index {index.path} is not JSON ({e})", where) from None
    wmap = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(wmap, dict) or not wmap or not all(isinstance(v, str) for v in wmap.values()):
        raise UserInputError(f"weights index {index.path} has no 'weight_map' of key -> shard file", where)
    shards = list(dict.fromkeys(wmap.values()))
    base = index.path.rsplit("/", 1)[0] + "/" if "/" in index.path else ""
    for s in shards:
        if "/" in s or "\\" in s or s in (".", "..") or not s.endswith(".safetensors"):
            raise UserInputError(f"weights index {index.path} names a shard {s!r} that is not a .safetensors file "
                                 f"next to it", where)
    return [base + s for s in shards]


# Content digest -> top-level names a Python source imports (absolute imports): a monorepo's models often share
# sources, and parsing each copy again cost most of a 100,000-graph analysis.
_IMPORTS: dict[str, tuple[str, ...]] = {}
_IMPORTS_MAX = 100_000


def _imports_of(root: Any, path: str, digest: str) -> tuple[str, ...]:
    known = _IMPORTS.get(digest)
    if known is not None:
        return known
    try:
        data = (root / path).read_bytes()
    except OSError:
        return ()  # the trace reports it
    try:
        tree = ast.parse(data)
    except (SyntaxError, ValueError) as e:
        raise source_error(path, e) from None
    found: dict[str, None] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.setdefault(alias.name.split(".")[0], None)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.setdefault(node.module.split(".")[0], None)
    names = tuple(found)
    if len(_IMPORTS) >= _IMPORTS_MAX:
        _IMPORTS.clear()
    _IMPORTS[digest_bytes(data)] = names  # keyed by what was parsed (the file may have changed since `digest`)
    return names


def source_error(path: str, e: SyntaxError | ValueError) -> UserInputError:
    """A model source that does not parse, as one located error at analysis (before anything runs): `path:line:col`
    with the workspace-relative path, as `python` would say it (SyntaxError's offset is 1-based)."""
    if isinstance(e, SyntaxError):
        line, col = e.lineno or 1, max(1, e.offset or 1)
        what = "indentation error" if isinstance(e, IndentationError) else "syntax error"
        return UserInputError(f"{what} in a model source: {e.msg}", Location(path, line, col))
    return UserInputError(f"a model source that Python cannot read: {e}", Location(path))


def _imported_modules(root: Any, sources: list[tuple[str, str]]) -> list[str]:
    """Top-level names of the modules the sources (path, digest) import (absolute imports; the sources' own modules
    left out)."""
    local = {p.rsplit("/", 1)[-1].removesuffix(".py") for p, _d in sources}
    found: dict[str, None] = {}
    for p, d in sources:
        for name in _imports_of(root, p, d):
            found.setdefault(name, None)
    return [m for m in found if m not in local]


KIND = RuleKind(SCHEMA, analyze)
