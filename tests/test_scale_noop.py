"""The no-op fast path on a generated monorepo: it never imports torch, and no edit, load()ed .bzl change, toolchain
version change, new package or missing output is ever answered from it."""

from __future__ import annotations

import contextlib
import json
import marshal
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

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
        self.last: tuple[int, dict[str, Any] | None] = (0, None)  # (when the last build began, the stamp it left)

    def build(self, expect_rc: int = 0) -> tuple[int, set[str], str]:
        """(executed actions, modules imported, stdout) of one `build //...`."""
        time.sleep(0.05)  # edits made just before a build are in its racy window: the stamp would not be written
        began = time.time_ns()
        proc = run_cli(["build", "//...", "--jobs", "2", "--cache-dir", str(self.cache)], self.root, self.env,
                       ("-X", "importtime"))
        self.last = (began, self.stamp())
        assert proc.returncode == expect_rc, proc.stdout + proc.stderr[-4000:]
        m = re.search(r"(\d+) executed", proc.stdout)
        return (int(m.group(1)) if m else -1), _imports(proc.stderr), proc.stdout

    def noop(self) -> None:
        """A build that must take the fast path: nothing executed, no analysis, no torch."""
        began, stamp = self.last
        stale = self.stale(stamp)  # (before this build, whose normal path would rewrite what it finds stale)
        n, mods, out = self.build()
        assert n == 0, out
        assert "neuronbuild.build" not in mods and "networkx" not in mods, out + self.why_not_noop(began, stamp, stale)
        assert not any(m == "torch" or m.startswith("torch.") for m in mods)

    def stamp(self) -> dict[str, Any] | None:
        """The no-op stamp of this workspace's `build //...` (noop.write's data), None if there is none."""
        for f in (self.cache / "v1" / "state").glob("noop-*.marshal"):
            try:
                data = marshal.loads(f.read_bytes())
                if Path(json.loads(data["key"])["root"]).resolve() == self.root.resolve():
                    return dict(data)
            except (OSError, ValueError, EOFError, KeyError, TypeError):
                continue
        return None

    @staticmethod
    def stale(stamp: dict[str, Any] | None) -> list[str]:
        """The stamp's files and directories that differ now from what it holds."""
        from neuronbuild import noop
        from neuronbuild.digests import stat_key

        out = []
        for p, k in zip(*((stamp["paths"], stamp["keys"]) if stamp else ((), ())), strict=True):
            try:
                now: Any = stat_key(os.stat(p))
            except OSError as e:
                now = e
            if now != tuple(k):
                out.append(f"{p}: {tuple(k)} -> {now}")
        for d, sig in zip(*((stamp["dirs"], stamp["dirsigs"]) if stamp else ((), ())), strict=True):
            if noop.dir_signature(d) != sig:
                out.append(f"directory {d}: {sig!r} -> {noop.dir_signature(d)!r}")
        return out

    def why_not_noop(self, began: int, stamp: dict[str, Any] | None, stale: list[str]) -> str:
        """Why the stamp the build before left (begun at `began`, time.time_ns()) did not answer (`stale`: its files
        that differed just before), for a failure's message: a flake under load was never explained by its output."""
        from neuronbuild.digests import RACY_NS, stat_key

        probe = run_cli([], self.root, self.env, ("-c", "import json; from neuronbuild import noop; "
                                                  "print(json.dumps([noop.environment(), noop.toolchain_paths()]))"))
        env, tools = json.loads(probe.stdout) if probe.returncode == 0 else ("{}", [])
        if stamp is None:
            recent = []
            for p in [*map(str, self.root.rglob("*")), *tools]:
                with contextlib.suppress(OSError):
                    k = stat_key(os.stat(p))
                    if max(k[1], k[3]) >= began - RACY_NS and "neuronbuild-out" not in p:
                        recent.append(f"{p} (mtime {k[1] - began:+} ns, ctime {k[3] - began:+} ns from its start)")
            return ("\nno-op miss: the build before left no stamp (noop.write refused it: an input missing, or "
                    f"changed within RACY_NS of its start); changed since shortly before it began: {recent}")
        why = list(stale)
        old, new = json.loads(stamp["env"]), json.loads(env)
        old_vars, new_vars = dict(old.pop("env", ())), dict(new.pop("env", ()))  # ((name, value), ...)
        for d, a, b in (("", old, new), ("variable ", old_vars, new_vars)):
            why += [f"environment {d}{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(a.keys() | b.keys())
                    if a.get(k) != b.get(k)]
        if stamp["tools"] != tools:
            why.append(f"toolchain paths: {stamp['tools']} -> {tools}")
        return f"\nno-op miss; the stamp the build before left differs: {why or 'in nothing seen from here'}"


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
