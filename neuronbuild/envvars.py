"""Every NEURONBUILD_* environment variable, in one table, and the typed view of them a command reads (issue #45).

`VARIABLES` names each one with its type, its default and what it means (docs/environment.md shows the same table, checked by
tests/test_envvars.py). `Config.of(env)` reads them from one environment mapping, once: the command's (the client's
environment for a build-server command, this process's for a batch one). Code that needs one asks `current()`: the
running command's Config (`using(config)` makes it current for the command's code), or, outside any command (library
use, a worker process, a serving host), this process's environment read at the call. No other module reads a
NEURONBUILD_* variable from os.environ (tests/test_envvars.py)."""

from __future__ import annotations

import contextvars
import os
from collections import namedtuple

TYPE_CHECKING = False  # (not typing's: the build server's thin client imports this module and must stay light)
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from typing import TypeVar

    T = TypeVar("T")


# Types: "text" (a string; empty = unset), "path" (a file or directory; empty = unset), "flag" (unset/empty: the
# default; 0, false, no, off: false; anything else: true), "seconds" (a number >= 0), "int" (a whole number),
# "list" (comma-separated words), "paths" (os.pathsep-separated directories).
# scope: who reads it: build (commands), server, worker (set by neuronbuild for its workers), runtime, release
Var = namedtuple("Var", "name kind default meaning scope")


