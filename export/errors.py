"""Export errors; the whole tree is drawn in ``edgeline.device_profiles.errors``.

ExportError
├── ModelLoadError      MODEL could not be imported, called, or did not give a torch.nn.Module
├── CalibrationError    sample files that do not match the model
├── LoweringError       a backend could not convert the model (names the operator when it can)
└── BudgetError         no target met the profile's budgets
"""

from __future__ import annotations

from edgeline.device_profiles.errors import EdgelineError

__all__ = ["BudgetError", "CalibrationError", "ExportError", "LoweringError", "ModelLoadError"]


class ExportError(EdgelineError):
    """Export failed for a reason the user can act on."""


class ModelLoadError(ExportError):
    pass


class CalibrationError(ExportError):
    pass


class LoweringError(ExportError):
    def __init__(self, message: str, *, operators: tuple[str, ...] = ()):
        super().__init__(message)
        self.operators = operators


class BudgetError(ExportError):
    pass
