"""Toolchains and rule kinds are plug-ins: a third toolchain, registered from a test module outside neuronbuild/,
builds real graphs end to end (planning, workers, cache, outputs), and no-op rebuilds find it cached."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import MODEL_SRC, run_cli, write_ws

PLUGIN_ENV = {"NEURONBUILD_PLUGINS": "echo_toolchain",
              "NEURONBUILD_PLUGIN_PATH": str(Path(__file__).resolve().parent / "plugins")}

BUILD = """
neuron_model(name = "tiny", srcs = ["llama.py"], entry = "llama:build_model",
             config = {"vocab": 64, "hidden": 16, "layers": 1, "heads": 2},
             inputs = {"input_ids": "int64[batch, seq]"})
neuron_buckets(name = "b", dims = {"batch": [1], "seq": [8, 16]})
neuron_target(name = "echo", platform = "echo")
neuron_compile(name = "tiny_echo", model = ":tiny", buckets = [":b"], target = ":echo")
"""


def test_a_toolchain_registered_outside_neuronbuild_builds_end_to_end(tmp_path: Path) -> None:
    ws = write_ws(tmp_path / "ws", {"m/llama.py": MODEL_SRC, "m/BUILD": BUILD})
    cache = str(tmp_path / "cache")
    proc = run_cli(["build", "--cache-dir", cache], ws, PLUGIN_ENV)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4 actions: 4 executed" in proc.stdout
    assert "Summarize //m:tiny_echo [batch=1, seq=8] for echo!" in proc.stdout + proc.stderr
    assert proc.stderr.count("echo summaries are not runnable") == 1  # the toolchain's own note, once
    out = ws / "neuronbuild-out" / "m" / "tiny_echo"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["platform"] == "echo" and manifest["artifact_format"] == "echo-summary"
    for seq in (8, 16):
        summary = json.loads((out / f"batch1_seq{seq}" / "summary.json").read_text())
        assert summary["step"] == "summarize" and summary["nodes"] > 5
        assert "aten.embedding.default" in summary["ops"]
    again = run_cli(["build", "--cache-dir", cache, "--profile", str(tmp_path / "p.json")], ws, PLUGIN_ENV)
    assert "0 executed, 4 cached" in again.stdout, again.stdout + again.stderr
    plan = run_cli(["plan", "--cache-dir", cache], ws, PLUGIN_ENV)
    assert "//m:tiny_echo  echo!" in plan.stdout and "0 to execute" in plan.stdout


def test_an_unknown_platform_names_the_registered_ones(tmp_path: Path) -> None:
    ws = write_ws(tmp_path / "ws", {"m/llama.py": MODEL_SRC, "m/BUILD": BUILD})
    proc = run_cli(["build", "--cache-dir", str(tmp_path / "cache")], ws)  # the plug-in is not registered here
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("m/BUILD:6:") and "'echo'" not in proc.stderr.split("got")[0] and "'trn2'" in \
        proc.stderr, proc.stderr
    bad = run_cli(["plan"], ws, {"NEURONBUILD_PLUGINS": "no_such_plugin_module"})
    assert bad.returncode == 2 and "no_such_plugin_module" in bad.stderr and bad.stderr.count("\n") == 1


def test_a_flag_of_a_plug_in_that_cannot_be_imported_names_the_plug_in_and_why(tmp_path: Path) -> None:
    # The plug-in declares --portable-release; broken, it declares nothing, and its flag is unknown: the one-line
    # error says which plug-in failed to import and why, not only that the flag is unrecognized.
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "broken_release.py").write_text("import no_such_dependency_of_the_plugin\n")
    ws = write_ws(tmp_path / "ws", {"m/llama.py": MODEL_SRC, "m/BUILD": BUILD})
    env = {"NEURONBUILD_PLUGINS": "broken_release", "NEURONBUILD_PLUGIN_PATH": str(plugins)}
    bad = run_cli(["plan", "--portable-release", "r2"], ws, env)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
    assert "unrecognized arguments: --portable-release" in bad.stderr, bad.stderr
    assert "plug-in broken_release" in bad.stderr and "no_such_dependency_of_the_plugin" in bad.stderr, bad.stderr


def test_a_toolchain_missing_protocol_members_is_refused_at_registration_naming_them() -> None:
    import pytest

    from neuronbuild import plugins

    class Half:
        name = "half"
        platforms = ("half",)

    with pytest.raises(TypeError, match=r"toolchain 'half' .*missing artifact_format, estimate_s, .*plan, run, "
                                        r"load_artifact$"):
        plugins.register_toolchain(Half())  # type: ignore[arg-type]
    assert "half" not in plugins.toolchains() and "half" not in plugins.platforms()


def test_a_toolchain_leaving_out_optional_capabilities_gets_their_defaults() -> None:
    """Only what the toolchain must say is required (plugin_api/toolchain.TOOLCHAIN_REQUIRED); the rest is filled
    at registration with the capability's "nothing": no warm-up, worker hooks, options or notes."""
    from neuronbuild import plugins
    from neuronbuild.plugin_api.toolchain import TOOLCHAIN_REQUIRED, StepDirs

    class Minimal:
        name, platforms, artifact_format, estimate_s, estimate_mb = "minimal", ("minimal",), "minimal-1", 1.0, 10.0

    tc = Minimal()
    for member in TOOLCHAIN_REQUIRED[5:]:
        setattr(tc, member, lambda *a: None)
    plugins.register_toolchain(tc)  # type: ignore[arg-type]  # (unregistered after the test: tests/conftest.py)
    got = plugins.toolchain_for("minimal")
    assert got is tc and got.warm_up_key({}) is None and got.step_dirs({}) == StepDirs()
    assert got.notes(None) == [] and got.host_status() == {} and got.runtime_loader == ""  # type: ignore[arg-type]
    assert got.option_warnings({"opt_level": 2}) == [] and tuple(got.option_keys) == ()


