"""What `pip install` gives users. A wheel built from the checkout holds every package and data file; installed from
it (not editable) into a fresh virtualenv, the base install alone (torch, safetensors, numpy) serves a deployed cpu
bundle, and with the `build` extra the CLI builds a tiny workspace whose bundle deploys and then loads strictly.

One virtualenv, installed once (torch comes from the wheel on disk): the module fixture runs the serving-only checks
before it adds the `build` extra and records each phase's results; each test asserts on one phase's, so the tests
do not depend on their order."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers import _ENV_AT_START, REPO, run_cli, write_ws

pytestmark = pytest.mark.slow

# The build side's own distributions (import names): none may be in a serving-only install. (torch itself requires
# networkx, jinja2 and filelock, so those are there whatever neuronbuild declares.)
BUILD_ONLY = ("starlark_go", "blake3", "rich", "zstandard", "cryptography", "dask", "boto3")

SERVE = r"""
import importlib.util, json, sys
import neuronbuild
from neuronbuild.runtime import open_cache
lm = open_cache(sys.argv[1], strict=True).causal_lm("//models:llama_cpu")
tokens = lm.generate([[1, 17, 99, 250], [1, 5, 6]], max_new_tokens=4).tolist()
print(json.dumps({"tokens": tokens, "file": neuronbuild.__file__,
                  "present": [m for m in sys.argv[2:] if importlib.util.find_spec(m) is not None]}))
"""

STRICT = r"""
import json, sys
import torch
import neuronbuild
from neuronbuild.runtime import open_cache
m = open_cache(sys.argv[1], strict=True).model("//m:mlp_cpu")
torch.manual_seed(0)
y = m(torch.randn(2, 8))
y = y if isinstance(y, torch.Tensor) else next(iter(y.values())) if isinstance(y, dict) else y[0]
print(json.dumps({"shape": list(y.shape), "finite": bool(torch.isfinite(y).all()), "file": neuronbuild.__file__}))
"""

MLP = '''import torch


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def build(config):
    torch.manual_seed(0)
    return Mlp()
'''

# Loads the shipped macro library from the installed package data (@neuronbuild//rules:llm.bzl).
TINY_BUILD = '''load("@neuronbuild//rules:llm.bzl", "llm_compile")
neuron_model(name = "mlp", srcs = ["mlp.py"], entry = "mlp:build", inputs = {"x": "float32[batch, 8]"})
neuron_buckets(name = "b", shapes = [{"batch": 2}])
neuron_target(name = "cpu", platform = "cpu", isa = "x86-64")
llm_compile(name = "mlp", model = ":mlp", buckets = [":b"], targets = [":cpu"])
neuron_bundle(name = "release", srcs = [":mlp_cpu"])
'''


def _env() -> dict[str, str]:
    """The user's environment (no PYTHONPATH: nothing from the checkout), batch mode."""
    env = {k: v for k, v in os.environ.items()
           if (k in _ENV_AT_START or not k.startswith("TORCHINDUCTOR_")) and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["NEURONBUILD_NO_SERVER"] = "1"
    return env


def _run(cmd: list[str], cwd: Path, timeout: float = 1200) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)


def _ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, f"{proc.args}\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built (as `pip wheel` does, build isolation and all) from a copy of the checkout's sources."""
    base = tmp_path_factory.mktemp("wheel")
    src = base / "src"
    for name in ("neuronbuild", "rules"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(REPO / name, src / name)
    _ok(_run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(base / "dist"), str(src)], base))
    (found,) = (base / "dist").glob("neuronbuild-*.whl")
    return found


