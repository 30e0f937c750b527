"""The build context: one view of the workspace, plan settings, cache tiers and verbosity, shared by every command.

Made once per command by `make_context` from the common flags (commands/common.py), so `build`, `plan`, `explain`,
`validate`, `upgrade-impact` and `cache` compute the same fingerprints and read the same tiers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neuronbuild import streams
from neuronbuild.errors import UserInputError
from neuronbuild.workspace import Workspace, find_workspace

if TYPE_CHECKING:
    from neuronbuild.analysis.action_graph import ActionGraph
    from neuronbuild.cache.local import LocalCache
    from neuronbuild.command import Command
    from neuronbuild.history import History
    from neuronbuild.loading.target_graph import TargetGraph
    from neuronbuild.plugin_api.toolchain import PlanSettings

QUIET, NORMAL, VERBOSE = 0, 1, 2  # verbosity levels (the progress display uses the same numbers)


@dataclass(frozen=True)
class CacheConfig:
    """Where results live: the local cache directory and the optional shared tier."""

    dir: Path
    remote: str | None = None  # an absolute directory or s3://bucket/prefix
    remote_readonly: bool = False
    s3_endpoint_url: str | None = None
    # Who signs the records this build uploads, and whose records it serves (cache/record_auth.py): the keys are
    # loaded once here (a bad file is exit 2 before anything runs); only key ids are ever shown or written.
    signer: Any = field(default=None, compare=False, repr=False)  # runtime.signing.SigningKey
    signing_key: str | None = None  # its path (to check that actions cannot read it)
    trusted: Any = field(default=None, compare=False, repr=False)  # runtime.signing.TrustedKeys
    trust_writers: bool = False


@dataclass(frozen=True)
class BuildContext:
    """Everything a command needs to see the build as `build` sees it."""

    found_workspace: Workspace | None  # None: run outside any workspace (allowed for `cache` subcommands)
    cache: CacheConfig
    settings: PlanSettings
    verbosity: int = NORMAL
    # The command this context is for (command.Command: its environment, cwd, streams) and the key bundles are signed
    # with (--signing-key, else $NEURONBUILD_SIGNING_KEY; absolute), handed to packaging by build.py.
    command: Command | None = field(default=None, compare=False, repr=False)
    signing_key: Path | None = None

    @property
    def workspace(self) -> Workspace:
        if self.found_workspace is None:
            return find_workspace(self.command.cwd if self.command is not None else None)  # raises the usual "not inside a neuronbuild workspace" error
        return self.found_workspace

    def report(self, msg: str) -> None:
        """Print a note to stderr (warnings and errors even when quiet)."""
        if self.verbosity != QUIET or msg.startswith(("warning", "error")):
            print(msg, file=self.command.err if self.command is not None else streams.err(), flush=True)

    def load(self, patterns: Sequence[str]) -> TargetGraph:
        """Load the targets the patterns select (with the persistent load and digest caches)."""
        from neuronbuild import incremental, plugins
        from neuronbuild.loading.target_graph import load_targets

        plugins.load()  # (the rule kinds loading validates against)
        load_cache = incremental.open_caches(self.cache.dir, self.workspace.root, self.command)
        with incremental.analysis_gc():
            graph = load_targets(self.workspace.root, patterns_or_default(patterns), self.workspace.cwd_package,
                                 load_cache)
        incremental.save_caches(self.cache.dir, self.workspace.root, load_cache, self.command)
        return graph

    def plan(self, graph: TargetGraph, settings: PlanSettings | None = None,
             errors: list[UserInputError] | None = None) -> ActionGraph:
        """The action graph with this context's settings (or `settings`, for what-if plans). `errors` (--keep-going):
        targets whose analysis fails are left out, their errors appended there (planner.plan)."""
        from neuronbuild import incremental, plugins
        from neuronbuild.analysis.planner import plan

        plugins.load()
        settings = settings if settings is not None else self.settings
        with incremental.analysis_gc():
            return plan(graph, settings, incremental.analysis_memo(self.workspace.root, settings, self.command), errors)

    def open_cache(self) -> LocalCache:
        """The cache with every configured tier (local, plus the shared directory or S3 tier)."""
        from neuronbuild.cache.tiered import open_cache

        c = self.cache
        return open_cache(c.dir, c.remote, c.remote_readonly, c.s3_endpoint_url, self.report, signer=c.signer,
                          trusted=c.trusted, trust_writers=c.trust_writers)

    def history(self, cache: LocalCache) -> History:
        """Past results (records + latest result per identity) of the local tier, for explanations and estimates."""
        return cache.history()

    def without_overrides(self) -> BuildContext:
        """This context minus what-if toolchain overrides (the baseline of upgrade-impact)."""
        return replace(self, settings=replace(self.settings, toolchain_overrides={}))


def patterns_or_default(patterns: Sequence[str]) -> tuple[str, ...]:
    return tuple(patterns) if patterns else ("//...",)


def make_context(*, cache_dir: str | None = None, remote_cache: str | None = None, remote_cache_readonly: bool = False,
                 s3_endpoint_url: str | None = None, remote_cache_trusted_keys: str | None = None,
                 remote_cache_trust_writers: bool = False, remote_cache_signing_key: str | None = None,
                 action_env: list[str] | None = None, tool_flags: Mapping[str, Any] | None = None,
                 toolchain: list[str] | None = None, verbosity: int | None = None,
                 workspace: Workspace | None = None, need_workspace: bool = True,
                 signing_key: str | None = None, command: Command | None = None) -> BuildContext:
    """The one function that turns the common flags into a BuildContext, for `command` (default: the running one).
    `tool_flags`: the toolchain settings flags' values by dest (plan_settings.tool_values). `signing_key`: the
    --signing-key flag (else the command's $NEURONBUILD_SIGNING_KEY)."""
    from neuronbuild import plugins
    from neuronbuild.analysis.plan_settings import resolve_settings
    from neuronbuild.cache.local import resolve_cache_dir
    from neuronbuild.command import current

    cmd = command if command is not None else current()
    plugins.load_settings()  # (what the toolchains' settings resolve to: resolve_settings)

    ws = workspace
    if ws is None:
        try:
            ws = find_workspace(cmd.cwd)
        except UserInputError:
            if need_workspace:
                raise
    remote = remote_cache or None
    if remote and "://" not in remote:
        remote = str(cmd.path(remote))
    signer, trusted, key_path = _record_keys(remote_cache_trusted_keys, remote_cache_trust_writers,
                                            remote_cache_signing_key, bool(remote))
    cfg = CacheConfig(resolve_cache_dir(cache_dir), remote, remote_cache_readonly, s3_endpoint_url, signer, key_path,
                      trusted, remote_cache_trust_writers)
    settings = resolve_settings(action_env, tool_flags, toolchain)
    return BuildContext(ws, cfg, settings, NORMAL if verbosity is None else verbosity, cmd,
                        cmd.signing_key(signing_key))


def _record_keys(trusted_keys: str | None, trust_writers: bool, signing_key: str | None,
                 shared: bool = False) -> tuple[Any, Any, str | None]:
    """(signer, trusted keys, signing key path) from the shared-tier trust flags; UserInputError (exit 2) for a key
    that cannot be used or flags that contradict each other. With a `shared` tier and the tier not declared trusted
    (#49): records are signed with the signing key, else the user's own (cache/user_key.py: made on first use), and
    only records signed by that key or one of `trusted_keys` are served."""
    if trusted_keys and trust_writers:
        raise UserInputError("--remote-cache-trusted-keys and --remote-cache-trust-writers contradict each other: "
                             "give one (trusted keys: only signed records are served; trust writers: any record)")
    flag = "--remote-cache-signing-key"
    if shared and not trust_writers and not signing_key:
        from neuronbuild.cache.user_key import ensure_user_key

        flag = "the user's own record key"
        try:
            signing_key = str(ensure_user_key()[0])
        except OSError as e:
            raise UserInputError(f"cannot make your record-signing key for the shared cache ({e}): set "
                                 "$NEURONBUILD_RECORD_KEY to a file to keep it in, or give --remote-cache-signing-key "
                                 "FILE, or --remote-cache-trust-writers to serve every record unsigned") from None
    if not trusted_keys and not signing_key:
        return None, None, None
    from neuronbuild.runtime.signing import SignatureError, SigningKey, TrustedKeys

    try:
        path = str(Path(signing_key).expanduser().resolve()) if signing_key else None
        signer = SigningKey(Path(path)) if path else None
        flag = "--remote-cache-trusted-keys"
        trusted: Any = TrustedKeys(Path(trusted_keys).expanduser()) if trusted_keys else None
    except SignatureError as e:
        raise UserInputError(f"{flag}: {e}") from None
    if shared and not trust_writers and signer is not None:
        from neuronbuild.cache.user_key import TrustSet, public_of

        trusted = TrustSet([public_of(signer._key)], trusted, implicit=trusted is None)
    return signer, trusted, path
