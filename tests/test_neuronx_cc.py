"""The neuronx-cc hand-off against a stand-in that keeps neuronx-cc's command-line contract (tests/standins/neuronx-cc):
success (NEFF cached and materialised), failure (log shown, nothing cached) and a hang (killed at the timeout)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import run_cli
from introspect_ws import (
    STANDIN,
    cli_json,
    copy_ws,
    edit,
    tiny_built_fixture,  # noqa: F401  (registers the session fixture `tiny_built`)
)

from neuronbuild.toolchains.errors import ToolchainError
from neuronbuild.toolchains.neuron_flags import neuron_cc_env_flags
from neuronbuild.toolchains.neuronx_cc import neuronx_cc_command

NO_CC = {"NEURONX_CC": ""}


def _setup(tiny_built: tuple[Path, Path], tmp_path: Path, mode: str | None = None) -> tuple[Path, Path]:
    """A copy of the tiny workspace cut to one bucket (optionally with a stand-in mode flag) and of its cache (the
    trace is cached, so a build runs one trn2 compile)."""
    ws0, cache0 = tiny_built
    ws, cache = copy_ws(ws0, tmp_path / "ws"), tmp_path / "cache"
    shutil.copytree(cache0, cache)
    edit(ws / "m/BUILD", '"seq": [8, 16]', '"seq": [8]')
    if mode:
        edit(ws / "m/BUILD", 'model_type = "transformer"', f'model_type = "transformer", flags = ["--standin-mode={mode}"]')
    return ws, cache


def _fps(ws: Path, cache: Path, *extra: str, env: dict[str, str] | None = None) -> dict[str, str]:
    out = cli_json(["plan", "--cache-dir", str(cache), *extra], ws, env)
    return {a["description"]: a["fingerprint"] for a in out["execute"]}


@pytest.fixture(scope="module")
def hlo_and_archive(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A real model.hlo.pb (+ params.json) of a tiny model, and the same program as a torch.export archive."""
    import torch

    from neuronbuild.toolchains.neuron_hlo import lower_program

    d = tmp_path_factory.mktemp("hlo")
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).eval()
    with torch.no_grad():
        ep = torch.export.export(model, (torch.ones(3, 4),), strict=False)
    torch.export.save(ep, str(d / "program.pt2"))
    low = lower_program(ep)
    (d / "model.hlo.pb").write_bytes(low.proto)
    (d / "params.json").write_bytes(low.params_json())
    return d / "model.hlo.pb", d / "params.json", d / "program.pt2"


def _standin(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(STANDIN), *args], capture_output=True, text=True, cwd=cwd, timeout=120)


