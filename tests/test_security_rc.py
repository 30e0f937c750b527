"""Workspace rc files are untrusted input too: a huge rc file or line is one located error line (exit 2) at once, not
seconds of splitting (issue #31)."""

from __future__ import annotations

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
