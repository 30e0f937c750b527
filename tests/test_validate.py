"""`neuronbuild validate` on the built example's cpu targets: passes showing the measured error, and fails (exit 1)
when the tolerance is 0, when an artifact in the cache is wrong, or when nothing was built."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import blake3
from helpers import copy_example, run_cli

CPU_TARGETS = ["//models:llama_cpu", "//models:llama_tiny_cpu"]


def _rows(stdout: str) -> dict[tuple[str, str], list[str]]:
    """(target, bucket) -> [platform, max abs, max rel, tolerance, result...] from validate's table."""
    lines = stdout.splitlines()
    assert lines[0].split()[:3] == ["target", "bucket", "platform"], stdout
    return {(f[0], f[1]): f[2:] for f in (ln.split() for ln in lines[1:]) if f and f[0].startswith("//")}


def test_validate_passes_on_the_built_cpu_targets_and_shows_the_measured_error(
        built_example, cache_dir: Path) -> None:  # type: ignore[no-untyped-def]
    ws, _ = built_example
    proc = run_cli(["validate", *CPU_TARGETS, "--cache-dir", str(cache_dir)], ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = _rows(proc.stdout)
    assert set(rows) == {("//models:llama_cpu", b) for b in ("context_batch1_seq32", "context_batch4_seq32",
                                                              "token_batch1", "token_batch4")} \
        | {("//models:llama_tiny_cpu", "batch4_seq1")}
    for (_target, _bucket), (platform, max_abs, max_rel, tol, result) in rows.items():
        assert platform.startswith("cpu/x86-64") and result == "ok"
        # A real measurement: AOTInductor's fused kernels differ from eager in the last bits, not more.
        assert 0.0 < float(max_abs) <= float(tol) == 1e-4
        assert 0.0 < float(max_rel) < 1e-4
    assert "every graph is within its tolerance" in proc.stdout


def test_validate_fails_with_a_zero_tolerance(cache_dir: Path, tmp_path: Path, built_example) -> None:  # type: ignore[no-untyped-def]
    # The tolerance is not a fingerprint input: the same cached artifacts are checked against a stricter bound.
    ws = copy_example(tmp_path / "ws")
    build = ws / "models" / "BUILD"
    text = build.read_text()
    old = 'target = ":cpu",\n    options = "//tools:cpu_default",'
    assert old in text
    build.write_text(text.replace(old, 'target = ":cpu",\n    options = "//tools:cpu_default", '
                                       'tolerance = 0.0,'))
    proc = run_cli(["validate", "//models:llama_cpu", "--cache-dir", str(cache_dir)], ws)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = _rows(proc.stdout)
    assert len(rows) == 4
    assert all(r[-1] == "FAIL" and float(r[1]) > 0.0 and float(r[3]) == 0.0 for r in rows.values()), proc.stdout
    assert "4 graph(s) failed validation" in proc.stderr and "Traceback" not in proc.stderr


def _scaled_safetensors(data: bytes, factor: float) -> bytes:
    """The same safetensors file with its smallest float32 norm weight multiplied by `factor` (header unchanged; a
    tensor the package reads: the file also holds buffers inductor folded into the package, e.g. rotary inv_freq)."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    name = min((k for k, v in header.items() if k != "__metadata__" and v["dtype"] == "F32" and "norm" in k),
               key=lambda k: header[k]["data_offsets"][1] - header[k]["data_offsets"][0])
    lo, hi = (8 + n + o for o in header[name]["data_offsets"])
    values = struct.unpack(f"<{(hi - lo) // 4}f", data[lo:hi])
    return data[:lo] + struct.pack(f"<{len(values)}f", *(v * factor for v in values)) + data[hi:]


def _cache_copy(src: Path, dest: Path) -> Path:
    """A copy of a cache (blobs hard-linked: they are immutable and only ever replaced, never written in place)."""
    def copy(s: str, d: str) -> None:
        if f"{os.sep}cas{os.sep}" in s:
            os.link(s, d)
        else:
            shutil.copy2(s, d)
    shutil.copytree(src, dest, copy_function=copy)
    return dest


def test_validate_fails_when_a_cached_artifact_is_wrong(built_example, cache_dir: Path,
                                                        tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A cache whose llama weights entry (the model's weights action's result, which every llama graph ships) holds
    well-formed but wrong weights (as a broken toolchain or a bad merge of caches could leave): the blob's digest is
    right, so only validate's comparison with eager can catch it; the other model's graphs still pass."""
    ws, _ = built_example
    cache = _cache_copy(cache_dir, tmp_path / "cache")
    manifest = json.loads((ws / "neuronbuild-out/models/llama_cpu/manifest.json").read_text())
    shipped = {b["outputs"]["constants.safetensors"]["digest"] for b in manifest["buckets"]}
    assert len(shipped) == 1  # one weights file for every bucket
    wrong = _scaled_safetensors((ws / "neuronbuild-out/models/llama_cpu/token_batch4/constants.safetensors")
                                .read_bytes(), 3.0)
    digest = blake3.blake3(wrong).hexdigest()
    blob = cache / "v1" / "cas" / digest[:2] / digest
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(wrong)
    (record_path,) = [p for p in (cache / "v1" / "ac").glob("*/*.json")
                      if (json.loads(p.read_text()).get("outputs") or {}).get("constants.safetensors", {})
                      .get("digest") in shipped]  # the weights action's result: the only one writing that file
    record = json.loads(record_path.read_text())
    record["outputs"]["constants.safetensors"] = {"digest": digest, "size": len(wrong)}
    tmp = record_path.with_suffix(".new")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, record_path)  # a new file: the session cache's record (a hard link's source) stays as it was

    proc = run_cli(["validate", *CPU_TARGETS, "--cache-dir", str(cache)], ws)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = _rows(proc.stdout)
    bad = {k: v for k, v in rows.items() if k[0] == "//models:llama_cpu"}
    good = {k: v for k, v in rows.items() if k[0] == "//models:llama_tiny_cpu"}
    assert len(bad) == len(manifest["buckets"]) and good, proc.stdout
    assert all(r[-1] == "FAIL" and float(r[1]) > 1e-2 for r in bad.values()), proc.stdout
    assert all(r[-1] == "ok" and float(r[1]) <= 1e-4 for r in good.values()), proc.stdout
    assert f"{len(bad)} graph(s) failed validation" in proc.stderr and "Traceback" not in proc.stderr
    # The session cache itself is untouched: the real entry still validates.
    again = run_cli(["validate", "//models:llama_cpu", "--cache-dir", str(cache_dir)], ws)
    assert again.returncode == 0, again.stdout + again.stderr


