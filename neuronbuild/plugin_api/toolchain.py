"""The toolchain protocol (the plug-in API's toolchain half): what a registered toolchain tells analysis, the request
it plans compile actions for and the plan-wide settings it reads. The registry (plugin_api/registry.py) is typed with
it, so mypy checks every use of a toolchain against it.

A toolchain is the sum of small capabilities (`Identity`, `Targets`, `Planning`, `Steps`, `HostSide`). The members
with a default here are optional: the registry fills those a registered toolchain leaves out (a class subclassing
`Toolchain` inherits them), so a toolchain says only what it has (no warm-up, options, worker hooks, ...: nothing).

A toolchain serves platforms; for one (trace, target, options, bucket) it plans one or more actions (the last is the
primary one: its outputs are the graph's artifacts), names the versions that enter their fingerprints, runs its steps
in workers, and says how validate loads its artifacts. See neuronbuild/toolchains/cpu.py for a complete example.

Optional warm-up: a toolchain whose steps share a per-machine artifact that is costly to make the first time (the cpu
toolchain: inductor's precompiled headers, ~10 s of a machine's first compile) defines `warm_up_key(spec)`. At the
start of a build that will run such steps on >= 2 workers, the scheduler sends one pseudo-task per distinct key (per
host on Dask) to a worker beside the traces: the worker calls `run(WARM_UP, warm_up_spec(...), ...)`, which builds
the artifact under a per-machine lock, keyed so that it can only be reused by steps it fits (see `warm_up_spec`). A
step provider that is not a toolchain may define the same."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from neuronbuild import FORMAT_VERSION
from neuronbuild.plugin_api.actions import PROVIDER, Action, Bucket, DepInput, provider_name
from neuronbuild.plugin_api.flag import Flag
from neuronbuild.plugin_api.rules import Attr, AttrType

if TYPE_CHECKING:
    from neuronbuild.loading.labels import Label  # (a leaf value module: it never imports the plug-in API)

WARM_UP = "warm_up"  # the step (and pseudo-action kind) of a toolchain's per-machine warm-up


def is_warm_up(msg: Mapping[str, Any]) -> bool:
    """Whether a worker's message (its "kind" and "spec") is a warm-up rather than an action."""
    return msg.get("kind") == WARM_UP or (isinstance(msg.get("spec"), Mapping) and msg["spec"].get("step") == WARM_UP)


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()  # an option key's default meaning "absent from the options unless set"


@dataclass(frozen=True)
class OptionKey:
    """One compiler option a toolchain reads (a `compiler_options` attribute). Only the keys a toolchain declares
    reach its plans and its fingerprints: an option it does not read cannot re-run its actions. `type` is the
    attribute's loading type (schema.INT, STRING, STRING_LIST); `default` fills the key when unset (UNSET: left out).
    The `compiler_options` rule's attributes are the union of every registered toolchain's keys."""

    name: str
    type: AttrType
    doc: str
    default: Any = UNSET
    choices: tuple[Any, ...] | None = None


@dataclass(frozen=True)
class StepDirs:
    """Directories (absolute) one of a toolchain's steps uses outside its sandbox, TMPDIR and HOME, granted by the
    worker's confinement (execution/confine.py): `write` (e.g. inductor's per-user working dir) and `read`
    (read-only: e.g. precompiled headers its warm-up writes, a configured compiler's installation)."""

    write: tuple[str, ...] = ()
    read: tuple[str, ...] = ()


