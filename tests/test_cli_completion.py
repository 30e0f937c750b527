"""Shell completion: the scripts `neuronbuild completion bash|zsh` generates, exercised by running bash with the bash
script as the shell would (COMP_LINE/COMP_POINT, then the completion function), against the example workspace."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, run_cli

EXAMPLES = REPO / "examples"


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The generated bash script, and a bin dir whose `neuronbuild` runs this checkout's CLI (as installed)."""
    d = tmp_path_factory.mktemp("completion")
    proc = run_cli(["completion", "bash"], REPO)
    assert proc.returncode == 0, proc.stderr
    (d / "nb.bash").write_text(proc.stdout)
    bindir = d / "bin"
    bindir.mkdir()
    exe = bindir / "neuronbuild"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} -m neuronbuild \"$@\"\n")
    exe.chmod(0o755)
    return d / "nb.bash", bindir


def complete(script: tuple[Path, Path], line: str, cwd: Path = EXAMPLES) -> list[str]:
    path, bindir = script
    driver = (f'source {path}\nCOMP_LINE="$1"; COMP_POINT=${{#COMP_LINE}}\n_neuronbuild\n'
              'printf "%s\\n" "${COMPREPLY[@]}"\n')
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(["bash", "-c", driver, "bash", line], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    return [w for w in proc.stdout.splitlines() if w]


def test_commands_and_nested_commands(script: tuple[Path, Path]) -> None:
    from neuronbuild.cli import make_parser
    from neuronbuild.completion import command_specs

    commands = [s.name for s in command_specs(make_parser()[0])[1:] if " " not in s.name]
    assert {"build", "plan", "query", "cache", "clean", "completion"} <= set(commands)
    assert complete(script, "neuronbuild ") == commands
    assert complete(script, "neuronbuild c") == ["cache", "clean", "completion"]
    assert complete(script, "neuronbuild -C examples pl") == ["plan"]
    assert complete(script, "neuronbuild cache ") == ["verify", "gc", "stats", "pin", "unpin"]
    assert complete(script, "neuronbuild completion ") == ["bash", "zsh", "fish"]


def test_flags_and_their_values(script: tuple[Path, Path]) -> None:
    assert complete(script, "neuronbuild build --keep") == ["--keep-going"]
    assert complete(script, "neuronbuild cache gc --max-") == ["--max-size", "--max-age"]
    assert "--max-size" not in complete(script, "neuronbuild cache stats --")
    assert complete(script, "neuronbuild build --executor ") == ["local", "dask", "dask-local"]
    assert complete(script, "neuronbuild query x --output ") == ["label", "json", "graph"]
    assert complete(script, "neuronbuild --") == ["--help", "--norc", "--version", "--batch", "--max-idle-secs",
                                                  "--output-user-root"]
    # A file-valued flag completes file names.
    assert complete(script, "neuronbuild build --profile mod") == ["models"]


def test_target_labels(script: tuple[Path, Path]) -> None:
    # bash completes the word after the last ':' (COMP_WORDBREAKS), so candidates come without "//models:".
    assert complete(script, "neuronbuild build //models:llama_") == [
        "llama_cpu", "llama_tiny", "llama_tiny_cpu", "llama_trn2", "llama_trn2_tp2"]
    assert complete(script, "neuronbuild build //t") == ["//tools/...", "//tools:"]
    assert "//models/..." in complete(script, "neuronbuild plan ")
    assert complete(script, "neuronbuild validate :rel", EXAMPLES / "models") == ["release", "release_cpu"]
    # Outside a workspace there is nothing to offer, and nothing goes wrong.
    assert complete(script, "neuronbuild build //", Path("/")) == []


def test_every_flag_of_every_command_is_in_the_script(script: tuple[Path, Path]) -> None:
    from neuronbuild.cli import make_parser
    from neuronbuild.completion import command_specs

    text = script[0].read_text()
    parser, _ = make_parser()
    for spec in command_specs(parser):
        for flag in spec.flags:
            assert flag in text, (spec.name, flag)


@pytest.mark.skipif(shutil.which("zsh") is None, reason="zsh is not installed here")
def test_zsh_script_parses() -> None:
    proc = run_cli(["completion", "zsh"], REPO)
    check = subprocess.run(["zsh", "-n"], input=proc.stdout, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr


def test_zsh_script_is_generated_from_the_same_definition() -> None:
    proc = run_cli(["completion", "zsh"], REPO)
    assert proc.returncode == 0 and proc.stdout.startswith("#compdef neuronbuild\n")
    for line in ("'build:build targets (default //...)'", "_nb_flags[build]=", "_nb_subs[cache]="):
        assert line in proc.stdout, line
    bad = run_cli(["completion", "tcsh"], REPO)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1


def _fish_lines(text: str, key: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith(f"complete -c neuronbuild -n '__nb_key_is {key}' ")]


def test_fish_script_is_generated_from_the_same_definition() -> None:
    """Without fish: the generated `complete` lines, per command, are those of the CLI definition."""
    proc = run_cli(["completion", "fish"], REPO)
    assert proc.returncode == 0 and proc.stdout.startswith("# fish completion for neuronbuild")
    gc = " ".join(_fish_lines(proc.stdout, "cache:gc"))
    assert "-l max-size -r" in gc and "-l cache-dir -r -F" in gc and "neuronx-cc" not in gc
    assert "-l executor -r -f -a 'local dask dask-local'" in " ".join(_fish_lines(proc.stdout, "build"))
    top = _fish_lines(proc.stdout, "-")
    assert any("-a 'init' -d " in ln for ln in top) and any("-a 'build' -d 'build targets" in ln for ln in top)


@pytest.mark.skipif(shutil.which("fish") is None, reason="fish is not installed here")
def test_fish_completes_commands_flags_and_labels(script: tuple[Path, Path], tmp_path: Path) -> None:
    path = tmp_path / "nb.fish"
    path.write_text(run_cli(["completion", "fish"], REPO).stdout)
    env = {**os.environ, "PATH": f"{script[1]}:{os.environ['PATH']}", "PYTHONPATH": str(REPO)}

    def fish(line: str) -> list[str]:
        proc = subprocess.run(["fish", "--no-config", "-c", f"source {path}; complete -C {line!r}"], cwd=EXAMPLES,
                              env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
        return [w.split("\t")[0] for w in proc.stdout.splitlines()]

    assert {"build", "cache", "init", "help", "version"} <= set(fish("neuronbuild "))
    assert fish("neuronbuild cache ") == ["gc", "pin", "stats", "unpin", "verify"]
    gc = fish("neuronbuild cache gc --")
    assert "--max-size" in gc and "--neuronx-cc" not in gc
    assert fish("neuronbuild -C x bu") == ["build"]
    assert fish("neuronbuild build --executor ") == ["dask", "dask-local", "local"]
    assert fish("neuronbuild build //models:llama_t") == ["//models:llama_tiny", "//models:llama_tiny_cpu",
                                                          "//models:llama_trn2", "//models:llama_trn2_tp2"]
