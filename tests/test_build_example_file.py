"""BUILD.example documents every rule and attribute, and is itself a valid BUILD file."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from helpers import REPO, write_ws

from neuronbuild.analysis.planner import plan
from neuronbuild.loading.schema import RULES
from neuronbuild.loading.target_graph import load_targets


def test_build_example_mentions_every_rule_and_attribute() -> None:
    text = (REPO / "BUILD.example").read_text()
    for kind, schema in RULES.items():
        assert re.search(rf"^{kind}\(", text, re.M), kind
        for attr in schema.attrs:
            assert re.search(rf"\b{attr.name}\s*=", text), f"{kind}.{attr.name}"


def test_build_example_loads_and_plans(tmp_path: Path) -> None:
    ws = write_ws(tmp_path / "ws", {"pkg/BUILD": (REPO / "BUILD.example").read_text(), "pkg/llama.safetensors": "",
                                    "pkg/layers.py": "", "pkg/hf.py": "", "pkg/llama/config.json": "{}",
                                    "pkg/llama/model.safetensors.index.json": "{}",
                                    "tools/defs.bzl": (REPO / "examples/tools/defs.bzl").read_text()})
    shutil.copy(REPO / "examples/models/llama.py", ws / "pkg" / "llama.py")
    graph = load_targets(ws, ["//pkg:all"])
    kinds = {t.kind for t in graph.targets.values()}
    assert kinds == set(RULES)
    ag = plan(graph)
    assert {str(c.label) for c in ag.compiles} == {"//pkg:llama_trn2", "//pkg:llama_cpu"}
