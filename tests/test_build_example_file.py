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


def test_build_example_says_at_its_top_every_file_it_needs() -> None:
    """Copied alone, BUILD.example cannot build: its opening comment names every file and .bzl it refers to, and
    points to `neuronbuild init` for a workspace that builds as it is."""
    text = (REPO / "BUILD.example").read_text()
    top = "\n".join(ln for ln in text.split("\n\n", 1)[0].splitlines() if ln.startswith("#"))
    assert "neuronbuild init" in top
    referenced = set(re.findall(r'(?:srcs|weights|data) = \[?"([\w./-]+\.(?:py|safetensors|json))"', text))
    referenced |= set(re.findall(r'^load\("(//[\w/]+:[\w.]+)"', text, re.M))
    assert {"llama.py", "hf.py", "layers.py", "//tools:defs.bzl", "llama/config.json"} <= referenced
    for name in referenced:
        assert name in top, name