@functools.cache  # (versions of the components entering fingerprints: from package metadata, never importing them)
def package_version(name: str) -> str:
    """An installed distribution's version from package metadata (never importing it), or 'not-installed'."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not-installed"


def distributions_of(modules: Iterable[str]) -> dict[str, str]:
    """Installed distributions (name -> version) providing these top-level modules; torch is in every trace record
    already, modules no distribution provides (the standard library, the workspace's own) are left out."""
    wanted = [m for m in modules if m not in sys.stdlib_module_names and m not in ("torch", "neuronbuild")]
    if not wanted:
        return {}  # (no scan of every installed distribution: ~1 s per process with torch's environment)
    dists = _packages_distributions()
    out: dict[str, str] = {}
    for mod in wanted:
        for dist in dists.get(mod, ()):
            name = dist.lower().replace("_", "-")
            if name != "torch":
                out[name] = package_version(dist)
    return dict(sorted(out.items()))


@functools.cache
def _packages_distributions() -> Mapping[str, list[str]]:
    return metadata.packages_distributions()


def trace_toolchain() -> dict[str, str]:
    """The versions every trace record holds: Python's major.minor and torch's."""
    return {"python": f"{sys.version_info.major}.{sys.version_info.minor}", "torch": package_version("torch")}


def secret_digest(value: str) -> str:
    """What stands for an --action-env value wherever it is written down: 'sha256:<hex>' of its UTF-8 bytes."""
    import hashlib

    return "sha256:" + hashlib.sha256(value.encode("utf-8", "surrogateescape")).hexdigest()


@dataclass(frozen=True)
class PlanSettings:
    """Everything besides the targets that changes fingerprints. The defaults give the skeleton's fingerprints."""

    action_env: tuple[tuple[str, str | None], ...] = ()  # declared --action-env names and values (None: unset)
    # (settings name, resolved JSON value) of each toolchain setting that resolved to one (e.g. a configured
    # compiler: its path, version, timeout), sorted by name
    tools: tuple[tuple[str, Any], ...] = field(default=(), hash=False)
    toolchain_overrides: Mapping[str, str] = field(default_factory=dict, hash=False, compare=False)

    def env_record(self) -> dict[str, str | None]:
        """The declared variables as every action record holds them: names, each with its value's digest (the value
        changes fingerprints, but records, manifests and reports never hold it: it may be a secret); None: unset."""
        return {name: secret_digest(value) if value is not None else None for name, value in self.action_env}

    def tool(self, name: str) -> Any:
        """What the toolchain settings `name` resolved to (ToolSettings.resolve), or None."""
        return next((v for k, v in self.tools if k == name), None)

    def trace_toolchain(self) -> dict[str, str]:
        return self.override(trace_toolchain())

    def override(self, tc: dict[str, str]) -> dict[str, str]:
        """`tc` with the what-if versions (--toolchain NAME=VERSION) of the components it has."""
        for k, v in self.toolchain_overrides.items():
            if k in tc:
                tc[k] = v
        return tc


@dataclass(frozen=True)
class CompileRequest:
    """One bucket of one compile target, as its toolchain plans it."""

    label: Label  # the neuron_compile target
    platform: str
    target: Mapping[str, Any] = field(hash=False)  # the target record (platform + toolchain fields, e.g. isa)
    options: Mapping[str, Any] = field(hash=False)  # effective options
    bucket: Bucket = Bucket(())
    inputs: Mapping[str, Any] = field(default_factory=dict, hash=False)  # the model's input specs, in order
    trace: Action | None = None  # the trace action whose program the toolchain compiles
    settings: PlanSettings = field(default_factory=PlanSettings)
    common: Mapping[str, Any] = field(default_factory=dict, hash=False)  # record fields every action carries (env)
    # The model's weights action (one per model, dtype and layout; its outputs: constants.safetensors, or
    # rank_<r>.safetensors per rank): a step that reads them takes weights_inputs(); one that only ships them beside
    # its outputs (weights bound at load: the cpu and Neuron compiles) weights_shipped().
    weights: Action | None = None

    def weights_inputs(self) -> tuple[DepInput, ...]:
        """The model's weights files as inputs of a step (each under its own name in the sandbox); a step that only
        needs shapes takes none, so changing weight values never re-runs it."""
        assert self.weights is not None
        return tuple(DepInput(self.weights.fingerprint, f, f) for f in self.weights.outputs)

    def weights_shipped(self) -> tuple[DepInput, ...]:
        """The model's weights files as what a step ships beside its outputs (`Action.ships`) without reading them:
        a step whose output does not depend on weight values (weights bound at load: a Neuron module's parameters,
        an AOTInductor package without constants), so a weights-only change re-runs the weights action alone.
        None for a graphs-only model (neuron_model `graphs_only`): nothing ships; a model_weights target's do."""
        if self.weights is None:
            return ()
        return tuple(DepInput(self.weights.fingerprint, f, f) for f in self.weights.outputs)

    def record(self, action: str, versions: Mapping[str, str], **fields: Any) -> dict[str, Any]:
        """The canonical record of one of this bucket's actions: everything that can change its output. `fields`
        add (or replace) entries, e.g. the fingerprint of an intermediate action it reads instead of the trace's."""
        assert self.trace is not None
        rec = {
            "format": FORMAT_VERSION,
            "action": action,
            "trace": self.trace.fingerprint,
            "target": dict(self.target),
            "options": dict(self.options),
            "bucket": self.bucket.as_dict(),
            "inputs": [[k, v] for k, v in self.inputs.items()],  # a list: positional order enters the fingerprint
            "toolchain": dict(versions),
        }
        rec.update(fields)  # (= `rec | fields | common`, without the copies: 100,000 records at 100,000 graphs)
        if self.common:
            rec.update(self.common)
        return rec


class Identity(Protocol):
    """Who a toolchain is: its name, the platforms it serves (the registry refuses one another toolchain serves) and
    how the runtime recognises its artifacts (`artifact_format`, written into manifests)."""

    name: str
    platforms: tuple[str, ...]
    artifact_format: str


class Targets(Protocol):
    """The neuron_target side: the attributes it reads and the record entering fingerprints."""

    target_attrs: tuple[Attr, ...] = ()  # neuron_target attributes it reads besides `platform` (e.g. cpu's isa)
    # The tensor-parallel degrees (a neuron_compile's tp_degree) each of its platforms' runtime accepts; a platform
    # not in it: 1 only (its graphs are never sharded).
    tp_degrees: Mapping[str, tuple[int, ...]] = {}

    def target_record(self, platform: str, attrs: Mapping[str, Any]) -> dict[str, Any]:
        """The target as it enters fingerprints (e.g. cpu resolves isa='native' to this machine's level)."""
        ...

    def describe_target(self, target: Mapping[str, Any]) -> str:
        """How progress lines name the target, e.g. 'cpu/x86-64-v3' or 'trn2'."""
        ...


class Planning(Protocol):
    """The analysis side: the options it reads, its versions, the actions of one bucket, its estimates and notes."""

    option_keys: tuple[OptionKey, ...] = ()  # the compiler options it reads (the only ones entering its fingerprints)
    estimate_s: float  # assumed seconds of its primary step when nothing was recorded
    estimate_mb: float  # assumed peak MB of its primary step when nothing was recorded
    # MB more per MB of the model's declared weight files, for a step that holds the weights
    # (estimate.default_peak_mb); steps on shapes leave it 0.
    estimate_mb_per_weight_mb: float = 0.0

    def versions(self, platform: str, settings: PlanSettings) -> dict[str, str]:
        """Toolchain component versions entering the fingerprints of its actions."""
        ...

    def plan(self, req: CompileRequest) -> list[Action]:
        """The actions of one bucket, producers first; the last one's outputs are the graph's artifacts."""
        ...

    def notes(self, settings: PlanSettings) -> list[str]:
        """Said once per build that has graphs for this toolchain (e.g. 'no neuronx-cc configured')."""
        return []

    def option_warnings(self, options: Mapping[str, Any]) -> list[str]:
        """Located warnings about the options it reads (e.g. neuronx-cc flags its compiler does not document)."""
        return []


class Steps(Protocol):
    """The worker side: its steps, its warm-up (see the module doc) and its worker hooks."""

    # Whether its warm-up leaves something other workers on the machine reuse (files): then it gets a pseudo-action
    # at the start of a build; False: each worker warms itself before its first such step (e.g. an import).
    warm_up_shared: bool = False

    def run(self, step: str, spec: Mapping[str, Any], sandbox: Path, out_dir: Path) -> dict[str, Any]:
        """Run one of its steps in a worker process (may import torch); returns JSON-able metadata."""
        ...

    def warm_up_key(self, spec: Mapping[str, Any]) -> Mapping[str, Any] | None:
        """What the step `spec` needs warm on its machine (see the module doc), or None (no warm-up)."""
        return None

    def prepare_worker(self) -> None:
        """Once in each worker process before it runs anything (forked workers inherit it): import what its steps
        import, so the actions forked from the worker start warm. It must start no thread and run no torch op (a
        fork copies only the forking thread); a failure here is ignored (the step reports it)."""
        return None

    def step_dirs(self, spec: Mapping[str, Any]) -> StepDirs:
        """In the worker, before its step `spec` runs confined: the directories it may use besides its sandbox
        (created by the toolchain when they are its own)."""
        return StepDirs()


class StepProvider(Steps, Protocol):
    """What runs an action's step in a worker (registry.run_step): a toolchain (its own steps), or a provider planning
    nothing (`plugins.register_steps`: the core's trace and weights), named by the spec (actions.provider_name)."""

    name: str


STEPS_REQUIRED = ("name", "run")  # (checked by register_steps; the rest: Steps' defaults)


class HostSide(Protocol):
    """What runs its artifacts on a machine: its runtime loader's module, `validate`'s loader, `farm status`."""

    # The module registering the runtime loader of `artifact_format` (plugin_api/loader.py `ArtifactLoader`); it
    # imports nothing of the build side, so serving-only installs load these graphs ("" if they are never served).
    runtime_loader: str = ""
    validate_note: str = ""  # what `validate` checks of its artifacts when that is less than the real thing ("" if not)

    def host_status(self) -> dict[str, str | None]:
        """What this machine would build its graphs with, as its fingerprints record it (columns of `farm status`,
        run on each farm worker; may run tools, must not import torch): e.g. {"cxx": ..., "isa": ...}. None: absent
        (e.g. no compiler configured); a broken tool is reported in its value, not raised."""
        return {}

    def load_artifact(self, files: Mapping[str, Path]) -> Callable[..., Any]:
        """A callable running the artifacts on this machine, for `neuronbuild validate`."""
        ...


class Toolchain(Identity, Targets, Planning, StepProvider, HostSide, Protocol):
    """A registered toolchain (neuronbuild.plugins.register_toolchain): every capability."""


# What a toolchain must declare itself (the rest has defaults above), checked at registration.
TOOLCHAIN_REQUIRED = (
    "name",
    "platforms",
    "artifact_format",
    "estimate_s",
    "estimate_mb",
    "target_record",
    "describe_target",
    "versions",
    "plan",
    "run",
    "load_artifact",
)


class ToolSettings(Protocol):
    """What a toolchain adds to the plan-wide settings (registered with `plugins.register_settings`, in a module that
    imports built-in modules only: the command-line parser, the no-op stamp and the build server's client read it;
    the same module as the toolchain for a plug-in, `*_settings.py` for the built-ins). The core names none of it;
    every member but `name` is optional (plugin_api/flag.py `SettingsDefaults`):
    - `flags` (`plugins.Flag`): added to every command that plans, accepted in rc files; their values (by `dest`,
      None when absent) reach `check` and `resolve`;
    - `tools`: executables whose files the no-op and server stamps watch (names found on PATH; `$VAR`: the one a
      variable names);
    - `components`: what a what-if `--toolchain NAME=VERSION` may name besides python and torch;
    - `check(values)`: the checks needing no subprocess, made before the no-op fast path (UserInputError: exit 2);
    - `resolve(values)` (after `check`): a JSON value entering the plan settings under `name` (the analysis engine's
      input and, as the toolchain's `versions` reads it through `PlanSettings.tool`, its fingerprints), or None;
    - `worker_versions(expect)`: of the components an action's record holds (`expect`), the versions this worker
      has (a farm worker refuses an action whose versions differ from its own)."""

    name: str

    @property
    def flags(self) -> tuple[Flag, ...]: ...

    @property
    def tools(self) -> tuple[str, ...]: ...

    @property
    def components(self) -> tuple[str, ...]: ...

    def check(self, values: Mapping[str, Any]) -> None: ...

    def resolve(self, values: Mapping[str, Any]) -> Any: ...

    def worker_versions(self, expect: Mapping[str, str]) -> dict[str, str]: ...


def warm_up_spec(providers: Mapping[str, StepProvider], spec: Mapping[str, Any],
                 shared_only: bool = False) -> dict[str, Any] | None:
    """The spec of the warm-up the step `spec` benefits from on the machine that runs it: its provider (as `spec`
    names it, one of `providers`: plugins.step_providers()), WARM_UP and the provider's key (JSON-able; steps with
    equal ones share one warm-up). None: its provider has no warm-up (`shared_only`: none that leaves files for the
    machine's other workers, `warm_up_shared`), or its hook failed (that costs the warm-up, never the step). Called
    in the build process: must not import torch. The key only groups steps: what the artifact is keyed by on disk
    (flags, ISA, compiler and torch versions) is the provider's business, so a warm-up can never hand a step an
    artifact made for other flags."""
    provider = providers.get(provider_name(spec))
    if provider is None or (shared_only and not provider.warm_up_shared):
        return None
    try:
        key = provider.warm_up_key(spec)
    except Exception:  # noqa: BLE001 - a plug-in's broken hook
        return None
    if key is None:
        return None
    return {k: spec[k] for k in (PROVIDER, "toolchain") if spec.get(k)} | {"step": WARM_UP, "key": dict(key)}


def toolchain_options(tc: Toolchain, merged: Mapping[str, Any]) -> dict[str, Any]:
    """The options `tc` sees and fingerprints: its declared keys, set values over declared defaults; nothing else."""
    out: dict[str, Any] = {}
    for key in tc.option_keys:
        value = merged.get(key.name, key.default)
        if value is UNSET:
            continue
        out[key.name] = list(value) if isinstance(value, list | tuple) else value
    return out
