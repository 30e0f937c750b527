"""State files in a (possibly shared) cache are data only: a hostile one is a miss, never code run by the next build."""

from __future__ import annotations

import hashlib
import json
import marshal
import os
import pickle
from pathlib import Path

import pytest
from helpers import run_cli, write_ws

from neuronbuild.self_stamp import code_stamp

BUILD = '''neuron_buckets(name = "b", shapes = [{"batch": 1}])
neuron_target(name = "t", platform = "cpu", isa = "x86-64")
compiler_options(name = "o", opt_level = 2)
'''


class _Payload:
    """Unpickling this runs a shell command that creates `marker`: what a hostile writer of a shared cache plants."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def _state_dir(cache: Path, root: Path) -> tuple[Path, str]:
    return cache / "v1" / "state", hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:20]


def test_a_hostile_state_file_in_the_cache_runs_nothing_and_is_a_miss(tmp_path: Path) -> None:
    root = write_ws(tmp_path / "ws", {"pkg/BUILD": BUILD})
    cache = tmp_path / "cache"
    state, key = _state_dir(cache, root)
    cmd = ["build", "//pkg:all", "--cache-dir", str(cache)]
    assert run_cli(cmd, root).returncode == 0
    # The state files the next build reads (the load cache, the digest cache, the no-op stamp), by their own names,
    # owned by this user: each replaced by a pickle that runs a command when unpickled.
    planted = sorted(state.iterdir())
    assert {p.name.split("-")[0] for p in planted} == {"load", "digests", "noop"}, planted
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Payload(marker))
    pickle.loads(payload)  # (the check below can fail: unpickled, the payload does run its command)
    assert marker.exists()
    marker.unlink()
    for p in planted:
        p.write_bytes(payload)
    proc = run_cli(cmd, root)
    assert proc.returncode == 0, proc.stderr
    assert not marker.exists(), "a state file from the cache ran code"
    # Each was a miss: the build took the full path (not the no-op stamp's answer), evaluated the BUILD file again
    # (not the load cache's targets), hashed the files again, and wrote each file anew as plain data.
    for p in planted:
        data = p.read_bytes()
        assert data != payload, p
        written = json.loads(data) if p.suffix == ".json" else marshal.loads(data)
        assert isinstance(written, dict) and "format" in written, p
    assert json.loads((state / f"load-{key}.json").read_text())["entries"]["pkg"]["build_file"] == "pkg/BUILD"
    # Counted: the planted load cache gives no package (one miss, no hit), and the build still loads every target.
    from neuronbuild.loading.load_cache import LoadCache
    from neuronbuild.loading.target_graph import load_targets

    f = state / f"load-{key}.json"
    f.write_bytes(payload)
    lc = LoadCache(f)
    g = load_targets(root, ["//pkg:all"], "", lc)
    assert (lc.hits, lc.misses) == (0, 1)
    assert sorted(str(lbl) for lbl in g.targets) == ["//pkg:b", "//pkg:o", "//pkg:t"]
    assert not marker.exists()


def test_a_forged_load_cache_entry_is_validated_like_a_rule_call_and_dropped(tmp_path: Path) -> None:
    root = write_ws(tmp_path / "ws", {"pkg/BUILD": BUILD})
    cache = tmp_path / "cache"
    state, key = _state_dir(cache, root)
    proc = run_cli(["build", "//pkg:all", "--cache-dir", str(cache)], root)
    assert proc.returncode == 0, proc.stderr
    f = state / f"load-{key}.json"
    data = json.loads(f.read_text())
    assert data["code"] == code_stamp()
    targets = data["entries"]["pkg"]["targets"]
    # Forge: an option set with an invalid level, and a target claiming another package.
    for t in targets:
        if t[1] == "compiler_options":
            t[2]["opt_level"] = 7
    targets.append(["//other:x", "neuron_target", {"name": "x", "platform": "cpu"}, "pkg/BUILD", 9])
    f.write_text(json.dumps(data))

    from neuronbuild.loading.load_cache import LoadCache
    from neuronbuild.loading.target_graph import load_targets

    lc = LoadCache(f)
    g = load_targets(root, ["//pkg:all"], "", lc)
    assert (lc.hits, lc.misses) == (0, 1)
    assert sorted(str(lbl) for lbl in g.targets) == ["//pkg:b", "//pkg:o", "//pkg:t"]
    assert [t.attrs["opt_level"] for t in g.targets.values() if t.kind == "compiler_options"] == [2]

    # Deeply nested JSON, a wrong type where a list belongs, a huge file: each a miss, never an exception.
    for bad in ("[" * 100_000 + "]" * 100_000,
                json.dumps({**data, "entries": {"pkg": {**data["entries"]["pkg"], "targets": "x"}}})):
        f.write_text(bad)
        lc = LoadCache(f)
        g = load_targets(root, ["//pkg:all"], "", lc)
        assert (lc.hits, lc.misses, len(g.targets)) == (0, 1, 3)


def test_state_files_written_by_another_user_are_ignored(tmp_path: Path) -> None:
    root = write_ws(tmp_path / "ws", {"pkg/BUILD": BUILD})
    cache = tmp_path / "cache"
    state, key = _state_dir(cache, root)
    assert run_cli(["build", "//pkg:all", "--cache-dir", str(cache)], root).returncode == 0
    f = state / f"load-{key}.json"
    from neuronbuild.loading.load_cache import LoadCache
    from neuronbuild.loading.target_graph import load_targets

    lc = LoadCache(f)
    load_targets(root, ["//pkg:all"], "", lc)
    assert lc.hits == 1
    for p in state.iterdir():  # as if another user (or a group-writable shared dir) had written them
        os.chmod(p, 0o666)
    lc = LoadCache(f)
    load_targets(root, ["//pkg:all"], "", lc)
    assert (lc.hits, lc.misses) == (0, 1)
    from neuronbuild.atomic import read_own_state

    for p in state.iterdir():
        try:
            read_own_state(p)
        except PermissionError:
            continue
        raise AssertionError(f"{p} was trusted")
    # And a build still works (it evaluates the BUILD file again instead of trusting those files).
    assert run_cli(["build", "//pkg:all", "--cache-dir", str(cache)], root).returncode == 0


def test_state_files_owned_by_another_uid_are_ignored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The uid half of the ownership check: a state file another user owns (mode 0644, as a shared cache holds it)
    is not read, whatever it says."""
    root = write_ws(tmp_path / "ws", {"pkg/BUILD": BUILD})
    cache = tmp_path / "cache"
    state, key = _state_dir(cache, root)
    assert run_cli(["build", "//pkg:all", "--cache-dir", str(cache)], root).returncode == 0
    f = state / f"load-{key}.json"
    from neuronbuild.atomic import read_own_state
    from neuronbuild.loading.load_cache import LoadCache
    from neuronbuild.loading.target_graph import load_targets

    lc = LoadCache(f)
    load_targets(root, ["//pkg:all"], "", lc)
    assert lc.hits == 1  # this user's own file is read
    for p in state.iterdir():
        os.chmod(p, 0o644)
        if os.geteuid() == 0:
            os.chown(p, 65534, 65534)  # nobody's
    if os.geteuid() != 0:  # (CI runs as root; elsewhere this process takes another identity instead)
        me = os.geteuid()
        monkeypatch.setattr(os, "geteuid", lambda: me + 1)
    lc = LoadCache(f)
    load_targets(root, ["//pkg:all"], "", lc)
    assert (lc.hits, lc.misses) == (0, 1)
    for p in state.iterdir():
        with pytest.raises(PermissionError):
            read_own_state(p)
    if os.geteuid() == 0:  # and a build does not trust them either: it evaluates again and writes its own
        proc = run_cli(["build", "//pkg:all", "--cache-dir", str(cache), "--verbose"], root)
        assert proc.returncode == 0, proc.stderr
        assert all(p.stat().st_uid == 0 for p in state.iterdir())
