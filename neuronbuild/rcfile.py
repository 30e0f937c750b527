"""`.neuronbuildrc` files: default flags per command from $HOME and the workspace root, as Bazel's bazelrc.

A line is `SECTION FLAGS...` (shell quoting; `#` starts a comment). SECTION is a command (`build`, `plan`, `cache`,
...) or `common`. The flags a command gets are, in this order (a later value wins, the command line last of all):
`common` lines, then `build` lines for the commands that plan builds (plan, explain, upgrade-impact, validate), then the
command's own lines; for each section the home rc ($HOME/.neuronbuildrc) comes before the workspace rc
(<workspace root>/.neuronbuildrc). `common` and inherited `build` flags a command does not take are skipped; a flag a
line's own command does not take, a missing or bad value, or an unknown section is a one-line `rc:line: error:`.
`deploy` and `verify` take no rc flags: deploy's `--dest` (alias `--cache-dir`) is a serving directory, not the build cache.
Startup options before the command (`--batch`, `--max-idle-secs N`, ...) do not stop rc files being read. A workspace
rc file that sets a program the build runs or where results go (NOTED) is named on stderr once per value."""

from __future__ import annotations

import argparse
import difflib
import os
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from neuronbuild import envvars, streams
from neuronbuild.errors import UserInputError
from neuronbuild.workspace import MARKER

RC_NAME = ".neuronbuildrc"
COMMON = "common"
INHERITS_BUILD = ("plan", "explain", "upgrade-impact", "validate")
NO_RC = ("deploy", "verify", "completion", "help")
# An rc file holds a few flags per command: a larger file or a longer line is refused before it is split (shlex reads
# a character at a time: seconds for a megabyte line).
MAX_RC_BYTES = 256 << 10
MAX_RC_LINE = 16 << 10


class RcError(UserInputError):
    """A bad rc line: reported as `path:line: error: ...`, exit 2."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(message)
        self.where = where

    def __str__(self) -> str:
        return f"{self.where}: error: {self.message}"


@dataclass(frozen=True)
class RcLine:
    """One non-empty line of an rc file: its section (command) and its flag words."""

    path: Path
    line: int
    section: str
    args: tuple[str, ...]

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def read_rc(path: Path, sections: Sequence[str]) -> list[RcLine]:
    """The lines of one rc file; an unknown section or bad quoting is an RcError. A missing file has no lines."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_RC_BYTES + 1)
        if len(data) > MAX_RC_BYTES:
            raise RcError(str(path), f"the rc file is larger than {MAX_RC_BYTES >> 10} KiB")
        text = data.decode("utf-8")
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError) as e:
        raise RcError(str(path), f"cannot read the rc file: {e}") from None
    out: list[RcLine] = []
    for n, raw in enumerate(text.splitlines(), 1):
        if len(raw) > MAX_RC_LINE:
            raise RcError(f"{path}:{n}", f"the line is longer than {MAX_RC_LINE >> 10} KiB")
        try:
            words = shlex.split(raw, comments=True)
        except ValueError as e:
            raise RcError(f"{path}:{n}", f"cannot split the line: {e}") from None
        if not words:
            continue
        section = words[0]
        if section not in sections:
            near = difflib.get_close_matches(section, sections, n=1)
            hint = f" (did you mean '{near[0]}'?)" if near else f" (known: {', '.join(sections)})"
            raise RcError(f"{path}:{n}", f"unknown command '{section}' at the start of the line{hint}")
        out.append(RcLine(path, n, section, tuple(words[1:])))
    return out


def rc_files(start: Path) -> list[Path]:
    """The home rc, then the rc in the root of the workspace containing `start` (if any, and not the same file)."""
    files: list[Path] = []
    home = envvars.environ().get("HOME")  # (the command's)
    if home:
        files.append(Path(home) / RC_NAME)
    cwd = start.resolve()
    for d in (cwd, *cwd.parents):
        if (d / MARKER).is_file():
            files.append(d / RC_NAME)
            break
    seen: list[Path] = []
    for f in files:
        if f.is_file() and not any(f.resolve() == s.resolve() for s in seen):
            seen.append(f)
    return seen


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in parser._actions for s in a.option_strings if not isinstance(a, argparse._HelpAction)}


