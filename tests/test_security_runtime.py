"""The serving runtime refuses inputs a kernel would read out of range: token ids outside the model's vocabulary and
non-integer ids are a ValueError naming the input, never an abort of the serving process (issue #31)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from helpers import run_cli

BUNDLE = Path("neuronbuild-out/models/release.tar.zst")
CPU = "//models:llama_cpu"

PROBE = r"""
import json, sys
import torch
from neuronbuild.runtime import open_cache

lm = open_cache(sys.argv[1], strict=True).causal_lm(sys.argv[2])
out = {"vocab": lm.vocab_size}
cases = {"huge": [[1, 10**6]], "negative": [[1, -1]], "at_vocab": [[1, lm.vocab_size]], "float": [[1, 2.5]],
         "bool": [[True, 1]], "float_tensor": torch.tensor([[1.0, 2.0]])}
for name, ids in cases.items():
    try:
        lm.generate(ids, max_new_tokens=2)
        out[name] = "no error"
    except ValueError as e:
        out[name] = str(e)
out["ok"] = lm.generate([[1, lm.vocab_size - 1]], max_new_tokens=2).shape[1]
print(json.dumps(out))
"""


def test_out_of_range_or_non_integer_token_ids_are_a_value_error_not_an_abort(
        built_example, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ws, _ = built_example
    dest = tmp_path / "cache"
    proc = run_cli(["deploy", str(ws / BUNDLE), "--cache-dir", str(dest)], ws)
    assert proc.returncode == 0, proc.stderr
    run = subprocess.run([sys.executable, "-c", PROBE, str(dest), CPU], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (run.returncode, run.stderr[-3000:])  # never SIGABRT from a kernel
    got = json.loads(run.stdout.strip().splitlines()[-1])
    vocab = got["vocab"]
    assert isinstance(vocab, int) and vocab > 1
    assert got["huge"] == f"input_ids[0][1] = 1000000 is not a token id of {CPU} (0 <= id < vocab_size {vocab})"
    assert got["negative"].startswith("input_ids[0][1] = -1 is not a token id")
    assert got["at_vocab"].startswith(f"input_ids[0][1] = {vocab} is not a token id")
    for name in ("float", "bool", "float_tensor"):
        assert "input_ids must hold integer token ids" in got[name], got[name]
    assert got["ok"] == 4  # the largest valid id still generates
