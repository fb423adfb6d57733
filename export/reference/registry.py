"""Which reference models exist, what each looks like from outside, and loading one by name.

The catalogue repeats a few facts of each module (task, input shape, label count) so that listing needs
no torch; a test keeps it equal to the modules.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

from edgeline.errors import EdgelineError

if TYPE_CHECKING:
    from pathlib import Path

    import numpy as np
    from torch import nn

    from edgeline.export.reference.data import Dataset, DetectionDataset, DetectionImages

__all__ = [
    "CATALOGUE",
    "REFERENCE_MODELS",
    "AnomalyReferenceModule",
    "DetectorReferenceModule",
    "ReferenceInfo",
    "ReferenceModule",
    "load_reference",
    "resolve_names",
]


@dataclass(frozen=True)
class ReferenceInfo:
    """What a reference model is, known without importing it."""

    name: str
    module: str
    task: str
    input_shape: tuple[int, ...]
    label_count: int
    data: str
    """Where its data comes from, said plainly: real, or synthetic."""


CATALOGUE: dict[str, ReferenceInfo] = {
    info.name: info
    for info in (
        ReferenceInfo(
            "digits", "edgeline.export.reference.digits", "classify", (1, 8, 8), 10, "real: scikit-learn digits"
        ),
        ReferenceInfo(
            "resnet8",
            "edgeline.export.reference.resnet8",
            "classify",
            (3, 32, 32),
            10,
            "real digits, upscaled and tinted",
        ),
        ReferenceInfo("ds_cnn", "edgeline.export.reference.ds_cnn", "classify", (1, 49, 10), 12, "synthetic MFCC-like"),
        ReferenceInfo(
            "vww", "edgeline.export.reference.vww", "classify", (3, 96, 96), 2, "real photos with pasted digit glyphs"
        ),
        ReferenceInfo(
            "autoencoder", "edgeline.export.reference.autoencoder", "anomaly", (640,), 0, "synthetic machine log-mel"
        ),
        ReferenceInfo(
            "shapes",
            "edgeline.export.reference.shapes",
            "detect",
            (3, 96, 96),
            4,
            "synthetic: shapes on textured backgrounds",
        ),
    )
}

REFERENCE_MODELS: dict[str, str] = {name: info.module for name, info in CATALOGUE.items()}
"""Reference model name → the module that defines it."""


class ReferenceModule(Protocol):
    """The interface every reference module has. A detector's (``TASK`` ``"detect"``) data are images with boxes,
    not arrays: it is a :class:`DetectorReferenceModule`."""

    NAME: str
    TASK: str
    LABELS: tuple[str, ...]
    INPUT_SHAPE: tuple[int, ...]

    def build(self, seed: int = 0) -> nn.Module: ...

    def make_data(self, seed: int = 0) -> Dataset: ...

    def train(self, model: nn.Module, data: Dataset, *, seed: int = 0) -> nn.Module: ...

    def model(self) -> nn.Module: ...


class AnomalyReferenceModule(ReferenceModule, Protocol):
    """A reference module whose ``TASK`` is ``"anomaly"``: it also scores and thresholds."""

    def anomaly_threshold(self, model: nn.Module, calibration_inputs: np.ndarray) -> float: ...

    def thresholded_accuracy(
        self, model: nn.Module, inputs: np.ndarray, labels: np.ndarray, threshold: float
    ) -> float: ...


class DetectorReferenceModule(Protocol):
    """A reference module whose ``TASK`` is ``"detect"``: :class:`ReferenceModule`'s names, with images and their
    boxes as data, the output layout its ``HEAD`` names (``edgeline.detection.HEADS``) and the pre-processing its
    images go through (``IMAGE_PREPROCESS``, ``--preprocess`` text)."""

    NAME: str
    TASK: str
    LABELS: tuple[str, ...]
    INPUT_SHAPE: tuple[int, ...]
    HEAD: str
    IMAGE_PREPROCESS: str

    def build(self, seed: int = 0) -> nn.Module: ...

    def make_data(self, seed: int = 0) -> DetectionDataset: ...

    def train(self, model: nn.Module, data: DetectionDataset, *, seed: int = 0) -> nn.Module: ...

    def model(self) -> nn.Module: ...

    def write_yolo(self, data: DetectionImages, root: Path) -> None: ...


def _unknown(name: str) -> EdgelineError:
    return EdgelineError(f"unknown reference model {name!r}; valid: {', '.join(REFERENCE_MODELS)}")


def load_reference(name: str) -> ReferenceModule:
    """The module of reference model ``name`` (imports torch); an unknown name is a user error."""
    if name not in REFERENCE_MODELS:
        raise _unknown(name)
    return cast("ReferenceModule", importlib.import_module(REFERENCE_MODELS[name]))


def resolve_names(names: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """Names as a user typed them → known names in order, duplicates dropped; ``all`` alone means all."""
    if not names:
        raise EdgelineError(f"name at least one reference model or 'all'; valid: {', '.join(REFERENCE_MODELS)}")
    if "all" in names:
        if len(names) > 1:
            raise EdgelineError(
                f"'all' cannot be combined with model names; give 'all' alone or some of: {', '.join(REFERENCE_MODELS)}"
            )
        return tuple(REFERENCE_MODELS)
    for name in names:
        if name not in REFERENCE_MODELS:
            raise _unknown(name)
    return tuple(dict.fromkeys(names))
