"""The neuron_buckets rule: the input shapes a graph is compiled for (a cross product of sizes, or a list)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import Any

from neuronbuild.analysis.analysis_context import AnalysisContext
from neuronbuild.analysis.providers import BucketsInfo
from neuronbuild.loading.schema import DIMS, NAME, SHAPES, TAGS
from neuronbuild.loading.targets import Target
from neuronbuild.plugin_api.rules import Attr, AttrError, RuleKind, RuleSchema

MAX_BUCKETS = 10_000  # per neuron_buckets target: far above any real bucket set, far below what exhausts a build


def _check(a: Mapping[str, Any]) -> None:
    if (a.get("dims") is None) == (a.get("shapes") is None):
        raise AttrError("exactly one of 'dims' and 'shapes' must be given")
    if a.get("dims") is not None:
        sizes = [len(v) for v in a["dims"].values()]
        n = math.prod(sizes)
        if n > MAX_BUCKETS:
            raise AttrError(f"neuron_buckets 'dims' give {n} buckets (the cross product {' x '.join(map(str, sizes))}),"
                            f" more than the limit of {MAX_BUCKETS}")
    elif len(a["shapes"]) > MAX_BUCKETS:
        raise AttrError(f"neuron_buckets 'shapes' lists {len(a['shapes'])} buckets, more than the limit of "
                        f"{MAX_BUCKETS}")


SCHEMA = RuleSchema(
    "neuron_buckets",
    "Input shapes a graph is compiled for: a cross product (dims) or an explicit list (shapes).",
    (
        NAME,
        Attr("dims", DIMS, "Dimension name -> list of sizes; the buckets are their cross product."),
        Attr("shapes", SHAPES, "Explicit list of {dimension name: size} dicts."),
        TAGS,
    ),
    _check,
)


def analyze(ctx: AnalysisContext, t: Target) -> BucketsInfo:
    dims = t.attrs.get("dims")
    if dims is None:
        return BucketsInfo(tuple(dict(s) for s in t.attrs["shapes"]))
    names = list(dims)
    return BucketsInfo(tuple(dict(zip(names, combo, strict=True)) for combo in itertools.product(*dims.values())))


KIND = RuleKind(SCHEMA, analyze)
