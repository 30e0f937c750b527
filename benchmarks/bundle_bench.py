"""Bundle writing speed and size for a large weights file: the previous writer (one zstd stream, level 10 with
long-distance matching, single-threaded) against the current one (level per member: weights at a fast level,
everything else high; multi-threaded zstd), side by side in one run (#28).

    .venv/bin/python benchmarks/bundle_bench.py [--mb 1024] [--graph-kb 512] [--skip-old] [--workdir DIR]

The weights member is a real safetensors file of random bf16 tensors (normal, std 0.02, Llama-like [rows, 2048]
shapes), written in chunks; the graph member is a synthetic HLO-like text. Both writers go through the same tar member
list (manifest first, members sorted) into a file on disk; each archive is then read back across frames and every
member compared, and its decompression timed. Prints wall, bytes and ratio per writer, and the speed-up. Figures are
noisy on a shared machine: compare the two rows of one run."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import shutil
import struct
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import zstandard  # noqa: E402

from neuronbuild.packaging import bundle  # noqa: E402
from neuronbuild.packaging.manifest import Member  # noqa: E402

COLS = 2048


def write_weights(path: Path, mb: int) -> int:
    """A safetensors file of ~mb MiB of random bf16 [rows, COLS] tensors, 32 MiB each, written tensor by tensor."""
    per = 32 << 20
    rows = per // (2 * COLS)
    n = max(1, (mb << 20) // per)
    header: dict[str, Any] = {}
    off = 0
    for i in range(n):
        header[f"model.layers.{i}.weight"] = {"dtype": "BF16", "shape": [rows, COLS], "data_offsets": [off, off + per]}
        off += per
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    g = torch.Generator().manual_seed(0)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb)
        for _ in range(n):
            t = (torch.randn(rows, COLS, generator=g) * 0.02).to(torch.bfloat16)
            f.write(t.view(torch.uint8).numpy().tobytes())
    return path.stat().st_size


def graph_text(kb: int) -> bytes:
    lines = []
    i = 0
    while sum(len(x) for x in lines) < kb << 10:
        lines.append(f"  %dot.{i} = bf16[1,128,2048]{{2,1,0}} dot(bf16[1,128,2048] %p{i % 97}, bf16[2048,2048] "
                     f"%w{i % 211}), lhs_contracting_dims={{2}}, rhs_contracting_dims={{0}}\n".encode())
        i += 1
    return b"".join(lines)


def previous_write_archive(dest: Any, manifest_bytes: bytes, members: list[Member]) -> None:
    """The writer before per-member levels: one zstd stream, level 10, window 2^27 + LDM, single-threaded."""
    params = zstandard.ZstdCompressionParameters.from_level(10, window_log=27, enable_ldm=True, threads=0)
    with zstandard.ZstdCompressor(compression_params=params).stream_writer(dest, closefd=False) as zw, \
            tarfile.open(fileobj=zw, mode="w|", format=tarfile.USTAR_FORMAT) as tar:
        tar.addfile(bundle._tarinfo("manifest.json", len(manifest_bytes)), io.BytesIO(manifest_bytes))
        for m in sorted(members, key=lambda m: m.path):
            if m.data is not None:
                tar.addfile(bundle._tarinfo(m.path, m.size), io.BytesIO(m.data))
            else:
                assert m.source is not None
                with open(m.source, "rb") as f:
                    tar.addfile(bundle._tarinfo(m.path, m.size), f)


def read_back(archive: Path, members: list[Member]) -> float:
    """Decompress across frames and compare every member's sha256; returns the wall time."""
    want = {m.path: m.sha256 for m in members}
    t = time.perf_counter()
    with open(archive, "rb") as raw, \
            zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True) as zr, \
            tarfile.open(fileobj=zr, mode="r|") as tar:
        got: dict[str, str] = {}
        for m in tar:
            f = tar.extractfile(m)
            assert f is not None
            h = hashlib.sha256()
            while chunk := f.read(1 << 20):
                h.update(chunk)
            got[m.name] = h.hexdigest()
    dt = time.perf_counter() - t
    got.pop("manifest.json", None)
    assert got == want, "members differ after the round trip"
    return dt


def sha256_file(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=1024, help="weights file size in MiB (default 1024)")
    ap.add_argument("--graph-kb", type=int, default=512, help="graph member size in KiB (default 512)")
    ap.add_argument("--skip-old", action="store_true", help="measure the current writer only")
    ap.add_argument("--workdir", help="where to write the files (default: a temporary directory, removed)")
    args = ap.parse_args()
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bundle-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        wpath = work / "weights.safetensors"
        size = write_weights(wpath, args.mb)
        graph = graph_text(args.graph_kb)
        members = [
            Member("weights/w.safetensors", sha256_file(wpath), size, wpath),
            Member("graphs/m/llm/ctx_1x128/model.hlo.pb", hashlib.sha256(graph).hexdigest(), len(graph), None, graph),
        ]
        manifest = json.dumps({"files": {m.path: m.sha256 for m in members}}).encode()
        print(f"weights {size / 2**20:.0f} MiB (random bf16), graph {len(graph) / 2**10:.0f} KiB; "
              f"{os.cpu_count()} CPUs, zstd threads {bundle.zstd_threads()}, load {os.getloadavg()[0]:.1f}")
        rows: dict[str, tuple[float, int]] = {}
        writers = [("current", lambda out: bundle.write_archive(out, manifest, members, "zstd"))]
        if not args.skip_old:
            writers.insert(0, ("previous", lambda out: previous_write_archive(out, manifest, members)))
        for name, write in writers:
            archive = work / f"{name}.tar.zst"
            t = time.perf_counter()
            with open(archive, "wb") as out:
                write(out)
                out.flush()
                os.fsync(out.fileno())
            wall = time.perf_counter() - t
            nbytes = archive.stat().st_size
            rt = read_back(archive, members)
            rows[name] = (wall, nbytes)
            print(f"  {name:8s} write {wall:7.2f} s ({size / 2**20 / wall:7.1f} MiB/s), {nbytes / 2**20:8.1f} MiB "
                  f"({nbytes / size:.3f} of the weights), read back + verify {rt:.2f} s")
            with contextlib.suppress(OSError):
                archive.unlink()
        if "previous" in rows:
            (ow, ob), (nw, nb) = rows["previous"], rows["current"]
            print(f"  speed-up {ow / nw:.1f}x, size current/previous {nb / ob:.3f}")
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
