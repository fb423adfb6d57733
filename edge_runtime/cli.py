"""The ``edgeline`` command.

Subcommands live next to what they drive and are found by name, so a device without the ``export``
extra still gets a working ``edgeline`` (and a clear message if it asks for ``edgeline export``).
Each module named here has ``register(subparsers)``, which adds its parser with a ``func`` default
taking the parsed arguments and returning an exit code. Registering imports no heavy dependency.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from edgeline.errors import EdgelineError

__all__ = ["main"]

COMMAND_MODULES: tuple[str, ...] = (
    "edgeline.export.cli",  # export
    "edgeline.commands",  # infer, verify
    "edgeline.bundle_cli",  # bundle show
    "edgeline.daemon.run_command",  # run
    "edgeline.device_profiles.cli",  # profiles
    "edgeline.export.reference.cli",  # reference
    "edgeline.sim.cli",  # sim
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edgeline",
        description="Export PyTorch models for small devices and run them there.",
    )
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
    except EdgelineError as exc:
        print(f"edgeline {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"edgeline {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`edgeline ... | head`): not an error worth a traceback.
        sys.stderr.close()
        return 0
    return code


if __name__ == "__main__":
    sys.exit(main())
