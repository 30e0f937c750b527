"""Runtime calls as users make them (issue 32): inputs positional or by their declared names, numpy arrays or torch
tensors, dtypes checked against the manifest before any graph runs (int32 tokens widened for an int64 input, a float
for an int input refused naming the input), nothing on stderr from a failed call; a strict model() fails when it is
opened if its graphs cannot run here (issue 30); `deploy` says when a release cannot run on this host and
`deploy --host` refuses it. Uses the example's release bundle (built once for the session)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run_cli

RELEASE = Path("neuronbuild-out/models/release.tar.zst")  # llama_cpu + llama_trn2
RELEASE_CPU = Path("neuronbuild-out/models/release_cpu.tar.zst")
CPU, TRN2 = "//models:llama_cpu", "//models:llama_trn2"
NO_DEVICE = {"NEURON_PLATFORM_TARGET_OVERRIDE": ""}  # this host's own answer: no Neuron device here


@pytest.fixture(scope="module")
def deployed(built_example, tmp_path_factory: pytest.TempPathFactory) -> Path:  # type: ignore[no-untyped-def]
    ws, _ = built_example
    dest = tmp_path_factory.mktemp("inputs_serve") / "cache"
    proc = run_cli(["deploy", str(ws / RELEASE), "--dest", str(dest)], ws, env=NO_DEVICE)
    assert proc.returncode == 0, proc.stderr
    return dest


@pytest.fixture(scope="module")
def cache(deployed: Path):  # type: ignore[no-untyped-def]
    from neuronbuild.runtime import open_cache

    return open_cache(deployed, strict=True, require=[CPU])


@pytest.fixture(scope="module")
def context(cache):  # type: ignore[no-untyped-def]
    """The cpu context graphs (inputs input_ids, attention_mask: int64 [batch, seq]; buckets batch 1 and 4 x seq 32)."""
    return cache.model(CPU).family("context")


def test_inputs_by_name_positional_or_numpy_give_the_same_outputs(context) -> None:  # type: ignore[no-untyped-def]
    import numpy as np
    import torch

    assert list(context.inputs) == ["input_ids", "attention_mask"]
    ids = torch.randint(0, 512, (3, 20), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    want = context(ids, mask)
    calls = {
        "named": context(input_ids=ids, attention_mask=mask),
        "named, other order": context(attention_mask=mask, input_ids=ids),
        "mixed": context(ids, attention_mask=mask),
        "numpy": context(ids.numpy(), mask.numpy()),
        "numpy by name": context(input_ids=ids.numpy(), attention_mask=mask.numpy()),
        "numpy, read-only and big-endian": context(np.asarray(ids.numpy().astype(">i8")), _read_only(mask.numpy())),
    }
    for how, got in calls.items():
        for name in ("logits", "kv"):
            assert torch.equal(got[name], want[name]), (how, name)
    assert context.route(input_ids=ids, attention_mask=mask).bucket_name == "context_batch4_seq32"


def _read_only(a):  # type: ignore[no-untyped-def]
    a = a.copy()
    a.flags.writeable = False
    return a


def test_int32_tokens_for_an_int64_input_are_widened(context) -> None:  # type: ignore[no-untyped-def]
    import torch

    ids = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    want = context(ids, mask)
    for got in (context(ids.to(torch.int32), mask.to(torch.int32)),
                context(ids.numpy().astype("int32"), attention_mask=mask.numpy().astype("uint8"))):
        assert torch.equal(got["logits"], want["logits"])
    # a non-contiguous view (no padding needed at batch 4) runs as its values, not as its strides
    t = ids.t().contiguous().t()
    assert not t.is_contiguous() and torch.equal(context(t, mask)["logits"], want["logits"])


def test_generate_takes_numpy_prompts(cache) -> None:  # type: ignore[no-untyped-def]
    import numpy as np

    lm = cache.causal_lm(CPU)
    prompts = [[0, 0, 1, 17, 99, 250], [1, 5, 6, 7, 8, 9]]
    mask = [[0, 0, 1, 1, 1, 1], [1] * 6]
    want = lm.generate([[1, 17, 99, 250], [1, 5, 6, 7, 8, 9]], max_new_tokens=5)
    got = lm.generate(np.array(prompts, dtype=np.int32), attention_mask=np.array(mask, dtype=np.int8), max_new_tokens=5)
    assert got.tolist() == want.tolist()


def test_a_float_for_an_int_input_is_refused_naming_the_input_and_both_dtypes(context) -> None:  # type: ignore[no-untyped-def]
    import numpy as np
    import torch

    from neuronbuild.runtime import InputError

    ids = torch.randint(0, 512, (1, 32))
    mask = torch.ones_like(ids)
    refused = {
        "input 'input_ids' is declared int64, given float32": lambda: context(ids.float(), mask),
        "input 'attention_mask' is declared int64, given float64": lambda: context(ids, mask.numpy().astype(np.float64)),
        "input 'attention_mask' is declared int64, given bool": lambda: context(ids, attention_mask=mask.bool()),
        "input 'input_ids' is declared int64, given uint64": lambda: context(ids.numpy().astype(np.uint64), mask),
        "has no input 'mask' (its inputs: input_ids, attention_mask)": lambda: context(ids, mask=mask),
        "missing input(s) attention_mask": lambda: context(input_ids=ids),
        "input 'input_ids' given twice": lambda: context(ids, mask, input_ids=ids),
        "input 'input_ids' must be a torch tensor or a numpy array, got list": lambda: context(ids.tolist(), mask),
    }
    for message, call in refused.items():
        with pytest.raises(InputError) as e:
            call()
        assert message in str(e.value) and str(e.value).startswith(CPU), str(e.value)


FAILED_CALLS = r"""
import json, sys
import numpy as np, torch
from neuronbuild.runtime import open_cache
model = open_cache(sys.argv[1], strict=True, require=[sys.argv[2]]).model(sys.argv[2]).family("context")
ids = torch.randint(0, 512, (4, 32))
errors = []
for call in (lambda: model(ids.float(), torch.ones_like(ids)),                # float for int64
             lambda: model(ids.numpy().astype(np.float32), np.ones((4, 32))),  # numpy floats
             lambda: model(tokens=ids, mask=ids),                             # names it does not declare
             lambda: model(torch.zeros(2, 50, dtype=torch.int64), torch.ones(2, 50, dtype=torch.int64)),  # seq
             lambda: model(ids, torch.ones(4, 32, 2, dtype=torch.int64))):     # wrong rank
    try:
        call()
        errors.append("no error")
    except Exception as e:  # noqa: BLE001
        errors.append(f"{type(e).__name__}: {e}")
