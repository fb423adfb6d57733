"""MobileNetV1 (width 0.25) after the MLPerf Tiny visual-wake-words reference.

Input ``(N, 3, 96, 96)`` float32 RGB in [0, 1]; output: 2 logits, ``("no_person", "person")``.
Architecture as MLPerf Tiny's: a 3x3 stride-2 convolution with 8 filters, then MobileNetV1's 13
depthwise-separable blocks at width 0.25 (16, 32, 32, 64, 64, 128, 128 ×5, 256, 256 channels), BatchNorm
and ReLU after every convolution, global average pooling and a dense layer.

Data: **a stand-in, not the COCO-derived Visual Wake Words set.** The labels keep MLPerf's names, but
what the model learns is "a glyph is in the picture". Backgrounds are random crops (random size, flipped
at random, brightness jittered) of the two real photos that ship with scikit-learn
(``load_sample_images``: a temple in China and a flower), resized to 96x96. A "person" image has a real
handwritten digit from scikit-learn's digits pasted at a random position and scale, in a colour chosen to
contrast with the background under it; a "no_person" image has none. Held out by construction:
validation crops come from the right quarter of each photo and validation glyphs from the digits'
validation split, neither of which training ever sees.
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
    "MobileNetV1",
    "build",
    "make_data",
    "model",
    "train",
]

NAME = "vww"
TASK = "classify"
LABELS: tuple[str, ...] = ("no_person", "person")
IMAGE_PREPROCESS = "resize=center-crop,color=rgb,scale=1/255,mean=0,std=1,layout=nchw"
"""How a camera frame becomes its input (the bundle's ``image``): RGB in [0, 1], NCHW; centre-cropped, as the
training crops are squares of the photos, resized: a frame's centre square is what it knows."""
INPUT_SHAPE: tuple[int, ...] = (3, 96, 96)

_SIZE = INPUT_SHAPE[1]
# (output channels, depthwise stride) of MobileNetV1's 13 separable blocks at width multiplier 0.25.
_BLOCKS: tuple[tuple[int, int], ...] = (
    (16, 1), (32, 2), (32, 1), (64, 2), (64, 1), (128, 2),
    (128, 1), (128, 1), (128, 1), (128, 1), (128, 1),
    (256, 2), (256, 1),
)  # fmt: skip
_TRAIN_SAMPLES, _VALIDATION_SAMPLES = 1200, 300
_GLYPH_SIDES = (32, 64)
_TRAIN_COLUMNS = 480
"""Photo columns [0, 480) give training crops, [480, 640) validation crops."""
_TRAIN_MAX_CROP, _VALIDATION_MAX_CROP = 320, 160
"""Largest crop side, in photo pixels, before resizing to 96x96."""


def _conv_bn_relu(in_channels: int, out_channels: int, kernel: int, stride: int, groups: int = 1) -> list[nn.Module]:
    return [
        nn.Conv2d(in_channels, out_channels, kernel, stride, padding=kernel // 2, groups=groups, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(),
    ]


class MobileNetV1(nn.Module):
    def __init__(self, num_classes: int = len(LABELS)) -> None:
        super().__init__()
        layers = _conv_bn_relu(3, 8, 3, stride=2)
        channels = 8
        for out_channels, stride in _BLOCKS:
            layers += _conv_bn_relu(channels, channels, 3, stride, groups=channels)
            layers += _conv_bn_relu(channels, out_channels, 1, 1)
            channels = out_channels
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))


def build(seed: int = 0) -> nn.Module:
    """The untrained network, initialised from ``seed``, in eval mode."""
    return seeded_build(MobileNetV1, seed)


def _photos() -> list[np.ndarray]:
    """scikit-learn's bundled sample photos as ``(3, H, W)`` float arrays in [0, 1]."""
    from sklearn.datasets import load_sample_images

    return [np.transpose(image, (2, 0, 1)).astype(np.float32) / 255.0 for image in load_sample_images().images]


def _background(rng: np.random.Generator, photos: list[np.ndarray], columns: slice, max_side: int) -> np.ndarray:
    photo = photos[rng.integers(len(photos))][:, :, columns]
    height, width = photo.shape[1:]
    side = int(rng.integers(_SIZE, min(max_side, height, width) + 1))
    top, left = int(rng.integers(height - side + 1)), int(rng.integers(width - side + 1))
    crop = bilinear_resize(photo[:, top : top + side, left : left + side], _SIZE, _SIZE)
    if rng.random() < 0.5:
        crop = crop[:, :, ::-1]
    return np.clip(crop * rng.uniform(0.7, 1.3), 0.0, 1.0)


def _paste_glyph(rng: np.random.Generator, image: np.ndarray, glyph: np.ndarray) -> np.ndarray:
    side = int(rng.integers(_GLYPH_SIDES[0], _GLYPH_SIDES[1] + 1))
    mask = np.clip(bilinear_resize(glyph, side, side), 0.0, 1.0)
    top, left = int(rng.integers(_SIZE - side + 1)), int(rng.integers(_SIZE - side + 1))
    region = image[:, top : top + side, left : left + side]
    # Each channel opposite to the ground under the glyph, so it stands out wherever it lands.
    ground = region.mean(axis=(1, 2), keepdims=True)
    colour = np.where(ground < 0.5, rng.uniform(0.8, 1.0, size=(3, 1, 1)), rng.uniform(0.0, 0.2, size=(3, 1, 1)))
    opacity = rng.uniform(0.8, 1.0)
    out = image.copy()
    out[:, top : top + side, left : left + side] = region + (colour - region) * mask * opacity
    return out


def _samples(
    rng: np.random.Generator, photos: list[np.ndarray], glyphs: np.ndarray, columns: slice, max_side: int, count: int
) -> tuple[np.ndarray, np.ndarray]:
    labels = np.tile(np.arange(len(LABELS), dtype=np.int64), count // len(LABELS))
    rng.shuffle(labels)
    images = np.empty((len(labels), *INPUT_SHAPE), dtype=np.float32)
    for index, label in enumerate(labels):
        image = _background(rng, photos, columns, max_side)
        if label == LABELS.index("person"):
            image = _paste_glyph(rng, image, glyphs[rng.integers(len(glyphs))])
        images[index] = image
    return images, labels


def make_data(seed: int = 0) -> Dataset:
    """Photo crops with and without a pasted glyph (see the module docstring), balanced classes."""
    digits, photos = load_digits_split(), _photos()
    train_x, train_y = _samples(
        rng_for(seed, "vww-train"),
        photos,
        digits.train_images,
        slice(0, _TRAIN_COLUMNS),
        _TRAIN_MAX_CROP,
        _TRAIN_SAMPLES,
    )
    validation_x, validation_y = _samples(
        rng_for(seed, "vww-validation"),
        photos,
        digits.validation_images,
        slice(_TRAIN_COLUMNS, None),
        _VALIDATION_MAX_CROP,
        _VALIDATION_SAMPLES,
    )
    return Dataset(
        train_x=train_x,
        train_y=train_y,
        calibration_x=calibration_subset(train_x, seed),
        validation_x=validation_x,
        validation_y=validation_y,
    )


def train(model: nn.Module, data: Dataset, *, seed: int = 0) -> nn.Module:
    """300 Adam steps of 32 images (about 20 s on two quiet cores): clearly better than chance, no more."""
    return fit_classifier(model, data.train_x, data.train_y, steps=300, batch_size=32, learning_rate=0.01, seed=seed)


def model() -> nn.Module:
    """The trained reference model (``edgeline export export/reference/vww.py:model``)."""
    return train(build(), make_data())
