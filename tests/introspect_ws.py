"""A tiny trn2-only workspace (traces and lowerings take seconds) for the explain, plan and neuronx-cc tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import MODEL_SRC, run_cli, write_ws

REPO = Path(__file__).resolve().parent.parent
STANDIN = REPO / "tests" / "standins" / "neuronx-cc"


def tiny_ws(root: Path, seqs: tuple[int, ...] = (8, 16), opt_level: int = 2) -> Path:
    return write_ws(root, {
        "m/llama.py": MODEL_SRC,
        "m/BUILD": f"""
neuron_model(name = "tiny", srcs = ["llama.py"], entry = "llama:build_model",
             config = {{"vocab": 64, "hidden": 16, "layers": 1, "heads": 2}},
             inputs = {{"input_ids": "int64[batch, seq]"}})
neuron_buckets(name = "b", dims = {{"batch": [1], "seq": {list(seqs)}}})
neuron_target(name = "trn2", platform = "trn2")
compiler_options(name = "opts", opt_level = {opt_level}, model_type = "transformer")
neuron_compile(name = "tiny_trn2", model = ":tiny", buckets = [":b"], target = ":trn2", options = ":opts")
""",
    })


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, (old, path)
    path.write_text(text.replace(old, new))


def cli_json(args: list[str], ws: Path, env: dict[str, str] | None = None) -> dict:  # type: ignore[type-arg]
    proc = run_cli([*args, "--output", "json"], ws, env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


def copy_ws(ws: Path, dest: Path) -> Path:
    shutil.copytree(ws, dest, ignore=shutil.ignore_patterns("neuronbuild-out"))
    return dest


@pytest.fixture(scope="session", name="tiny_built")
def tiny_built_fixture(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny workspace built once into its own cache (its weights action, 2 traces, 2 lowerings, 2 trn2
    compiles); tests never modify either
    (copy the workspace to edit it, copy the cache to build into it)."""
    base = tmp_path_factory.mktemp("tiny")
    ws, cache = tiny_ws(base / "ws"), base / "cache"
    proc = run_cli(["build", "--jobs", "2", "--cache-dir", str(cache)], ws, {"NEURONX_CC": ""})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "7 actions: 7 executed, 0 cached" in proc.stdout
    return ws, cache
