"""Export errors: ``ExportError`` and its subclasses, drawn (with what each means) in the one tree, in
``edgeline.device_profiles.errors``."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from edgeline.device_profiles.errors import BackendUnavailableError, EdgelineError

if TYPE_CHECKING:
    from edgeline.export.report import ExportReport

__all__ = [
    "BudgetError",
    "CalibrationError",
    "ExportError",
    "LoweringError",
    "ModelLoadError",
    "TraceError",
    "require_export_extra",
]


def require_export_extra(*modules: str) -> None:
    """Refuse the command before it does any work when the export extra is not installed (a device's base install):
    one line naming the extra (the CLI names the command). ``modules``: what it imports besides torch."""
    missing = [name for name in ("torch", *modules) if importlib.util.find_spec(name) is None]
    if missing:
        raise BackendUnavailableError(
            f"needs the export extra ({', '.join(missing)} not installed): pip install 'edgeline[export]'"
        )


class ExportError(EdgelineError):
    """Export failed for a reason the user can act on."""

    report: ExportReport | None = None
    """The export's report when the error ends an export that tried its targets (an explicit target rejected or
    failed): ``edgeline export --json`` prints it before the error."""


class ModelLoadError(ExportError):
    pass


class CalibrationError(ExportError):
    pass


class TraceError(ExportError):
    """The model fails every target alike (its forward decides on a tensor's value in Python): no target is tried."""


class LoweringError(ExportError):
    def __init__(self, message: str, *, operators: tuple[str, ...] = ()):
        super().__init__(message)
        self.operators = operators


class BudgetError(ExportError):
    pass
