"""The neuronx-cc hand-off: run the configured neuronx-cc on a graph's HLO module and collect its NEFF.

Contract (the documented CLI): in a scratch dir holding the module as `model.hlo.pb`, run
`neuronx-cc compile model.hlo.pb --framework XLA --target <platform> --output model.neff [flags]`, flags being the
effective options mapped by neuron_flags. Its combined stdout/stderr goes to the action's log; a non-zero exit or a
missing NEFF fails the action; past the timeout its whole process group is killed and the action fails. (The real
compiler cannot be installed here: tests run a stand-in that enforces this contract, tests/standins/neuronx-cc.)"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from neuronbuild import envvars
from neuronbuild.toolchains import neuron_flags
from neuronbuild.toolchains.errors import ToolchainError

PROGRAM = neuron_flags.HLO_FILE
NEFF = neuron_flags.NEFF_FILE


def neuronx_cc_command(exe: str, platform: str, options: Mapping[str, Any],
                       env_flags: list[str] | None = None) -> list[str]:
    """The argv, relative to the scratch dir: `<exe> compile model.hlo.pb --framework XLA --target P --output ...`."""
    try:
        return neuron_flags.neuronx_cc_argv(exe, platform, options, env_flags)
    except ValueError as exc:
        raise ToolchainError(str(exc)) from None


def neuronx_cc_version(path: str) -> str:
    """The version neuronx-cc reports (`neuronx-cc --version`, e.g. 'NeuronX Compiler version 2.15.128.0+...'), once
    per command (envvars.fact)."""
    return envvars.fact((neuronx_cc_version, path), lambda: _neuronx_cc_version(path))


def _neuronx_cc_version(path: str) -> str:
    from neuronbuild.errors import UserInputError

    try:
        proc = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60,
                              env=dict(envvars.environ()))
    except (OSError, subprocess.SubprocessError) as e:
        raise UserInputError(f"neuronx-cc at {path} does not run: {e}") from None
    text = (proc.stdout or "") + (proc.stderr or "")
    if proc.returncode != 0:
        raise UserInputError(f"'{path} --version' exited with status {proc.returncode}: "
                             f"{text.strip().splitlines()[-1] if text.strip() else 'no output'}")
    m = re.search(r"version\s+(\S+)", text, re.IGNORECASE)
    if m:
        return m.group(1)
    lines = text.strip().splitlines()
    if not lines:
        raise UserInputError(f"'{path} --version' printed nothing")
    return lines[0].strip()


def _check_version(exe: str, expected: str) -> None:
    from neuronbuild.errors import UserInputError

    try:
        got = neuronx_cc_version(exe)
    except UserInputError as e:
        raise ToolchainError(e.message) from None
    if got != expected:
        raise ToolchainError(f"neuronx-cc at {exe} reports version {got}, but the plan was made with {expected}")


def run_neuronx_cc(cc: Mapping[str, Any], platform: str, options: Mapping[str, Any], out_dir: Path,
                   scratch: Path, env_flags: list[str] | None = None,
                   env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Compile out_dir/model.hlo.pb into out_dir/model.neff. `cc` is the plan's {"path", "version", "timeout_s"};
    `env`: variables the module's compile needs (neuron_steps.compile_env: fp8), added to the action's own."""
    exe, timeout = str(cc["path"]), float(cc["timeout_s"])
    _check_version(exe, str(cc["version"]))
    work = Path(scratch)
    work.mkdir(parents=True, exist_ok=True)
    src = out_dir / PROGRAM
    if (work / PROGRAM).exists():
        (work / PROGRAM).unlink()
    try:
        os.link(src, work / PROGRAM)
    except OSError:
        shutil.copyfile(src, work / PROGRAM)
    cmd = neuronx_cc_command(exe, platform, options, env_flags)
    log_path = work / "neuronx-cc.log"
    timed_out = False
    started = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=work, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, **env} if env else None)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            rc = proc.wait()
        finally:
            if proc.poll() is None:  # interrupted: never leave the compiler running
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    ran = time.monotonic() - started
    output = log_path.read_text(encoding="utf-8", errors="replace")
    prefix = "".join(f"{k}={shlex.quote(v)} " for k, v in sorted((env or {}).items()))
    sys.stdout.write(f"# neuronx-cc: {prefix}{shlex.join(cmd)}\n{output}")
    if output and not output.endswith("\n"):
        sys.stdout.write("\n")
    ending = f"killed after the {timeout:g} s timeout" if timed_out else f"exit status {rc}"
    sys.stdout.write(f"# neuronx-cc: {ending} (ran {ran:.2f} s)\n")
    sys.stdout.flush()
    if timed_out:
        raise ToolchainError(f"neuronx-cc timed out after {timeout:g} s and was killed (see the action log)")
    if rc != 0:
        last = [ln.strip() for ln in output.splitlines() if ln.strip()]
        raise ToolchainError(f"neuronx-cc exited with status {rc}" + (f": {last[-1]}" if last else ""))
    neff = work / NEFF
    if not neff.is_file():
        raise ToolchainError(f"neuronx-cc exited with status 0 but wrote no {NEFF}")
    os.replace(neff, out_dir / NEFF)
    size = (out_dir / NEFF).stat().st_size
    return {"neff": NEFF, "neff_bytes": size, "neuronx_cc": str(cc["version"])}
