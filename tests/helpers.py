"""Shared helpers for tests: writing small workspaces and running the CLI in-process or as a subprocess."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
MODEL_SRC = (EXAMPLES / "models" / "llama.py").read_text() if (EXAMPLES / "models" / "llama.py").exists() else ""


def write_ws(root: Path, files: dict[str, str]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "WORKSPACE.neuronbuild").write_text("")
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def copy_example(dest: Path, hf: bool = False) -> Path:
    """The example workspace; examples/hf (transformers models, tests/test_models_hf.py) only when asked for."""
    skip = ("neuronbuild-out", "__pycache__") + (() if hf else ("hf",))
    shutil.copytree(EXAMPLES, dest, ignore=shutil.ignore_patterns(*skip))
    return dest


# The suite runs in batch mode (no build server): in-process cli.main calls and every child inherit this. Tests of the
# server (tests/test_server.py) opt in explicitly, with their own output user root, and shut their servers down.
os.environ["NEURONBUILD_NO_SERVER"] = "1"
# Builds record their invocations in the workspace's output base (neuronbuild/report/): under a temporary user root
# here, never the user's ~/.cache/neuronbuild-server (tests that need their own root set it, as test_server.py does).
if "NEURONBUILD_OUTPUT_USER_ROOT" not in os.environ:
    import atexit
    import tempfile

    os.environ["NEURONBUILD_OUTPUT_USER_ROOT"] = tempfile.mkdtemp(prefix="neuronbuild-test-output-root-")
    atexit.register(shutil.rmtree, os.environ["NEURONBUILD_OUTPUT_USER_ROOT"], True)

# A caller's compile-affecting variables (OMP_NUM_THREADS in many CI images, NEURON_*, XLA_*) make every build warn
# that they are not passed to actions: tests that count warnings would see the machine's shell, not the build. The
# suite starts without them; tests of that warning pass them explicitly (tests/test_explain_env.py).
_COMPILE_AFFECTING = re.compile(r"^(NEURON_.*|TORCHINDUCTOR_.*|XLA_.*|OMP_NUM_THREADS)$")
for _name in [k for k in os.environ if _COMPILE_AFFECTING.match(k)]:
    del os.environ[_name]

_ENV_AT_START = frozenset(os.environ)  # helpers is imported by conftest, before any test imports torch


def run_cli(args: list[str], cwd: Path, env: dict[str, str] | None = None,
            python_flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    # In-process use of torch, dask or jax in other tests sets variables such as TORCHINDUCTOR_CACHE_DIR or
    # OMP_NUM_THREADS in this process; a user's shell would not have them, so children start without them unless a
    # test passes them explicitly.
    full_env = {k: v for k, v in os.environ.items() if k in _ENV_AT_START or not _COMPILE_AFFECTING.match(k)}
    full_env.update(env or {})
    return subprocess.run([sys.executable, *python_flags, "-m", "neuronbuild", *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=1800)


def running(pid: int) -> bool:
    """Whether process `pid` runs (exists and is not a zombie); False too when it ends while being looked at."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def named(comm: str) -> list[int]:
    """The running (not zombie) processes whose name (comm) is `comm`."""
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if Path(f"/proc/{p}/comm").read_text().strip() == comm and running(int(p)):
                    out.append(int(p))
            except OSError:
                pass
    return out


def user_signals() -> None:
    """preexec_fn for a child that stands for a command typed at a terminal: Ctrl-C and SIGTERM reach it. Python
    keeps an inherited SIG_IGN for SIGINT (it installs KeyboardInterrupt only over SIG_DFL), and a blocked mask is
    inherited too; a test process may have either from a library it ran (seen on xdist workers: an interrupted build
    spun on for 30 s)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
