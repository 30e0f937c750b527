""".neuronbuildrc files (home and workspace, per-command defaults, the command line wins, one-line errors) and
`neuronbuild clean [--expunge]`, through the real CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import REPO, copy_example, run_cli


def _home(tmp_path: Path, text: str | None = None) -> dict[str, str]:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    if text is not None:
        (home / ".neuronbuildrc").write_text(text)
    return {"HOME": str(home), "NEURONBUILD_CACHE_DIR": "", "XDG_CACHE_HOME": str(tmp_path / "xdg")}


def _plan_json(ws: Path, env: dict[str, str], *args: str) -> dict:  # type: ignore[type-arg]
    proc = run_cli(["plan", "--output", "json", *args], ws, env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    return copy_example(tmp_path / "ws")


def test_rc_flags_apply_per_command_and_the_command_line_wins(built_example, ws: Path, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                             cache_dir: Path) -> None:
    env = _home(tmp_path, f"common --cache-dir {cache_dir}\nbuild --jobs 3\n")
    (ws / ".neuronbuildrc").write_text("# the workspace's defaults come after the home rc's\nbuild --jobs 5\n"
                                       "plan --jobs 2\n")
    # plan takes build's flags (so it plans what build would), then its own; the command line last.
    assert _plan_json(ws, env)["estimate"]["jobs"] == 2
    assert _plan_json(ws, env, "--jobs", "7")["estimate"]["jobs"] == 7
    (ws / ".neuronbuildrc").write_text("build --jobs 5\n")
    assert _plan_json(ws, env)["estimate"]["jobs"] == 5  # workspace rc after home rc
    (ws / ".neuronbuildrc").unlink()
    assert _plan_json(ws, env)["estimate"]["jobs"] == 3
    # `common --cache-dir` reaches every command that has the flag: the session cache holds these results.
    assert _plan_json(ws, env, "//models:llama_cpu")["execute"] == []
    stats = run_cli(["cache", "stats"], ws, env)
    assert stats.returncode == 0 and f"local  {cache_dir}:" in stats.stdout, stats.stdout
    # ...but not deploy's --cache-dir (a serving directory), and query, which has no such flag, ignores it.
    assert run_cli(["query", "//models:llama"], ws, env).stdout == "//models:llama\n"
    # --norc reads no rc file.
    none = run_cli(["--norc", "plan", "--output", "json", "//models:llama_cpu"], ws, env)
    assert len(json.loads(none.stdout)["execute"]) == 9  # the empty default cache (XDG_CACHE_HOME) holds nothing


def test_rc_mutually_exclusive_flags_yield_to_the_command_line(built_example, ws: Path, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                               cache_dir: Path) -> None:
    env = _home(tmp_path, f"build --quiet --cache-dir {cache_dir}\n")
    quiet = run_cli(["build", "//models:llama_cpu"], ws, env)
    assert quiet.returncode == 0 and quiet.stdout == "", quiet.stdout
    loud = run_cli(["build", "//models:llama_cpu", "--verbose"], ws, env)
    assert loud.returncode == 0 and "0 executed" in loud.stdout, loud.stderr


@pytest.mark.parametrize("line,message", [
    ("build --jobz 4", "unknown option --jobz (did you mean --jobs?)"),
    ("build --jobs lots", "bad value for --jobs: 'lots'"),
    ("build --jobs", "--jobs needs a value"),
    ("build --keep-going=yes", "--keep-going takes no value"),
    ("bulid --jobs 4", "unknown command 'bulid' at the start of the line (did you mean 'build'?)"),
    ("build //models:llama", "'//models:llama' is not a flag (rc lines hold flags only, e.g. 'build --jobs 4')"),
    ("plan --output yaml", "bad value for --output: 'yaml' (choose from text, json)"),
    ("plan --seed 3", "'plan' has no option --seed"),
    ("build --remote-cache 'unterminated", "cannot split the line: No closing quotation"),
])
def test_a_bad_rc_line_is_a_one_line_error_naming_the_file_and_line(ws: Path, tmp_path: Path, line: str,
                                                                     message: str) -> None:
    rc = ws / ".neuronbuildrc"
    rc.write_text(f"# defaults\n\n{line}\n")
    proc = run_cli(["plan", "//models:llama_cpu"], ws, _home(tmp_path))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"{rc}:3: error: {message}\n"


def test_clean_removes_outputs_and_expunge_only_this_workspace_state(built_example, ws: Path, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                                      cache_dir: Path) -> None:
    other = copy_example(tmp_path / "other")
    for w in (ws, other):
        proc = run_cli(["build", "//models:release_cpu", "--cache-dir", str(cache_dir)], w)
        assert proc.returncode == 0, proc.stderr
    state = cache_dir / "v1" / "state"
    files_before = {p.name for p in state.iterdir()}
    pins_before = {p.name for p in (cache_dir / "v1" / "pins").iterdir()}
    roots_before = {p.name for p in (cache_dir / "v1" / "roots").glob("*.json")}
    blobs_before = sorted(p.name for p in (cache_dir / "v1" / "cas").rglob("*") if p.is_file())

    proc = run_cli(["clean", "--cache-dir", str(cache_dir)], ws)
    assert proc.returncode == 0 and "clean: removed" in proc.stdout, proc.stderr
    assert not (ws / "neuronbuild-out").exists() and (other / "neuronbuild-out").is_dir()
    assert {p.name for p in state.iterdir()} == files_before  # plain clean leaves the cache alone

    proc = run_cli(["clean", "--expunge", "--cache-dir", str(cache_dir)], ws)
    assert proc.returncode == 0, proc.stderr
    removed = files_before - {p.name for p in state.iterdir()}
    assert {n.split("-")[0] for n in removed} == {"load", "digests", "noop"}, removed
    assert len(pins_before - {p.name for p in (cache_dir / "v1" / "pins").iterdir()}) == 1  # its bundle's pin
    assert len(roots_before - {p.name for p in (cache_dir / "v1" / "roots").glob("*.json")}) == 1  # its gc roots
    assert sorted(p.name for p in (cache_dir / "v1" / "cas").rglob("*") if p.is_file()) == blobs_before
    # The other workspace's state is intact: its next build is still a no-op, and this one restores from the cache.
    again = run_cli(["build", "//models:release_cpu", "--cache-dir", str(cache_dir)], other)
    assert again.returncode == 0 and "0 executed" in again.stdout
    back = run_cli(["build", "//models:release_cpu", "--cache-dir", str(cache_dir)], ws)
    assert back.returncode == 0 and "0 executed" in back.stdout
    assert (ws / "neuronbuild-out/models/llama_cpu/manifest.json").is_file()


def test_clean_outside_a_workspace_is_a_one_line_error(tmp_path: Path) -> None:
    proc = run_cli(["clean"], tmp_path, {"HOME": str(tmp_path)})
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "not inside a neuronbuild workspace" in proc.stderr
    assert REPO.is_dir()
