"""Shell completion: bash, zsh and fish scripts generated from the argparse CLI definition, and target-label candidates.

The scripts hold the commands, their flags, the flags' choices and which flags take files; target labels come from
`neuronbuild completion --labels PREFIX`, which lists packages (`//pkg:`, `//pkg/...`) or a package's targets."""

from __future__ import annotations

import argparse
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

# Positional arguments that are target patterns (completed with labels), or files.
PATTERN_DESTS = ("patterns", "expr")
FILE_DESTS = ("bundle",)
# Value-taking flags completed with file names (the rest take words: sizes, counts, URLs).
FILE_METAVARS = ("PATH", "DIR", "SIZE_FILE")
FILE_FLAGS = ("--cache-dir", "--profile", "--build-event-json-file", "--neuronx-cc", "--remote-cache", "--expect",
              "-C")


@dataclass(frozen=True)
class CommandSpec:
    """What completion needs of one command (`build`, or `cache gc`)."""

    name: str
    help: str
    flags: tuple[str, ...]
    value_flags: tuple[str, ...]
    file_flags: tuple[str, ...]
    choices: dict[str, tuple[str, ...]] = field(hash=False)
    positional: str  # "patterns", "file", "choice" or ""
    positional_choices: tuple[str, ...] = ()
    subcommands: tuple[str, ...] = ()


def _subparsers(p: argparse.ArgumentParser) -> tuple[dict[str, argparse.ArgumentParser], dict[str, str]]:
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            helps = {c.dest: c.help or "" for c in a._choices_actions}
            return dict(a.choices), helps
    return {}, {}


def _spec(name: str, help_text: str, p: argparse.ArgumentParser) -> CommandSpec:
    flags: list[str] = []
    values: list[str] = []
    files: list[str] = []
    choices: dict[str, tuple[str, ...]] = {}
    positional = ""
    pos_choices: tuple[str, ...] = ()
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            continue
        if not a.option_strings:
            if a.dest in PATTERN_DESTS:
                positional = "patterns"
            elif a.dest in FILE_DESTS:
                positional = "file"
            elif a.choices and not positional:
                positional, pos_choices = "choice", tuple(str(c) for c in a.choices)
            continue
        if a.help == argparse.SUPPRESS:
            continue
        flags.extend(a.option_strings)
        if a.nargs != 0:
            values.extend(a.option_strings)
            if a.choices:
                for s in a.option_strings:
                    choices[s] = tuple(str(c) for c in a.choices)
            elif any(s in FILE_FLAGS for s in a.option_strings) or (a.metavar or "") in FILE_METAVARS:
                files.extend(a.option_strings)
    subs, _helps = _subparsers(p)
    return CommandSpec(name, help_text, tuple(flags), tuple(values), tuple(files), choices, positional, pos_choices,
                       tuple(subs))


def command_specs(parser: argparse.ArgumentParser) -> list[CommandSpec]:
    """The top level (name ""), every command, and every nested command as "cache gc"."""
    out = [_spec("", parser.description or "", parser)]
    subs, helps = _subparsers(parser)
    for name, p in subs.items():
        if name not in helps:
            continue  # hidden
        out.append(_spec(name, helps[name], p))
        nested, nested_helps = _subparsers(p)
        for sub, sp in nested.items():
            out.append(_spec(f"{name} {sub}", nested_helps.get(sub, ""), sp))
    return out


def _q(words: tuple[str, ...] | list[str]) -> str:
    return shlex.quote(" ".join(words))


def _key(name: str) -> str:
    """A command's key in the scripts' tables: "-" (top level), "build", "cache:gc"; only shell-safe characters, so
    bash and zsh read the subscripts alike without quoting."""
    return name.replace(" ", ":") or "-"


def _table(specs: list[CommandSpec]) -> str:
    """Associative-array assignments (valid bash and zsh) describing every command, keyed "-" for the top level."""
    rows: list[str] = []
    for s in specs:
        key = _key(s.name)
        rows.append(f"_nb_flags[{key}]={_q(s.flags)}")
        rows.append(f"_nb_values[{key}]={_q(s.value_flags)}")
        rows.append(f"_nb_files[{key}]={_q(s.file_flags)}")
        rows.append(f"_nb_pos[{key}]={shlex.quote(s.positional or '-')}")
        if s.positional_choices:
            rows.append(f"_nb_choices[{key}@]={_q(s.positional_choices)}")
        if s.subcommands:
            rows.append(f"_nb_subs[{key}]={_q(s.subcommands)}")
        for flag, ch in s.choices.items():
            rows.append(f"_nb_choices[{key}@{flag}]={_q(ch)}")
    return "\n".join(rows)


# The loop body (bash and zsh alike) finding the command words typed so far: `key` is the table's key for them
# ("-", "build", "cache:gc"; _key), `cmd` the command.
_KEY_LOOP = """        w="${words[i]}"
        if [[ -z "$cmd" ]]; then
            case "$w" in
                -C) ((i++)) ;;
                -*) ;;
                *) cmd="$w"; key="$w" ;;
            esac
        elif [[ "$key" == "$cmd" && " ${_nb_subs[$cmd]} " == *" $w "* ]]; then
            key="$cmd:$w"
        fi
    done"""