def test_the_wheel_holds_every_package_module_and_data_file(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = [p for p in (REPO / "neuronbuild").rglob("*") if p.is_file() and "__pycache__" not in p.parts
               and p.suffix != ".pyc"]
    want = {p.relative_to(REPO).as_posix() for p in sources}
    assert {p.parent for p in sources if p.name == "__init__.py"} >= {REPO / "neuronbuild" / "server"}
    want |= {f"neuronbuild/rules/{p.name}" for p in (REPO / "rules").iterdir() if p.is_file()}
    assert "neuronbuild/packaging/templates/README.md.j2" in want and "neuronbuild/rules/llm.bzl" in want
    assert want - names == set()
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    requires = [ln for ln in zipfile.ZipFile(wheel).read(meta).decode().splitlines() if ln.startswith("Requires-Dist")]
    base = sorted(ln.split(": ", 1)[1].split(";")[0].split(">")[0].split("=")[0].split("<")[0].strip()
                  for ln in requires if "extra ==" not in ln)
    assert base == ["numpy", "safetensors", "torch"], requires


@dataclass
class Installed:
    serving: dict = field(default_factory=dict)  # type: ignore[type-arg]
    reference: dict = field(default_factory=dict)  # type: ignore[type-arg]
    serving_build: subprocess.CompletedProcess[str] | None = None
    version: str = ""
    build: subprocess.CompletedProcess[str] | None = None
    rebuild: subprocess.CompletedProcess[str] | None = None
    strict: dict = field(default_factory=dict)  # type: ignore[type-arg]
    site: str = ""


@pytest.fixture(scope="module")
def installed(wheel: Path, built_example, tmp_path_factory: pytest.TempPathFactory) -> Installed:  # type: ignore[no-untyped-def]
    """A fresh virtualenv (no system site-packages, no editable install): first the wheel alone, which serves the
    example's deployed release_cpu bundle; then the wheel's `build` extra, which builds, deploys and strictly loads
    a tiny workspace."""
    ws_example, _ = built_example
    base = tmp_path_factory.mktemp("venv")
    deployed = base / "deployed"
    _ok(run_cli(["deploy", str(ws_example / "neuronbuild-out/models/release_cpu.tar.zst"), "--cache-dir",
                 str(deployed)], ws_example))
    venv = base / "venv"
    _ok(_run([sys.executable, "-m", "venv", "--without-pip", str(venv)], base))
    py, nb = str(venv / "bin" / "python"), str(venv / "bin" / "neuronbuild")
    # This pip installs into the new venv (--python): no pip of its own needed; no .pyc compiled ahead (torch's
    # thousands of modules), each is compiled when first imported, as any install without the step does.
    pip = [sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-compile"]
    _ok(_run([*pip, str(wheel), "torch==2.13.0"], base))
    got = Installed(site=_ok(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], base)).strip())
    # Phase 1: serving only.
    got.serving = json.loads(_ok(_run([py, "-c", SERVE, str(deployed), *BUILD_ONLY], base)).splitlines()[-1])
    got.reference = json.loads(_ok(_run([sys.executable, "-c", SERVE, str(deployed)], base)).splitlines()[-1])
    got.serving_build = _run([nb, "build", "//..."], ws_example)
    # Phase 2: the build extra.
    _ok(_run([*pip, f"{wheel}[build]"], base))
    got.version = _ok(_run([nb, "--version"], base)).strip()
    ws = write_ws(base / "ws", {"m/mlp.py": MLP, "m/BUILD": TINY_BUILD})
    cache = base / "cache"
    got.build = _run([nb, "build", "//m:release", "--jobs", "1", "--cache-dir", str(cache)], ws)
    got.rebuild = _run([nb, "build", "//m:release", "--jobs", "1", "--cache-dir", str(cache)], ws)
    serve = base / "serve"
    if got.build.returncode == 0:
        _ok(_run([nb, "deploy", str(ws / "neuronbuild-out/m/release.tar.zst"), "--cache-dir", str(serve)], ws))
        got.strict = json.loads(_ok(_run([py, "-c", STRICT, str(serve)], base)).splitlines()[-1])
    return got


def test_the_base_install_alone_serves_a_deployed_bundle(installed: Installed) -> None:
    assert installed.serving["file"].startswith(installed.site)  # the installed copy, not the checkout
    assert installed.serving["present"] == []  # nothing of the build side installed
    assert installed.serving["tokens"] == installed.reference["tokens"]
    assert len(installed.serving["tokens"]) == 2 and len(installed.serving["tokens"][0]) == 4 + 4
    # The build side is missing: one line saying how to install it, no traceback.
    proc = installed.serving_build
    assert proc is not None and proc.returncode == 2, proc and proc.stderr
    assert "pip install 'neuronbuild[build]'" in proc.stderr and "Traceback" not in proc.stderr


def test_the_wheel_with_the_build_extra_builds_deploys_and_loads_strictly(installed: Installed) -> None:
    assert installed.version.splitlines()[0] == "neuronbuild 0.1.0"  # (then the versions builds depend on)
    assert installed.build is not None and installed.build.returncode == 0, installed.build.stderr[-4000:]
    assert "3 executed" in installed.build.stdout + installed.build.stderr  # weights, a trace, an AOTInductor compile
    assert installed.rebuild is not None and installed.rebuild.returncode == 0
    assert "0 executed" in installed.rebuild.stdout + installed.rebuild.stderr
    assert installed.strict["file"].startswith(installed.site)
    assert installed.strict["shape"] == [2, 4] and installed.strict["finite"]