def test_command_line_contract(hlo_and_archive, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    hlo, params, _ = hlo_and_archive
    options = {"opt_level": 3, "auto_cast": "matmult", "model_type": "transformer", "lnc": 1, "flags": ["--foo=1"]}
    argv = neuronx_cc_command(str(STANDIN), "trn2", options, neuron_cc_env_flags("--verbose=35 --cache_dir=/c"))
    assert argv == [str(STANDIN), "compile", "model.hlo.pb", "--framework", "XLA", "--target", "trn2", "--output",
                    "model.neff", "-O3", "--auto-cast", "matmult", "--auto-cast-type", "bf16", "--model-type",
                    "transformer", "--lnc", "1", "--foo=1", "--verbose=35"]
    # --auto-cast is always explicit (neuronx-cc's own default is matmult); no --lnc unless set, and never off trn2
    assert neuronx_cc_command("cc", "trn1", {})[9:] == ["-O2", "--auto-cast", "none"]
    with pytest.raises(ToolchainError, match="lnc .* trn2 only"):
        neuronx_cc_command("cc", "trn1", {"lnc": 2})
    # The exact argv the build runs is accepted by the stand-in, which reads the module's signature into the NEFF.
    shutil.copyfile(hlo, tmp_path / "model.hlo.pb")
    proc = _standin(argv[1:], tmp_path)
    assert proc.returncode == 0, proc.stderr
    neff = (tmp_path / "model.neff").read_bytes()
    assert neff.startswith(b"NEFF\x00standin\n")
    body = json.loads(neff.split(b"\n", 1)[1])
    declared = json.loads(params.read_text())
    assert [v["shape"] for v in body["inputs"].values()] == [p["shape"] for p in declared["parameters"]]
    assert list(body["inputs"]) == [f"input{i}" for i in range(len(declared["parameters"]))]
    assert [v["shape"] for v in body["outputs"].values()] == [[3, 2]]
    assert body["options"]["--lnc"] == "1" and body["extra_flags"] == ["--foo=1"]
    assert "Compiler status PASS" in (tmp_path / "log-neuron-cc.txt").read_text()


def test_standin_rejects_what_the_real_cli_would(hlo_and_archive, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    hlo, _params, archive = hlo_and_archive
    for name, data in (("program.pt2", archive.read_bytes()), ("text.hlo", b"HloModule m\nENTRY e {}\n"),
                       ("cut.hlo.pb", hlo.read_bytes()[: len(hlo.read_bytes()) // 2]), ("empty.pb", b"")):
        (tmp_path / name).write_bytes(data)
        proc = _standin(["compile", name, "--framework", "XLA", "--target", "trn2", "--output", "m.neff"], tmp_path)
        assert proc.returncode == 1 and "not a serialized HloModuleProto" in proc.stderr, (name, proc.stderr)
        assert not (tmp_path / "m.neff").exists()
    shutil.copyfile(hlo, tmp_path / "model.hlo.pb")
    base = ["compile", "model.hlo.pb", "--framework", "XLA", "--target", "trn2", "--output", "m.neff"]
    for bad, why in ((["--framework", "PT"], "--framework"), (["--lnc", "2"], "--lnc"), (["-O4"], "-O4"),
                     (["--auto-cast", "fp8"], "--auto-cast"), (["--model-type", "llm"], "--model-type"),
                     (["-O1", "--optlevel", "2"], "given twice"), (["extra.pb"], "exactly one input")):
        args = [*base, *bad]
        if bad == ["--framework", "PT"]:
            args = [*base[:2], "--framework", "PT", *base[4:]]
        if bad == ["--lnc", "2"]:
            args = [*base[:4], "--target", "trn1", *base[6:], "--lnc", "2"]
        proc = _standin(args, tmp_path)
        assert proc.returncode == 2 and why in proc.stderr, (bad, proc.stderr)
    missing = _standin(["compile", "model.hlo.pb", "--target", "trn2", "--output", "m.neff"], tmp_path)
    assert missing.returncode == 2 and "required: --framework" in missing.stderr
    version = _standin(["--version"], tmp_path)
    assert version.returncode == 0 and version.stdout.startswith("NeuronX Compiler version 2.99.0.0+standin")


def test_neuron_cc_flags_drop_the_cache_wrapper_flags() -> None:
    assert neuron_cc_env_flags("--cache_dir /c --no_cache --retry_failed_compilation --log_level INFO "
                               "--verbose 35 --enable-saturate-infinity") == [
        "--verbose", "35", "--enable-saturate-infinity"]
    assert neuron_cc_env_flags("") == [] and neuron_cc_env_flags("--cache_dir=/c -O1") == ["-O1"]


def test_version_enters_compile_fingerprints_only(tiny_built, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ws, cache = tiny_built
    without = _fps(ws, tmp_path / "empty", env=NO_CC)
    with_cc = _fps(ws, tmp_path / "empty", "--neuronx-cc", str(STANDIN))
    via_env = _fps(ws, tmp_path / "empty", env={"NEURONX_CC": str(STANDIN)})
    newer = _fps(ws, tmp_path / "empty", env={"NEURONX_CC": str(STANDIN), "NEURONX_CC_STANDIN_VERSION": "3.0.1"})
    assert via_env == with_cc
    for other in (with_cc, newer):
        assert {k for k in without if without[k] != other[k]} == {k for k in without if k.startswith("Compile")}
    assert {k for k in with_cc if with_cc[k] != newer[k]} == {k for k in with_cc if k.startswith("Compile")}
    out = cli_json(["explain", "--cache-dir", str(cache)], ws, {"NEURONX_CC": str(STANDIN)})
    assert {tuple(c["text"] for c in a["changes"]) for a in out["execute"]} == {
        ("toolchain neuronx-cc: (unset) -> 2.99.0.0+standin",)}
    bad = run_cli(["plan", "--neuronx-cc", str(tmp_path / "missing")], ws)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--neuronx-cc" in bad.stderr


def test_without_neuronx_cc_the_build_says_once_that_no_neffs_were_produced(tiny_built, tmp_path) -> None:  # type: ignore[no-untyped-def]
    ws = copy_ws(tiny_built[0], tmp_path / "ws")
    proc = run_cli(["build", "--cache-dir", str(tmp_path / "cache")], ws, NO_CC)
    assert proc.returncode == 0 and " 7 executed" in proc.stdout  # 2 buckets: trace, lower, compile each; weights
    assert proc.stderr.count("NEFFs were not produced") == 1
    assert not list((ws / "neuronbuild-out").rglob("*.neff"))


def test_success_stores_the_neff_and_logs_the_compiler(tiny_built, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ws, cache = _setup(tiny_built, tmp_path)
    proc = run_cli(["build", "--jobs", "2", "--cache-dir", str(cache), "--neuronx-cc", str(STANDIN)], ws)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4 actions: 1 executed, 3 cached" in proc.stdout  # the weights, trace and lowering are reused
    assert "NEFFs were not produced" not in proc.stderr
    out = ws / "neuronbuild-out/m/tiny_trn2"
    manifest = json.loads((out / "manifest.json").read_text())
    assert [b["name"] for b in manifest["buckets"]] == ["batch1_seq8"]
    for b in manifest["buckets"]:
        assert set(b["outputs"]) == {"model.hlo.pb", "params.json", "constants.safetensors", "compile_flags.json",
                                     "program_constants.safetensors",
                                     "model.neff"}
        d = out / b["name"]
        neff = (d / "model.neff").read_bytes()
        assert neff.startswith(b"NEFF\x00standin\n")
        body = json.loads(neff.split(b"\n", 1)[1])
        assert body["target"] == "trn2" and body["options"]["--optlevel"] == "2"
        assert body["options"]["--model-type"] == "transformer"
        assert body["input_sha256"] == hashlib.sha256((d / "model.hlo.pb").read_bytes()).hexdigest()
        flags = json.loads((d / "compile_flags.json").read_text())
        assert flags["neuronx_cc_version"] == "2.99.0.0+standin"
        assert flags["argv"][:9] == ["neuronx-cc", "compile", "model.hlo.pb", "--framework", "XLA", "--target", "trn2",
                                     "--output", "model.neff"]
        log = (cache / "v1/logs" / b["fingerprint"][:2] / f"{b['fingerprint']}.log").read_text()
        assert f"# neuronx-cc: {STANDIN} {shlex.join(flags['argv'][1:])}\n" in log  # what ran is what was recorded
        assert "Compiler status PASS" in log and "# neuronx-cc: exit status 0" in log
    again = run_cli(["build", "--cache-dir", str(cache), "--neuronx-cc", str(STANDIN)], ws)
    assert " 0 executed" in again.stdout  # the NEFF came from the cache


def test_failure_shows_the_log_and_caches_nothing(tiny_built, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ws, cache = _setup(tiny_built, tmp_path, mode="fail")
    proc = run_cli(["build", "--jobs", "2", "--cache-dir", str(cache), "--neuronx-cc", str(STANDIN)], ws)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "neuronx-cc exited with status 1: ERROR 70: internal compiler error" in proc.stderr
    logs = re.findall(r"log: (\S+\.log)", proc.stderr)
    assert logs and "ERROR 70: internal compiler error" in Path(logs[0]).read_text()
    planned = cli_json(["plan", "--cache-dir", str(cache), "--neuronx-cc", str(STANDIN)], ws)
    statuses = {r["compile"]["status"] for t in planned["targets"] for r in t["buckets"]}
    assert statuses == {"build"}  # not cached as a success
    assert list((cache / "v1/failures").rglob("*.json"))  # kept for reports


def test_hang_is_killed_at_the_timeout(tiny_built, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ws, cache = _setup(tiny_built, tmp_path, mode="hang")
    proc = run_cli(["build", "--jobs", "2", "--cache-dir", str(cache), "--neuronx-cc", str(STANDIN),
                    "--neuronx-cc-timeout", "2"], ws)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "neuronx-cc timed out after 2 s and was killed" in proc.stderr
    log = Path(re.findall(r"log: (\S+\.log)", proc.stderr)[0]).read_text()
    pid = int(re.search(r"\(pid (\d+)\)", log).group(1))  # type: ignore[union-attr]
    # killed at the timeout: the compiler ran 2 s (plus the kill's latency, bounded generously for a loaded machine),
    # not until something else gave up (the stand-in sleeps until killed; the test's own limit is 1800 s)
    ran = float(re.search(r"# neuronx-cc: killed after the 2 s timeout \(ran ([0-9.]+) s\)", log).group(1))  # type: ignore[union-attr]
    assert 2.0 <= ran < 60.0, ran
    assert _standins_running_as(pid) == []


def _standins_running_as(pid: int) -> list[int]:
    """The host's running processes of the neuronx-cc stand-in whose pid is `pid` in their own pid namespace (the
    pid a compile logs is the action's namespace's, which the host may give another process, e.g. a kernel thread)."""
    from helpers import running

    out = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{p}/cmdline").read_bytes()
            nspid = next((ln.split()[1:] for ln in Path(f"/proc/{p}/status").read_text().splitlines()
                          if ln.startswith("NSpid:")), [])
        except OSError:
            continue
        if str(STANDIN).encode() in cmdline and nspid and int(nspid[-1]) == pid and running(int(p)):
            out.append(int(p))
    return out
