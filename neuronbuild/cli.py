"""The `neuronbuild` command line: argument parsing, dispatch to command modules, one-line errors and exit codes."""

from __future__ import annotations

import os
import sys

from neuronbuild import streams

TYPE_CHECKING = False  # (not typing's: importing typing alone costs a no-op client through the server milliseconds)
if TYPE_CHECKING:
    import argparse
    from collections.abc import Sequence
    from pathlib import Path
    from typing import Any

    from neuronbuild.command import Command

# argparse, the command modules and errors are imported only when the command runs in this process: a command the
# build server runs costs the client nothing but the thin client (neuronbuild/server/client.py).


# What a build's outputs depend on besides neuronbuild (their versions enter the fingerprints that use them).
VERSIONED_PACKAGES = ("torch", "transformers", "jax", "jaxlib", "torchax", "starlark-go")


def version_text() -> str:
    """`neuronbuild --version`: neuronbuild's version, then Python's and the build's packages' (from package metadata,
    nothing imported)."""
    import platform

    from neuronbuild import __version__
    from neuronbuild.plugin_api.toolchain import package_version

    deps = ", ".join(f"{name} {package_version(name).replace('not-installed', 'not installed')}"
                     for name in VERSIONED_PACKAGES)
    return f"neuronbuild {__version__}\nPython {platform.python_version()}, {deps}"


def _parser_class() -> type[argparse.ArgumentParser]:
    import argparse

    from neuronbuild.errors import EXIT_BAD_INPUT

    class _Parser(argparse.ArgumentParser):
        def error(self, message: str) -> None:  # type: ignore[override]
            message += _nearest_hint(self, message)
            if message.startswith("unrecognized arguments"):
                from neuronbuild.plugins import PLUGINS_ENV, settings_problems

                # A plug-in that could not be imported declared no flags: say so, not only that its flag is unknown.
                for mod, why in settings_problems().items():
                    message += (f" (plug-in {mod} from ${PLUGINS_ENV} could not be imported, so its flags are "
                                f"unknown: {why})")
            print(f"neuronbuild: error: {message}", file=streams.err())
            raise SystemExit(EXIT_BAD_INPUT)

        def _print_message(self, message: str, file: Any = None) -> None:
            # help, usage and errors to the command's streams (a server command's go to its client)
            super()._print_message(message, streams.err() if file is sys.stderr else streams.out() if file in (
                None, sys.stdout) else file)

        def _get_formatter(self) -> argparse.HelpFormatter:
            # help as wide as the command's terminal ($COLUMNS of its environment, which the server's client sets)
            import shutil

            from neuronbuild import envvars

            cols = envvars.environ().get("COLUMNS", "")
            width = int(cols) if cols.isdigit() else shutil.get_terminal_size().columns
            return self.formatter_class(prog=self.prog, width=max(width - 2, 11))  # type: ignore[call-arg]

    return _Parser


def _nearest_hint(parser: argparse.ArgumentParser, message: str) -> str:
    """` (did you mean 'build'?)` for a mistyped command or choice, ` (--jbos: did you mean --jobs?)` for a mistyped
    flag: the nearest choice, or the nearest flag of the command given (else of every command), as difflib ranks them."""
    import argparse
    import difflib
    import re

    choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message)
    if choice:
        near = difflib.get_close_matches(choice.group(1), re.findall(r"'([^']*)'", choice.group(2)), n=1)
        return f" (did you mean '{near[0]}'?)" if near else ""
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    if not message.startswith("unrecognized arguments: "):
        return ""
    parsers = [parser]
    if sub is not None:
        given = [sub.choices[a] for a in _argv_seen if a in sub.choices]
        parsers = given[:1] or [parser, *sub.choices.values()]
    flags = sorted({o for p in parsers for a in p._actions for o in a.option_strings if o.startswith("--")})
    startup = {o for a in parser._actions for o in a.option_strings} - {"-h", "--help", "--version"}
    hints = []
    for word in message.split(": ", 1)[1].split():
        flag = word.split("=", 1)[0]
        near = difflib.get_close_matches(flag, flags, n=1) if word.startswith("--") else []
        if parser is not parsers[0] and flag in startup:
            hints.append(f"{flag} is a startup option: write it before the command: neuronbuild {flag} COMMAND ...")
        elif near:
            hints.append(f"{word}: did you mean {near[0]}?")
    return f" ({'; '.join(hints)})" if hints else ""