out = model(ids.to(torch.int32), torch.ones_like(ids).numpy().astype(np.int32))  # ran, not refused
print(json.dumps({"errors": errors, "shape": list(out["logits"].shape)}))
"""


def test_failed_calls_write_nothing_to_stderr(deployed: Path, tmp_path: Path) -> None:
    """In a fresh process (so that the C++ runtime's own writes to fd 2 would show): every failed call is one Python
    exception and stderr stays empty; int32 inputs, which AOTInductor used to refuse on stderr, run."""
    proc = subprocess.run([sys.executable, "-c", FAILED_CALLS, str(deployed), CPU], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr == ""
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["shape"] == [4, 512]
    float_ids, numpy_floats, names, too_long, rank = got["errors"]
    assert float_ids.startswith("InputError: ") and "'input_ids' is declared int64, given float32" in float_ids
    assert "'input_ids' is declared int64, given float32" in numpy_floats
    assert "has no input 'tokens'" in names
    assert too_long.startswith("NoBucketFits: ") and rank.startswith("NoBucketFits: ")


def test_strict_model_fails_at_open_when_its_graphs_cannot_run_here(deployed: Path) -> None:
    """trn2 graphs without emulation cannot run on this host: a strict model() says so when opened, naming every
    graph and why, as `require` at open does (not at the first call)."""
    from neuronbuild.runtime import open_cache

    cache = open_cache(deployed, strict=True)  # nothing required at open
    with pytest.raises(RuntimeError) as e:
        cache.model(TRN2)
    msg = str(e.value)
    assert msg.startswith(f"strict mode: {TRN2}: 4 graph(s) cannot run here")
    assert f"{TRN2} [token: batch=4]: target.platform differs (built for trn2" in msg
    cpu = cache.model(CPU)  # the cpu graphs run here: all loaded now
    assert cache.counters.hit == 4 and cpu.families == ["context", "token"]
    lenient = open_cache(deployed, strict=False)
    assert lenient.model(TRN2).label == TRN2  # lenient: opens; the problem shows at a call (or the eager fallback)


def test_deploy_says_when_a_release_cannot_run_on_this_host(built_example, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ws, _ = built_example
    proc = run_cli(["deploy", str(ws / RELEASE), "--dest", str(tmp_path / "a")], ws, env=NO_DEVICE)
    assert proc.returncode == 0, proc.stderr
    assert "installed" in proc.stdout
    assert "warning: this host (" in proc.stderr and "cannot run 4 of 8 graph(s) of this release" in proc.stderr
    assert f"{TRN2}: 4 of 4 graph(s): target.platform differs (built for trn2, this host has no Neuron device" \
        in proc.stderr
    assert CPU not in proc.stderr and "Traceback" not in proc.stderr
    # --host is the strict check: nothing is installed
    proc = run_cli(["deploy", str(ws / RELEASE), "--dest", str(tmp_path / "b"), "--host"], ws, env=NO_DEVICE)
    assert proc.returncode == 1 and "nothing was installed" in proc.stderr and f"{TRN2}: 4 of 4" in proc.stderr
    assert not (tmp_path / "b").exists()
    # a release this host runs: no warning, and --host accepts it
    proc = run_cli(["deploy", str(ws / RELEASE_CPU), "--dest", str(tmp_path / "c"), "--host"], ws, env=NO_DEVICE)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    # on a trn2 host (as the Neuron platform override reports one) the whole release runs
    proc = run_cli(["deploy", str(ws / RELEASE), "--dest", str(tmp_path / "d"), "--host"], ws,
                   env={"NEURON_PLATFORM_TARGET_OVERRIDE": "trn2"})
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
