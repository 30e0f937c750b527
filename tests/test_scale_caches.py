"""The load cache and the on-disk digest cache never serve stale results: changed BUILD/.bzl/source files are seen."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from helpers import write_ws

from neuronbuild import digests
from neuronbuild.errors import UserInputError
from neuronbuild.loading.labels import Label
from neuronbuild.loading.load_cache import LoadCache
from neuronbuild.loading.loader import Loader
from neuronbuild.loading.starlark_adapter import run_on_starlark_thread
from neuronbuild.loading.target_graph import load_targets

BUILD = '''load("//tools:defs.bzl", "my_model")
my_model(name = "m")
neuron_buckets(name = "b", shapes = [{"batch": 1}])
'''
DEFS = '''load("//tools:seeds.bzl", "SEED")
def my_model(name):
    neuron_model(name = name, srcs = ["m.py"], entry = "m:build", inputs = {"x": "float32[batch]"}, seed = SEED)
'''


def _ws(tmp_path: Path) -> Path:
    return write_ws(tmp_path / "ws", {"pkg/BUILD": BUILD, "pkg/m.py": "def build(c): pass\n", "tools/BUILD": "",
                                      "tools/defs.bzl": DEFS, "tools/seeds.bzl": "SEED = 1\n"})


def _settle() -> None:
    """Let the last write leave the racy window (as it has for any file not edited in the last few milliseconds)."""
    time.sleep(3 * digests.RACY_NS / 1e9)


def _load(root: Path, cache_file: Path) -> tuple[int, LoadCache]:
    lc = LoadCache(cache_file)
    g = load_targets(root, ["//pkg:all"], "", lc)
    lc.save()
    return g.targets[Label("pkg", "m")].attrs["seed"], lc


def _edit(p: Path, old: str, new: str) -> None:
    p.write_text(p.read_text().replace(old, new))
    _settle()


def test_unchanged_packages_come_from_the_load_cache_and_edits_are_seen(tmp_path: Path) -> None:
    root = _ws(tmp_path)
    _settle()
    cf = tmp_path / "load.pickle"
    seed, lc = _load(root, cf)
    assert (seed, lc.hits, lc.misses) == (1, 0, 1)
    seed, lc = _load(root, cf)
    assert (seed, lc.hits, lc.misses) == (1, 1, 0)
    _edit(root / "tools/seeds.bzl", "SEED = 1", "SEED = 2")  # a .bzl loaded by a loaded .bzl
    seed, lc = _load(root, cf)
    assert (seed, lc.misses) == (2, 1)
    _edit(root / "tools/defs.bzl", "seed = SEED", "seed = SEED + 5")
    assert _load(root, cf)[0] == 7
    _edit(root / "pkg/BUILD", 'my_model(name = "m")', 'my_model(name = "m")\nneuron_target(name = "t", platform = "trn2")')
    seed, lc = _load(root, cf)
    assert (seed, lc.misses) == (7, 1)
    assert _load(root, cf)[1].hits == 1


def test_a_deleted_source_file_is_an_error_even_when_the_package_is_cached(tmp_path: Path) -> None:
    root = _ws(tmp_path)
    _settle()
    cf = tmp_path / "load.pickle"
    _load(root, cf)
    (root / "pkg/m.py").unlink()
    with pytest.raises(UserInputError, match="source file 'pkg/m.py' does not exist"):
        _load(root, cf)


def test_a_package_edited_while_it_is_loaded_is_not_cached(tmp_path: Path) -> None:
    root = _ws(tmp_path)
    _settle()
    cf = tmp_path / "load.pickle"
    lc = LoadCache(cf)
    loader = Loader(root)
    started = time.time_ns()
    pkg = run_on_starlark_thread(loader.load_package, "pkg")  # evaluates SEED = 1
    (root / "tools/seeds.bzl").write_text("SEED = 3\n")  # edited before the result is cached
    lc.put(loader, pkg, started)
    lc.save()
    _settle()
    assert _load(root, cf)[0] == 3


def test_digest_cache_survives_processes_and_sees_content_changes_that_keep_size_and_mtime(tmp_path: Path) -> None:
    f = tmp_path / "w" / "weights.bin"
    f.parent.mkdir()
    f.write_bytes(b"a" * 1000)
    _settle()
    d1 = digests.digest_file(f)
    state = tmp_path / "digests.marshal"
    digests.save_persistent(state, tmp_path)
    digests._stat_cache._entries.clear()
    digests.load_persistent(state)
    assert digests._stat_cache.get(str(f), digests.stat_key(f.stat())) == d1  # a new process would not read it again
    st = f.stat()
    f.write_bytes(b"b" * 1000)  # same size; the mtime is put back, as `cp -p` or `touch -d` would do
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    _settle()
    d2 = digests.digest_file(f)
    assert d2 != d1 and d2 == digests.digest_bytes(b"b" * 1000)


def test_a_file_hashed_right_after_a_write_is_not_cached(tmp_path: Path) -> None:
    f = tmp_path / "fresh.bin"
    f.write_bytes(b"x" * 10)
    digests.digest_file(f)
    assert digests._stat_cache.get(str(f), digests.stat_key(f.stat())) is None


def test_noop_request_key_covers_flags_and_the_variables_they_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from neuronbuild import noop

    def key(**flags: object) -> str:
        return noop.request_key(Path("/ws"), "", ["//..."], Path("/cache"), flags)

    monkeypatch.setenv("MY_FLAG_VAR", "1")
    base = key(action_env=["MY_FLAG_VAR"], jobs=2)
    assert key(action_env=["MY_FLAG_VAR"], jobs=8, keep_going=True) == base  # cannot change a no-op's outcome
    assert key(action_env=["MY_FLAG_VAR", "X=1"], jobs=2) != base
    monkeypatch.setenv("MY_FLAG_VAR", "2")
    assert key(action_env=["MY_FLAG_VAR"], jobs=2) != base


def test_a_cached_package_keeps_the_declared_order_of_dict_attributes(tmp_path: Path) -> None:
    """Input order is part of a model: a package served from the load cache must not come back with sorted keys."""
    root = write_ws(tmp_path / "ws", {"pkg/m.py": "def build(c): pass\n", "pkg/BUILD": (
        'neuron_model(name = "m", srcs = ["m.py"], entry = "m:build",\n'
        '             inputs = {"x": "float32[batch, 8]", "cache": "float32[2, batch]"})\n')})
    _settle()
    cf = tmp_path / "load.json"
    fresh = LoadCache(cf)
    first = load_targets(root, ["//pkg:m"], "", fresh)
    fresh.save()
    cached = LoadCache(cf)
    second = load_targets(root, ["//pkg:m"], "", cached)
    assert cached.hits == 1
    for g in (first, second):
        assert list(g.targets[Label("pkg", "m")].attrs["inputs"]) == ["x", "cache"]


@pytest.mark.parametrize("size", [0, 1, 4095, digests._CHUNK - 1, digests._CHUNK, digests._CHUNK + 1, 2 * digests._CHUNK + 5])
def test_a_hashed_copy_has_every_byte_and_their_blake3_whatever_the_size_and_offset(tmp_path: Path, size: int) -> None:
    import io

    import blake3

    data = os.urandom(size)
    src = tmp_path / "src"
    src.write_bytes(b"head" + data)
    for skip, opener in ((4, lambda: open(src, "rb")), (4, lambda: io.BytesIO(src.read_bytes()))):
        with opener() as f, open(tmp_path / "out", "wb") as out:
            f.seek(skip)  # a copy from where the stream is (buffers sized from there)
            got = digests.copy_hashing(f, out)
        assert got == (blake3.blake3(data).hexdigest(), size)
        assert (tmp_path / "out").read_bytes() == data


def _kept_ws(tmp_path: Path) -> Path:
    return write_ws(tmp_path / "ws", {
        "a/BUILD": 'load("//tools:defs.bzl", "my_model")\nmy_model(name = "m")\n', "a/m.py": "def build(c): pass\n",
        "b/BUILD": 'load("//tools:defs.bzl", "my_model")\nmy_model(name = "m")\n', "b/m.py": "def build(c): pass\n",
        "c/BUILD": 'neuron_buckets(name = "b", shapes = [{"batch": 1}])\n',
        "tools/BUILD": "", "tools/defs.bzl": DEFS, "tools/seeds.bzl": "SEED = 1\n"})


def _kept_load(root: Path, lc: LoadCache) -> dict[str, object]:
    return dict(load_targets(root, ["//..."], "", lc).packages)


def test_a_kept_load_cache_reuses_each_unchanged_package_node_and_recomputes_what_an_edited_bzl_reached(
        tmp_path: Path) -> None:
    """The loading engine (a kept session's LoadCache): an unchanged package is its node's same Package object (so
    analysis checks its Targets by identity) and is not loaded again; an edited .bzl makes every package that loaded it
    (through another .bzl too) stale, and only those."""
    root = _kept_ws(tmp_path)
    _settle()
    lc = LoadCache(None, keep=True)
    assert lc.engine is not None
    first = _kept_load(root, lc)
    again = _kept_load(root, lc)
    assert all(again[n] is first[n] for n in first) and lc.engine.computed == 0
    _edit(root / "tools/seeds.bzl", "SEED = 1", "SEED = 3")
    after = _kept_load(root, lc)
    assert {n for n in first if after[n] is not first[n]} == {"a", "b"}
    assert after["a"].targets[0].attrs["seed"] == 3  # type: ignore[attr-defined]


def test_a_kept_load_cache_sees_a_new_build_file_in_a_listed_directory(tmp_path: Path) -> None:
    """Directory listings are engine nodes valid while the directory's mtime is unchanged: a BUILD file created in a
    directory listed before (or in a new subdirectory) is found by the next //... load."""
    root = _kept_ws(tmp_path)
    _settle()
    lc = LoadCache(None, keep=True)
    assert sorted(_kept_load(root, lc)) == ["a", "b", "c", "tools"]
    (root / "c/BUILD").unlink()
    (root / "d/e").mkdir(parents=True)
    (root / "d/e/BUILD").write_text('neuron_buckets(name = "b", shapes = [{"batch": 2}])\n')
    _settle()
    assert sorted(_kept_load(root, lc)) == ["a", "b", "d/e", "tools"]


def test_a_kept_graph_check_rechecks_an_unchanged_package_whose_reference_went_away(tmp_path: Path) -> None:
    """The kept graph check skips only packages whose node and referred packages' nodes are current: removing the
    target an unchanged package refers to is the same located error a fresh load reports."""
    root = write_ws(tmp_path / "ws", {
        "p/BUILD": 'neuron_target(name = "t", platform = "trn2")\n',
        "q/BUILD": 'neuron_model(name = "m", srcs = ["m.py"], entry = "m:build", inputs = {"x": "float32[batch]"})\n'
                   'neuron_buckets(name = "b", shapes = [{"batch": 1}])\n'
                   'neuron_compile(name = "c", model = ":m", buckets = [":b"], target = "//p:t")\n',
        "q/m.py": "def build(c): pass\n"})
    _settle()
    lc = LoadCache(None, keep=True)
    _kept_load(root, lc)
    _kept_load(root, lc)
    _edit(root / "p/BUILD", 'name = "t"', 'name = "u"')
    with pytest.raises(UserInputError) as kept:
        _kept_load(root, lc)
    with pytest.raises(UserInputError) as fresh:
        load_targets(root, ["//..."], "", None)
    assert "refers to '//p:t', which does not exist" in str(kept.value) and str(kept.value) == str(fresh.value)
