"""pytest configuration: makes tests/helpers importable."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


import pytest  # noqa: E402
from helpers import copy_example, run_cli  # noqa: E402


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache shared by every test that builds the example (content-addressed, so workspaces can share it)."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def built_example(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path):  # type: ignore[no-untyped-def]
    """The example workspace built once (`//...`, real torch compiles); tests read its outputs, never modify it."""
    ws = copy_example(tmp_path_factory.mktemp("example") / "ws")
    proc = run_cli(["build", "//...", "--jobs", "2", "--cache-dir", str(cache_dir)], ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return ws, proc
