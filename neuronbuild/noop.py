"""The no-op fast path: a stamp of everything the last successful build read and produced; a build whose stamp still
matches prints its summary without loading, analysis or execution (so without importing networkx, starlark or torch).

The stamp (one file per workspace + request + cache directory, under <cache>/v1/state/) holds:
- the request key (workspace root, cwd package, patterns and every build flag except --jobs/--keep-going);
- the environment that can change fingerprints: Python version, executable and prefix (venv), os.uname(), the CPU flags,
  neuronbuild's own code (`self_stamp`), the variables in ENV_PREFIXES/ENV_NAMES and any variable a flag names;
- stat keys (size, mtime_ns, inode, ctime_ns) of every input: BUILD and load()ed .bzl files, the source and weights
  files of every loaded target, and the toolchain: each sys.path entry (installing or upgrading a package rewrites
  its dist-info directory there) and the executables each toolchain's settings declare (`plugins.tool_files`: its
  compilers) as PATH resolves them now;
- the listing signature (subdirectories, BUILD and marker presence) of every directory from the cwd up to the root and,
  when a pattern is recursive, of every directory of the workspace: a new, removed or renamed package is seen;
- stat keys of every action record and output blob in the cache, and of every materialised output and manifest.
Any difference, missing file or unreadable stamp sends the build down the normal path, which rewrites the stamp.
A stamp is not written when an input changed within digests.RACY_NS of the build's start (its contents might not be
what the build read), so an edit during a build is never hidden.

If you add an input to fingerprints, make sure it is covered here (a file, a tool, an environment variable or a flag).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import marshal
import os
import re
import shutil
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from neuronbuild import envvars
from neuronbuild.atomic import atomic_write_bytes, read_own_state_stat
from neuronbuild.digests import StatKey, StatMemo, is_racy, stat_key
from neuronbuild.self_stamp import checkout_dir, code_stamp
from neuronbuild.workspace import BUILD_FILE, MARKER

FORMAT = "nb-noop-1"
ENV_PREFIXES = ("NEURON", "TORCH", "AOTI", "ATEN_", "OMP_", "PYTHON")
ENV_NAMES = ("PATH", "CXX", "CC", "LD_LIBRARY_PATH", "TMPDIR", "HOME")
IGNORED_FLAGS = ("jobs", "keep_going", "command", "directory")
_SKIP_DIRS = ("neuronbuild-out", "__pycache__")

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def request_key(root: Path, cwd_package: str, patterns: Sequence[str], cache_dir: Path,
                flags: Mapping[str, Any]) -> str:
    """A canonical string naming one build request; flags that cannot change a no-op's outcome are left out."""
    rest = {k: v for k, v in flags.items() if k not in IGNORED_FLAGS and k not in ("patterns", "cache_dir")}
    # A flag naming an environment variable (e.g. --action-env NAME) makes that variable's value an input too. The key
    # is stored (in the stamp): --action-env values, which may be secrets, enter it as digests only.
    caller = envvars.environ()  # the command's environment
    named = {w: _secret(caller[w]) for w in _words(rest) if _ENV_NAME.match(w) and w in caller}
    if rest.get("action_env"):
        rest["action_env"] = [f"{n}={_secret(v)}" if eq else n
                              for n, eq, v in (str(x).partition("=") for x in rest["action_env"])]
    # A flag naming a file (e.g. --neuronx-cc PATH) makes that file an input too: its stat key enters the request key.
    files = {v: list(stat_key(os.stat(v))) for v in rest.values()
             if isinstance(v, str) and os.sep in v and os.path.isfile(v)}
    return json.dumps({"root": str(root), "cwd": cwd_package, "patterns": list(patterns), "cache": str(cache_dir),
                       "flags": rest, "named_env": named, "flag_files": files}, sort_keys=True, default=str)


def _secret(value: str) -> str:
    return hashlib.sha256(value.encode("utf-8", "surrogateescape")).hexdigest()


def _words(v: Any) -> list[str]:
    if isinstance(v, str):
        return [v.split("=", 1)[0]]
    if isinstance(v, Mapping):
        return [w for x in v.items() for w in _words(x)]
    if isinstance(v, (list, tuple)):
        return [w for x in v for w in _words(x)]
    return []


def stamp_file(cache_dir: Path, key: str) -> Path:
    return cache_dir / "v1" / "state" / f"noop-{hashlib.sha256(key.encode()).hexdigest()[:24]}.marshal"


def environment() -> str:
    env = sorted((k, v) for k, v in envvars.environ().items() if k.startswith(ENV_PREFIXES) or k in ENV_NAMES)
    return json.dumps({"python": sys.version, "exe": os.path.realpath(sys.executable),
                       "prefix": sys.prefix, "uname": list(os.uname()), "env": env,
                       "cpu": _cpu_flags(), "code": code_stamp()}, sort_keys=True)


