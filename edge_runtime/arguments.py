"""What every ``edgeline`` command line shares: the parser class, the logging flags and checked numbers.

``CommandParser`` is the class of the top-level parser, and argparse makes every subparser with the class of its
parent, so each command (and each action under it, as ``profiles list``) gets the same one-line errors, unknown flags
included, and the same ``-v``/``-q``/``--log-level``: ``edgeline -v run ...`` and ``edgeline run -v ...`` both work.
Nothing heavy is imported here: ``edgeline --help`` reads this module.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

__all__ = ["LOG_LEVELS", "CommandParser", "bounded_int"]

LOG_LEVELS = ("debug", "info", "warning", "error")
DEFAULT_LOG_LEVEL = "info"


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, but a name with hyphens (``executorch-xnnpack``, ``int8-static``) is never split
    across lines."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


class CommandParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose mistakes are one line (exit 2), carrying the logging flags at every level."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)
        # The innermost parser's name is the one a command's error line starts with: `edgeline profiles show: ...`
        self.set_defaults(command_prog=self.prog)
        levels = self.add_argument_group("logging").add_mutually_exclusive_group()
        # SUPPRESS: a subparser sets the level only when its own flag is given, so it never resets one given before
        # the command name to the default (argparse copies a subparser's defaults over the parent's values).
        common: dict[str, Any] = {"dest": "log_level", "default": argparse.SUPPRESS}
        verbose = "debug messages, and what third-party libraries print (shown otherwise only when a step fails)"
        levels.add_argument("-v", "--verbose", action="store_const", const="debug", help=verbose, **common)
        levels.add_argument(
            "-q", "--quiet", action="store_const", const="warning", help="warnings and errors only", **common
        )
        level = f"one of: %(choices)s (default {DEFAULT_LOG_LEVEL})"
        levels.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS, metavar="LEVEL", help=level, **common)

    def parse_known_args(  # type: ignore[override]  # one signature for argparse's overloads
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        """What this parser does not know is refused here, by the innermost command (``edgeline verify: error:
        unrecognized arguments: --bogus``): argparse would hand a command's leftovers up for the top level to
        report as its own (``edgeline: error: ...``). Every parser of the command line is a ``CommandParser``."""
        given = list(sys.argv[1:] if args is None else args)
        self._unknown_options = self._options_unknown_in(given)
        parsed, extras = super().parse_known_args(given, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras

    def _options_unknown_in(self, given: list[str]) -> list[str]:
        """The options of ``given`` this parser does not know (nor abbreviates), up to a command's name: what follows
        it is the command's to judge."""
        commands = {
            name
            for action in self._actions
            if isinstance(action, argparse._SubParsersAction)
            for name in action.choices
        }
        known = self._option_string_actions
        unknown = []
        for word in given:
            if word == "--" or word in commands:
                break
            if len(word) < 2 or word[0] != "-" or " " in word or self._negative_number_matcher.match(word):
                continue  # a value: "-" for stdin, a negative number, a quoted phrase
            name = word.split("=", 1)[0]
            abbreviates = name.startswith("--") and any(option.startswith(name) for option in known)
            if name not in known and not abbreviates and word[:2] not in known:  # word[:2]: -v and -q given as -vq
                unknown.append(word)
        return unknown

    def error(self, message: str) -> NoReturn:
        """One line, like every other mistake: ``edgeline CMD: error: ...`` (``--help`` has the usage). An unknown
        option is named first even when argparse stops at a missing required argument: it is often that argument,
        misspelt."""
        unknown = getattr(self, "_unknown_options", [])
        if unknown and message.startswith("the following arguments are required"):
            message = f"unrecognized arguments: {' '.join(unknown)} (and {message})"
        self.exit(2, f"{self.prog}: error: {message}\n")


def bounded_int(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: an integer from ``low`` (to ``high``); anything else is refused with the valid range."""
    valid = f"{low} or more" if high is None else f"{low} to {high}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer ({valid}), got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{value} is out of range; valid: {valid}")
        return value

    return parse


DETECTION_FLAGS = ("score_threshold", "iou_threshold", "max_detections")
"""A detector's settings a run may replace (``edgeline.postprocess.DETECTION_OVERRIDES``, kept equal by a test;
here so that registering the commands imports no numpy)."""


def fraction(text: str) -> float:
    """An argparse ``type``: a number from 0 to 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1, got {text!r}") from None
    if not 0.0 <= value <= 1.0:  # NaN fails too
        raise argparse.ArgumentTypeError(f"{text} is out of range; valid: 0 to 1")
    return value


def add_detection_arguments(parser: Any, title: str) -> None:
    """``--score-threshold``, ``--iou-threshold``, ``--max-detections`` (``DETECTION_FLAGS``), in a group ``title``."""
    group = parser.add_argument_group(title)
    group.add_argument("--score-threshold", type=fraction, metavar="S", help="lowest score of a detection kept: 0 to 1")
    group.add_argument(
        "--iou-threshold", type=fraction, metavar="T", help="NMS suppresses a box overlapping a better one more: 0 to 1"
    )
    group.add_argument("--max-detections", type=bounded_int(1, 10_000), metavar="N", help="most detections per input")


def detection_overrides(args: argparse.Namespace) -> dict[str, float]:
    """The detection flags given (``add_detection_arguments``), by their settings' names."""
    return {key: getattr(args, key) for key in DETECTION_FLAGS if getattr(args, key, None) is not None}
