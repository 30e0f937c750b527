"""Deeply nested JSON from files and processes neuronbuild does not trust (pins and records in a shared cache, the
cache's config.json, state files, messages on the channels between processes) is refused like any malformed document:
one line, never a RecursionError traceback, whatever later walks the value (issue #31)."""

from __future__ import annotations

import json
import os
import struct
import threading
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
from helpers import run_cli, write_ws

from neuronbuild import jsondata
from neuronbuild.execution import channel


def _nested(depth: int) -> bytes:  # under the interpreter's recursion limit: json.loads alone accepts it
    return b'{"a": ' + b"[" * depth + b"]" * depth + b"}"


def test_a_message_nested_past_the_bound_is_refused_even_when_json_would_parse_it() -> None:
    r, w = os.pipe()
    frames = [_nested(500), _nested(jsondata.MAX_DEPTH - 2), _nested(100_000)]
    writer = threading.Thread(target=lambda: [os.write(w, struct.pack("!i", len(f)) + f) for f in frames])
    writer.start()
    with Connection(r, writable=False) as conn:
        with pytest.raises(channel.BadMessage, match=f"a message nested deeper than {jsondata.MAX_DEPTH} levels"):
            channel.recv(conn)
        assert channel.recv(conn)["a"]  # within the bound: a message
        with pytest.raises(channel.BadMessage, match="nested deeper than"):
            channel.recv(conn)
    writer.join()
    os.close(w)


@pytest.mark.parametrize("depth", [500, 100_000])
def test_deep_pin_files_config_and_records_in_a_cache_are_one_line_errors_or_misses(tmp_path: Path,
                                                                                  depth: int) -> None:
    ws = write_ws(tmp_path / "ws", {"pkg/BUILD": 'neuron_target(name = "t", platform = "trn2")\n'})
    cache = tmp_path / "cache"
    (cache / "v1" / "pins").mkdir(parents=True)
    (cache / "v1" / "config.json").write_bytes(_nested(depth))
    fp = "ab" * 32
    (cache / "v1" / "ac" / fp[:2]).mkdir(parents=True)
    record = {"version": 1, "fingerprint": fp, "identity": "x", "outputs": {}, "record": {"r": json.loads(b"0")},
              "duration_s": 0.0}
    text = json.dumps(record).replace('"r": 0', '"r": ' + "[" * depth + "]" * depth)
    (cache / "v1" / "ac" / fp[:2] / f"{fp}.json").write_text(text)
    for args in (["cache", "stats"], ["cache", "verify"]):
        proc = run_cli([*args, "--cache-dir", str(cache)], ws)
        assert "Traceback" not in proc.stderr and "RecursionError" not in proc.stderr, proc.stderr[-2000:]
        assert proc.returncode in (0, 1), proc.stderr[-2000:]
    (cache / "v1" / "pins" / "rel.json").write_bytes(_nested(depth))
    proc = run_cli(["cache", "gc", "--max-size", "1", "--cache-dir", str(cache)], ws)
    assert proc.returncode != 0 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert "rel.json: unreadable pin file (JSON nested deeper than" in proc.stderr, proc.stderr


@pytest.mark.parametrize("depth", [500, 100_000])
def test_a_deep_params_json_in_a_neuron_graph_is_a_one_line_runtime_error(depth: int) -> None:
    from neuronbuild.runtime.xla_cpu import XlaCpuError, read_params, read_tp

    for read in (read_tp, read_params):
        with pytest.raises(XlaCpuError, match="params.json is malformed: JSON nested deeper than"):
            read(_nested(depth))
