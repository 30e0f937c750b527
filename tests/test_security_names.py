"""Names and files that would escape their place are refused at load time, with a location."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import run_cli, write_ws

MODEL = 'neuron_model(name = "m", srcs = ["m.py"], entry = "m:build", inputs = {"x": "float32[b]"})\n'
REST = ('neuron_buckets(name = "bk", shapes = [{"b": 1}])\n'
        'neuron_target(name = "t", platform = "trn2")\n')


@pytest.mark.parametrize("name,message", [
    ("..", "invalid target name '..'"),
    (".", "invalid target name '.'"),
    ("x" * 300, "300 characters long (the limit is 200)"),
])
def test_bad_target_names_are_refused_at_load_time(tmp_path: Path, name: str, message: str) -> None:
    build = MODEL + REST + f'neuron_compile(name = "{name}", model = ":m", buckets = [":bk"], target = ":t")\n'
    ws = write_ws(tmp_path / "ws", {"BUILD": build, "m.py": "def build(c):\n    pass\n"})
    proc = run_cli(["build", "//:all", "--cache-dir", str(tmp_path / "cache")], ws)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("BUILD:4:") and message in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1
    assert not (ws / "manifest.json").exists() and not (ws / "neuronbuild-out").exists()


def test_srcs_from_another_package_are_refused_with_a_location(tmp_path: Path) -> None:
    build = ('\n\nneuron_model(name = "m", srcs = ["//other:m.py"], entry = "m:build", '
             'inputs = {"x": "float32[b]"})\n')
    ws = write_ws(tmp_path / "ws", {"pkg/BUILD": build, "other/BUILD": "", "other/m.py": ""})
    proc = run_cli(["build", "//pkg:all", "--cache-dir", str(tmp_path / "cache")], ws)
    assert proc.returncode == 2
    assert proc.stderr.startswith("pkg/BUILD:3:") and "error: attribute 'srcs': '//other:m.py' is in package //other" in proc.stderr, proc.stderr


def test_symlinked_build_and_bzl_files_outside_the_workspace_are_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "BUILD").write_text(REST)
    (outside / "defs.bzl").write_text("X = 1\n")
    ws = write_ws(tmp_path / "ws", {"b/BUILD": 'load(":defs.bzl", "X")\n' + REST})
    (ws / "a").mkdir()
    (ws / "a" / "BUILD").symlink_to(outside / "BUILD")
    (ws / "b" / "defs.bzl").symlink_to(outside / "defs.bzl")
    proc = run_cli(["build", "//a:all", "--cache-dir", str(tmp_path / "cache")], ws)
    assert proc.returncode == 2 and "a/BUILD points outside the workspace" in proc.stderr, proc.stderr
    proc = run_cli(["build", "//b:all", "--cache-dir", str(tmp_path / "cache")], ws)
    assert proc.returncode == 2 and "b/defs.bzl points outside the workspace" in proc.stderr, proc.stderr
    assert proc.stderr.startswith("b/BUILD:1:")
    # Inside the workspace, symlinks are fine.
    (ws / "c").mkdir()
    (ws / "c" / "BUILD").symlink_to(ws / "b" / "BUILD")
    (ws / "b" / "defs.bzl").unlink()
    (ws / "b" / "defs.bzl").write_text("X = 1\n")
    (ws / "c" / "defs.bzl").symlink_to(ws / "b" / "defs.bzl")
    ok = run_cli(["build", "//c:all", "--cache-dir", str(tmp_path / "cache")], ws)
    assert ok.returncode == 0, ok.stderr
