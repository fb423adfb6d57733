"""What every ``edgeline`` command line shares: the parser class, the logging flags and checked numbers.

``CommandParser`` is the class of the top-level parser, and argparse makes every subparser with the class of its
parent, so each command (and each action under it, as ``profiles list``) gets the same one-line errors and the
same ``-v``/``-q``/``--log-level``: ``edgeline -v run ...`` and ``edgeline run -v ...`` both work. Nothing heavy is
imported here: ``edgeline --help`` reads this module.
"""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Callable
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

    def error(self, message: str) -> NoReturn:
        """One line, like every other mistake: ``edgeline CMD: error: ...`` (``--help`` has the usage)."""
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
