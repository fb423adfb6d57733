"""A small CNN for scikit-learn's handwritten digits: the quickest reference model with real data.

Input ``(N, 1, 8, 8)`` float32, pixel value / 16 (so in [0, 1]); output: 10 logits, one per digit.
Data: the 1,797 real 8x8 digits that ship with scikit-learn, split 75/25 stratified with a fixed seed
(:data:`edgeline.export.reference.data.DIGITS_SPLIT_SEED`); calibration is 128 training images.
"""

from __future__ import annotations

import torch
from torch import nn

from edgeline.export.reference.data import Dataset, calibration_subset, load_digits_split
from edgeline.export.reference.training import fit_classifier, seeded_build

__all__ = ["INPUT_SHAPE", "LABELS", "NAME", "TASK", "DigitsCNN", "build", "make_data", "model", "train"]

NAME = "digits"
TASK = "classify"
LABELS: tuple[str, ...] = tuple(str(digit) for digit in range(10))
INPUT_SHAPE: tuple[int, ...] = (1, 8, 8)


def _conv_bn_relu(in_channels: int, out_channels: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(),
    )


class DigitsCNN(nn.Module):
    """conv 16 → conv 32 → 2x2 average pool → linear 10, each conv with BatchNorm and ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(_conv_bn_relu(1, 16), _conv_bn_relu(16, 32), nn.AvgPool2d(2))
        self.classifier = nn.Linear(32 * 4 * 4, len(LABELS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


def build(seed: int = 0) -> nn.Module:
    """The untrained network, initialised from ``seed``, in eval mode."""
    return seeded_build(DigitsCNN, seed)


def make_data(seed: int = 0) -> Dataset:
    """The real digits; ``seed`` only picks the calibration images (the split itself is fixed)."""
    split = load_digits_split()
    train_x = split.train_images[:, None, :, :]
    return Dataset(
        train_x=train_x,
        train_y=split.train_labels,
        calibration_x=calibration_subset(train_x, seed),
        validation_x=split.validation_images[:, None, :, :],
        validation_y=split.validation_labels,
    )


def train(model: nn.Module, data: Dataset, *, seed: int = 0) -> nn.Module:
    """300 Adam steps of 64 images (about a second on two cores)."""
    return fit_classifier(model, data.train_x, data.train_y, steps=300, batch_size=64, learning_rate=0.01, seed=seed)


def model() -> nn.Module:
    """The trained reference model (``edgeline export export/reference/digits.py:model``)."""
    return train(build(), make_data())