def bash_script(parser: argparse.ArgumentParser) -> str:
    specs = command_specs(parser)
    top = specs[0]
    table = _table(specs)
    return f"""# bash completion for neuronbuild (generated by `neuronbuild completion bash`; regenerate after upgrades).
# Load it with:  source <(neuronbuild completion bash)   (e.g. in ~/.bashrc)
declare -gA _nb_flags _nb_values _nb_files _nb_pos _nb_choices _nb_subs
_nb_commands={_q(list(top.subcommands))}
{table}

_neuronbuild() {{
    local line="${{COMP_LINE:0:COMP_POINT}}" cur="" prev="" cmd="" key="-" w i
    local -a words
    read -ra words <<< "$line"   # whitespace-split: labels keep their ':'
    if [[ -n "$line" && "${{line: -1}}" != [[:space:]] ]]; then
        cur="${{words[${{#words[@]}}-1]}}"
        unset 'words[${{#words[@]}}-1]'
    fi
    prev="${{words[${{#words[@]}}-1]}}"
    local -a reply=()
    for ((i = 1; i < ${{#words[@]}}; i++)); do
{_KEY_LOOP}
    if [[ " ${{_nb_values[$key]}} " == *" $prev "* ]]; then
        if [[ -n "${{_nb_choices[$key@$prev]}}" ]]; then
            reply=($(compgen -W "${{_nb_choices[$key@$prev]}}" -- "$cur"))
        elif [[ " ${{_nb_files[$key]}} " == *" $prev "* ]]; then
            reply=($(compgen -f -- "$cur"))
        fi
    elif [[ "$cur" == -* ]]; then
        reply=($(compgen -W "${{_nb_flags[$key]}}" -- "$cur"))
    elif [[ -z "$cmd" ]]; then
        reply=($(compgen -W "$_nb_commands" -- "$cur"))
    elif [[ -n "${{_nb_subs[$key]}}" ]]; then
        reply=($(compgen -W "${{_nb_subs[$key]}}" -- "$cur"))
    else
        case "${{_nb_pos[$key]}}" in
            patterns) reply=($(command neuronbuild completion --labels "$cur" 2>/dev/null)) ;;
            file) reply=($(compgen -f -- "$cur")) ;;
            choice) reply=($(compgen -W "${{_nb_choices[$key@]}}" -- "$cur")) ;;
        esac
    fi
    if [[ "$cur" == *:* && "$COMP_WORDBREAKS" == *:* ]]; then
        local strip="${{cur%"${{cur##*:}}"}}"   # bash completes only the part after the last ':'
        for i in "${{!reply[@]}}"; do reply[i]="${{reply[i]#"$strip"}}"; done
    fi
    if [[ ${{#reply[@]}} -eq 1 && ( "${{reply[0]}}" == *: || "${{reply[0]}}" == */ ) ]]; then
        compopt -o nospace 2>/dev/null
    fi
    COMPREPLY=("${{reply[@]}}")
}}
complete -o default -F _neuronbuild neuronbuild
"""


def zsh_script(parser: argparse.ArgumentParser) -> str:
    specs = command_specs(parser)
    described = " ".join(shlex.quote(f"{s.name}:{s.help}") for s in specs[1:] if " " not in s.name)
    table = _table(specs)
    return f"""#compdef neuronbuild
# zsh completion for neuronbuild (generated by `neuronbuild completion zsh`; regenerate after upgrades).
# Load it with:  source <(neuronbuild completion zsh)   (after compinit), or save it as _neuronbuild on $fpath.
typeset -gA _nb_flags _nb_values _nb_files _nb_pos _nb_choices _nb_subs
_nb_described=({described})
{table}

_neuronbuild() {{
    local cur="${{words[CURRENT]}}" prev="${{words[CURRENT-1]}}" cmd="" key="-" w i
    for ((i = 2; i < CURRENT; i++)); do
{_KEY_LOOP}
    if [[ " ${{_nb_values[$key]}} " == *" $prev "* ]]; then
        if [[ -n "${{_nb_choices[$key@$prev]}}" ]]; then
            compadd -- ${{=_nb_choices[$key@$prev]}}
        elif [[ " ${{_nb_files[$key]}} " == *" $prev "* ]]; then
            _files
        fi
    elif [[ "$cur" == -* ]]; then
        compadd -- ${{=_nb_flags[$key]}}
    elif [[ -z "$cmd" ]]; then
        _describe -t commands 'neuronbuild command' _nb_described
    elif [[ -n "${{_nb_subs[$key]}}" ]]; then
        compadd -- ${{=_nb_subs[$key]}}
    else
        case "${{_nb_pos[$key]}}" in
            patterns)
                local -a labels
                labels=(${{(f)"$(command neuronbuild completion --labels "$cur" 2>/dev/null)"}})
                compadd -S '' -- ${{(M)labels:#*[:/]}}
                compadd -- ${{labels:#*[:/]}} ;;
            file) _files ;;
            choice) compadd -- ${{=_nb_choices[$key@]}} ;;
        esac
    fi
}}
if (( $+functions[compdef] )); then compdef _neuronbuild neuronbuild; fi
"""


