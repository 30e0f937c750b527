"""The model_weights rule (#51): a model's weights for one layout, built where the checkpoint lives, apart from its
graphs. It references the model declaration (its sources, config, dtype and quantization decide the state's names,
dtypes and shapes) and names the checkpoint; `tp_degree` picks the layout (one file, or one shard per rank). Its one
action is the model's weights action (the same record, so the same fingerprint, as a compile of the model with that
checkpoint would plan). A neuron_bundle ships it with graphs built without weights (`weights`), and deploy checks the
pair (runtime/verified.py `weights_mismatch`)."""

from __future__ import annotations

from dataclasses import dataclass

from neuronbuild.analysis import tensor_parallel
from neuronbuild.analysis.analysis_context import AnalysisContext
from neuronbuild.analysis.providers import ModelInfo
from neuronbuild.errors import UserInputError
from neuronbuild.kinds.model import WEIGHTS, graphs_only, weights_record
from neuronbuild.loading.labels import Label
from neuronbuild.loading.schema import INT, LABEL, NAME, STRING, TAGS
from neuronbuild.loading.target_graph import locate
from neuronbuild.loading.targets import Target
from neuronbuild.plugin_api.rules import Attr, RuleKind, RuleSchema

SCHEMA = RuleSchema(
    "model_weights",
    "A model's weights for one layout (dtype, quantization: the model's; tp_degree), streamed from a checkpoint "
    "apart from its graphs; a neuron_bundle combines it with graphs built without weights.",
    (
        NAME,
        Attr("model", LABEL, "The neuron_model (or hf_causal_lm) whose weights these are: its sources, config, dtype "
             "and quantization decide the names, dtypes and shapes.", required=True, kinds=("neuron_model",)),
        Attr("weights", WEIGHTS, "The checkpoint: one .safetensors file, a list of shards, or an HF "
             "'*.safetensors.index.json'. Default: the model's own `weights` (required when the model declares graphs "
             "only).", kinds=("file",)),
        Attr("weights_prefix", STRING, "A prefix the checkpoint's keys carry and the module's do not (default: the "
             "model's `weights_prefix`).", default=""),
        Attr("tp_degree", INT, "The layout: 1 writes one constants.safetensors; N > 1 one shard per rank "
             "(rank_<r>.safetensors), for graphs compiled with the same tp_degree.", default=1),
        TAGS,
    ),
)


@dataclass(frozen=True)
class WeightsTarget:
    """A model_weights target's provider: its weights action and what it was made for."""

    label: Label
    model: Label
    tp_degree: int
    action: str  # the weights action's fingerprint
    outputs: tuple[str, ...] = ()  # constants.safetensors, or rank_<r>.safetensors per rank


def analyze(ctx: AnalysisContext, t: Target) -> WeightsTarget:
    model: ModelInfo = ctx.provider(t.attrs["model"])
    where = locate(ctx.graph, t)
    tp = int(t.attrs["tp_degree"])
    if tp < 1:
        raise UserInputError(f"attribute 'tp_degree' must be a positive int, got {tp}", locate(ctx.graph, t, "tp_degree"))
    record = dict(model.record)
    files = list(model.files)
    labels = t.attrs.get("weights")
    if labels:
        own = record.get("weights") or {}
        paths = {str(p) for p, _d in own.get("shards") or ()} | ({str(own["path"])} if own.get("path") else set())
        files = [f for f in files if f.path not in paths]  # (the model's own checkpoint, replaced by this one)
        record["weights"] = weights_record(ctx, t, files, tuple(labels))
        prefix = t.attrs["weights_prefix"] or record.get("weights_prefix") or ""
        record.pop("weights_prefix", None)
        if prefix:
            record["weights_prefix"] = prefix
    elif graphs_only(record):
        raise UserInputError(f"{t.attrs['model']} declares graphs only (no checkpoint): give this target the "
                             f"checkpoint in `weights`", where)
    elif t.attrs["weights_prefix"]:
        record["weights_prefix"] = t.attrs["weights_prefix"]
    if tp > 1:  # the model-structure checks a compile at this degree makes (heads, kv heads, widths it divides)
        problem = tensor_parallel.check(record, "", tp, (tp,))  # (the degrees a platform accepts: its compile's)
        if problem:
            raise UserInputError(f"{t.label}: {problem}", where)
    info = ModelInfo(model.label, record, tuple(files), model.dims)
    action = ctx.add(ctx.weights(info, tp))
    return WeightsTarget(t.label, model.label, tp, action.fingerprint, tuple(action.outputs))


KIND = RuleKind(SCHEMA, analyze, plans_actions=True)
