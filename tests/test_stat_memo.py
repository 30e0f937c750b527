"""digests.StatMemo, the one rule by which the process keeps what it made from a file's bytes (docs/server.md), and
its users: .bzl parses, action records, no-op stamps."""

from __future__ import annotations

import marshal
import os
import time
from pathlib import Path

import pytest

from neuronbuild import digests, noop
from neuronbuild.cache.action_cache import ActionCache, ActionResult, OutputRef
from neuronbuild.digests import StatMemo, stat_key
from neuronbuild.loading import loader


def _settle() -> None:
    """Let the last write leave the racy window (as it has for any file not edited in the last few milliseconds)."""
    time.sleep(3 * digests.RACY_NS / 1e9)


def test_a_value_is_returned_while_its_file_keeps_the_stat_key_it_was_read_with(tmp_path: Path) -> None:
    f = tmp_path / "a"
    f.write_bytes(b"one")
    _settle()
    memo: StatMemo[str] = StatMemo()
    now = time.time_ns()
    assert memo.put(str(f), stat_key(f.stat()), "one", now)
    assert memo.get(str(f), stat_key(f.stat())) == "one"
    st = f.stat()
    f.write_bytes(b"two")  # same size, the mtime put back (cp -p, touch -d): the ctime still moves
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert memo.get(str(f), stat_key(f.stat())) is None


def test_a_file_written_within_the_racy_window_of_its_read_is_not_kept_unless_the_caller_vouches(tmp_path: Path) -> None:
    f = tmp_path / "a"
    now = time.time_ns()
    f.write_bytes(b"fresh")
    memo: StatMemo[str] = StatMemo()
    assert not memo.put(str(f), stat_key(f.stat()), "fresh", now)
    assert memo.get(str(f), stat_key(f.stat())) is None
    assert memo.put(str(f), stat_key(f.stat()), "fresh", None)  # (a blob, never written in place)
    assert memo.get(str(f), stat_key(f.stat())) == "fresh"


def test_a_full_memo_keeps_the_paths_kept_first_and_still_updates_them() -> None:
    memo: StatMemo[int] = StatMemo(2)
    key = (1, 2, 3, 4)
    assert memo.put("a", key, 1, None) and memo.put("b", key, 2, None)
    assert not memo.put("c", key, 3, None)
    assert memo.get("c", key) is None and memo.get("a", key) == 1
    assert memo.put("a", (1, 2, 3, 5), 10, None)  # (a path kept: its new value replaces the old)
    assert memo.get("a", (1, 2, 3, 5)) == 10 and memo.get("a", key) is None


def test_a_bzl_rewritten_in_place_with_its_size_and_mtime_put_back_is_parsed_again(tmp_path: Path) -> None:
    f = tmp_path / "defs.bzl"
    f.write_text("X = 1\n")
    _settle()
    first = loader._parse_bzl("//:defs.bzl", f, "")
    assert loader._parse_bzl("//:defs.bzl", f, "") is first  # (parsed once while unchanged)
    st = f.stat()
    f.write_text("Y = 2\n")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    _settle()
    again = loader._parse_bzl("//:defs.bzl", f, "")
    assert "Y" in again.defined and "X" not in again.defined


def test_a_bzl_edited_just_before_its_parse_is_parsed_again_next_time(tmp_path: Path) -> None:
    f = tmp_path / "defs.bzl"
    f.write_text("X = 1\n")
    first = loader._parse_bzl("//:defs.bzl", f, "")  # (within the racy window: a write in this tick could follow)
    assert loader._parse_bzl("//:defs.bzl", f, "") is not first


def test_a_bzl_parse_is_reused_only_under_the_name_and_package_it_was_parsed_for(tmp_path: Path) -> None:
    f = tmp_path / "defs.bzl"
    f.write_text("X = 1\n")
    _settle()
    loader._parse_bzl("//a:defs.bzl", f, "a")
    other = loader._parse_bzl("@r//b:defs.bzl", f, "b")  # (its messages and relative labels are its own)
    assert (other.display, other.package) == ("@r//b:defs.bzl", "b")


def _record(cache: ActionCache, fp: str, identity: str) -> None:
    cache.put(ActionResult(fp, identity, {"o": OutputRef("0" * 64, 1)}, {"k": fp}), durable=False)


def test_a_record_this_process_touched_stays_parsed_and_one_changed_by_others_is_read_again(tmp_path: Path) -> None:
    cache = ActionCache(tmp_path)
    fp = "ab" * 32
    _record(cache, fp, "one")
    _settle()
    first = cache.get(fp)
    assert first is not None and cache.get(fp) is first
    cache.touch(fp)  # (its own utime, through a descriptor of the file parsed: the parsed copy is re-keyed)
    assert cache.get(fp) is first
    os.utime(cache.path(fp), ns=(1, 1))  # anyone else's: read again
    _settle()
    again = cache.get(fp)
    assert again is not first and again == first and cache.get(fp) is again
    _record(cache, fp, "two")  # replaced by a rename: a new inode
    _settle()
    got = cache.get(fp)
    assert got is not None and got.identity == "two"


def test_a_memoised_noop_stamp_is_not_used_once_others_may_write_it(tmp_path: Path) -> None:
    stamp = tmp_path / "stamp"
    stamp.write_bytes(marshal.dumps({"format": noop.FORMAT}))
    os.chmod(stamp, 0o600)
    _settle()
    first = noop._load(stamp)
    assert noop._load(stamp) is first  # (one stat: the memo)
    os.chmod(stamp, 0o622)
    with pytest.raises(PermissionError):
        noop._load(stamp)