def test_validate_reports_unbuilt_graphs_and_exits_1(built_example, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ws, _ = built_example
    proc = run_cli(["validate", "//models:llama_cpu", "--cache-dir", str(tmp_path / "empty")], ws)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = _rows(proc.stdout)
    assert len(rows) == 4 and all(" ".join(r[4:]).startswith("NOT BUILT (run neuronbuild build //models:llama_cpu)")
                                  for r in rows.values()), proc.stdout
    assert "4 graph(s) failed validation" in proc.stderr and "Traceback" not in proc.stderr


def test_validate_reports_a_graph_whose_weights_are_not_built_yet_as_not_built(built_example, cache_dir: Path,
                                                                                tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """As while a build still runs: the compiles are cached, the weights action they ship is not (was a KeyError
    traceback: 'constants.safetensors')."""
    ws, _ = built_example
    cache = _cache_copy(cache_dir, tmp_path / "cache")
    for p in (cache / "v1" / "ac").glob("*/*.json"):
        if "constants.safetensors" in (json.loads(p.read_text()).get("outputs") or {}):
            p.unlink()  # the weights actions' results
    proc = run_cli(["validate", "//models:llama_cpu", "--cache-dir", str(cache)], ws)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    rows = _rows(proc.stdout)
    assert len(rows) == 4 and all(" ".join(r[4:]).startswith("NOT BUILT") for r in rows.values()), proc.stdout
