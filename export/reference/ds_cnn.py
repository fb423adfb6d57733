"""DS-CNN after the MLPerf Tiny keyword-spotting reference (Speech Commands, 12 classes).

Input ``(N, 1, 49, 10)`` float32: 49 frames of 10 MFCC coefficients; output: 12 logits in :data:`LABELS`
order. Architecture as MLPerf Tiny's: a (10, 4) convolution with 64 filters and stride (2, 2), BatchNorm
and ReLU, then four depthwise-separable blocks (depthwise 3x3 + BN + ReLU, pointwise 64 + BN + ReLU),
average pooling over the remaining 25x5 map and a dense layer. (MLPerf's dropout layers are left out: they
do nothing at inference.)

Data: **synthetic**, not Speech Commands. Each word has a fixed spectro-temporal template, a sum of four
Gaussian blobs at word-specific (frame, coefficient) positions on top of an energy envelope in c0 common
to all speech. A sample is its word's template with a random time shift (±8 frames), per-blob jitter of
position and amplitude, an overall gain, a per-coefficient channel offset and additive noise.
``_silence_`` is noise and channel offset only; ``_unknown_`` is speech whose four blobs are drawn fresh
for every sample from the same prior as the words' templates, so some unknowns resemble a word and the task
is learnable but not trivial.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from edgeline.export.reference.data import Dataset, calibration_subset, rng_for
from edgeline.export.reference.training import fit_classifier, seeded_build

__all__ = ["DSCNN", "INPUT_SHAPE", "LABELS", "NAME", "TASK", "build", "make_data", "model", "train"]

NAME = "ds_cnn"
TASK = "classify"
LABELS: tuple[str, ...] = (
    "down", "go", "left", "no", "off", "on", "right", "stop", "up", "yes", "_silence_", "_unknown_",
)  # fmt: skip
INPUT_SHAPE: tuple[int, ...] = (1, 49, 10)

FRAMES, COEFFICIENTS = INPUT_SHAPE[1:]
_WORDS = 10
_SILENCE, _UNKNOWN = LABELS.index("_silence_"), LABELS.index("_unknown_")
_BLOBS = 4
_TEMPLATE_SEED = 1_000_003
"""The words' templates define the task, so they do not change with the data seed."""

_TRAIN_PER_CLASS, _VALIDATION_PER_CLASS = 120, 30


def _separable_block(channels: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(channels, channels, 3, padding=1, groups=channels, bias=False),
        nn.BatchNorm2d(channels),
        nn.ReLU(),
        nn.Conv2d(channels, channels, 1, bias=False),
        nn.BatchNorm2d(channels),
        nn.ReLU(),
    )


class DSCNN(nn.Module):
    def __init__(self, num_classes: int = len(LABELS), channels: int = 64, blocks: int = 4) -> None:
        super().__init__()
        # padding (5, 1) gives MLPerf's 'same' output size, 25x5, with symmetric padding.
        self.stem = nn.Sequential(
            nn.Conv2d(1, channels, (10, 4), stride=(2, 2), padding=(5, 1), bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
        )
        self.blocks = nn.Sequential(*(_separable_block(channels) for _ in range(blocks)))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.pool(self.blocks(self.stem(x))), 1))


def build(seed: int = 0) -> nn.Module:
    """The untrained network, initialised from ``seed``, in eval mode."""
    return seeded_build(DSCNN, seed)


def _draw_blobs(rng: np.random.Generator, count: int) -> np.ndarray:
    """``(count, _BLOBS, 5)`` blobs: frame, coefficient, frame width, coefficient width, amplitude."""
    frame = rng.uniform(14.0, 35.0, size=(count, _BLOBS))
    coefficient = rng.uniform(0.0, COEFFICIENTS - 1.0, size=(count, _BLOBS))
    frame_width = rng.uniform(2.0, 5.0, size=(count, _BLOBS))
    coefficient_width = rng.uniform(0.6, 1.5, size=(count, _BLOBS))
    amplitude = rng.choice([-1.0, 1.0], size=(count, _BLOBS)) * rng.uniform(0.8, 1.6, size=(count, _BLOBS))
    return np.stack([frame, coefficient, frame_width, coefficient_width, amplitude], axis=-1)