def _takes_value(action: argparse.Action) -> bool:
    return action.nargs != 0


def _split(line: RcLine, known: dict[str, argparse.Action]) -> list[tuple[argparse.Action, list[str], str]]:
    """A line's words as (action, words, option) groups: `--x v`, `--x=v` or `--flag`; an unknown option is an error."""
    groups: list[tuple[argparse.Action, list[str], str]] = []
    words = list(line.args)
    i = 0
    while i < len(words):
        w = words[i]
        if not w.startswith("-") or w in ("-", "--"):
            raise RcError(line.where, f"'{w}' is not a flag (rc lines hold flags only, e.g. '{line.section} --jobs 4')")
        name, eq, _value = w.partition("=")
        action = known.get(name)
        if action is None and not eq and not w.startswith("--") and len(w) > 2 and w[:2] in known:
            name, action = w[:2], known[w[:2]]  # -j4
            eq = "="
        if action is None:
            near = difflib.get_close_matches(name, [k for k in known if k.startswith("--")], n=1)
            raise RcError(line.where, f"unknown option {name}" + (f" (did you mean {near[0]}?)" if near else ""))
        if _takes_value(action) and not eq:
            if i + 1 >= len(words):
                raise RcError(line.where, f"{name} needs a value")
            groups.append((action, [w, words[i + 1]], name))
            i += 2
            continue
        if not _takes_value(action) and eq:
            raise RcError(line.where, f"{name} takes no value")
        groups.append((action, [w], name))
        i += 1
    return groups


def _value(words: list[str], name: str) -> str:
    if len(words) == 2:
        return words[1]
    return words[0][len(name) + 1:] if words[0].startswith(name + "=") else words[0][len(name):]


def _check(line: RcLine, action: argparse.Action, words: list[str], name: str) -> None:
    """The checks argparse would make of the value, reported at the rc line."""
    if not _takes_value(action):
        return
    value = _value(words, name)
    if action.type is not None and callable(action.type):
        try:
            converted = action.type(value)
        except (TypeError, ValueError, argparse.ArgumentTypeError):
            raise RcError(line.where, f"bad value for {name}: '{value}'") from None
    else:
        converted = value
    if action.choices is not None and converted not in action.choices:
        raise RcError(line.where, f"bad value for {name}: '{value}' (choose from "
                                  f"{', '.join(map(str, action.choices))})")


@dataclass(frozen=True)
class Command:
    """A command line cut where rc flags go: global words, the command words (`cache gc`), then the rest."""

    prefix: tuple[str, ...]  # global options before the command
    words: tuple[str, ...]  # the command (and for `cache`, its sub-command)
    rest: tuple[str, ...]
    directory: str | None
    norc: bool


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    return {}


def split_command(argv: Sequence[str], parser: argparse.ArgumentParser) -> Command | None:
    """Find the command in argv (after global options: -C DIR, --norc, --version, -h); None if there is none."""
    argv = list(argv)
    commands = subparsers(parser)
    i = 0
    directory: str | None = None
    norc = False
    top = _options(parser)  # -C, --norc, --version and the startup options (--batch, --max-idle-secs N, ...)
    while i < len(argv) and argv[i].startswith("-"):
        w = argv[i]
        name, eq, _value = w.partition("=")
        if w == "-C" and i + 1 < len(argv):
            directory = argv[i + 1]
            i += 2
            continue
        if w.startswith("-C") and len(w) > 2:
            directory = w[2:].lstrip("=")
        elif w == "--norc":
            norc = True
        elif w in ("-h", "--help"):
            pass
        elif name in top and _takes_value(top[name]):
            if not eq:
                i += 1  # the startup option's value (argparse checks it)
                if i >= len(argv):
                    return None
        elif w not in top:
            return None  # argparse reports it
        i += 1
    if i >= len(argv) or argv[i] not in commands:
        return None
    cmd = argv[i]
    nested = subparsers(commands[cmd])
    if not nested:
        return Command(tuple(argv[:i]), (cmd,), tuple(argv[i + 1:]), directory, norc)
    j = i + 1
    while j < len(argv) and argv[j].startswith("-"):
        j += 1
    if j >= len(argv) or argv[j] not in nested:
        return None
    return Command(tuple(argv[:i]), (cmd, argv[j]), tuple(argv[i + 1:j] + argv[j + 1:]), directory, norc)


