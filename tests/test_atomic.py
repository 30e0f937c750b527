"""The one atomic write and the one host-local lock (neuronbuild/atomic.py) every cache, bundle and state file uses:
a reader sees the old file or the whole new one, a failed write leaves no trace, and a lock is held until released
or until its holder dies."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from neuronbuild.atomic import atomic_write_bytes, atomic_writer, file_lock, try_lock, unlock

HOLD = """
import sys, time
from neuronbuild.atomic import try_lock
fd = try_lock(sys.argv[1], directory=sys.argv[2] == "dir")
print("held", flush=True)
time.sleep(600)
"""


def test_a_failed_streaming_write_leaves_the_old_file_and_no_temp_file(tmp_path: Path) -> None:
    dest = tmp_path / "out" / "blob"
    atomic_write_bytes(dest, b"old", mode=0o644)
    with pytest.raises(RuntimeError), atomic_writer(dest) as f:
        f.write(b"new, half written")
        f.flush()
        assert Path(f.name).parent == dest.parent and Path(f.name).read_bytes() == b"new, half written"
        assert dest.read_bytes() == b"old"  # nothing visible until the block ends
        raise RuntimeError("interrupted")
    assert dest.read_bytes() == b"old"
    assert sorted(p.name for p in dest.parent.iterdir()) == ["blob"]


def test_a_streamed_write_replaces_the_file_whole_with_the_asked_mode(tmp_path: Path) -> None:
    dest = tmp_path / "big"
    with atomic_writer(dest, tmp_path / "staging", durable=False, mode=0o640, prefix=".x-") as f:
        for _ in range(64):
            f.write(b"\0" * 65536)
    assert dest.stat().st_size == 64 * 65536 and dest.stat().st_mode & 0o777 == 0o640
    assert list((tmp_path / "staging").iterdir()) == []


@pytest.mark.parametrize("kind", ["file", "dir"])
def test_a_lock_held_by_another_process_is_refused_until_that_process_dies(tmp_path: Path, kind: str) -> None:
    target = tmp_path / ("lockdir" if kind == "dir" else "x.lock")
    if kind == "dir":
        target.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(target), kind], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert try_lock(target, blocking=False, directory=kind == "dir") is None
        assert try_lock(target, blocking=False, shared=True, directory=kind == "dir") is None
    finally:
        holder.kill()
        holder.wait()
    fd = try_lock(target, blocking=False, directory=kind == "dir")  # released by the holder's death
    assert fd is not None
    unlock(fd)
    if kind == "dir":
        assert sorted(p.name for p in tmp_path.iterdir()) == ["lockdir"]  # no lock file left behind


def test_shared_locks_coexist_and_exclude_a_writer(tmp_path: Path) -> None:
    path = tmp_path / "gc.lock"
    with file_lock(path, shared=True):
        fd = try_lock(path, shared=True, blocking=False)  # another open file description: a second reader
        assert fd is not None
        unlock(fd)
    with file_lock(path):
        pid = os.fork()
        if pid == 0:  # a separate process: flock conflicts between open file descriptions
            os._exit(0 if try_lock(path, blocking=False) is None else 1)
        assert os.waitpid(pid, 0)[1] == 0


def test_a_symlinked_directory_is_not_locked_through(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(OSError):
        try_lock(tmp_path / "link", directory=True)
