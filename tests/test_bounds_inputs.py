"""Bounded inputs: NULs, deep nesting, huge files, malformed indexes and hostile bundle framing give one-line errors."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
import zstandard
from helpers import run_cli, write_ws

from neuronbuild.packaging.deploy import BundleError, read_bundle


def _deep_config(n: int) -> str:
    d = "{}"
    for _ in range(n):
        d = '{"a": ' + d + "}"
    return d


CASES = {
    "nul-byte": ('neuron_buckets(name = "b", shapes = [{"batch": 1}])\x00\n', "pkg/BUILD:1:52: error: NUL byte"),
    "nul-in-string": ('neuron_target(name = "t\\x00junk", platform = "cpu")\n',
                      "pkg/BUILD:1:22: error: NUL character in a string"),
    # NULs built at run time reach the natives through starlark-go's conversion, which truncates at a NUL.
    "nul-built-at-run-time": ('neuron_target(name = "b" + ("%c" % 0) + "junk", platform = "cpu")\n',
                              "pkg/BUILD:1:14: error: attribute 'name': NUL character in a string"),
    "nul-nested-at-run-time": ('neuron_model(name = "m", srcs = ["m.py"], entry = "m:b", inputs = {"x": "float32[b]"}, '
                               'config = {"k": [1, {"v": "a" + chr(0)}]})\n',
                               "pkg/BUILD:1:13: error: attribute 'config': NUL character in a string"),
    # A value that contains itself overflowed the Go stack converting it (a fatal crash with a Go traceback).
    "cyclic-value": ('def mk():\n    l = ["a"]\n    l.append(l)\n    return l\n'
                     'neuron_target(name = "t", platform = "cpu", tags = mk())\n',
                     "pkg/BUILD:5:14: error: attribute 'tags': value contains itself"),
    "deep-value-at-run-time": ('def mk():\n    x = {}\n    for i in range(3000):\n        x = {"a": x}\n    return x\n'
                               'neuron_model(name = "m", srcs = ["m.py"], entry = "m:b", inputs = {"x": "float32[b]"}, '
                               'config = mk())\n', "pkg/BUILD:6:13: error: an attribute value is nested too deeply"),
    "reserved-name": ('__nb_raw_neuron_target(name = "t", platform = "cpu")\n',
                      "pkg/BUILD:1:1: error: name '__nb_raw_neuron_target' is reserved"),
    # Planning 10^6 buckets took hours: the cross product is capped at load time, naming the rule and the count.
    "bucket-cross-product": ('neuron_buckets(name = "b", dims = {"a": list(range(1, 101)), "b": list(range(1, 101)), '
                             '"c": list(range(1, 101))})\n', "pkg/BUILD:1:15: error: neuron_buckets 'dims' give "
                             "1000000 buckets (the cross product 100 x 100 x 100), more than the limit of 10000"),
    "deps-chain": ("\n".join(f'compiler_options(name = "o{i}", deps = [":o{i + 1}"])' for i in range(3000))
                   + '\ncompiler_options(name = "o3000")\n', "error: dependency chain longer than 256"),
    "deep-config": ('neuron_model(name = "m", srcs = ["m.py"], entry = "m:b", inputs = {"x": "float32[b]"}, config = '
                    + _deep_config(900) + ")\n", "error: expression nested too deeply"),
    "huge-file": ('neuron_buckets(name = "b", shapes = [{"batch": 1}])\n' + ("# padding\n" * 500_000),
                  "pkg/BUILD:1:1: error: file is larger than 4 MiB"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_build_input_is_one_located_line(tmp_path: Path, case: str) -> None:
    text, expected = CASES[case]
    ws = write_ws(tmp_path / "ws", {"pkg/m.py": ""})
    (ws / "pkg" / "BUILD").write_bytes(text.encode())
    proc = run_cli(["build", "//pkg:all", "--cache-dir", str(tmp_path / "cache")], ws)
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr


def test_runtime_nul_from_a_macro_is_located_at_the_call(tmp_path: Path) -> None:
    # A macro's string built at run time: refused at the BUILD file's call, naming the macro, and the fast path's
    # false alarms (a literal backslash-x00, "[...]") still load.
    ws = write_ws(tmp_path / "ws", {
        "pkg/defs.bzl": 'def tgt(name):\n    neuron_target(name = name + ("%c" % 0), platform = "cpu")\n',
        "pkg/BUILD": 'load(":defs.bzl", "tgt")\nneuron_target(name = "ok", platform = "cpu", tags = ["a\\\\x00", "[...]"])\n'
                     '\ntgt(name = "t")\n',
    })
    proc = run_cli(["query", "//pkg:all"], ws)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == ("pkg/BUILD:4:4: error: attribute 'name': NUL character in a string (starlark-go would "
                           "silently truncate it) (in tgt at pkg/defs.bzl:2:18)\n"), proc.stderr
    (ws / "pkg" / "BUILD").write_text('load(":defs.bzl", "tgt")\n'
                                     'neuron_target(name = "ok", platform = "cpu", tags = ["a\\\\x00", "[...]"])\n')
    proc = run_cli(["query", "attr(tags, x00, //pkg:all)"], ws)
    assert proc.returncode == 0 and proc.stdout.split() == ["//pkg:ok"], proc.stderr


def _bundle(members: list[tuple[str, bytes]], trailing: bytes = b"") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return zstandard.ZstdCompressor().compress(buf.getvalue()) + trailing


def _manifest(extra_files: dict[str, dict[str, object]] | None = None) -> tuple[bytes, bytes]:
    """A minimal valid manifest (no graphs) with its neuronbuild.env; returns (manifest bytes, env bytes)."""
    import hashlib

    from neuronbuild.packaging.envfile import render_env

    m: dict[str, object] = {"bundle_format": 1, "label": "//p:r", "graphs": [],
                            "requirements": {"torch": [], "python": [], "neuron_platforms": []}}
    env = render_env(m)
    m["files"] = {"neuronbuild.env": {"sha256": hashlib.sha256(env).hexdigest(), "size": len(env)},
                  **(extra_files or {})}
    return json.dumps(m).encode(), env


def _sink(_p: str, f: io.BufferedIOBase, _n: int) -> tuple[str, int]:
    import hashlib

    data = f.read()
    return hashlib.sha256(data).hexdigest(), len(data)


def test_hostile_bundle_framing_is_refused_with_bounded_work(tmp_path: Path) -> None:
    # A GNU long-name header of 8 MB (tarfile would read it whole): refused from its declared size.
    long_name = _bundle([("x" * (8 << 20), b"")])
    p = tmp_path / "long.tar.zst"
    p.write_bytes(long_name)
    with pytest.raises(BundleError, match="GNU long-name header"):
        read_bundle(p, _sink)
    # A manifest member over the limit: refused from its header, not read.
    big = tmp_path / "big.tar.zst"
    big.write_bytes(_bundle([("manifest.json", b" " * ((64 << 20) + 1))]))
    with pytest.raises(BundleError, match="manifest.json is 67108865 bytes"):
        read_bundle(big, _sink)
    # A manifest nested 100,000 deep: one line, no RecursionError.
    deep = tmp_path / "deep.tar.zst"
    deep.write_bytes(_bundle([("manifest.json", b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")]))
    with pytest.raises(BundleError, match="nests deeper than 64 levels"):
        read_bundle(deep, _sink)
    # 200 trailing zstd frames of zeros after a valid (empty) archive: refused without decoding them all.
    frame = zstandard.ZstdCompressor().compress(b"\0" * (8 << 20))
    trail = tmp_path / "trail.tar.zst"
    mbytes, env = _manifest()
    trail.write_bytes(_bundle([("manifest.json", mbytes), ("neuronbuild.env", env)], frame * 200))
    with pytest.raises(BundleError, match="trailing data"):
        read_bundle(trail, _sink)


def test_deploy_index_and_free_space_errors_are_one_line(tmp_path: Path) -> None:
    archive = tmp_path / "b.tar.zst"
    mbytes, env = _manifest({"weights/huge.bin": {"sha256": "0" * 64, "size": 10 ** 15}})
    archive.write_bytes(_bundle([("manifest.json", mbytes), ("neuronbuild.env", env)]))
    for name, index in (("broken", "{"), ("nested", "[" * 100_000 + "]" * 100_000),
                        ("entries", json.dumps({"format": 1, "releases": ["x"]}))):
        dest = tmp_path / name
        dest.mkdir()
        (dest / "neuronbuild-deploy.json").write_text(index)
        proc = run_cli(["deploy", str(archive), "--cache-dir", str(dest)], tmp_path)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert "deploy index" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_cli(["deploy", str(archive), "--cache-dir", str(tmp_path / "fresh")], tmp_path)
    assert proc.returncode == 2 and "not enough free space" in proc.stderr, proc.stderr
    assert not (tmp_path / "fresh").exists()


# One model, one bucket, one trn2 compile: the workspace of the capped-output tests below.
ONE_GRAPH_BUILD = ('neuron_model(name = "m", srcs = ["m.py"], entry = "m:build", inputs = {"x": "float32[b]"})\n'
                   'neuron_buckets(name = "bk", shapes = [{"b": 1}])\n'
                   'neuron_target(name = "t", platform = "trn2")\n'
                   'neuron_compile(name = "c", model = ":m", buckets = [":bk"], target = ":t")\n')

HUGE_ERROR_MODEL = '''def build(config):
    raise ValueError("x" * (50 * 1024 * 1024))
'''


def test_a_huge_exception_message_is_capped(tmp_path: Path) -> None:
    ws = write_ws(tmp_path / "ws", {"pkg/BUILD": ONE_GRAPH_BUILD, "pkg/m.py": HUGE_ERROR_MODEL})
    proc = run_cli(["build", "//pkg:all", "--jobs", "1", "--cache-dir", str(tmp_path / "cache")], ws)
    assert proc.returncode == 1
    assert len(proc.stdout) + len(proc.stderr) < 20_000, len(proc.stderr)
    assert "message cut at 2000 characters" in proc.stderr


LOUD_MODEL = '''import sys


def build(config):
    chunk = "y" * (1 << 20)
    for _ in range(40):  # 40 MiB on stdout, then a failure: the log keeps its end, where the failure is
        sys.stdout.write(chunk + "\\n")
    raise ValueError("the end of a loud action")
'''


def test_an_actions_log_is_capped_keeping_its_end(tmp_path: Path) -> None:
    ws = write_ws(tmp_path / "ws", {"pkg/BUILD": ONE_GRAPH_BUILD, "pkg/m.py": LOUD_MODEL})
    proc = run_cli(["build", "//pkg:all", "--jobs", "1", "--cache-dir", str(tmp_path / "cache")], ws)
    assert proc.returncode == 1 and len(proc.stdout) + len(proc.stderr) < 20_000, proc.stderr[-2000:]
    logs = [p for p in (tmp_path / "cache").rglob("*.log") if p.stat().st_size > (1 << 20)]
    assert logs, "the loud action's log was not kept"
    for log in logs:
        assert log.stat().st_size <= (16 << 20) + 4096, (log, log.stat().st_size)
        data = log.read_bytes()
        assert b"log cut to its last 16777216 bytes" in data and b"the end of a loud action" in data[-100_000:]
