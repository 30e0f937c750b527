"""Plan-wide settings that enter fingerprints: declared action env, the configured neuronx-cc, toolchain overrides."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from neuronbuild.analysis.toolchain_versions import trace_toolchain
from neuronbuild.errors import UserInputError

NEURONX_CC_ENV = "NEURONX_CC"  # path of the neuronx-cc executable (else --neuronx-cc, else PATH)
NEURONX_CC = "neuronx-cc"  # the toolchain component name (and the executable's name on PATH)
DEFAULT_NEURONX_CC_TIMEOUT_S = 3600.0
TOOLCHAIN_COMPONENTS = ("python", "torch", "cxx", NEURONX_CC)
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_DIST_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")  # a distribution a model imports (recorded per trace)


@dataclass(frozen=True)
class NeuronxCc:
    """A configured neuronx-cc: absolute executable path, its version (enters fingerprints), the per-graph timeout."""

    path: str
    version: str
    timeout_s: float = DEFAULT_NEURONX_CC_TIMEOUT_S

    def spec(self) -> dict[str, Any]:
        return {"path": self.path, "version": self.version, "timeout_s": self.timeout_s}


@dataclass(frozen=True)
class PlanSettings:
    """Everything besides the targets that changes fingerprints. The defaults give the skeleton's fingerprints."""

    action_env: tuple[tuple[str, str | None], ...] = ()  # declared --action-env names and values (None: unset)
    neuronx_cc: NeuronxCc | None = None
    toolchain_overrides: Mapping[str, str] = field(default_factory=dict, hash=False, compare=False)

    def env_record(self) -> dict[str, str | None]:
        """The declared variables as every action record holds them: names, each with its value's digest (the value
        changes fingerprints, but records, manifests and reports never hold it: it may be a secret); None: unset."""
        return {name: secret_digest(value) if value is not None else None for name, value in self.action_env}

    def trace_toolchain(self) -> dict[str, str]:
        return self.override(trace_toolchain())

    def override(self, tc: dict[str, str]) -> dict[str, str]:
        """`tc` with the what-if versions (--toolchain NAME=VERSION) of the components it has."""
        for k, v in self.toolchain_overrides.items():
            if k in tc:
                tc[k] = v
        return tc


def secret_digest(value: str) -> str:
    """What stands for an --action-env value wherever it is written down: 'sha256:<hex>' of its UTF-8 bytes."""
    import hashlib

    return "sha256:" + hashlib.sha256(value.encode("utf-8", "surrogateescape")).hexdigest()


def redact_action_env(items: list[str]) -> list[str]:
    """--action-env words as a report shows them: NAME stays, NAME=VALUE becomes NAME=<sha256:12 hex digits>."""
    out = []
    for item in items:
        name, eq, value = str(item).partition("=")
        out.append(f"{name}=<{secret_digest(value)[:19]}>" if eq else name)
    return out


def parse_action_env(items: list[str] | None, environ: Mapping[str, str] | None = None) -> tuple[
        tuple[str, str | None], ...]:
    """`--action-env NAME` (value from the caller's environment) or `--action-env NAME=VALUE`; sorted by name."""
    environ = os.environ if environ is None else environ
    out: dict[str, str | None] = {}
    for item in items or ():
        name, eq, value = item.partition("=")
        if not _ENV_NAME_RE.match(name):
            raise UserInputError(f"--action-env: invalid variable name {name!r} (expected NAME or NAME=VALUE)")
        out[name] = value if eq else environ.get(name)
    return tuple(sorted(out.items()))


def parse_toolchain_overrides(items: list[str] | None) -> dict[str, str]:
    """`--toolchain torch=2.14.1` (repeatable) -> {"torch": "2.14.1"}."""
    out: dict[str, str] = {}
    for item in items or ():
        name, eq, value = item.partition("=")
        if not eq or not value:
            raise UserInputError(f"--toolchain: expected COMPONENT=VERSION, got {item!r}")
        if name not in TOOLCHAIN_COMPONENTS and not _DIST_NAME_RE.match(name):
            raise UserInputError(f"--toolchain: unknown component {name!r} (known: {', '.join(TOOLCHAIN_COMPONENTS)}, "
                                 f"or a distribution a model imports, e.g. transformers)")
        out[name] = value
    return out


def find_neuronx_cc(flag: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """--neuronx-cc PATH, else $NEURONX_CC, else neuronx-cc on PATH, else None. Absolute path of an executable."""
    environ = os.environ if environ is None else environ
    explicit = flag or environ.get(NEURONX_CC_ENV)
    if explicit:
        found = shutil.which(explicit) if os.sep not in explicit else explicit
        if not found or not os.path.isfile(found) or not os.access(found, os.X_OK):
            source = "--neuronx-cc" if flag else f"${NEURONX_CC_ENV}"
            raise UserInputError(f"{source}: {explicit!r} is not an executable file")
        return os.path.abspath(found)
    found = shutil.which(NEURONX_CC, path=environ.get("PATH"))
    return os.path.abspath(found) if found else None


@functools.cache
def neuronx_cc_version(path: str) -> str:
    """The version neuronx-cc reports (`neuronx-cc --version`, e.g. 'NeuronX Compiler version 2.15.128.0+...')."""
    try:
        proc = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
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


def resolve_settings(action_env: list[str] | None = None, neuronx_cc: str | None = None,
                     neuronx_cc_timeout: float | None = None, toolchain: list[str] | None = None) -> PlanSettings:
    """Settings from command-line values (bad values raise UserInputError: exit 2)."""
    if neuronx_cc_timeout is not None and neuronx_cc_timeout <= 0:
        raise UserInputError("--neuronx-cc-timeout must be a positive number of seconds")
    path = find_neuronx_cc(neuronx_cc)
    cc = None
    if path is not None:
        cc = NeuronxCc(path, neuronx_cc_version(path), neuronx_cc_timeout or DEFAULT_NEURONX_CC_TIMEOUT_S)
    return PlanSettings(parse_action_env(action_env), cc, parse_toolchain_overrides(toolchain))
