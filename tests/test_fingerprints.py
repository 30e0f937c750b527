"""Fingerprints cover what changes an output and nothing else: no absolute paths, no ambient environment."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import copy_example

from neuronbuild import platforms
from neuronbuild.analysis.planner import plan
from neuronbuild.cache.local import resolve_cache_dir
from neuronbuild.command import Command
from neuronbuild.loading.target_graph import load_targets


def _fps(ws: Path) -> dict[str, str]:
    ag = plan(load_targets(ws, ["//..."]))
    return {a.describe(): fp for fp, a in ag.actions.items()}


def test_same_example_at_two_paths_has_identical_fingerprints(tmp_path: Path) -> None:
    a = copy_example(tmp_path / "one" / "ws")
    b = copy_example(tmp_path / "elsewhere" / "deeper" / "checkout")
    fa, fb = _fps(a), _fps(b)
    assert len(fa) == 20  # 2 weights actions, 5 traces (4 llama graphs + llama_tiny), 4 trn2 lowerings, 4 trn2 + 5 cpu compiles
    assert fa == fb
    ag = plan(load_targets(a, ["//..."]))
    for action in ag.actions.values():
        assert str(tmp_path) not in repr(action.record) and str(tmp_path) not in repr(action.spec)


def test_ambient_environment_does_not_change_fingerprints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ws = copy_example(tmp_path / "ws")
    before = _fps(ws)
    monkeypatch.setenv("HOME", "/somewhere/else")
    monkeypatch.setenv("USER", "someone")
    monkeypatch.setenv("TORCHINDUCTOR_FOO", "1")
    monkeypatch.setenv("NEURON_CC_FLAGS", "--bar")
    assert _fps(ws) == before


def test_native_isa_is_resolved_into_the_fingerprint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ws = copy_example(tmp_path / "ws")
    base = _fps(ws)
    monkeypatch.setenv(platforms.HOST_ISA_ENV, "x86-64-v2")
    with Command.batch([]).active():  # a new command: the facts of its environment learnt afresh (envvars.fact)
        other = _fps(ws)
    changed = {k for k in base if base[k] != other.get(k)}
    assert changed == {k for k in base if k.startswith("Compile") and "/cpu/" in k.replace(" for cpu/", "/cpu/")}
    assert any("x86-64-v2" in k for k in other)


def test_weights_content_enters_the_fingerprint(tmp_path: Path) -> None:
    ws = copy_example(tmp_path / "ws")
    before = _fps(ws)
    w = ws / "models" / "llama_tiny.safetensors"
    data = bytearray(w.read_bytes())
    data[-1] ^= 0xFF
    w.write_bytes(bytes(data))
    os.utime(w, ns=(1, 1))
    after = _fps(ws)
    changed = {k for k in before if before[k] != after[k]}
    # the weights action only: traces and Lowers work on shapes, and compiles never read the weights file (it ships
    # beside their outputs)
    assert changed == {k for k in before if "llama_tiny" in k and k.startswith("Weights")} and changed


def test_cache_dir_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEURONBUILD_CACHE_DIR", str(tmp_path / "env"))
    assert resolve_cache_dir(str(tmp_path / "flag")) == tmp_path / "flag"
    assert resolve_cache_dir(None) == tmp_path / "env"
    monkeypatch.delenv("NEURONBUILD_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert resolve_cache_dir(None) == tmp_path / "xdg" / "neuronbuild"


def test_canonical_json_is_exactly_json_dumps_canonical_form() -> None:
    """Fingerprints must not move when the encoder is made faster: canonical_json writes exactly the bytes of
    json.dumps(sort_keys, compact separators, ASCII, no NaN) for records of every shape, and refuses what it refuses."""
    import json
    import math
    import random

    from neuronbuild.digests import canonical_json

    rng = random.Random(1234)
    atoms = [0, -7, 2**70, 1.5, -0.0, 1e-300, 3.141592653589793, True, False, None, "", "plain", "é ü", "tab\t\"q\"\\",
             "\u2603 snow", "\U0001f600", "\x00nul"]

    def value(depth: int) -> object:
        r = rng.random()
        if depth > 3 or r < 0.5:
            return rng.choice(atoms)
        if r < 0.75:
            return [value(depth + 1) for _ in range(rng.randrange(4))]
        keys = rng.sample(["z", "a", "m", "B", "é", "10", "9", "", "_"], rng.randrange(6))
        return {k: value(depth + 1) for k in keys}

    for _ in range(2000):
        rec = {k: value(0) for k in rng.sample(["trace", "action", "format", "toolchain", "bucket", "x"], 4)}
        want = json.dumps(rec, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()
        assert canonical_json(rec) == want
    assert canonical_json({"b": {2: 1, 1: [True]}, "a": ()}) == b'{"a":[],"b":{"1":[true],"2":1}}'
    for bad in (math.nan, math.inf):
        with pytest.raises(ValueError):
            canonical_json({"x": bad})
    with pytest.raises(TypeError):
        canonical_json({"x": object()})
    with pytest.raises(TypeError):
        canonical_json({"x": {1: 1, "a": 2}})  # unorderable keys, as json.dumps with sort_keys
