"""ResNet-8 after the MLPerf Tiny image-classification reference (CIFAR-10 shape).

Input ``(N, 3, 32, 32)`` float32 in [0, 1]; output: 10 logits. Architecture as MLPerf Tiny's: a 3x3
convolution with 16 filters, BatchNorm and ReLU, then three residual stacks of 16, 32 and 64 filters (the
second and third stride 2, with a 1x1 strided convolution on the shortcut), 8x8 average pooling and a dense
layer.

Data: **a stand-in for CIFAR-10 made from real images that ship with scikit-learn** (nothing is
downloaded): the real 8x8 handwritten digits, upscaled bilinearly to 32x32, turned into three channels with
a seeded per-sample background colour, glyph tint and brightness; the label is the digit. Train and
validation come from the fixed stratified digits split, so no validation image was trained on.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from edgeline.export.reference.data import Dataset, bilinear_resize, calibration_subset, load_digits_split, rng_for
from edgeline.export.reference.training import fit_classifier, seeded_build

__all__ = [
    "IMAGE_PREPROCESS",
    "INPUT_SHAPE",
    "LABELS",
    "NAME",
    "TASK",
    "ResNet8",
    "build",
    "make_data",
    "model",
    "tint",
    "train",
]

NAME = "resnet8"
TASK = "classify"
LABELS: tuple[str, ...] = tuple(str(digit) for digit in range(10))
IMAGE_PREPROCESS = "resize=center-crop,color=rgb,scale=1/255,mean=0,std=1,layout=nchw"
"""How a camera frame becomes its input (the bundle's ``image``): RGB in [0, 1], NCHW; centre-cropped, as the
the digits fill a square: a frame's centre square."""
INPUT_SHAPE: tuple[int, ...] = (3, 32, 32)


class ResidualStack(nn.Module):
    """Two 3x3 convolutions with BatchNorm; ReLU after the first and after the sum with the shortcut."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU()
        # MLPerf's shortcut is a bare 1x1 convolution whenever the shape changes.
        self.shortcut: nn.Module = (
            nn.Conv2d(in_channels, out_channels, 1, stride=stride)
            if stride != 1 or in_channels != out_channels
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return self.relu(y + self.shortcut(x))


class ResNet8(nn.Module):
    def __init__(self, num_classes: int = len(LABELS)) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.stacks = nn.Sequential(
            ResidualStack(16, 16, stride=1),
            ResidualStack(16, 32, stride=2),
            ResidualStack(32, 64, stride=2),
        )
        self.pool = nn.AvgPool2d(8)
        self.classifier = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.pool(self.stacks(self.stem(x))), 1))


def build(seed: int = 0) -> nn.Module:
    """The untrained network, initialised from ``seed``, in eval mode."""
    return seeded_build(ResNet8, seed)


def tint(glyphs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``(N, 8, 8)`` glyphs in [0, 1] → ``(N, 3, 32, 32)`` colour images with per-sample colours."""
    count = len(glyphs)
    intensity = bilinear_resize(glyphs, 32, 32)[:, None, :, :]
    background = rng.uniform(0.0, 0.45, size=(count, 3, 1, 1))
    foreground = rng.uniform(0.55, 1.0, size=(count, 3, 1, 1))
    # Half of the images are dark glyphs on a light ground, as photos come both ways.
    inverted = rng.random(count) < 0.5
    background, foreground = (
        np.where(inverted[:, None, None, None], foreground, background),
        np.where(inverted[:, None, None, None], background, foreground),
    )
    brightness = rng.uniform(0.7, 1.3, size=(count, 1, 1, 1))
    images = (background + (foreground - background) * intensity) * brightness
    images += rng.normal(0.0, 0.03, size=images.shape)
    return np.clip(images, 0.0, 1.0).astype(np.float32)


def make_data(seed: int = 0) -> Dataset:
    """Tinted, upscaled real digits (see the module docstring); ``seed`` drives tints and calibration."""
    split = load_digits_split()
    train_x = tint(split.train_images, rng_for(seed, "resnet8-train"))
    return Dataset(
        train_x=train_x,
        train_y=split.train_labels,
        calibration_x=calibration_subset(train_x, seed),
        validation_x=tint(split.validation_images, rng_for(seed, "resnet8-validation")),
        validation_y=split.validation_labels,
    )


def train(model: nn.Module, data: Dataset, *, seed: int = 0) -> nn.Module:
    """400 Adam steps of 32 images (10-20 s on two cores)."""
    return fit_classifier(model, data.train_x, data.train_y, steps=400, batch_size=32, learning_rate=0.01, seed=seed)


def model() -> nn.Module:
    """The trained reference model (``edgeline export export/reference/resnet8.py:model``)."""
    return train(build(), make_data())
