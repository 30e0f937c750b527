"""Deploy interrupted by SIGTERM cleans up like Ctrl-C; staging left by a killed deploy is reclaimed by the next one."""

from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import zstandard
from helpers import _ENV_AT_START

from neuronbuild.packaging.envfile import render_env

BIG = 1 << 30  # a member large enough that the deploy is still writing it when the signal arrives


def _bundle(path: Path, label: str, big: int) -> Path:
    m: dict[str, object] = {"bundle_format": 1, "label": label, "graphs": [],
                            "requirements": {"torch": [], "python": [], "neuron_platforms": []}}
    env = render_env(m)
    zeros = hashlib.sha256()
    chunk = b"\0" * (1 << 20)
    for _ in range(big // len(chunk)):
        zeros.update(chunk)
    m["files"] = {"neuronbuild.env": {"sha256": hashlib.sha256(env).hexdigest(), "size": len(env)},
                  "weights/big.bin": {"sha256": zeros.hexdigest(), "size": big}}
    mbytes = json.dumps(m).encode()
    with open(path, "wb") as raw, zstandard.ZstdCompressor().stream_writer(raw) as zw, \
            tarfile.open(fileobj=zw, mode="w|", format=tarfile.USTAR_FORMAT) as tar:
        for name, data, size in (("manifest.json", io.BytesIO(mbytes), len(mbytes)),
                                 ("neuronbuild.env", io.BytesIO(env), len(env))):
            info = tarfile.TarInfo(name)
            info.size = size
            tar.addfile(info, data)
        info = tarfile.TarInfo("weights/big.bin")
        info.size = big

        class Zeros(io.RawIOBase):
            left = big

            def readable(self) -> bool:
                return True

            def readinto(self, b):  # type: ignore[no-untyped-def]
                n = min(len(b), self.left)
                b[:n] = bytes(n)
                self.left -= n
                return n

        tar.addfile(info, io.BufferedReader(Zeros()))
    return path


def _deploy(archive: Path, dest: Path) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k in _ENV_AT_START or not k.startswith("TORCHINDUCTOR_")}
    return subprocess.Popen([sys.executable, "-m", "neuronbuild", "deploy", str(archive), "--cache-dir", str(dest)],
                            env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_for_staging(dest: Path, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if any(p.stat().st_size > 0 for p in dest.glob(".staging-*/weights/*")):
            return
        time.sleep(0.02)
    raise AssertionError(f"the deploy never started writing ({proc.poll()}): {proc.communicate()}")


def test_sigterm_during_deploy_cleans_up_and_a_killed_deploys_staging_is_reclaimed(tmp_path: Path) -> None:
    archive = _bundle(tmp_path / "big.tar.zst", "//p:big", BIG)
    small = _bundle(tmp_path / "small.tar.zst", "//p:small", 1 << 20)
    dest = tmp_path / "serve"
    first = _deploy(small, dest)
    assert first.wait(60) == 0, first.communicate()
    before = sorted(p.name for p in dest.iterdir())

    proc = _deploy(archive, dest)
    _wait_for_staging(dest, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 8, proc.communicate()
    assert "interrupted" in proc.communicate()[1]
    assert sorted(p.name for p in dest.iterdir()) == before  # no staging dir left, nothing installed

    proc = _deploy(archive, dest)
    _wait_for_staging(dest, proc)
    proc.send_signal(signal.SIGKILL)  # cannot clean up: leaves its staging dir
    proc.wait(30)
    assert any(dest.glob(".staging-*"))
    again = _deploy(small, dest)
    assert again.wait(60) == 0, again.communicate()
    assert not any(dest.glob(".staging-*")), "a killed deploy's staging dir was not reclaimed"
