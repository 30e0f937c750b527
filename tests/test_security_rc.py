"""Workspace rc files are untrusted input too: a huge rc file or line is one located error line (exit 2) at once, not
seconds of splitting (issue #31)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_cli, write_ws

from neuronbuild.rcfile import MAX_RC_BYTES, MAX_RC_LINE


@pytest.mark.parametrize("shape", ["line", "file"])
def test_an_oversized_rc_file_or_line_is_one_located_error(tmp_path: Path, shape: str) -> None:
    ws = write_ws(tmp_path / "ws", {"pkg/BUILD": 'neuron_target(name = "t", platform = "trn2")\n'})
    if shape == "line":  # valid flags, 90 KB of them
        (ws / ".neuronbuildrc").write_text("build" + " --jobs 4" * 10_000 + "\n")
        expected = f"{ws / '.neuronbuildrc'}:1: error: the line is longer than {MAX_RC_LINE >> 10} KiB"
    else:
        (ws / ".neuronbuildrc").write_text("build --jobs 4\n" * (MAX_RC_BYTES // 10))
        expected = f"{ws / '.neuronbuildrc'}: error: the rc file is larger than {MAX_RC_BYTES >> 10} KiB"
    proc = run_cli(["plan", "//pkg:all", "--cache-dir", str(tmp_path / "cache")], ws,
                   env={"HOME": str(tmp_path / "home")})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == expected


def _plan_jobs(ws: Path, tmp_path: Path, startup: list[str]) -> int:
    proc = run_cli([*startup, "plan", "--output", "json", "//pkg:all", "--cache-dir", str(tmp_path / "cache")], ws,
                   env={"HOME": str(tmp_path / "home")})
    assert proc.returncode == 0, proc.stderr
    return int(json.loads(proc.stdout)["estimate"]["jobs"])


@pytest.mark.parametrize("startup", [["--batch"], ["--batch", "--max-idle-secs", "60"],
                                     ["--output-user-root=OUR", "--batch", "-C", "."]])
def test_rc_files_apply_when_startup_options_precede_the_command(tmp_path: Path, startup: list[str]) -> None:
    ws = write_ws(tmp_path / "ws", {"pkg/BUILD": 'neuron_target(name = "t", platform = "trn2")\n'})
    (ws / ".neuronbuildrc").write_text("build --jobs 5\n")
    startup = [w.replace("OUR", str(tmp_path / "our")) for w in startup]
    assert _plan_jobs(ws, tmp_path, startup) == 5
    assert _plan_jobs(ws, tmp_path, ["--norc", *startup]) != 5  # (the control: the rc's value, not a default)


def test_a_workspace_rc_setting_a_tool_or_endpoint_is_named_on_stderr_once(tmp_path: Path) -> None:
    ws = write_ws(tmp_path / "ws", {"pkg/BUILD": 'neuron_target(name = "t", platform = "trn2")\n'})
    ran = tmp_path / "ran"
    for cc in (ws / "tools" / "cc.sh", tmp_path / "other-cc"):  # a stand-in neuronx-cc: it only tells its version
        cc.parent.mkdir(exist_ok=True)
        cc.write_text(f"#!/bin/sh\necho \"$0\" >> {ran}\necho 'NeuronX Compiler version 2.0.0'\n")
        cc.chmod(0o755)
    rc = ws / ".neuronbuildrc"
    rc.write_text("build --jobs 2\nbuild --neuronx-cc tools/cc.sh --s3-endpoint-url http://127.0.0.1:9\n")
    home = tmp_path / "home"
    home.mkdir()
    (home / ".neuronbuildrc").write_text("build --remote-cache /srv/team-cache\n")  # the user's own: no note
    env = {"HOME": str(home), "NEURONBUILD_OUTPUT_USER_ROOT": str(tmp_path / "our")}

    def plan(*flags: str, code: int = 0) -> list[str]:
        proc = run_cli(["plan", "//pkg:all", "--cache-dir", str(tmp_path / "cache"), *flags], ws, env=env)
        assert proc.returncode == code, proc.stderr
        return [ln for ln in proc.stderr.splitlines() if ln.startswith("neuronbuild: note:") or "error:" in ln]

    # A program a cloned workspace's rc file chooses is not run, not even its --version, until the user allows it.
    refused = f"{rc}:2: error: a workspace rc file sets --neuronx-cc 'tools/cc.sh': the neuronx-cc program the build runs"
    got = plan(code=2)
    assert len(got) == 1 and got[0].startswith(refused) and "--trust-workspace-rc once" in got[0], got
    rc.write_text(rc.read_text() + "build --trust-workspace-rc\n")  # a workspace cannot consent for the user
    assert plan(code=2)[0].startswith(refused) and not ran.exists()
    rc.write_text("build --jobs 2\nbuild --neuronx-cc tools/cc.sh --s3-endpoint-url http://127.0.0.1:9\n")
    assert plan("--trust-workspace-rc") == [
        f"neuronbuild: note: {rc}:2 (a workspace rc file) sets --neuronx-cc 'tools/cc.sh': the neuronx-cc program "
        "the build runs",
        f"neuronbuild: note: {rc}:2 (a workspace rc file) sets --s3-endpoint-url 'http://127.0.0.1:9': the S3 "
        "endpoint results are read from and uploaded to"]
    assert ran.read_text().split() == [str(ws / "tools" / "cc.sh")]
    assert plan() == []  # once: the user has been told, and consented to that value
    rc.write_text(f"build --neuronx-cc {tmp_path / 'other-cc'} --s3-endpoint-url http://127.0.0.1:9\n")
    assert plan(code=2)[0].startswith(f"{rc}:1: error: a workspace rc file sets --neuronx-cc")  # a new value: ask
    (home / ".neuronbuildrc").write_text("build --trust-workspace-rc\n")  # the user's own rc may consent
    assert plan() == [f"neuronbuild: note: {rc}:1 (a workspace rc file) sets --neuronx-cc '{tmp_path / 'other-cc'}':"
                      " the neuronx-cc program the build runs"]  # a changed value is new
    # The record is the user's, not the workspace's: a workspace cannot pre-mark its settings as seen.
    assert not any(p.name == "rc-notices" for p in ws.rglob("*"))