def _fish_q(text: str) -> str:
    """A fish single-quoted string (fish escapes only \\ and ' inside them)."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def fish_script(parser: argparse.ArgumentParser) -> str:
    """`complete` lines per command, guarded by the command words typed so far (`__nb_key_is cache:gc`)."""
    from neuronbuild.rcfile import target_parser

    specs = command_specs(parser)
    lines: list[str] = []
    for s in specs:
        key = _key(s.name)
        cond = f"-n {_fish_q(f'__nb_key_is {key}')}"
        subs, helps = _subparsers(target_parser(parser, s.name.split()))
        for sub in s.subcommands:
            if sub in helps:
                lines.append(f"complete -c neuronbuild {cond} -a {_fish_q(sub)} -d {_fish_q(helps[sub])}")
        for flag in s.flags:
            opt = f"-l {flag[2:]}" if flag.startswith("--") else f"-s {flag[1:]}" if len(flag) == 2 else \
                f"-o {flag[1:]}"
            extra = ""
            if flag in s.value_flags:
                extra = " -r"
                if flag in s.choices:
                    extra += f" -f -a {_fish_q(' '.join(s.choices[flag]))}"
                elif flag in s.file_flags:
                    extra += " -F"
            lines.append(f"complete -c neuronbuild {cond} {opt}{extra}")
        if s.positional == "patterns":
            lines.append(f"complete -c neuronbuild {cond} -f -a "
                         f"{_fish_q('(command neuronbuild completion --labels (commandline -ct) 2>/dev/null)')}")
        elif s.positional == "file":
            lines.append(f"complete -c neuronbuild {cond} -F")
        elif s.positional == "choice":
            lines.append(f"complete -c neuronbuild {cond} -f -a {_fish_q(' '.join(s.positional_choices))}")
    body = "\n".join(lines)
    nested = " ".join(sorted({s.name.split(" ")[0] for s in specs if " " in s.name}))
    return f"""# fish completion for neuronbuild (generated by `neuronbuild completion fish`; regenerate after upgrades).
# Load it with:  neuronbuild completion fish | source   (or save it as ~/.config/fish/completions/neuronbuild.fish)
function __nb_key_is --description 'whether the command words typed so far are $argv[1] (- for none, cache:gc)'
    set -l words (commandline -opc)
    set -l key -
    set -l cmd
    set -l skip 0
    for w in $words[2..-1]
        if test $skip = 1
            set skip 0
        else if test -z "$cmd"
            switch $w
                case -C
                    set skip 1
                case '-*'
                case '*'
                    set cmd $w
                    set key $w
            end
        else if test "$key" = "$cmd"; and contains -- $cmd {nested}; and not string match -q -- '-*' $w
            set key "$cmd:$w"
        end
    end
    test "$key" = "$argv[1]"
end
complete -c neuronbuild -f
{body}
"""


def label_candidates(prefix: str, start: Path | None = None) -> list[str]:
    """Completions of a target pattern prefix: `//pkg:` and `//pkg/...` for packages, `//pkg:name` for targets."""
    from neuronbuild import plugins
    from neuronbuild.errors import NeuronBuildError
    from neuronbuild.loading.loader import Loader
    from neuronbuild.loading.starlark_adapter import run_on_starlark_thread
    from neuronbuild.workspace import find_workspace

    try:
        ws = find_workspace(start)
    except NeuronBuildError:
        return []
    plugins.load()  # the rule kinds a BUILD file calls
    loader = Loader(ws.root)
    if ":" in prefix:
        pkg_part, _, name_part = prefix.rpartition(":")
        package = ws.cwd_package if pkg_part == "" else pkg_part[2:] if pkg_part.startswith("//") else \
            os.path.normpath(os.path.join(ws.cwd_package, pkg_part)).lstrip("./") if pkg_part != "." else ""
        if not loader.has_package(package):
            return []
        try:
            pkg = run_on_starlark_thread(lambda: loader.load_package(package))
        except NeuronBuildError:
            return []
        names = sorted({t.label.name for t in pkg.targets} | {"all"})
        return [f"{pkg_part}:{n}" for n in names if n.startswith(name_part)]
    out: list[str] = []
    absolute = prefix.startswith("//") or prefix in ("", "/")
    if absolute and "//...".startswith(prefix):
        out.append("//...")
    for package in loader.find_packages(""):
        for cand in (f"//{package}:", f"//{package}/...") if package else ("//:",):
            if absolute and cand.startswith(prefix):
                out.append(cand)
    return sorted(dict.fromkeys(out))
