"""Shared tiers serve only signed records by default (#49): each user's record key is made on first use and signs
what they upload; another user's records (or unsigned ones) are re-run, never an error, until that user's key is
declared (--remote-cache-trusted-keys) or every writer is trusted (--remote-cache-trust-writers). And a local cache
filled from a shared tier without checks re-runs those actions once keys are trusted (instead of failing)."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import pytest
from helpers import run_cli, write_ws
from test_security_cache_signing import BUILD, MODEL, _keygen


@pytest.fixture(scope="module")
def ws(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_ws(tmp_path_factory.mktemp("trust") / "ws", {"pkg/BUILD": BUILD, "pkg/m.py": MODEL})


def _build(ws: Path, cache: Path, shared: Path, key: Path | None, *extra: str) -> tuple[int, str, str]:
    env = {"NEURONBUILD_RECORD_KEY": str(key)} if key is not None else None
    p = run_cli(["build", "//pkg:c", "--jobs", "1", "--cache-dir", str(cache), "--remote-cache", str(shared), *extra],
                ws, env=env)
    assert "Traceback" not in p.stderr, p.stderr
    return p.returncode, p.stdout, p.stderr


def _counts(out: str) -> tuple[int, int]:
    m = re.search(r"(\d+) actions: (\d+) executed, (\d+) cached", out)
    assert m, out
    return int(m.group(2)), int(m.group(3))


def test_records_are_signed_with_each_users_own_key_and_another_users_are_rerun_until_declared(
        ws: Path, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    alice, bob = tmp_path / "alice" / "record-key", tmp_path / "bob" / "record-key"
    rc, out, err = _build(ws, tmp_path / "a", shared, alice)
    assert rc == 0, out + err
    # Alice's key was made on first use: private to her, with the public line she gives her team beside it.
    assert stat.S_IMODE(alice.stat().st_mode) == 0o600 and stat.S_IMODE(alice.parent.stat().st_mode) == 0o700
    pub = Path(f"{alice}.pub").read_text()
    assert pub.startswith("ssh-ed25519 ") and "BEGIN" not in pub
    before = alice.read_bytes()
    from neuronbuild.runtime.signing import SigningKey

    alice_id = SigningKey(alice).key_id
    records = [json.loads(p.read_bytes()) for p in (shared / "v1" / "ac").glob("*/*.json")]
    assert records and all(r.get("writer") == alice_id and r.get("signature") for r in records)
    # Alice's own next build (a fresh local cache) serves her records.
    rc, out, err = _build(ws, tmp_path / "a2", shared, alice)
    assert rc == 0 and _counts(out) == (0, len(records)) and "warning" not in err, out + err
    assert alice.read_bytes() == before  # (made once)
    # Bob has never declared Alice's key: her records are re-run here, with one warning naming the fix.
    rc, out, err = _build(ws, tmp_path / "b", shared, bob)
    assert rc == 0 and _counts(out) == (len(records), 0), out + err
    warned = [ln for ln in err.splitlines() if ln.startswith("warning:")]
    assert len(warned) == 1 and "--remote-cache-trusted-keys FILE" in warned[0] and str(shared) in warned[0], err
    assert "--remote-cache-trust-writers" in warned[0]
    # Declaring it (a team's keys file, e.g. from ~/.neuronbuildrc) serves them; so does trusting every writer.
    team = tmp_path / "team.pub"
    team.write_text(pub)
    rc, out, err = _build(ws, tmp_path / "b2", shared, bob, "--remote-cache-trusted-keys", str(team))
    assert rc == 0 and _counts(out)[0] == 0 and "warning" not in err, out + err
    rc, out, err = _build(ws, tmp_path / "b3", shared, bob, "--remote-cache-trust-writers")
    assert rc == 0 and _counts(out)[0] == 0, out + err


def test_an_unsigned_record_in_a_shared_tier_is_rerun_by_default_not_served(ws: Path, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    # A writer trusting every writer and holding no key uploads unsigned records (as before #49).
    rc, out, err = _build(ws, tmp_path / "w", shared, None, "--remote-cache-trust-writers")
    assert rc == 0, out + err
    records = list((shared / "v1" / "ac").glob("*/*.json"))
    assert records and not any(json.loads(p.read_bytes()).get("signature") for p in records)
    rc, out, err = _build(ws, tmp_path / "r", shared, tmp_path / "r-key")
    assert rc == 0 and _counts(out) == (len(records), 0), out + err
    assert "is not signed, so it is not served" in err


def test_a_local_cache_filled_without_checks_reruns_its_actions_once_keys_are_trusted(ws: Path,
                                                                                        tmp_path: Path) -> None:
    """The issue's case: a build that copied down unsigned shared records, then the first build trusting keys. Its
    local copies are unverified: that build asks the shared tier again, refuses the unsigned records and re-runs
    the actions (never `output ... is missing from the cache`); the next build serves its own results locally."""
    shared = tmp_path / "shared"
    shared.mkdir()
    rc, out, err = _build(ws, tmp_path / "w", shared, None, "--remote-cache-trust-writers")
    assert rc == 0, out + err
    n = len(list((shared / "v1" / "ac").glob("*/*.json")))
    dev = tmp_path / "dev"
    rc, out, err = _build(ws, dev, shared, None, "--remote-cache-trust-writers")
    assert rc == 0 and _counts(out) == (0, n), out + err  # (copied down, unverified)
    team = Path(f"{_keygen(tmp_path / 'ci_key')}.pub")  # (the team's CI key: it signed none of these)
    key = tmp_path / "dev-key"
    rc, out, err = _build(ws, dev, shared, key, "--remote-cache-trusted-keys", str(team))
    assert rc == 0 and "missing from the cache" not in err and _counts(out) == (n, 0), out + err
    rc, out, err = _build(ws, dev, shared, key, "--remote-cache-trusted-keys", str(team))
    assert rc == 0 and _counts(out) == (0, n), out + err
    rc, out, err = _build(ws, dev, shared, key)  # the default trusts the same own key
    assert rc == 0 and _counts(out) == (0, n), out + err
    assert os.path.exists(key)


def test_an_action_rerun_over_an_unverified_local_copy_is_served_from_its_new_record(tmp_path: Path) -> None:
    """The cause of the issue's `missing from the cache`: the build looked the unverified copy up first (a complete
    local entry is remembered for the build), re-ran the action, stored its result, and then still saw the copy it
    remembered (refused: unverified) when the next action asked for that output."""
    from neuronbuild.cache.tiered import TieredCache, open_shared
    from neuronbuild.runtime.signing import TrustedKeys

    shared = tmp_path / "shared"
    shared.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    (out / "o").write_text("result")
    from neuronbuild.digests import fingerprint

    record = {"action": "trace", "target": "//pkg:m"}
    fp = fingerprint(record)
    writer = TieredCache(tmp_path / "writer", open_shared(str(shared)), trust_writers=True)
    writer.store_outputs(fp, "trace //pkg:m", record, out, ["o"], 1.0, {})  # (unsigned: no key)
    dev = TieredCache(tmp_path / "dev", open_shared(str(shared)), trust_writers=True)
    assert dev.lookup(fp) is not None  # (copied down, unverified)
    key = _keygen(tmp_path / "ci")
    trusting = TieredCache(tmp_path / "dev", open_shared(str(shared)), report=lambda msg: None,
                           trusted=TrustedKeys(Path(f"{key}.pub")))
    assert trusting.lookup(fp) is None  # the copy is not served; the action runs again ...
    trusting.store_outputs(fp, "trace //pkg:m", record, out, ["o"], 1.0, {})
    again = trusting.lookup(fp)  # ... and its own result is what the next action reads
    assert again is not None and again.writer == ""
