"""pytest configuration: makes tests/helpers importable."""

import importlib.util
import os
import sys
from collections.abc import Generator, Iterator, Mapping
from pathlib import Path

# A test process may start XLA:CPU before any tp test runs (an in-process lowering): it starts with as many host
# devices as the runtime gives a process it starts (runtime/xla_cpu.HOST_DEVICES), whatever the files' order on
# an xdist worker (a tp_degree 2 graph in a process started with 1 device failed, depending on that order).
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "64")
# The test session's own record-signing key for shared cache tiers (#49: each user's is made on first use, in
# ~/.config/neuronbuild), so tests never touch the user's and make one key per session (per xdist worker).
if "NEURONBUILD_RECORD_KEY" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _KEY_DIR = tempfile.mkdtemp(prefix="nb-record-key-")
    os.environ["NEURONBUILD_RECORD_KEY"] = os.path.join(_KEY_DIR, "record-key")
    atexit.register(shutil.rmtree, _KEY_DIR, True)

sys.path.insert(0, str(Path(__file__).resolve().parent))


import pytest  # noqa: E402
from helpers import copy_example, run_cli  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _plugins_loaded() -> None:
    """Tests call loading and analysis directly: the plug-ins registered first, as every command does."""
    from neuronbuild import plugins

    plugins.load()


# The plug-in registry (neuronbuild/plugin_api/registry.py) is one per process, and an xdist worker runs many files:
# what a test registers (a toolchain, rule kind, step provider, loader, settings) is gone after it, and what a test
# module registers when imported (at collection, before any test runs) is there for its own tests only, after the
# built-ins as a command would see them (ci80: a module's toolchain, registered ahead of plugins.load(), came first in
# another file's step providers).
_IMPORT_REGISTRATIONS: dict[str, dict[str, dict[str, object]]] = {}  # test module's path -> what its import added


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, pytest.CollectReport,
                                                                         pytest.CollectReport]:
    """Collecting a test module imports it: what that registers is kept aside (_module_registrations) and taken out."""
    if not isinstance(collector, pytest.Module):
        return (yield)
    from neuronbuild import plugins
    from neuronbuild.plugin_api import registry

    plugins.load()  # (the built-ins first: a module's own registrations come after them, and are told apart)
    before = registry.snapshot()
    try:
        return (yield)
    finally:
        after = registry.snapshot()
        added = {table: {k: v for k, v in entries.items() if before[table].get(k) is not v}
                 for table, entries in after.items()}
        if any(added.values()):
            _IMPORT_REGISTRATIONS[str(collector.path)] = added
        registry.restore(before)


@pytest.fixture(scope="module", autouse=True)
def _module_registrations(request: pytest.FixtureRequest) -> Iterator[None]:
    """What the test module registered when imported, registered again for its own tests (and gone after them)."""
    added = _IMPORT_REGISTRATIONS.get(str(request.path))
    if not added:
        yield
        return
    from neuronbuild.plugin_api import registry

    saved = registry.snapshot()
    registry.restore({table: {**entries, **added[table]} for table, entries in saved.items()})
    yield
    registry.restore(saved)


@pytest.fixture(autouse=True)
def _registry_restored() -> Iterator[None]:
    """The registry after each test as before it: what the test (or its fixtures) registered or removed is undone."""
    from neuronbuild.plugin_api import registry

    saved = registry.snapshot()
    yield
    registry.restore(saved)


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


def _uses_built_example(rootpath: Path, nodeid: str, _seen: dict[str, bool] = {}) -> bool:  # noqa: B006 (a memo)
    """Whether the test file of `nodeid` uses the session's `built_example` (read from its text: the scheduler runs in
    the controller, which does not collect)."""
    file = nodeid.split("::", 1)[0]
    if file not in _seen:
        try:
            _seen[file] = "built_example" in (rootpath / file).read_text()
        except OSError:
            _seen[file] = False
    return _seen[file]


