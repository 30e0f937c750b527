"""The no-op fast path on a generated monorepo: it never imports torch, and no edit, load()ed .bzl change, toolchain
version change, new package or missing output is ever answered from it."""

from __future__ import annotations

import re
import shutil
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, run_cli

sys.path.insert(0, str(REPO / "benchmarks"))
import gen_monorepo  # noqa: E402

PKG = gen_monorepo.package_name(0)


def _imports(stderr: str) -> set[str]:
    return {ln.split("|")[-1].strip() for ln in stderr.splitlines() if ln.startswith("import time:")}


class Ws:
    def __init__(self, root: Path, cache: Path, pythonpath: Path) -> None:
        self.root, self.cache, self.env = root, cache, {"PYTHONPATH": str(pythonpath)}

    def build(self, expect_rc: int = 0) -> tuple[int, set[str], str]:
        """(executed actions, modules imported, stdout) of one `build //...`."""
        time.sleep(0.05)  # edits made just before a build are in its racy window: the stamp would not be written
        proc = run_cli(["build", "//...", "--jobs", "2", "--cache-dir", str(self.cache)], self.root, self.env,
                       ("-X", "importtime"))
        assert proc.returncode == expect_rc, proc.stdout + proc.stderr[-4000:]
        m = re.search(r"(\d+) executed", proc.stdout)
        return (int(m.group(1)) if m else -1), _imports(proc.stderr), proc.stdout

    def noop(self) -> None:
        """A build that must take the fast path: nothing executed, no analysis, no torch."""
        n, mods, out = self.build()
        assert n == 0, out
        assert "neuronbuild.build" not in mods and "networkx" not in mods, out
        assert not any(m == "torch" or m.startswith("torch.") for m in mods)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Ws:
    """The generated monorepo built once (its cache shared by the module's tests)."""
    base = tmp_path_factory.mktemp("scale")
    (base / "pp").mkdir()
    gen_monorepo.generate(base / "ws", 2, 1, 2)  # one package: 1 trace + 2 Neuron compiles, via load()ed macros
    first = Ws(base / "ws", base / "cache", base / "pp")
    n, _mods, out = first.build()
    assert n == 6, out  # the weights action, 1 trace, 2 lowerings, 2 Neuron compiles
    return first


@pytest.fixture()
def ws(built: Ws, tmp_path: Path) -> Ws:
    """A copy of the built workspace (outputs included) of this test's own, over the shared cache, built once in
    place (everything cached): its no-op stamp, load and digest caches are written, as after a user's build. Edits
    stay in the copy, so no test depends on what another did before it."""
    (tmp_path / "pp").mkdir()
    root = Path(shutil.copytree(built.root, tmp_path / "ws", symlinks=True))
    copy = Ws(root, built.cache, tmp_path / "pp")
    n, _mods, out = copy.build()
    assert n == 0, out
    return copy


def test_noop_after_a_build_takes_the_fast_path_and_never_imports_torch(ws: Ws) -> None:
    ws.noop()
    ws.noop()


def test_full_path_noop_without_a_stamp_does_not_import_torch(ws: Ws) -> None:
    for stamp in (ws.cache / "v1" / "state").glob("noop-*"):
        stamp.unlink()
    n, mods, out = ws.build()
    assert n == 0 and "neuronbuild.build" in mods, out
    assert not any(m == "torch" or m.startswith("torch.") for m in mods)
    ws.noop()


def test_bucket_edit_rebuilds_exactly_the_new_graphs(ws: Ws) -> None:
    gen_monorepo.edit_one_bucket_list(ws.root, 0, 1)
    assert ws.build()[0] == 5  # 1 trace, 2 lowerings + 2 compiles of the new bucket
    ws.noop()


def test_a_loaded_bzl_edit_is_seen(ws: Ws) -> None:
    defs = ws.root / "common" / "defs.bzl"
    defs.write_text(defs.read_text().replace('options = "//common:" + kind[1]', 'options = "//common:base"'))
    assert ws.build()[0] == 1  # the trn2 compile used :fast, now :base; the trace is unchanged
    ws.noop()


def test_an_edit_keeping_size_and_mtime_is_seen(ws: Ws) -> None:
    src = ws.root / PKG / "model.py"
    st = src.stat()
    src.write_text(src.read_text().replace("torch.relu", "torch.tanh"))  # same length
    import os

    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert src.stat().st_size == st.st_size
    assert ws.build()[0] >= 3  # the trace and what its changed program feeds (early cutoff may stop some)
    ws.noop()


def test_a_changed_toolchain_version_is_seen(ws: Ws) -> None:
    # A torch distribution of another version earlier on the client's sys.path: importlib.metadata now reports 99.0
    # there, but the workers still run 2.13. The changed version is seen (every action is planned anew), and each
    # worker refuses to store a 2.13 artifact under a fingerprint that says 99.0.
    dist = Path(ws.env["PYTHONPATH"]) / "torch-99.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 99.0\n")
    _n, _mods, out = ws.build(expect_rc=1)
    # Every action is planned anew (none cached) and none succeeds. The roots (the weights action and the trace) both
    # refuse, or one refuses first and the build ends before the other starts: 1 or 2 failed, none executed.
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (actions|executed|cached|failed|not run|stopped|not started)", out)}
    assert counts.get("executed") == 0 and counts.get("cached") == 0 and counts.get("failed") in (1, 2), out
    assert sum(counts.get(k, 0) for k in ("failed", "not run", "stopped", "not started")) == counts["actions"], out
    dist.rename(dist.with_name("torch-99.0.dist-info.off"))
    assert ws.build()[0] == 0  # nothing wrong was cached: back on 2.13, the old results are still the answer
    ws.noop()


def test_a_missing_output_and_a_new_broken_package_are_seen(ws: Ws) -> None:
    manifests = list((ws.root / "neuronbuild-out").rglob("manifest.json"))
    assert manifests
    out = next(p for p in manifests[0].parent.rglob("*") if p.is_file() and p.name != "manifest.json")
    out.unlink()
    assert ws.build()[0] == 0
    assert out.is_file()  # restored from the cache by the normal path
    ws.noop()
    (ws.root / "g009").mkdir()
    (ws.root / "g009" / "BUILD").write_text("neuron_target(name = \n")
    ws.build(expect_rc=2)
