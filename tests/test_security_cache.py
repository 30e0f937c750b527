"""A corrupt action record in a (shared) cache is a miss for builds and is reported and repaired by `cache verify`."""

from __future__ import annotations

from pathlib import Path

from helpers import run_cli, write_ws

MODEL = '''import torch


def build(config):
    return torch.nn.Linear(4, 2)
'''
BUILD = '''neuron_model(name = "m", srcs = ["m.py"], entry = "m:build", inputs = {"x": "float32[b, n]"})
neuron_buckets(name = "bk", shapes = [{"b": 1, "n": 4}])
neuron_target(name = "t", platform = "trn2")
neuron_compile(name = "c", model = ":m", buckets = [":bk"], target = ":t")
'''
CORRUPT = {
    "outputs-a-string": b'{"version": 1, "fingerprint": "FP", "identity": "i", "outputs": "x", "record": {}, '
                        b'"duration_s": 0}',
    "deeply-nested": b'{"version": 1, "record": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
}


def test_corrupt_action_records_are_misses_and_verify_repairs_them(tmp_path: Path) -> None:
    ws = write_ws(tmp_path / "ws", {"pkg/BUILD": BUILD, "pkg/m.py": MODEL})
    cache = tmp_path / "cache"
    args = ["build", "//pkg:all", "--jobs", "1", "--cache-dir", str(cache)]
    first = run_cli(args, ws)
    assert first.returncode == 0, first.stderr
    records = sorted((cache / "v1" / "ac").glob("*/*.json"))
    assert len(records) == 2
    for name, data in CORRUPT.items():
        for r in records:
            r.write_bytes(data.replace(b"FP", r.stem.encode()))
        again = run_cli([*args[:-2], "--cache-dir", str(cache)], ws)
        assert again.returncode == 0, f"{name}: {again.stderr}"
        assert "2 executed" in again.stdout, again.stdout
        for r in records:
            r.write_bytes(data.replace(b"FP", r.stem.encode()))
        v = run_cli(["cache", "verify", "--cache-dir", str(cache)], ws)
        assert v.returncode != 0 and "bad-record" in v.stdout + v.stderr, v.stdout + v.stderr
        assert "Traceback" not in v.stderr
        fixed = run_cli(["cache", "verify", "--repair", "--cache-dir", str(cache)], ws)
        assert "Traceback" not in fixed.stderr
        assert not any(r.exists() for r in records)
        rebuilt = run_cli(args, ws)
        assert rebuilt.returncode == 0 and "2 executed" in rebuilt.stdout, rebuilt.stdout + rebuilt.stderr
