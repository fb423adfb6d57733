"""``edgeline completion bash|zsh``: a shell completion script generated from the command's own parser.

The script knows the command tree (commands, actions such as ``profiles show``), every option, which options take
a value and the choices of those that have them, and the choices of positional arguments (``sim SENSOR``). Where
nothing is known (a BUNDLE, a file), the shell completes file names. Both shells share one function,
``_edgeline_candidates``, in plain shell; each adds a few lines to hand its words over.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["completion_script", "register"]

SHELLS = ("bash", "zsh")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "completion",
        help="print a shell completion script (bash or zsh)",
        description="Print a completion script for SHELL on stdout. Load it from your shell's start-up file: "
        'bash: eval "$(edgeline completion bash)" in ~/.bashrc; zsh: eval "$(edgeline completion zsh)" in '
        "~/.zshrc, after compinit.",
    )
    parser.add_argument("shell", metavar="SHELL", choices=SHELLS, help="one of: %(choices)s")
    parser.set_defaults(func=_print_script)


def _print_script(args: argparse.Namespace) -> int:
    from edgeline.cli import build_parser

    print(completion_script(build_parser(), args.shell), end="")
    return 0


@dataclass(frozen=True)
class _Level:
    """One parser of the command tree: ``""`` (the top), ``"profiles"``, ``"profiles show"``, ..."""

    path: str
    options: tuple[str, ...]
    valued: dict[str, tuple[str, ...]]  # option taking a value -> its choices (none: any value, e.g. a file)
    commands: tuple[str, ...]
    positional_choices: tuple[str, ...]


def _levels(parser: argparse.ArgumentParser, path: str = "") -> Iterator[_Level]:
    # argparse keeps its actions in `_actions`; completion tools read them, there is no public API for it.
    options: list[str] = []
    valued: dict[str, tuple[str, ...]] = {}
    children: dict[str, argparse.ArgumentParser] = {}
    positional: tuple[str, ...] = ()
    for action in parser._actions:
        choices = tuple(str(choice) for choice in action.choices or ())
        if isinstance(action, argparse._SubParsersAction):
            children.update(action.choices)
        elif action.option_strings:
            options += action.option_strings
            if action.nargs != 0:
                valued.update(dict.fromkeys(action.option_strings, choices))
        elif not positional:
            positional = choices
    yield _Level(path, tuple(options), valued, tuple(children), positional)
    for name, child in children.items():
        yield from _levels(child, f"{path} {name}".strip())


def _words(words: tuple[str, ...]) -> str:
    return shlex.quote(" ".join(words))


def _candidates_function(levels: list[_Level]) -> str:
    """``_edgeline_candidates CUR WORD...``: the words that may come at CUR after WORD...; none: file names."""
    enter = 'level="${level:+$level }$word"'
    steps = [f"{shlex.quote(f'{level.path}:{name}')}) {enter} ;;" for level in levels for name in level.commands]
    steps += [
        f'{shlex.quote(f"{level.path}:{option}")}) value_of="$word" ;;' for level in levels for option in level.valued
    ]
    values = [
        f"{shlex.quote(f'{level.path}:{option}')}) echo {_words(choices)} ;;"
        for level in levels
        for option, choices in level.valued.items()
        if choices
    ]
    options = [f"{shlex.quote(level.path)}) echo {_words(level.options)} ;;" for level in levels]
    positionals = [
        f"{shlex.quote(level.path)}) echo {_words(level.commands or level.positional_choices)} ;;"
        for level in levels
        if level.commands or level.positional_choices
    ]

    def cases(subject: str, branches: list[str], indent: str) -> str:
        body = "".join(f"\n{indent}    {branch}" for branch in branches)
        return f'case "{subject}" in{body}\n{indent}esac'

    return f"""\
_edgeline_candidates() {{
    local cur="$1" level="" value_of="" word  # not `path`: zsh ties it to PATH
    shift
    for word in "$@"; do
        if [ -n "$value_of" ]; then
            value_of=""
            continue
        fi
        {cases("$level:$word", steps, "        ")}
    done
    if [ -n "$value_of" ]; then
        {cases("$level:$value_of", values, "        ")}
        return 0
    fi
    case "$cur" in
        -*) {cases("$level", options, "            ")} ;;
        *) {cases("$level", positionals, "            ")} ;;
    esac
}}
"""


BASH = """\
_edgeline() {
    local candidates
    candidates="$(_edgeline_candidates "${COMP_WORDS[COMP_CWORD]}" "${COMP_WORDS[@]:1:COMP_CWORD-1}")"
    COMPREPLY=($(compgen -W "$candidates" -- "${COMP_WORDS[COMP_CWORD]}"))
}
complete -o default -F _edgeline edgeline
"""

ZSH = """\
_edgeline() {
    local -a candidates
    candidates=(${(z)"$(_edgeline_candidates "${words[CURRENT]}" "${(@)words[2,CURRENT-1]}")"})
    if (( ${#candidates} )); then
        compadd -a candidates
    else
        _files
    fi
}
compdef _edgeline edgeline
"""


def completion_script(parser: argparse.ArgumentParser, shell: str) -> str:
    """The completion script of ``parser`` for ``shell`` (one of ``SHELLS``)."""
    header = f"# {shell} completion for edgeline, generated by `edgeline completion {shell}`\n"
    return header + _candidates_function(list(_levels(parser))) + {"bash": BASH, "zsh": ZSH}[shell]