def _cpu_flags() -> str:
    """The CPU's feature flags (isa = "native" resolves from them), without importing platforms.py's subprocess."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def toolchain_paths() -> list[str]:
    """Paths whose stat keys change when the Python packages or the compilers that builds use change (the
    executables the toolchains' settings declare: plugins.tool_files)."""
    from neuronbuild.plugins import tool_files

    skip = checkout_dir()  # a source checkout on sys.path: code_stamp covers what builds use of it
    out = [p for p in sys.path[1:] if p and p != skip and os.path.isdir(p)]  # [0] is the script's or cwd's directory
    for t in tool_files():
        found = shutil.which(t, path=envvars.environ().get("PATH"))
        if found:
            out.append(os.path.realpath(found))
    return list(dict.fromkeys(out))


# Stamps this process read: a build server answers no-op after no-op from one stamp, one stat instead of reading and
# unmarshalling ~8,000 entries each time (while it is still this user's own: as read_own_state_stat reads it).
_read: StatMemo[Any] = StatMemo(16)


def _load(path: Path) -> Any:
    p = str(path)
    st = os.stat(p)
    known = _read.get(p, stat_key(st))
    if known is not None and st.st_uid == os.geteuid() and not st.st_mode & 0o022:
        return known
    now = time.time_ns()
    raw, st = read_own_state_stat(p)
    data = marshal.loads(raw)
    _read.put(p, stat_key(st), data, now)
    return data


def check(cache_dir: Path, key: str) -> str | None:
    """The summary line of the last build if nothing it depends on changed, else None (take the normal path)."""
    start = time.perf_counter()
    try:
        data = _load(stamp_file(cache_dir, key))
    except (OSError, EOFError, ValueError, TypeError):
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("key") != key:
        return None
    if data.get("env") != environment() or data.get("tools") != toolchain_paths():
        return None
    paths, keys = data["paths"], data["keys"]
    try:
        for p, k in zip(paths, keys, strict=True):
            if stat_key(os.stat(p)) != k:
                return None
        for d, sig in zip(data["dirs"], data["dirsigs"], strict=True):
            if dir_signature(d) != sig:
                return None
    except (OSError, ValueError):
        return None
    total, cached = data["total"], data["cached"]
    if not total:
        return None  # nothing to build: the normal path says why (its warnings), and is fast anyway
    where = data.get("where")  # the summary's last line, as the build that wrote the stamp printed it
    return f"{total} actions: 0 executed, {cached} cached ({time.perf_counter() - start:.1f} s)" + \
        (f"\n{where}" if where else "")


def dir_signature(path: str) -> str:
    """What package discovery sees of a directory: its subdirectories (as the loader filters them) and whether it
    holds a BUILD file or a workspace marker. Unlike its mtime, this ignores outputs and editors' temporary files."""
    subdirs: list[str] = []
    flags = ""
    with os.scandir(path) as it:
        for e in it:
            if e.name in (BUILD_FILE, MARKER):
                flags += e.name[0] if e.is_file() else "?"
            elif e.is_dir() and not e.name.startswith(".") and e.name not in _SKIP_DIRS:
                subdirs.append(e.name)
    return "".join(sorted(flags)) + "/" + "/".join(sorted(subdirs))


def workspace_dirs(root: Path) -> list[str]:
    """Every directory a recursive pattern could find packages in (a superset of what the loader walks)."""
    out: list[str] = []
    for dirpath, dirnames, _files in os.walk(root):
        out.append(dirpath)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in _SKIP_DIRS)
    return out


def write(cache_dir: Path, key: str, started_ns: int, inputs: Iterable[str], dirs: Iterable[str],
          outputs: Iterable[str], total: int, cached: int, where: str = "") -> bool:
    """Write the stamp after a successful build that started at `started_ns` (time.time_ns()).

    Returns False (and removes any old stamp) when an input is missing or changed too recently to be trusted."""
    target = stamp_file(cache_dir, key)
    tools = toolchain_paths()
    paths: list[str] = []
    keys: list[StatKey] = []
    try:
        for p in dict.fromkeys([*inputs, *tools]):
            k = stat_key(os.stat(p))
            if is_racy(k, started_ns):
                raise LookupError(p)
            paths.append(p)
            keys.append(k)
        for p in dict.fromkeys(outputs):
            paths.append(p)
            keys.append(stat_key(os.stat(p)))
        dir_list = list(dict.fromkeys(dirs))
        sigs = [dir_signature(d) for d in dir_list]
    except (OSError, LookupError):
        with contextlib.suppress(OSError):
            os.unlink(target)
        return False
    blob = marshal.dumps({"format": FORMAT, "key": key, "env": environment(), "tools": tools, "paths": paths,
                          "keys": keys, "dirs": dir_list, "dirsigs": sigs, "total": total, "cached": cached, "where": where})
    atomic_write_bytes(target, blob, target.parent, durable=False)  # a speed-up only: no fsync
    return True


def invalidate(cache_dir: Path, key: str) -> None:
    """Forget the stamp (a build that failed or was interrupted must not leave an old success behind)."""
    with contextlib.suppress(OSError):
        os.unlink(stamp_file(cache_dir, key))
