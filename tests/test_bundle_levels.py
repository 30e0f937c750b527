"""Bundle archives compress each member at its own level (weights fast, the rest high) with multi-threaded zstd: the
bytes still do not depend on the machine's thread count, and deploy's reader gets every member back across the frames.
No build here: write_archive over a few in-memory and on-disk members (the built bundles are checked end to end by
test_bundle_deploy, test_bundle_gzip and test_security_bundles)."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from pathlib import Path
from unittest import mock

import pytest

from neuronbuild.packaging import bundle
from neuronbuild.packaging.deploy import _decompressed
from neuronbuild.packaging.manifest import Member


def _members(tmp_path: Path) -> list[Member]:
    weights = tmp_path / "w.safetensors"
    # Half random (incompressible), half a repeated pattern, over more than one zstd job.
    weights.write_bytes(os.urandom(3 << 20) + b"\x3c\x00" * (3 << 19))
    graph = b"%dot = bf16[1,128,64] dot(%p0, %w1)\n" * 20000
    return [Member("weights/abc.safetensors", hashlib.sha256(weights.read_bytes()).hexdigest(),
                   weights.stat().st_size, weights),
            Member("graphs/m/t/b1/model.hlo.pb", hashlib.sha256(graph).hexdigest(), len(graph), None, graph),
            Member("README.md", hashlib.sha256(b"hi\n").hexdigest(), 3, None, b"hi\n")]


def _archive(members: list[Member], compression: str, threads: int) -> bytes:
    out = io.BytesIO()
    with mock.patch.object(bundle, "zstd_threads", lambda: threads):
        bundle.write_archive(out, b'{"bundle_format": 1}', members, compression, b"signature")
    return out.getvalue()


@pytest.mark.parametrize("compression", ["zstd", "gzip"])
def test_bundle_bytes_do_not_depend_on_threads_and_deploy_reads_every_member_back(
        tmp_path: Path, compression: str) -> None:
    members = _members(tmp_path)
    one, three = _archive(members, compression, 1), _archive(members, compression, 3)
    assert one == three
    archive = tmp_path / f"b{bundle.SUFFIX[compression]}"
    archive.write_bytes(one)
    with _decompressed(archive) as stream, tarfile.open(fileobj=stream, mode="r|") as tar:
        got = {m.name: tar.extractfile(m).read() for m in tar}  # type: ignore[union-attr]
        rest = stream.read()
        assert rest.count(0) == len(rest)  # only the end-of-archive padding follows (what deploy accepts)
    names = list(got)
    assert names[:2] == ["manifest.json", "manifest.json.sig"] and names[2:] == sorted(m.path for m in members)
    for m in members:
        assert hashlib.sha256(got[m.path]).hexdigest() == m.sha256
    # The weights (half incompressible) cost their random half; the repetitive graph text compresses away.
    assert len(one) < (3 << 20) + (1 << 20)