VARIABLES: tuple[Var, ...] = (
    # -- build commands --------------------------------------------------------------------------------------------
    Var("NEURONBUILD_CACHE_DIR", "path", None, "the local cache directory (--cache-dir wins; default "
        "$XDG_CACHE_HOME/neuronbuild or ~/.cache/neuronbuild)", "build"),
    Var("NEURONBUILD_REMOTE_CACHE", "text", None, "default of --remote-cache: a shared directory or s3://bucket/prefix",
        "build"),
    Var("NEURONBUILD_REMOTE_CACHE_READONLY", "flag", False, "default of --remote-cache-readonly", "build"),
    Var("NEURONBUILD_REMOTE_CACHE_TRUSTED_KEYS", "path", None, "default of --remote-cache-trusted-keys", "build"),
    Var("NEURONBUILD_REMOTE_CACHE_TRUST_WRITERS", "flag", False, "default of --remote-cache-trust-writers", "build"),
    Var("NEURONBUILD_REMOTE_CACHE_SIGNING_KEY", "path", None, "default of --remote-cache-signing-key", "build"),
    Var("NEURONBUILD_S3_ENDPOINT_URL", "text", None, "S3-compatible endpoint of s3:// tiers (--s3-endpoint-url wins)",
        "build"),
    Var("NEURONBUILD_RECORD_KEY", "path", None, "the user's own record-signing key file (default "
        "$XDG_CONFIG_HOME/neuronbuild/record-key)", "build"),
    Var("NEURONBUILD_SIGNING_KEY", "path", None, "default of build --signing-key: the Ed25519 key bundles are signed "
        "with", "build"),
    Var("NEURONBUILD_SIGNING_KEY_PASSPHRASE", "text", None, "the passphrase of a protected signing key", "build"),
    Var("NEURONBUILD_PLUGINS", "list", (), "plug-in modules (rule kinds, toolchains, loaders) to import besides the "
        "built-ins", "build"),
    Var("NEURONBUILD_PLUGIN_PATH", "paths", (), "directories added to sys.path to import $NEURONBUILD_PLUGINS from",
        "build"),
    Var("NEURONBUILD_STARLARK_MEMORY_MB", "int", 1024, "memory budget of one BUILD/.bzl file's evaluation, MiB "
        "(at least 16)", "build"),
    Var("NEURONBUILD_CACHE_GC_GRACE_S", "seconds", 600.0, "cache entries used this recently are never collected",
        "build"),
    Var("NEURONBUILD_CACHE_GC_INTERVAL_S", "seconds", 3600.0, "the automatic gc after a build runs at most this often",
        "build"),
    Var("NEURONBUILD_CACHE_MAX_SIZE", "text", None, "automatic gc size limit, e.g. 50G (else <cache>/config.json)",
        "build"),
    Var("NEURONBUILD_CACHE_MAX_AGE", "text", None, "automatic gc age limit, e.g. 30d (else <cache>/config.json)",
        "build"),
    Var("NEURONBUILD_LOCK_HEARTBEAT_S", "seconds", 10.0, "how often an action lock's owner refreshes it", "build"),
    Var("NEURONBUILD_LOCK_STALE_S", "seconds", 60.0, "an action lock unchanged this long is broken", "build"),
    Var("NEURONBUILD_HOST_ISA", "text", None, "this machine's CPU ISA level instead of the detected one", "build"),
    Var("NEURONBUILD_ZYGOTE", "flag", True, "0: start each worker afresh instead of forking it from a zygote",
        "build"),
    Var("NEURONBUILD_ACTION_CGROUPS", "flag", True, "0: limit actions by the worker's watch only, no cgroups",
        "build"),
    Var("NEURONBUILD_LIGHT_STEPS", "flag", True, "0: light steps run in workers like every other action instead of in "
        "the build process (for A/B measurements)", "build"),
    # -- build server ----------------------------------------------------------------------------------------------
    Var("NEURONBUILD_NO_SERVER", "flag", False, "run every command in its own process (as --batch)", "server"),
    Var("NEURONBUILD_OUTPUT_USER_ROOT", "path", None, "where servers keep their output bases (--output-user-root "
        "wins; default $XDG_CACHE_HOME/neuronbuild-server)", "server"),
    Var("NEURONBUILD_WORKERS_IDLE_SECS", "seconds", 300.0, "the server releases its warm workers after this long "
        "without a command (read when the server starts)", "server"),
    Var("NEURONBUILD_WARM_GRACE_SECS", "seconds", 0.5, "the server's background warm-up starts once no command came "
        "for this long (read when the server starts)", "server"),
    # -- set by neuronbuild in its workers' environment ------------------------------------------------------------
    Var("NEURONBUILD_THREADS", "int", 1, "a worker's thread budget (compiler processes one action may run)",
        "worker"),
    Var("NEURONBUILD_SHARED_TMPDIR", "path", None, "in an action, the workers' shared toolchain scratch directory",
        "worker"),
    Var("NEURONBUILD_PREPARED_ACTIONS", "flag", True, "0: a root worker forks an action's namespace init and process "
        "at dispatch instead of preparing them while idle (for A/B measurements: benchmarks/fork_bench.py)", "worker"),
    # -- serving runtime (open_cache) ------------------------------------------------------------------------------
    Var("NEURONBUILD_LIBNRT", "path", "/opt/aws/neuron/lib/libnrt.so", "the Neuron runtime library", "runtime"),
    Var("NEURONBUILD_STRICT", "flag", False, "open_cache's default strict mode", "runtime"),
    Var("NEURONBUILD_REQUIRE", "list", (), "open_cache's default required labels", "runtime"),
    Var("NEURONBUILD_EMULATE", "text", None, "open_cache's default emulation (xla-cpu)", "runtime"),
    Var("NEURONBUILD_TRUSTED_KEYS", "path", None, "public keys a release's manifest must be signed by", "runtime"),
    Var("NEURONBUILD_NUM_BLOCKS", "text", None, "the host's KV block count for block-layout models: N, or "
        "LABEL=N,... (open_cache, verify --host; refused when it is not the compiled count)", "runtime"),
    # -- written into a release's env file for its service (neuronbuild itself does not read them) ------------------
    Var("NEURONBUILD_BUNDLE", "text", None, "release env file: the bundle's label", "release"),
    Var("NEURONBUILD_EXPECT_TORCH", "list", (), "release env file: the torch versions the bundle was built for",
        "release"),
    Var("NEURONBUILD_EXPECT_PYTHON", "list", (), "release env file: the Python versions the bundle was built for",
        "release"),
    Var("NEURONBUILD_DEPLOY_DIR", "path", None, "release env file: where `deploy --dest` installed it", "release"),
)
BY_NAME: dict[str, Var] = {v.name: v for v in VARIABLES}
FALSE_WORDS = ("0", "false", "no", "off")


def _parse(var: Var, raw: str) -> object:
    text = raw.strip()
    if not text:
        return var.default
    if var.kind in ("text", "path"):
        return text
    if var.kind == "flag":
        return text.lower() not in FALSE_WORDS
    if var.kind == "list":
        return tuple(w.strip() for w in text.split(",") if w.strip())
    if var.kind == "paths":
        return tuple(d for d in raw.split(os.pathsep) if d)
    from neuronbuild.errors import UserInputError

    try:
        value: float = int(text) if var.kind == "int" else float(text)
    except ValueError:
        raise UserInputError(f"${var.name}: {raw!r} is not a {'whole ' if var.kind == 'int' else ''}number "
                             f"(unset, it is {var.default})") from None
    if var.kind == "seconds" and not 0 <= value < float("inf"):
        raise UserInputError(f"${var.name}: {raw!r} is not a number of seconds >= 0 (unset, it is {var.default})")
    return value