# Seconds a test file takes on a worker of `make test` (its module fixtures' builds included), for the order files are
# handed out in: longest first, so the last files to start are short and the two workers end near the same time
# (xdist's own order, most tests first, started the 160-second tp families file, 6 tests, among the last). Taken from
# the last run's own figures where pytest's cache has them (CACHE_KEY, written by the controller at the end of a
# passing distributed run); these stand in for a fresh checkout: the CI run's durations (2 workers, 2 cores) where it
# listed them, the example's 17 files measured in one process (1,338 s at load 7-10, scaled to CI's pace: 900), the
# two other tp / family files guessed. Files not listed: their test count, as xdist does.
FILE_SECONDS = {"built_example": 900, "tests/test_tp_families.py": 175, "tests/test_llm_block_families.py": 175,
                "tests/test_llm_families.py": 140, "tests/test_llm_speculation.py": 150,
                "tests/test_quantization.py": 120, "tests/test_tensor_parallel.py": 120,
                "tests/test_llm_new_families.py": 120, "tests/test_validate_moe.py": 90}
CACHE_KEY = "neuronbuild/file_seconds"


def _scope(rootpath: Path, nodeid: str) -> str:
    """The unit `--dist loadfile` hands a worker: the test's file, or "built_example" for every file using it."""
    return "built_example" if _uses_built_example(rootpath, nodeid) else nodeid.split("::", 1)[0]


def longest_unit(queue: Mapping[str, Mapping[str, bool]], seconds: Mapping[str, float]) -> str:
    """The unit of `queue` (unit -> its tests) to hand out next: the one of most seconds, a unit without a figure
    counting one second a test; the queue's first among equals (xdist's order: most tests first)."""
    return max(queue, key=lambda unit: seconds.get(unit, len(queue[unit])))


if importlib.util.find_spec("xdist") is not None:  # (pytest refuses the hook of a plug-in it does not have)

    def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
        """`make test TEST_WORKERS=2` runs the suite on two pytest-xdist workers with `--dist loadfile`: each test file runs
        whole on one worker (its module fixtures are made once, its tests run in file order), and every file using the
        session's `built_example` runs on the same worker, which builds the example once for all of them (they share its
        workspace and cache; some rebuild in that workspace). Other session fixtures are per worker, as in a serial run.
        Files are handed out longest first (FILE_SECONDS, or the last run's figures)."""
        if config.getvalue("dist") != "loadfile":
            return None
        from xdist.scheduler import LoadFileScheduling

        seconds = {**FILE_SECONDS, **(config.cache.get(CACHE_KEY, {}) if config.cache is not None else {})}

        class ExampleAwareFileScheduling(LoadFileScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return _scope(config.rootpath, nodeid)

            def _assign_work_unit(self, node: object) -> None:
                """The longest unit still waiting first (the queue's own order, most tests first, among equals)."""
                self.workqueue.move_to_end(longest_unit(self.workqueue, seconds), last=False)
                super()._assign_work_unit(node)  # type: ignore[arg-type]

        return ExampleAwareFileScheduling(config, log)  # type: ignore[arg-type]

    _FILE_SECONDS_RUN: dict[str, float] = {}

    def pytest_runtest_logreport(report: pytest.TestReport) -> None:
        """(In the controller of a distributed run:) each file's seconds, setup and teardown included."""
        if hasattr(report, "node"):
            _FILE_SECONDS_RUN[report.nodeid] = _FILE_SECONDS_RUN.get(report.nodeid, 0.0) + report.duration

    def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
        """A distributed run's per-unit seconds, for the next run's order (not a run that failed or stopped)."""
        if not _FILE_SECONDS_RUN or exitstatus != 0 or session.config.cache is None:
            return
        units: dict[str, float] = {}
        for nodeid, took in _FILE_SECONDS_RUN.items():
            unit = _scope(session.config.rootpath, nodeid)
            units[unit] = units.get(unit, 0.0) + took
        known = session.config.cache.get(CACHE_KEY, {})  # (a run of some files keeps the others' figures)
        session.config.cache.set(CACHE_KEY, known | {k: round(v) for k, v in units.items()})


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """A real S3-compatible server (moto) on 127.0.0.1, one per test module."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()