def test_a_label_attribute_declared_own_package_refuses_another_packages_file_located(tmp_path: Path) -> None:
    # neuron_model's srcs declare own_package (plugin_api/rules.Attr): the loader checks the declaration, not the kind.
    ws = write_ws(tmp_path / "ws", {"n/a.py": "x = 1\n", "n/BUILD": "",
                                    "m/BUILD": 'neuron_model(name = "tiny", srcs = ["//n:a.py"], entry = "a:b",\n'
                                               '             inputs = {"x": "float32[2]"})\n'})
    proc = run_cli(["query", "//..."], ws)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("m/BUILD:1:") and "'//n:a.py' is in package //n, not in this package (//m)" in \
        proc.stderr, proc.stderr


def test_a_runtime_loader_missing_protocol_members_is_refused_at_registration_naming_them() -> None:
    import pytest

    from neuronbuild import plugins
    from neuronbuild.runtime.loaders import loader_for

    class Half:
        format = "half-format"

    with pytest.raises(TypeError, match=r"runtime loader 'half-format' .*missing host_mismatches, load, scratch_bytes"):
        plugins.register_loader(Half())  # type: ignore[arg-type]
    assert loader_for("half-format") is None


def test_a_plug_in_that_raises_while_imported_is_one_line_and_exit_2(tmp_path: Path) -> None:
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "raising_plugin.py").write_text("import os\n\nraise RuntimeError('the plug-in needs\\nits licence')\n")
    (plugins / "exiting_plugin.py").write_text("import sys\nsys.exit(5)\n")
    ws = write_ws(tmp_path / "ws", {"m/llama.py": MODEL_SRC, "m/BUILD": BUILD})
    for name, line, what in (("raising_plugin", 3, "RuntimeError: the plug-in needs its licence"),
                             ("exiting_plugin", 2, "SystemExit: 5")):
        env = {"NEURONBUILD_PLUGINS": name, "NEURONBUILD_PLUGIN_PATH": str(plugins)}
        for cmd in (["plan"], ["build", "--cache-dir", str(tmp_path / "cache")]):
            bad = run_cli(cmd, ws, env)
            assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr, bad.stderr
            assert f"plug-in module '{name}' failed while it was imported (at {plugins / name}.py:{line}): {what}" \
                in bad.stderr, bad.stderr