class Config:
    """The NEURONBUILD_* variables of one environment, typed (read once, by `of`), and that environment itself
    (`env`: what else a command reads from its caller's environment, e.g. HOME, PATH, --action-env values)."""

    __slots__ = ("env", "_values", "_errors", "facts")

    def __init__(self, env: Mapping[str, str], values: Mapping[str, object],
                 errors: Mapping[str, Exception]) -> None:
        self.env, self._values, self._errors = env, values, errors
        self.facts: dict[object, object] = {}  # what `fact` computed for this environment

    def __repr__(self) -> str:
        return f"Config({sorted(k for k in self.env if k.startswith('NEURONBUILD_'))})"

    @classmethod
    def of(cls, env: Mapping[str, str]) -> Config:
        values: dict[str, object] = {}
        errors: dict[str, Exception] = {}
        frozen = dict(env)
        for var in VARIABLES:
            raw = frozen.get(var.name)
            try:
                values[var.name] = var.default if raw is None else _parse(var, raw)
            except Exception as e:  # noqa: BLE001 - (UserInputError, not imported here: the client stays light)  # raised where it is read (a command that never needs it is not refused)
                errors[var.name] = e
                values[var.name] = var.default
        return cls(frozen, values, errors)

    def _get(self, name: str, *kinds: str) -> object:
        var = BY_NAME[name]  # (a KeyError: a variable missing from the table)
        assert var.kind in kinds, f"{name} is a {var.kind}, not {'/'.join(kinds)}"
        if name in self._errors:
            raise self._errors[name]
        return self._values[name]

    def text(self, name: str) -> str | None:
        v = self._get(name, "text", "path")
        return None if v is None else str(v)

    def flag(self, name: str) -> bool:
        return bool(self._get(name, "flag"))

    def seconds(self, name: str) -> float:
        return float(self._get(name, "seconds"))  # type: ignore[arg-type]

    def integer(self, name: str) -> int:
        return int(self._get(name, "int"))  # type: ignore[call-overload]

    def words(self, name: str) -> tuple[str, ...]:
        return tuple(self._get(name, "list", "paths"))  # type: ignore[arg-type]

    def with_env(self, changes: Mapping[str, str | None]) -> Config:
        """This environment with `changes` (None: removed), read again."""
        env = dict(self.env)
        for k, v in changes.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        return Config.of(env)


_current: contextvars.ContextVar[Config | None] = contextvars.ContextVar("neuronbuild_config", default=None)


def current() -> Config:
    """The running command's Config; outside a command, this process's environment (read now)."""
    cfg = _current.get()
    return cfg if cfg is not None else Config.of(os.environ)


_process_facts: dict[object, object] = {}  # `fact` outside a command


def fact(key: object, compute: Callable[[], T]) -> T:
    """A fact of the running command's environment or machine (the host's ISA level, a compiler's version), computed
    once per command: kept with its Config, which the build server makes anew for each command, so nothing one
    command learnt reaches the next (as in a batch process); outside a command, once per process."""
    cfg = _current.get()
    table = cfg.facts if cfg is not None else _process_facts
    try:
        return table[key]  # type: ignore[return-value]
    except KeyError:
        value = table[key] = compute()
        return value


def environ() -> Mapping[str, str]:
    """The running command's environment (outside a command: this process's)."""
    cfg = _current.get()
    return cfg.env if cfg is not None else os.environ


class using:  # noqa: N801 - used as a context manager function (contextlib costs the thin client an import)
    """`with using(config):` config is current() for the code run inside (this thread's context; threads the code
    starts read it through what it passes them)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self._tokens: list[contextvars.Token[Config | None]] = []

    def __enter__(self) -> Config:
        self._tokens.append(_current.set(self.config))
        return self.config

    def __exit__(self, *exc: object) -> None:
        _current.reset(self._tokens.pop())


def table_markdown() -> str:
    """The table as docs/environment.md shows it."""
    rows = ["| Variable | Type | Default | Read by | Meaning |", "|---|---|---|---|---|"]
    for v in VARIABLES:
        default = "" if v.default in (None, ()) else str(v.default)
        if v.kind == "flag":
            default = "1" if v.default else "0"
        elif isinstance(v.default, float):
            default = f"{v.default:g}"
        rows.append(f"| `{v.name}` | {v.kind} | {default} | {v.scope} | {v.meaning} |")
    return "\n".join(rows)
