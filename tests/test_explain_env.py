"""Hermetic action environment: undeclared variables change no fingerprint; --action-env declares one (name+value)."""

from __future__ import annotations

import os
from pathlib import Path

from helpers import run_cli
from introspect_ws import cli_json, tiny_ws

from neuronbuild.execution.env import COMPILE_AFFECTING, action_environment, undeclared_warning


def _fps(ws: Path, cache: Path, *extra: str, env: dict[str, str] | None = None) -> dict[str, str]:
    out = cli_json(["plan", "--cache-dir", str(cache), *extra], ws, env)
    return {a["description"]: a["fingerprint"] for a in out["execute"]}


def test_undeclared_variables_change_no_fingerprint_declared_ones_do(tmp_path: Path) -> None:
    ws, cache = tiny_ws(tmp_path / "ws"), tmp_path / "cache"
    base = _fps(ws, cache)
    assert len(base) == 7  # the weights action, 2 buckets x (trace, lower, compile)
    ambient = {"HOME": str(tmp_path / "elsewhere"), "PATH": f"{tmp_path}:{os.environ.get('PATH', '')}",
               "NEURON_CC_FLAGS": "--optlevel 3", "XLA_FLAGS": "--x", "MY_VAR": "1"}
    assert _fps(ws, cache, env=ambient) == base
    one = _fps(ws, cache, "--action-env", "MY_VAR", env=ambient)
    two = _fps(ws, cache, "--action-env", "MY_VAR", env={**ambient, "MY_VAR": "2"})
    assert set(one) == set(two) == set(base)
    assert all(one[k] != base[k] and two[k] != one[k] for k in base)  # the value enters every record
    assert _fps(ws, cache, "--action-env", "MY_VAR=2") == two  # NAME=VALUE is the same declaration


def test_warns_once_about_undeclared_compile_affecting_variables(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    for k in list(os.environ):  # e.g. TORCHINDUCTOR_CACHE_DIR, left by in-process torch use in other tests
        if COMPILE_AFFECTING.match(k):
            monkeypatch.delenv(k)
    ws, cache = tiny_ws(tmp_path / "ws"), tmp_path / "cache"
    env = {"NEURON_CC_FLAGS": "--optlevel 3", "TORCHINDUCTOR_MAX_AUTOTUNE": "1", "OMP_NUM_THREADS": "3"}
    proc = run_cli(["build", "--dry-run", "--cache-dir", str(cache)], ws, env)
    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1
    assert all(n in warnings[0] for n in env) and "--action-env" in warnings[0]
    proc = run_cli(["build", "--dry-run", "--cache-dir", str(cache), "--action-env", "NEURON_CC_FLAGS",
                    "--action-env", "TORCHINDUCTOR_MAX_AUTOTUNE", "--action-env", "OMP_NUM_THREADS"], ws, env)
    assert "warning:" not in proc.stderr


def test_action_environment_is_the_allow_list_plus_declared(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("SECRET_TOKEN", "x")
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0-3")
    env = action_environment(Path("/t"), Path("/h"), (("NEURON_RT_VISIBLE_CORES", "0-3"), ("UNSET_ONE", None)))
    assert "SECRET_TOKEN" not in env and "UNSET_ONE" not in env
    assert env["NEURON_RT_VISIBLE_CORES"] == "0-3" and env["HOME"] == "/h" and env["TMPDIR"] == "/t"
    assert undeclared_warning((), {"NEURONBUILD_CACHE_DIR": "/c", "NEURONX_CC": "/x", "PATH": "/bin"}) is None
    w = undeclared_warning((("XLA_FLAGS", "1"),), {"XLA_FLAGS": "1", "NEURON_RT_LOG_LEVEL": "INFO"})
    assert w is not None and "NEURON_RT_LOG_LEVEL" in w and "XLA_FLAGS" not in w
