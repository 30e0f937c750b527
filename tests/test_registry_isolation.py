"""The plug-in registry (plugin_api/registry.py) is one per process, and a pytest-xdist worker runs many test files in
it: tests/conftest.py puts it back after every test, and keeps what a test module registers when imported (at
collection, before any test runs) for that module's own tests, after the built-ins. So a test's assertion on the
registry never depends on which tests ran before it on its worker."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from neuronbuild import plugins
from neuronbuild.plugin_api import registry
from neuronbuild.plugin_api.actions import CORE_STEPS
from neuronbuild.plugin_api.toolchain import TOOLCHAIN_REQUIRED

NAME = "leftover"  # every plug-in the first test registers is named this (its loader's format too)
AT_IMPORT = registry.snapshot()  # (collection: the built-ins, and nothing any other test module registered)
_RAN: list[str] = []  # the first test's name once it has registered


def _names() -> dict[str, bool]:
    """Which tables hold a plug-in named NAME."""
    return {table: NAME in entries for table, entries in registry.snapshot().items()}


def _order(saved: dict[str, dict[str, Any]]) -> dict[str, list[tuple[str, int]]]:
    """Each table's names in order, with the identity of what each names."""
    return {table: [(k, id(v)) for k, v in entries.items()] for table, entries in saved.items()}


def _register_one_of_each() -> None:
    class Toolchain:
        name, platforms, artifact_format, estimate_s, estimate_mb = NAME, (NAME,), NAME, 1.0, 1.0

    tc = Toolchain()
    for member in TOOLCHAIN_REQUIRED[5:]:
        setattr(tc, member, lambda *a: None)

    class Kind:
        name, schema = NAME, None

        def analyze(self, ctx: object, target: object) -> None:
            return None

    class Steps:
        name = NAME + "_steps"  # (a toolchain has NAME already)

        def run(self, *args: object) -> dict[str, Any]:
            return {}

    class Loader:
        format = NAME

        def host_mismatches(self, *args: object) -> list[object]:
            return []

        def load(self, *args: object) -> None:
            return None

        def scratch_bytes(self, *args: object) -> int:
            return 0

    class Settings:
        name = NAME

    plugins.register_toolchain(tc)  # type: ignore[arg-type]
    plugins.register_rule(Kind())  # type: ignore[arg-type]
    plugins.register_steps(Steps())  # type: ignore[arg-type]
    plugins.register_loader(Loader())  # type: ignore[arg-type]
    plugins.register_settings(Settings())  # type: ignore[arg-type]


def test_a_test_registers_a_toolchain_rule_kind_step_provider_loader_and_settings() -> None:
    assert not any(_names().values()), _names()
    _register_one_of_each()
    assert plugins.toolchain_for(NAME).name == NAME and NAME in plugins.rules() and registry.loader(NAME) is not None
    assert f"{NAME}_steps" in plugins.step_providers() and _names() == dict.fromkeys(AT_IMPORT, True)
    _RAN.append("registered")  # (no clean-up: conftest's)


def test_the_next_test_sees_none_of_them_and_the_built_ins_as_before() -> None:
    if not _RAN:
        pytest.skip("the test before this one (same file) did not run in this process")
    assert not any(_names().values()), _names()
    assert CORE_STEPS in plugins.step_providers() and plugins.toolchain_for("cpu") is not None
    assert _order(registry.snapshot()) == _order(AT_IMPORT)


def test_restore_puts_back_a_removed_built_in_in_its_place_in_the_same_tables() -> None:
    steps = plugins.step_providers()  # (the registry's own table: it sees the restore)
    saved = registry.snapshot()
    core = steps.pop(CORE_STEPS)
    plugins.register_steps(core)  # now the last provider, not the first
    assert list(steps)[-1] == CORE_STEPS and list(steps) != list(saved["steps"])
    registry.restore(saved)
    assert list(steps)[0] == CORE_STEPS and _order(registry.snapshot()) == _order(saved)
    assert plugins.step_providers() is steps


FILE_A = f'''
from neuronbuild import plugins


class Steps:
    name = "registered_at_import"

    def run(self, *args):
        return {{}}


plugins.register_steps(Steps())  # when pytest collects (imports) this file, before any test


def test_its_own_import_time_registration_is_there_after_the_built_ins():
    names = list(plugins.step_providers())
    assert names[0] == "{CORE_STEPS}" and "registered_at_import" in names, names
    Steps.name = "registered_by_a_test"
    plugins.register_steps(Steps())
'''

FILE_B = '''
from neuronbuild import plugins


def test_nothing_the_file_before_registered_is_there():
    names = list(plugins.step_providers())
    assert "registered_at_import" not in names and "registered_by_a_test" not in names, names
'''


def test_what_one_file_registers_at_import_or_in_a_test_is_gone_in_the_next_file(tmp_path: Path) -> None:
    """Two files in one pytest process with this conftest (as on an xdist worker): the second sees neither the first
    file's import-time registration (pytest imports every file before running any test) nor its test's."""
    (tmp_path / "test_a_file.py").write_text(FILE_A)
    (tmp_path / "test_b_file.py").write_text(FILE_B)
    path = os.pathsep.join([str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")])  # (conftest)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                           "test_a_file.py", "test_b_file.py"], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": path}, timeout=600)
    assert proc.returncode == 0 and "2 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
