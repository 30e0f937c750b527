"""The documented release flow (docs/deploy.md) on this CPU host without a Neuron device: verify --host, deploy with
--sha256, then the start-up snippet from the docs, run as written in a fresh process with the release's environment."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from helpers import REPO, run_cli

BUNDLE = "neuronbuild-out/models/release_cpu.tar.zst"


def _doc_block(heading: str, lang: str) -> str:
    text = (REPO / "docs" / "deploy.md").read_text()
    start = text.index(heading)
    m = re.compile(rf"```{lang}\n(.*?)```", re.S).search(text, start)
    assert m is not None, f"no ```{lang} block after {heading!r}"
    return m.group(1)


def _env_file(path: Path) -> dict[str, str]:
    """NAME=VALUE lines (shell-quoted values), as `set -a; . FILE` reads them."""
    out: dict[str, str] = {}
    for ln in path.read_text().splitlines():
        if ln and not ln.startswith("#"):
            name, value = ln.split("=", 1)
            out[name] = " ".join(shlex.split(value))
    return out


def test_the_documented_release_flow_runs_as_written_on_a_cpu_host(built_example, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ws, _ = built_example
    cpu_host = {"NEURON_PLATFORM_TARGET_OVERRIDE": ""}  # this machine as the docs describe it: no Neuron device
    verify = run_cli(["verify", BUNDLE, "--host"], ws, cpu_host)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "can use every graph" in verify.stdout
    # The CPU+trn2 release is refused here, as the docs say, one line per trn2 graph.
    both = run_cli(["verify", "neuronbuild-out/models/release.tar.zst", "--host"], ws, cpu_host)
    assert both.returncode == 1 and both.stderr.count("target.platform differs (built for trn2") == 4, both.stderr

    # Step 3 as written, with the documented /tmp/serve replaced by this test's directory.
    serve = tmp_path / "serve"
    step3 = _doc_block("## 3. Check the host, then deploy", "").replace("/tmp/serve", str(serve))
    deploy_cmd = step3[step3.index("neuronbuild deploy"):].replace("\\\n", " ").strip()
    proc = subprocess.run(deploy_cmd.replace("neuronbuild ", f"{sys.executable} -m neuronbuild ", 1), shell=True,
                          cwd=ws, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rid = re.search(r"release (\w+) installed", proc.stdout)
    assert rid is not None, proc.stdout

    # Step 4: the release's environment, then the documented snippet in a fresh process.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NEURON", "TORCHINDUCTOR_"))}
    env.update(_env_file(serve / "releases" / rid.group(1) / "neuronbuild.env"))
    assert env["NEURONBUILD_STRICT"] == "1" and env["NEURONBUILD_REQUIRE"] == "//models:llama_cpu"
    env["TMPDIR"] = str(tmp_path)
    script = tmp_path / "start.py"
    script.write_text(_doc_block("## 4. Start strictly", "python").replace("/tmp/serve", str(serve)))
    run = subprocess.run([sys.executable, str(script)], cwd=ws, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    printed = re.search(r"print\(.*# (.*)$", _doc_block("## 4. Start strictly", "python"), re.M)
    assert printed is not None
    assert run.stdout.strip() == printed.group(1).strip()  # what the docs say it prints
