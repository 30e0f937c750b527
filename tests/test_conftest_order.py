"""tests/conftest.py's order of handing test files to pytest-xdist workers (`make test`): longest first."""

from __future__ import annotations

from pathlib import Path

from conftest import FILE_SECONDS, _scope, longest_unit


def test_the_longest_unit_goes_first_and_files_without_a_figure_count_their_tests() -> None:
    queue = {"tests/test_many.py": dict.fromkeys("abcdefghij", False), "tests/test_slow.py": {"t": False},
             "tests/test_few.py": {"u": False, "v": False}}
    assert longest_unit(queue, {"tests/test_slow.py": 150}) == "tests/test_slow.py"
    assert longest_unit(queue, {}) == "tests/test_many.py"  # (xdist's own order: most tests first)
    assert longest_unit(queue, {"tests/test_few.py": 10.0}) == "tests/test_many.py"
    assert longest_unit({"tests/test_b.py": {"x": False}, "tests/test_a.py": {"y": False}}, {}) == "tests/test_b.py"


def test_files_using_the_example_build_are_one_unit_and_every_listed_file_exists() -> None:
    root = Path(__file__).resolve().parent.parent
    assert _scope(root, "tests/test_build_example.py::test_x") == "built_example"
    assert _scope(root, "tests/test_tp_families.py::test_y[z]") == "tests/test_tp_families.py"
    assert all(unit == "built_example" or (root / unit).is_file() for unit in FILE_SECONDS)