def _templates() -> np.ndarray:
    return _draw_blobs(np.random.default_rng(_TEMPLATE_SEED), _WORDS)


def _render(blobs: np.ndarray, shift: np.ndarray, speech: np.ndarray) -> np.ndarray:
    """Features ``(N, FRAMES, COEFFICIENTS)`` for blobs ``(N, _BLOBS, 5)``, shifted by ``shift`` frames."""
    frames = np.arange(FRAMES, dtype=np.float64)[None, None, :, None]
    coefficients = np.arange(COEFFICIENTS, dtype=np.float64)[None, None, None, :]
    centre_frame = (blobs[..., 0] + shift[:, None])[..., None, None]
    centre_coefficient = blobs[..., 1][..., None, None]
    exponent = ((frames - centre_frame) / blobs[..., 2][..., None, None]) ** 2 / 2 + (
        (coefficients - centre_coefficient) / blobs[..., 3][..., None, None]
    ) ** 2 / 2
    features = np.sum(blobs[..., 4][..., None, None] * np.exp(-exponent), axis=1)
    # Speech raises the energy coefficient c0 over the word's duration.
    envelope = np.exp(-(((frames[0, 0, :, 0][None, :] - 24.0 - shift[:, None]) / 8.0) ** 4))
    features[:, :, 0] += 2.0 * envelope * speech[:, None]
    return features


def _samples(rng: np.random.Generator, per_class: int) -> tuple[np.ndarray, np.ndarray]:
    labels = np.repeat(np.arange(len(LABELS), dtype=np.int64), per_class)
    rng.shuffle(labels)
    count = len(labels)
    blobs = _draw_blobs(rng, count)  # fresh blobs: what an unknown word sounds like
    is_word = labels < _WORDS
    templates = _templates()
    blobs[is_word] = templates[labels[is_word]]
    blobs[..., 0] += rng.normal(0.0, 1.0, size=(count, _BLOBS))
    blobs[..., 1] += rng.normal(0.0, 0.3, size=(count, _BLOBS))
    blobs[..., 4] *= rng.uniform(0.75, 1.25, size=(count, _BLOBS))
    speech = (labels != _SILENCE).astype(np.float64)
    blobs[..., 4] *= speech[:, None] * rng.uniform(0.7, 1.3, size=(count, 1))
    shift = rng.uniform(-8.0, 8.0, size=count)
    features = _render(blobs, shift, speech)
    features += rng.normal(0.0, 0.25, size=(count, 1, COEFFICIENTS))  # channel
    features += rng.normal(0.0, 0.35, size=features.shape)
    return features[:, None, :, :].astype(np.float32), labels


def make_data(seed: int = 0) -> Dataset:
    """Synthetic MFCC-like features (see the module docstring): 1,440 training and 360 validation samples."""
    train_x, train_y = _samples(rng_for(seed, "ds_cnn-train"), _TRAIN_PER_CLASS)
    validation_x, validation_y = _samples(rng_for(seed, "ds_cnn-validation"), _VALIDATION_PER_CLASS)
    return Dataset(
        train_x=train_x,
        train_y=train_y,
        calibration_x=calibration_subset(train_x, seed),
        validation_x=validation_x,
        validation_y=validation_y,
    )


def train(model: nn.Module, data: Dataset, *, seed: int = 0) -> nn.Module:
    """300 Adam steps of 64 samples (a few seconds on two cores)."""
    return fit_classifier(model, data.train_x, data.train_y, steps=300, batch_size=64, learning_rate=0.005, seed=seed)


def model() -> nn.Module:
    """The trained reference model (``edgeline export export/reference/ds_cnn.py:model``)."""
    return train(build(), make_data())