def target_parser(parser: argparse.ArgumentParser, words: Sequence[str]) -> argparse.ArgumentParser:
    for w in words:
        parser = subparsers(parser)[w]
    return parser


def _all_options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every option of every (sub-)command, to know which take a value."""
    out: dict[str, argparse.Action] = {}
    for sub in subparsers(parser).values():
        out = {**_options(sub), **_all_options(sub), **out}
    return out


def expand(argv: Sequence[str], parser: argparse.ArgumentParser, cwd: Path | None = None) -> list[str]:
    """argv with the rc files' flags for its command inserted before the command line's own (which win)."""
    cmd = split_command(argv, parser)
    if cmd is None or cmd.norc or cmd.words[0] in NO_RC:
        return list(argv)
    base = Path(cwd or os.getcwd())
    start = base / cmd.directory if cmd.directory else base
    files = rc_files(start)
    if not files:
        return list(argv)
    commands = subparsers(parser)
    sections = [COMMON, *commands]
    lines = [ln for f in files for ln in read_rc(f, sections)]
    target = target_parser(parser, cmd.words)
    known = _options(target)
    everywhere = _all_options(parser)
    chain = [COMMON, *(["build"] if cmd.words[0] in INHERITS_BUILD else []), cmd.words[0]]
    groups: list[tuple[argparse.Action, list[str]]] = []
    sources: dict[int, tuple[RcLine, str]] = {}  # id(words) -> the line and option that gave them
    for section in chain:
        for ln in lines:
            if ln.section != section:
                continue
            own = section == cmd.words[0]
            for _action, words, name in _split(ln, {**everywhere, **known}):
                if name not in known:
                    if own and len(cmd.words) == 1:
                        raise RcError(ln.where, f"'{section}' has no option {name}")
                    continue  # a common/inherited flag (or another cache sub-command's) this command does not take
                _check(ln, known[name], words, name)
                groups.append((known[name], words))
                sources[id(words)] = (ln, name)
    groups = _drop_conflicts(target, groups, cmd.rest)
    # Consent to the workspace rc's programs comes from the user: the command line or the home rc, never a workspace's.
    trusted = TRUST_FLAG in cmd.rest or any(
        TRUST_FLAG in words and src is not None and _is_home_rc(src[0].path)
        for _a, words in groups for src in (sources.get(id(words)),))
    _note_workspace_settings(groups, sources, trusted)
    rc_words = [w for _a, ws in groups for w in ws]
    return [*cmd.prefix, *cmd.words, *rc_words, *cmd.rest]


def _drop_conflicts(parser: argparse.ArgumentParser, groups: list[tuple[argparse.Action, list[str]]],
                    rest: Sequence[str]) -> list[tuple[argparse.Action, list[str]]]:
    """Mutually exclusive flags (--quiet/--verbose): the command line's choice wins, else the rc's last one."""
    for meg in parser._mutually_exclusive_groups:
        members = set(meg._group_actions)
        given = {s for a in members for s in a.option_strings}
        if any(w.split("=", 1)[0] in given for w in rest):
            groups = [g for g in groups if g[0] not in members]
            continue
        last = next((g for g in reversed(groups) if g[0] in members), None)
        groups = [g for g in groups if g[0] not in members or g is last]
    return groups


# Flags that choose a program the build runs or where it sends or reads results: a workspace rc file (anyone who can
# commit to the workspace) that sets one is named on stderr the first time the value is used (issue #31).
NOTED = {
    "--neuronx-cc": "the neuronx-cc program the build runs",
    "--remote-cache": "the shared cache tier results are read from and uploaded to",
    "--s3-endpoint-url": "the S3 endpoint results are read from and uploaded to",
    "--scheduler": "the Dask scheduler actions are sent to",
    "--cache-dir": "the cache directory results are read from",
    "--signing-key": "the key releases are signed with",
    "--remote-cache-signing-key": "the key records uploaded to the shared cache are signed with",
    "--remote-cache-trusted-keys": "the keys whose shared-cache records are served",
    "--remote-cache-trust-writers": "serving shared-cache records no trusted key signed",
    "--build-event-json-file": "the file build events are written to",
    "--action-timeout": "each action's wall-clock limit",  # (a repository could lift the limits of its own models)
    "--action-memory": "each action's memory limit",
    "--action-pids": "each action's limit of processes and threads",
}
# Of those, the ones naming a program the build process runs (a `--version` probe before any action): a workspace rc
# file's value is used only with the user's consent (TRUST_FLAG once, remembered per rc file, option and value).
PROGRAMS = frozenset({"--neuronx-cc"})
TRUST_FLAG = "--trust-workspace-rc"
NOTICES_FILE = "rc-notices"  # in the output user root: one sha256 per line, of (rc file, option, value) seen
CONSENTS_FILE = "rc-consents"  # the same, of the programs the user allowed
MAX_NOTICES = 1000


def _is_home_rc(path: Path) -> bool:
    home = envvars.environ().get("HOME")  # (the command's)
    if not home:
        return False
    try:
        return path.resolve() == (Path(home) / RC_NAME).resolve()
    except OSError:
        return False


def _seen(state: Path) -> set[str]:
    from neuronbuild.atomic import read_own_state

    try:
        return set(read_own_state(state)[:MAX_NOTICES * 65].decode("ascii", "replace").split())
    except OSError:
        return set()


def _remember(state: Path, seen: set[str], new: list[str]) -> None:
    from neuronbuild.atomic import atomic_write_bytes
    from neuronbuild.server.protocol import private_dir

    keep = sorted(k for k in seen if len(k) == 64)
    if len(keep) + len(new) > MAX_NOTICES:
        keep = []  # bounded: the forgotten settings are noted (or asked) once more
    try:
        private_dir(state.parent)
        atomic_write_bytes(state, "".join(k + "\n" for k in [*keep, *new]).encode(), durable=False, mode=0o600)
    except OSError:
        pass  # noted again next time


def _note_workspace_settings(groups: list[tuple[argparse.Action, list[str]]],
                             sources: dict[int, tuple[RcLine, str]], trusted: bool = False) -> None:
    """Print `neuronbuild: note: <rc>:<line> sets --flag VALUE (...)` for each NOTED flag a workspace rc file
    (not the user's home rc) sets, once per rc file, flag and value: the state is the user's (the output user root),
    never the workspace's, so a workspace cannot mark its own settings as already seen. A PROGRAMS flag's value is
    refused (RcError, before anything runs) until the user allowed it with TRUST_FLAG (`trusted`), once per value."""
    import hashlib

    from neuronbuild.server.protocol import default_output_user_root

    root = Path(default_output_user_root())
    consents = None
    noted = []
    for _action, words in groups:
        src = sources.get(id(words))
        if src is None or src[1] not in NOTED or _is_home_rc(src[0].path):
            continue
        ln, name = src
        value = _value(words, name)
        key = hashlib.sha256("\0".join((str(ln.path.resolve()), name, value)).encode()).hexdigest()
        shown = f"{name} {value!r}" if value else name  # (a switch has no value)
        if name in PROGRAMS:
            if consents is None:
                consents = _seen(root / CONSENTS_FILE)
            if key not in consents:
                if not trusted:
                    raise RcError(ln.where, f"a workspace rc file sets {shown}: {NOTED[name]}, as you, before any "
                                            f"action (its --version first); nothing was run. If you trust this "
                                            f"workspace, add {TRUST_FLAG} once (remembered for this value)")
                _remember(root / CONSENTS_FILE, consents, [key])
                consents.add(key)
        noted.append((key, f"neuronbuild: note: {ln.where} (a workspace rc file) sets {shown}: {NOTED[name]}"))
    if not noted:
        return
    state = root / NOTICES_FILE
    seen = _seen(state)
    new = [(k, msg) for k, msg in noted if k not in seen]
    for _k, msg in new:
        print(msg, file=streams.err())
    if new:
        _remember(state, seen, [k for k, _m in new])