_argv_seen: list[str] = []  # the arguments being parsed (for _nearest_hint: which command's flags to rank)


EPILOG = """\
rc files: flags per command from ~/.neuronbuildrc, then <workspace>/.neuronbuildrc (e.g. `build --jobs 4`,
`common --cache-dir DIR`); the command line wins. `neuronbuild COMMAND -h` shows a command's flags.
exit codes: 0 ok, 1 build failed, 2 bad command line or BUILD input, 8 interrupted.
build, plan, explain and query run in a per-workspace build server (warm workers, loaded packages kept between
commands); --batch or NEURONBUILD_NO_SERVER=1 runs them in this process. `neuronbuild shutdown` stops it."""


def make_parser() -> tuple[argparse.ArgumentParser, dict[str, str]]:
    import argparse
    import importlib

    from neuronbuild.commands import COMMAND_MODULES

    _Parser = _parser_class()

    class _VersionAction(argparse.Action):
        def __call__(self, parser: argparse.ArgumentParser, *_args: object) -> None:
            print(version_text(), file=streams.out())
            parser.exit()

    parser = _Parser(prog="neuronbuild", description="Bazel-style builds of model graphs for accelerators.",
                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-C", dest="directory", metavar="DIR", help="run as if started in this directory")
    parser.add_argument("--norc", action="store_true", help="read no .neuronbuildrc file")
    parser.add_argument("--version", action=_VersionAction, nargs=0,
                        help="show neuronbuild's version and those of the packages its builds depend on, and exit")
    startup = parser.add_argument_group("build server (startup options, before the command; docs/server.md)")
    startup.add_argument("--batch", action="store_true",
                         help="run the command in this process, without the build server (also: NEURONBUILD_NO_SERVER=1)")
    startup.add_argument("--max-idle-secs", type=int, metavar="N",
                         help="the server exits after N idle seconds (default 10800); another value replaces it")
    startup.add_argument("--output-user-root", metavar="DIR",
                         help="where servers keep their output bases (default: $NEURONBUILD_OUTPUT_USER_ROOT or "
                              "~/.cache/neuronbuild-server)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands", parser_class=_Parser)
    owners: dict[str, str] = {}
    for name in COMMAND_MODULES:
        mod = importlib.import_module(f"neuronbuild.commands.{name}")
        before = set(sub.choices)
        mod.register(sub)
        for cmd in set(sub.choices) - before:
            owners[cmd] = name
    return parser, owners


_parsers: dict[object, tuple[argparse.ArgumentParser, dict[str, str]]] = {}


def _parser() -> tuple[argparse.ArgumentParser, dict[str, str]]:
    """make_parser(), kept for the next command of a build server with the same environment (some defaults read
    it). Parsing does not change a parser, and help text is formatted when printed (COLUMNS then)."""
    from neuronbuild import envvars

    key = frozenset(envvars.environ().items())
    found = _parsers.get(key)
    if found is None:
        _parsers.clear()
        found = _parsers[key] = make_parser()
    return found


def _quiet_stdout() -> None:
    """After a broken pipe (`neuronbuild query ... | head -1`): later writes and the exit flush go nowhere."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        from neuronbuild.server.client import maybe_run

        # build, plan, explain and query go to the workspace's server unless --batch (a command line this process
        # would refuse is refused before a server is started for it)
        code = maybe_run(args, command_line_error)
        if code is not None:
            return code
        return _main(args)
    except BrokenPipeError:
        _quiet_stdout()
        return 0
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] not in BUILD_SIDE:
            raise
        # A serving-only install (`pip install neuronbuild`: the runtime's dependencies alone).
        print(f"neuronbuild: error: this command needs the build side (module {e.name!r} is not installed): "
              "pip install 'neuronbuild[build]'", file=streams.err())
        return 2


# The `build` extra's modules (pyproject.toml): a serving-only install lacks them.
BUILD_SIDE = frozenset({"starlark_go", "networkx", "blake3", "rich", "jinja2", "zstandard", "cryptography"})


def _expand_and_parse(argv: list[str], parser: argparse.ArgumentParser,
                      cwd: Path | None = None) -> argparse.Namespace | int:
    """argv with its rc files' flags (those of `cwd`, the command's directory), parsed; or the exit code of a command
    line refused (its error printed)."""
    from neuronbuild.errors import NeuronBuildError
    from neuronbuild.rcfile import expand

    try:
        argv = expand(argv, parser, cwd)
    except NeuronBuildError as e:
        print(str(e), file=streams.err())
        return e.exit_code
    _argv_seen[:] = argv
    try:
        return parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)


def command_line_error(argv: list[str]) -> int | None:
    """The exit code of a command line this process would refuse (its one-line error printed), else None: what the
    client checks before it starts a build server for the command."""
    parsed = _expand_and_parse(argv, _parser()[0])
    return parsed if isinstance(parsed, int) else None


def _main(argv: list[str], cmd: Command | None = None) -> int:
    """Runs one command: `cmd` (the build server's, from its client's message), else this process as a batch one."""
    from neuronbuild.command import Command

    cmd = cmd if cmd is not None else Command.batch(argv)
    with cmd.active():
        return _run(argv, cmd)


def _run(argv: list[str], cmd: Command) -> int:

    from neuronbuild.errors import EXIT_BAD_INPUT, EXIT_BUILD_FAILED, EXIT_INTERRUPTED, NeuronBuildError

    parser, owners = _parser()
    if not argv:
        parser.print_help()
        return EXIT_BAD_INPUT
    args = _expand_and_parse(argv, parser, cmd.cwd)
    if isinstance(args, int):
        return args
    if args.command is None:
        parser.print_usage(streams.err())
        print("neuronbuild: error: give a command (neuronbuild -h lists them)", file=streams.err())
        return EXIT_BAD_INPUT
    try:
        if args.directory:  # -C DIR: the command runs as if started there
            cmd = cmd.in_directory(args.directory)
        _absolute_paths(args, cmd)
        with cmd.active():
            import importlib

            return int(importlib.import_module(f"neuronbuild.commands.{owners[args.command]}").run(args))
    except NeuronBuildError as e:
        print(str(e), file=streams.err())
        return e.exit_code
    except BrokenPipeError:
        raise
    except KeyboardInterrupt:
        print("neuronbuild: interrupted", file=streams.err())
        return EXIT_INTERRUPTED
    except OSError as e:
        print(f"neuronbuild: error: {e}", file=streams.err())
        return EXIT_BUILD_FAILED


# Flags and arguments naming files or directories: made absolute against the command's directory once parsed, so no
# command depends on the process's working directory (a build server's is its own).
PATH_DESTS = ("cache_dir", "remote_cache", "remote_cache_trusted_keys", "remote_cache_signing_key", "output_user_root",
              "trusted_keys", "bundle", "scratch", "dest", "src", "profile", "build_event_json_file", "signing_key")


def _absolute_paths(args: argparse.Namespace, cmd: Command) -> None:
    for dest in PATH_DESTS:
        v = getattr(args, dest, None)
        if isinstance(v, str) and v and "://" not in v:
            setattr(args, dest, str(cmd.path(v)))
    from neuronbuild import plugins

    for s in plugins.tool_settings():  # a toolchain's PATH flag: a value with a slash is a path, else a name on PATH
        for f in s.flags:
            v = getattr(args, f.dest, None)
            if f.metavar == "PATH" and isinstance(v, str) and (os.sep in v or v.startswith("~")):
                setattr(args, f.dest, str(cmd.path(v)))


def entry() -> None:
    """The `neuronbuild` command and `python -m neuronbuild`: main(), then the process ends with its code."""
    code = main()
    adapter = sys.modules.get("neuronbuild.loading.starlark_adapter")
    if adapter is not None and adapter.starlark_thread_stuck():
        # A Starlark evaluation this command gave up on (an endless loop that was interrupted, a runaway allocation
        # over its budget) still runs and cannot be stopped: end now, with the error already reported, rather than
        # through the interpreter's shutdown, while a runaway would go on allocating (seen: the Go runtime's own
        # out-of-memory abort under an address-space limit, after the located error had been printed).
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
    raise SystemExit(code)


if __name__ == "__main__":
    entry()
