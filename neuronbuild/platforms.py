"""Compile targets' platforms: resolving isa='native' to this machine's x86-64 level, and the C++ compiler version."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess

from neuronbuild import envvars

_LEVELS = (
    ("x86-64-v4", {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}),
    ("x86-64-v3", {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe"}),
    ("x86-64-v2", {"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"}),
)
# A worker's thread budget (execution/env.py sets it: the machine's cores / workers; toolchains/compile.py reads it).
THREADS_VAR = "NEURONBUILD_THREADS"
# In an action's process, the machine's shared toolchain scratch dir (the workers' $TMPDIR; the action's own $TMPDIR
# is private: execution/worker.py sets both), where toolchains/compile.py finds the precompiled headers beside it.
SHARED_TMP_VAR = "NEURONBUILD_SHARED_TMPDIR"
HOST_ISA_ENV = "NEURONBUILD_HOST_ISA"  # overrides detection (testing, or pinning a farm to a lower level)


def host_cores() -> int:
    """The cores this process may run on (its CPU affinity, else the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def host_isa() -> str:
    """This machine's CPU ISA level (x86-64-v4 ... x86-64), or the machine name on other architectures (once per
    command: envvars.fact)."""
    return envvars.fact(host_isa, _host_isa)


def _host_isa() -> str:
    forced = envvars.current().text(HOST_ISA_ENV)
    if forced:
        return forced
    machine = platform.machine()
    if machine not in ("x86_64", "AMD64"):
        return machine
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        return "x86-64"
    for name, need in _LEVELS:
        if need <= flags:
            return name
    return "x86-64"


def resolve_isa(isa: str | None) -> str:
    return host_isa() if isa in (None, "native") else str(isa)


def cxx_version() -> str:
    """Version of the C++ compiler AOTInductor will use (g++ on PATH), or 'none' (once per command: envvars.fact)."""
    return envvars.fact(cxx_version, _cxx_version)


def _cxx_version() -> str:
    env = envvars.environ()  # the command's
    path = env.get("PATH")
    cxx = env.get("CXX") or shutil.which("g++", path=path) or shutil.which("c++", path=path)
    if not cxx:
        return "none"
    try:
        out = subprocess.run([cxx, "-dumpfullversion", "-dumpversion"], capture_output=True, text=True, timeout=10,
                             env=dict(env))
        return f"{os.path.basename(cxx)} {out.stdout.strip()}"
    except (OSError, subprocess.SubprocessError):
        return "unknown"
