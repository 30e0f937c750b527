"""Big declared source files (a checkpoint) reach an action's sandbox as read-only links, not copies (#28: no second
copy of the checkpoint on disk): a hard link in the sandbox's read-only sibling, which the action's Landlock policy
lets it read and never write or truncate, so a hostile action cannot change the user's file; an edit of the user's
file while the action runs is noticed (its result is not stored). Small files stay copies."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from neuronbuild.cache.local import LocalCache
from neuronbuild.digests import digest_file
from neuronbuild.execution import sandbox
from neuronbuild.execution.confine import confine, installation_roots
from neuronbuild.execution.worker import action_policy
from neuronbuild.loading.labels import parse_label
from neuronbuild.plugin_api.actions import Bucket, FileInput, make_action

pytestmark = pytest.mark.skipif(not sandbox._confined_read_only(), reason="needs Landlock ABI >= 3")


def _action(ws: Path, names: list[str]) -> object:
    files = tuple(FileInput(n, digest_file(ws / n)) for n in names)
    return make_action("weights", parse_label("//pkg:m", ""), Bucket(()), {"t": 1}, {"step": "weights"}, files=files)


def test_a_big_input_is_a_read_only_link_the_action_cannot_change(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(sandbox, "LINK_MIN_BYTES", 4096)
    ws = tmp_path / "ws"
    ws.mkdir()
    data = os.urandom(8192)
    (ws / "w.safetensors").write_bytes(data)
    (ws / "m.py").write_text("x = 1\n")
    cache = LocalCache(tmp_path / "cache")
    sb = sandbox.prepare(_action(ws, ["w.safetensors", "m.py"]), ws, cache)  # type: ignore[arg-type]
    try:
        big, small = sb.inputs / "w.safetensors", sb.inputs / "m.py"
        assert big.is_symlink() and big.stat().st_ino == (ws / "w.safetensors").stat().st_ino  # no copy
        assert not small.is_symlink() and small.stat().st_ino != (ws / "m.py").stat().st_ino  # a copy
        assert [p for p, _s in sb.linked] == ["w.safetensors"] and sb.changed_input() is None

        # The action's process, confined as the worker confines it: it reads the file, cannot write or truncate it.
        msg = {"spec": {"step": "weights"}, "inputs": str(sb.inputs), "outputs": str(sb.outputs),
               "log": str(tmp_path / "log")}
        policy = action_policy(msg, dict(os.environ), installation_roots())
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(r)
                confine(policy)
                results = [str(big.read_bytes() == data)]
                for attempt in (lambda: open(big, "r+b").write(b"\0"), lambda: os.truncate(big, 0),
                                lambda: open(big.resolve(), "wb")):
                    try:
                        attempt()
                        results.append("written")
                    except PermissionError:
                        results.append("refused")
                os.write(w, " ".join(results).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        got = os.read(r, 1000).decode()
        os.close(r)
        assert os.waitpid(pid, 0)[1] == 0
        assert got == "True refused refused refused", got
        assert (ws / "w.safetensors").read_bytes() == data

        # The user edits the file while the action runs: noticed, the result must not be stored.
        with open(ws / "w.safetensors", "r+b") as f:
            f.write(b"\0")
        assert sb.changed_input() == "w.safetensors"
    finally:
        sb.remove()
    assert not sandbox.read_only_dir(sb.inputs).exists() and (ws / "w.safetensors").stat().st_nlink == 1


@pytest.mark.parametrize("bind", ["read-only bind mount", "refused"])
def test_an_action_cannot_chmod_or_touch_a_linked_big_input(tmp_path: Path, monkeypatch, bind: str) -> None:  # type: ignore[no-untyped-def]
    """chmod and utime are no Landlock rights: where the action has its own mount namespace, the read-only sibling is
    a read-only bind mount there, so changing the user's checkpoint's mode or times fails (EROFS) like writing it.
    Where that mount is refused, they succeed, and the executor gives the file its mode and times back
    (Sandbox.restore_linked) and does not store the result (changed_input)."""
    from test_action_namespaces import needs_namespaces

    from neuronbuild.execution import confine_ns, worker

    if bind == "refused":
        monkeypatch.setattr(confine_ns, "read_only_bind", lambda path: "read-only bind mount: refused (the test)")
    elif needs_namespaces.args[0]:
        pytest.skip("namespaces are refused here")

    monkeypatch.setattr(sandbox, "LINK_MIN_BYTES", 4096)
    ws = tmp_path / "ws"
    ws.mkdir()
    data = os.urandom(8192)
    user = ws / "w.safetensors"
    user.write_bytes(data)
    os.chmod(user, 0o600)
    os.utime(user, (1_000_000_000, 1_000_000_000))
    (ws / "m.py").write_text("x = 1\n")
    before = user.stat()
    sb = sandbox.prepare(_action(ws, ["w.safetensors", "m.py"]), ws, LocalCache(tmp_path / "cache"))  # type: ignore[arg-type]
    big = sb.inputs / "w.safetensors"

    def fake_run_action(kind, spec, inputs, outputs, log_path, expect=None, policy=None, notes=()):  # type: ignore[no-untyped-def]
        import ctypes
        import errno

        confine(policy)
        libc = ctypes.CDLL(None, use_errno=True)  # as a C extension or a subprocess would (no audit hook sees it)
        path, real = str(big).encode(), str(big.resolve()).encode()
        got = []
        for attempt in (lambda: libc.chmod(path, 0o666), lambda: libc.utimes(path, None),
                        lambda: libc.chmod(real, 0o666), lambda: libc.open(path, os.O_RDWR)):
            got.append("changed" if attempt() >= 0 else errno.errorcode[ctypes.get_errno()])
        return {"ok": True, "metadata": {"got": got, "notes": list(notes)}}

    monkeypatch.setattr(worker, "run_action", fake_run_action)
    try:
        msg = {"kind": "weights", "spec": {"step": "weights"}, "inputs": str(sb.inputs), "outputs": str(sb.outputs),
               "log": str(tmp_path / "log")}
        res = worker.run_isolated(msg, installation_roots())
        assert res["ok"], res
        if bind == "refused":  # chmod and utime succeed; Landlock still refuses the write
            assert res["metadata"]["got"] == ["changed", "changed", "changed", "EACCES"], res["metadata"]
            assert user.stat().st_mode & 0o777 == 0o666
            assert sb.restore_linked() == ["w.safetensors"] and sb.changed_input() == "w.safetensors"
            after = user.stat()
            assert (after.st_mode, after.st_mtime_ns) == (before.st_mode, before.st_mtime_ns)
            return
        # EROFS: the read-only mount (checked before Landlock, which refuses the write open too)
        assert res["metadata"] == {"got": ["EROFS"] * 4, "notes": []}, res["metadata"]
        assert sb.restore_linked() == []
        after = user.stat()
        assert (after.st_mode, after.st_mtime_ns, after.st_ino) == (before.st_mode, before.st_mtime_ns, before.st_ino)
        assert user.read_bytes() == data and sb.changed_input() is None
    finally:
        sb.remove()
