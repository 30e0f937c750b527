"""The environment actions run with: an allow-list plus declared --action-env variables, never ambient variables."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from neuronbuild import envvars
from neuronbuild.platforms import THREADS_VAR, host_cores

# Variables passed through from the caller. PATH only locates tools (g++); their versions enter fingerprints. The
# plug-in list and path make workers see the toolchains the build planned with (their versions enter fingerprints).
# (NEURONBUILD_PREPARED_ACTIONS=0: workers fork each action's processes when it is dispatched, worker.PREPARED_VAR)
PASSTHROUGH = ("PATH", "NEURONBUILD_PLUGINS", "NEURONBUILD_PLUGIN_PATH", "NEURONBUILD_PREPARED_ACTIONS")
# Caller variables that commonly change compiles; a build warns once when they are set but not declared.
COMPILE_AFFECTING = re.compile(r"^(NEURON_.*|NEURON_CC_FLAGS|TORCHINDUCTOR_.*|XLA_.*|OMP_NUM_THREADS)$")


def action_environment(toolchain_tmp: Path, home: Path,
                       declared: Sequence[tuple[str, str | None]] = ()) -> dict[str, str]:
    """The allow-list, then declared variables (their names and values are in every fingerprint) on top."""
    caller = envvars.environ()  # the command's environment
    env = {k: caller[k] for k in PASSTHROUGH if k in caller}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    env.update({
        "HOME": str(home),
        "TMPDIR": str(toolchain_tmp),  # AOTInductor's precompiled headers live under TMPDIR: keep them across builds
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONHASHSEED": "0",
        "OMP_NUM_THREADS": "1",  # one worker per core; codegen does not follow this (the toolchain pins threads)
        "AOTI_RUNTIME_CHECK_INPUTS": "1",
        # HOME is shared by every action: no Python process started with this environment (a worker, a compiler
        # written in Python) imports a .pth an action left in ~/.local (user site-packages run .pth code at start).
        "PYTHONNOUSERSITE": "1",
    })
    for name, value in declared:
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def undeclared_warning(declared: Sequence[tuple[str, str | None]],
                       environ: Mapping[str, str] | None = None) -> str | None:
    """One warning line naming compile-affecting caller variables that actions will not see, or None."""
    environ = envvars.environ() if environ is None else environ  # (the command's)
    names = {n for n, _v in declared}
    ignored = sorted(k for k in environ if COMPILE_AFFECTING.match(k) and k not in names)
    if not ignored:
        return None
    return (f"warning: {', '.join(ignored)} {'is' if len(ignored) == 1 else 'are'} set but not passed to actions; "
            f"declare with --action-env NAME to use {'it' if len(ignored) == 1 else 'them'} (fingerprinted)")


# The worker's thread budget (THREADS_VAR, read by toolchains/compile.compile_jobs): how many compiler processes one
# action may run at once. Torch's own threads stay at OMP_NUM_THREADS=1: inductor's codegen reads them, and an
# artifact must not depend on --jobs.


def worker_threads(workers: int, cores: int | None = None) -> int:
    """Each of `workers` concurrent workers on a machine gets an equal share of its cores, at least one: one worker
    on 2 cores gets both, --jobs 2 one each, --jobs 8 on 2 cores one each (oversubscribed by the user's choice)."""
    return max(1, (cores if cores is not None else host_cores()) // max(1, workers))


def with_threads(env: Mapping[str, str], threads: int) -> dict[str, str]:
    """The action environment of a worker allowed `threads` threads: the budget itself and inductor's parallel compile
    pool size (unless declared with --action-env, which wins). Neither enters fingerprints: they change how fast an
    artifact is made, never its bytes."""
    out = dict(env)
    out[THREADS_VAR] = str(max(1, threads))
    out.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(max(1, threads)))
    return out


_hidden = False


def hide_process_environ() -> bool:
    """Make this process's own environment (AWS keys, tokens) unreadable through /proc/<pid>/environ, which shows the
    region the environment was passed in at start and which any process of the user may read (an action included:
    its kernel rules let it read /proc). Moves libc's environment strings to the heap (setenv of each entry: os.environ
    and getenv() are unchanged), zeroes the original region, and makes the process non-dumpable (then its
    /proc files, environ and mem included, are root's). Called once by the build process (pool.WorkerPool) before
    any action can run. Returns whether the region was cleared.

    In a multi-threaded process (the build server, a Dask worker: it runs where the farm's pool starts, on Dask's
    event loop thread) this is memory-safe: nothing is freed (the original strings stay mapped, zeroed), each
    environ slot is swapped with one aligned pointer store under glibc's environment lock, and Python code reads
    os.environ, a copy. What remains is libc's own caveat for setenv beside threads: a getenv() in another thread that
    found its entry before the swap and reads the value after the zeroing sees it empty, once; so in a process with
    other threads the zeroing waits a moment after the swap, long enough for a getenv in flight to have returned."""
    global _hidden
    if _hidden:
        return True
    _hidden = True
    import ctypes
    import sys

    if sys.platform != "linux":
        return False
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[47]), int(fields[48])  # env_start, env_end (fields 50 and 51)
        threads = int(fields[17])  # num_threads (field 20)
        libc = ctypes.CDLL(None, use_errno=True)
        environ = ctypes.POINTER(ctypes.c_char_p).in_dll(libc, "environ")
        entries: list[bytes] = []
        while environ and environ[len(entries)] is not None:
            entries.append(environ[len(entries)])
    except (OSError, ValueError, IndexError, AttributeError):
        return False
    if not start or end <= start:
        return False
    # setenv(overwrite) points each entry at a heap copy in place (no clearenv: the array is never freed under another
    # thread's getenv); then nothing refers to the original strings.
    for e in entries:
        name, _, value = e.partition(b"=")
        if name:
            libc.setenv(name, value, 1)
    if threads > 1:
        import time

        time.sleep(0.01)
    ctypes.memset(start, 0, end - start)
    libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0
    return True


def default_jobs() -> int:
    """The Neuron docs' default of 8 parallel compile workers, capped by this machine's cores."""
    return max(1, min(8, os.cpu_count() or 1))
