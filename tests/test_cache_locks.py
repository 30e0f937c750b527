"""Execute-once claims on shared tiers: link()-created lock files and S3 conditional-write leases (local moto server)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from neuronbuild.cache import locks
from neuronbuild.cache.locks import LockDir, Owner
from neuronbuild.cache.s3 import S3Tier


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_a_held_lock_excludes_others_until_released(tmp_path: Path) -> None:
    a, b = LockDir(tmp_path / "locks", tmp_path / "tmp"), LockDir(tmp_path / "locks", tmp_path / "tmp")
    held = a.try_acquire("fp1")
    assert held is not None
    assert b.try_acquire("fp1") is None
    assert b.try_acquire("fp2") is not None  # other actions are independent
    held.release()
    assert b.try_acquire("fp1") is not None


def test_lock_of_a_dead_process_on_this_host_is_taken_over_at_once(tmp_path: Path) -> None:
    d = LockDir(tmp_path / "locks", tmp_path / "tmp")
    d.dir.mkdir(parents=True)
    d.path("fp").write_bytes(Owner(locks.HOST, _dead_pid(), "old", time.time()).to_json())
    got = d.try_acquire("fp")
    assert got is not None and locks.read_owner(d.path("fp")).token == got.token  # type: ignore[union-attr]


def test_lock_of_another_machine_is_broken_only_when_its_heartbeat_stops(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEURONBUILD_LOCK_STALE_S", "0.6")  # (read through envvars.current(): no command here)
    d = LockDir(tmp_path / "locks", tmp_path / "tmp")
    d.dir.mkdir(parents=True)
    path = d.path("fp")
    path.write_bytes(Owner("other-machine", 1, "theirs", time.time()).to_json())
    deadline = time.monotonic() + 1.2
    while time.monotonic() < deadline:  # the owner keeps beating: never stale
        path.touch()
        assert d.try_acquire("fp") is None
        time.sleep(0.1)
    time.sleep(0.3)
    assert d.try_acquire("fp") is None  # heartbeat just stopped: not yet STALE_S of silence observed
    time.sleep(0.7)
    got = d.try_acquire("fp")
    assert got is not None


def test_release_does_not_remove_a_lock_someone_else_took_over(tmp_path: Path) -> None:
    d = LockDir(tmp_path / "locks", tmp_path / "tmp")
    mine = d.try_acquire("fp")
    assert mine is not None
    d.path("fp").write_bytes(Owner("other-machine", 1, "theirs", time.time()).to_json())
    mine.release()
    assert d.path("fp").exists()


def test_s3_leases_exclude_each_other_and_dead_owners_are_replaced(s3_endpoint: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    a, b = S3Tier("s3://locks/p", s3_endpoint), S3Tier("s3://locks/p", s3_endpoint)
    a.client.create_bucket(Bucket="locks")
    lease = a.try_claim("fp")
    assert lease is not None
    assert b.try_claim("fp") is None
    lease.release()
    lease_b = b.try_claim("fp")
    assert lease_b is not None
    lease_b.release()
    # A lease left by a dead process on this host is taken over (compare-and-swap on its ETag).
    key = "p/v1/locks/fp.lock"
    a.client.put_object(Bucket="locks", Key=key, Body=Owner(locks.HOST, _dead_pid(), "gone", time.time()).to_json())
    taken = b.try_claim("fp")
    assert taken is not None
    assert a.try_claim("fp") is None
    taken.release()
