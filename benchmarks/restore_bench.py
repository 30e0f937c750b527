"""Restore speed from a shared-directory tier (verified copy-down into an empty local cache) against `cp -r` of the
same bytes, in one run. Goal: restore within 1.5x of cp.

    .venv/bin/python benchmarks/restore_bench.py [--entries 12] [--mb-per-entry 24] [--repeat 3]

Entries are synthetic action results (random bytes, one large and one small output each) stored through the real
cache code, uploaded to the shared directory by TieredCache.store_outputs, then restored by TieredCache.lookup
(which copies every blob down and re-hashes it). Both sides read warm page cache; figures are noisy on a shared
machine (take the median of --repeat runs)."""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from neuronbuild.cache.shared_fs import SharedDirTier  # noqa: E402
from neuronbuild.cache.tiered import TieredCache  # noqa: E402


def populate(base: Path, entries: int, mb: int) -> tuple[list[str], int]:
    producer = TieredCache(base / "producer", SharedDirTier(base / "shared"), report=lambda m: None)
    (base / "shared").mkdir()
    fps: list[str] = []
    total = 0
    for i in range(entries):
        out = base / "out"
        out.mkdir(exist_ok=True)
        (out / "model.pt2").write_bytes(os.urandom(mb << 20))
        (out / "meta.json").write_bytes(os.urandom(2048))
        fp = f"{i:064x}"
        res = producer.store_outputs(fp, f"bench {i}", {"i": i}, out, ["model.pt2", "meta.json"], 1.0, {})
        total += sum(o.size for o in res.outputs.values())
        fps.append(fp)
    shutil.rmtree(base / "producer")
    return fps, total


def restore_once(base: Path, fps: list[str]) -> float:
    local = base / "restore"
    shutil.rmtree(local, ignore_errors=True)
    cache = TieredCache(local, SharedDirTier(base / "shared"), readonly=True, report=lambda m: None)
    t = time.perf_counter()
    for fp in fps:
        assert cache.lookup(fp) is not None, fp
    return time.perf_counter() - t


def restore_nofsync(base: Path, fps: list[str]) -> float:
    """For information: the same restore with fsync turned off (what durability costs)."""
    real = os.fsync
    os.fsync = lambda fd: None  # type: ignore[assignment]
    try:
        return restore_once(base, fps)
    finally:
        os.fsync = real


def cp_once(base: Path, sync: bool = True) -> float:
    dest = base / "cp"
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir()
    t = time.perf_counter()
    subprocess.run(["cp", "-r", str(base / "shared" / "v1" / "cas"), str(base / "shared" / "v1" / "ac"), str(dest)],
                   check=True)
    if sync:
        subprocess.run(["sync", "-f", str(dest)], check=True)  # restore fsyncs each blob: cp pays durability too
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=12)
    ap.add_argument("--mb-per-entry", type=int, default=24)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="nb-restore-") as d:
        base = Path(d)
        fps, total = populate(base, args.entries, args.mb_per_entry)
        cp_times, restore_times, cp_ns_times, rs_ns_times = [], [], [], []
        for _ in range(args.repeat):  # interleaved, so both sides see the same machine load
            cp_times.append(cp_once(base))
            restore_times.append(restore_once(base, fps))
            cp_ns_times.append(cp_once(base, sync=False))
            rs_ns_times.append(restore_nofsync(base, fps))
        cp_s, rs_s = statistics.median(cp_times), statistics.median(restore_times)
        cp_ns, rs_ns = statistics.median(cp_ns_times), statistics.median(rs_ns_times)
        mb = total / (1 << 20)
        print(f"{args.entries} entries, {mb:.0f} MiB, median of {args.repeat}")
        print(f"{'':28s}{'seconds':>10s}{'MiB/s':>10s}")
        print(f"{'cp -r (+ sync)':28s}{cp_s:10.3f}{mb / cp_s:10.0f}")
        print(f"{'restore (verify, fsync)':28s}{rs_s:10.3f}{mb / rs_s:10.0f}")
        print(f"{'cp -r (no sync)':28s}{cp_ns:10.3f}{mb / cp_ns:10.0f}")
        print(f"{'restore (verify, no fsync)':28s}{rs_ns:10.3f}{mb / rs_ns:10.0f}")
        print(f"restore / cp = {rs_s / cp_s:.2f}x durable (goal <= 1.5x); {rs_ns / cp_ns:.2f}x without syncing")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
