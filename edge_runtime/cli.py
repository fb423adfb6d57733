"""The ``edgeline`` command.

Subcommands live next to what they drive and are found by name, so a device without the ``export``
extra still gets a working ``edgeline`` (and a clear message if it asks for ``edgeline export``).
Each module named here has ``register(subparsers)``, which adds its parser with a ``func`` default
taking the parsed arguments and returning an exit code. Registering imports no heavy dependency (numpy,
pydantic, torch): ``edgeline --help`` stays quick on a small device, and a test keeps it so.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from edgeline.arguments import DEFAULT_LOG_LEVEL, CommandParser
from edgeline.errors import EdgelineError

__all__ = ["build_parser", "main", "version"]

COMMAND_MODULES: tuple[str, ...] = (
    "edgeline.export.cli",  # export
    "edgeline.commands",  # infer
    "edgeline.verify",  # verify
    "edgeline.doctor",  # doctor
    "edgeline.updates.cli",  # keys, publish, rollout
    "edgeline.bundle_cli",  # bundle show
    "edgeline.daemon.run_command",  # run
    "edgeline.device_profiles.cli",  # profiles
    "edgeline.export.reference.cli",  # reference
    "edgeline.sim.cli",  # sim
    "edgeline.firmware_bridge.cli",  # bridge
    "edgeline.completion",  # completion
)

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def version() -> str:
    """The installed distribution's version; a source tree that is not installed has none."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as distribution_version

    try:
        return distribution_version("edgeline")
    except PackageNotFoundError:
        return "unknown (not installed)"


class _VersionAction(argparse.Action):
    """``--version``, reading the metadata only when asked."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        print(f"edgeline {version()}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="edgeline",
        description="Export PyTorch models for small devices and run them there.",
    )
    parser.add_argument("--version", action=_VersionAction, help="print the version and exit")
    parser.set_defaults(log_level=DEFAULT_LOG_LEVEL)  # the subparsers' logging flags default to nothing
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in COMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            # A device install may leave out whole folders; their commands are simply absent.
            if exc.name and module_name.startswith(exc.name):
                continue
            raise
        module.register(subparsers)
    return parser


@contextmanager
def _logging_to_stderr(level: str) -> Iterator[None]:
    """Log records of the given level and above on stderr while a command runs (undone after, for callers that
    run several commands in one process, such as the tests)."""
    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    previous = root.level
    root.addHandler(handler)
    root.setLevel(level.upper())
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(previous)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage mistake (already printed in one line)
        return exc.code if isinstance(exc.code, int) else 0
    args.from_process_argv = argv is None  # the command line of this process (a command may re-run it)
    try:
        with _logging_to_stderr(args.log_level):
            code: int = args.func(args)
    except EdgelineError as exc:
        print(f"{args.command_prog}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"{args.command_prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`edgeline ... | head`): not an error worth a traceback.
        sys.stderr.close()
        return 0
    return code


if __name__ == "__main__":
    sys.exit(main())
