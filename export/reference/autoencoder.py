"""The fully connected autoencoder of the MLPerf Tiny anomaly-detection reference (ToyADMOS / MIMII shape).

Input ``(N, 640)`` float32: 5 consecutive frames of 128 log-mel bins, flattened frame by frame; output:
the reconstruction, same shape. Architecture as MLPerf Tiny's: four dense layers of 128, a bottleneck of 8,
four dense layers of 128 (each followed by BatchNorm and ReLU) and a linear dense layer back to 640.
The anomaly score of a sample is its mean squared reconstruction error (:func:`anomaly_scores`); a sample
scoring above :func:`anomaly_threshold` is an anomaly.

Data: **synthetic** log-mel frames of one machine. A normal frame is a tilted noise floor with six stable
harmonic lines of a fundamental that wobbles slightly with the machine's speed, plus noise. Anomalies
come in three kinds, equally often: an extra tonal peak away from the harmonics, harmonics shifted by a
speed change of 12-30 %, or a broadband burst over one to three of the five frames. Training and
calibration data are normal only; validation is half normal, half anomalous (labels 0 and 1).
"""

from __future__ import annotations

import itertools

import numpy as np
import torch
from torch import nn

from edgeline.export.reference.data import Dataset, calibration_subset, rng_for
from edgeline.export.reference.training import fit, predict, seeded_build

__all__ = [
    "INPUT_SHAPE",
    "LABELS",
    "NAME",
    "TASK",
    "FCAutoencoder",
    "anomaly_scores",
    "anomaly_threshold",
    "build",
    "make_data",
    "model",
    "thresholded_accuracy",
    "train",
]

NAME = "autoencoder"
TASK = "anomaly"
LABELS: tuple[str, ...] = ()
FRAMES, MELS = 5, 128
INPUT_SHAPE: tuple[int, ...] = (FRAMES * MELS,)

_HARMONICS = 6
_FUNDAMENTAL = 9.0
"""Bin of the fundamental at nominal speed."""
_TRAIN_SAMPLES, _VALIDATION_PER_CLASS = 2000, 150


def _dense_bn_relu(in_features: int, out_features: int) -> list[nn.Module]:
    return [nn.Linear(in_features, out_features), nn.BatchNorm1d(out_features), nn.ReLU()]


class FCAutoencoder(nn.Module):
    def __init__(self, features: int = INPUT_SHAPE[0], hidden: int = 128, bottleneck: int = 8) -> None:
        super().__init__()
        widths = [features, hidden, hidden, hidden, hidden, bottleneck, hidden, hidden, hidden, hidden]
        layers: list[nn.Module] = []
        for in_features, out_features in itertools.pairwise(widths):
            layers += _dense_bn_relu(in_features, out_features)
        layers.append(nn.Linear(hidden, features))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def build(seed: int = 0) -> nn.Module:
    """The untrained network, initialised from ``seed``, in eval mode."""
    return seeded_build(FCAutoencoder, seed)


def _lines(bins: np.ndarray, centres: np.ndarray, amplitudes: np.ndarray, width: float) -> np.ndarray:
    """Gaussian spectral lines: ``centres``/``amplitudes`` ``(N, K)`` → ``(N, 1, MELS)``."""
    profile = np.exp(-(((bins[None, None, :] - centres[..., None]) / width) ** 2) / 2)
    return np.sum(amplitudes[..., None] * profile, axis=1)[:, None, :]


def _normal_frames(rng: np.random.Generator, count: int, speed: np.ndarray) -> np.ndarray:
    """``(count, FRAMES, MELS)`` frames of the machine running at ``speed`` (1.0 = nominal)."""
    bins = np.arange(MELS, dtype=np.float64)
    order = np.arange(1, _HARMONICS + 1, dtype=np.float64)
    centres = _FUNDAMENTAL * speed[:, None] * order[None, :]
    amplitudes = 2.0 * 0.8 ** order[None, :] * rng.uniform(0.9, 1.1, size=(count, _HARMONICS))
    floor = -0.5 - 0.006 * bins + rng.normal(0.0, 0.05, size=(count, 1))
    wobble = rng.uniform(0.95, 1.05, size=(count, FRAMES, 1))  # frame-to-frame level of the lines
    frames = floor[:, None, :] + wobble * _lines(bins, centres, amplitudes, width=1.0)
    return frames + rng.normal(0.0, 0.1, size=(count, FRAMES, MELS))


def _normal(rng: np.random.Generator, count: int) -> np.ndarray:
    return _normal_frames(rng, count, speed=rng.normal(1.0, 0.02, size=count))


def _anomalous(rng: np.random.Generator, count: int) -> np.ndarray:
    kind = rng.integers(3, size=count)
    speed = rng.normal(1.0, 0.02, size=count)
    shifted = kind == 1
    factor = rng.uniform(1.12, 1.3, size=count)
    speed[shifted] *= np.where(rng.random(shifted.sum()) < 0.5, factor[shifted], 1.0 / factor[shifted])
    frames = _normal_frames(rng, count, speed)
    bins = np.arange(MELS, dtype=np.float64)
    # An extra tone at least 3 bins away from every harmonic.
    tone = rng.uniform(5.0, 120.0, size=count)
    harmonics = _FUNDAMENTAL * speed[:, None] * np.arange(1, _HARMONICS + 1)[None, :]
    near = np.min(np.abs(tone[:, None] - harmonics), axis=1) < 3.0
    tone[near] = rng.uniform(60.0, 120.0, size=int(near.sum()))
    tone_level = np.where(kind == 0, rng.uniform(1.0, 2.0, size=count), 0.0)
    frames += _lines(bins, tone[:, None], tone_level[:, None], width=1.2)
    # A broadband burst over 1-3 consecutive frames.
    length = rng.integers(1, 4, size=count)
    start = rng.integers(0, FRAMES - length + 1)
    frame_index = np.arange(FRAMES)[None, :]
    in_burst = (frame_index >= start[:, None]) & (frame_index < (start + length)[:, None]) & (kind == 2)[:, None]
    burst_level = rng.uniform(0.6, 1.2, size=(count, 1)) * in_burst
    frames += burst_level[..., None] * np.linspace(1.0, 0.4, MELS)[None, None, :]
    return frames


def _flat(frames: np.ndarray) -> np.ndarray:
    return frames.reshape(len(frames), -1).astype(np.float32)


def make_data(seed: int = 0) -> Dataset:
    """Synthetic machine frames (see the module docstring): 2,000 normal for training, 300 for validation."""
    train_x = _flat(_normal(rng_for(seed, "autoencoder-train"), _TRAIN_SAMPLES))
    validation_rng = rng_for(seed, "autoencoder-validation")
    validation_x = np.concatenate(
        [
            _flat(_normal(validation_rng, _VALIDATION_PER_CLASS)),
            _flat(_anomalous(validation_rng, _VALIDATION_PER_CLASS)),
        ]
    )
    validation_y = np.repeat(np.array([0, 1], dtype=np.int64), _VALIDATION_PER_CLASS)
    order = validation_rng.permutation(len(validation_x))
    return Dataset(
        train_x=train_x,
        train_y=np.zeros(len(train_x), dtype=np.int64),
        calibration_x=calibration_subset(train_x, seed),
        validation_x=validation_x[order],
        validation_y=validation_y[order],
    )


def train(model: nn.Module, data: Dataset, *, seed: int = 0) -> nn.Module:
    """1,000 Adam steps of 64 normal samples reconstructing themselves (a few seconds on two cores)."""
    return fit(
        model,
        data.train_x,
        data.train_x,
        loss_fn=nn.functional.mse_loss,
        steps=1000,
        batch_size=64,
        learning_rate=0.003,
        seed=seed,
    )


def anomaly_scores(model: nn.Module, inputs: np.ndarray, *, batch_size: int = 256) -> np.ndarray:
    """Mean squared reconstruction error of each sample, ``(N,)`` float32."""
    reconstruction = predict(model, inputs, batch_size=batch_size)
    flat_error = (reconstruction - np.asarray(inputs, dtype=np.float32)).reshape(len(inputs), -1)
    return np.mean(flat_error**2, axis=1).astype(np.float32)


def anomaly_threshold(model: nn.Module, calibration_inputs: np.ndarray, *, percentile: float = 99.0) -> float:
    """The ``percentile`` of the scores of normal ``calibration_inputs``: above it, a sample is an anomaly."""
    return float(np.percentile(anomaly_scores(model, calibration_inputs), percentile))


def thresholded_accuracy(model: nn.Module, inputs: np.ndarray, labels: np.ndarray, threshold: float) -> float:
    """Share of samples whose ``score > threshold`` agrees with ``labels`` (1 = anomaly)."""
    predicted = anomaly_scores(model, inputs) > threshold
    return float(np.mean(predicted == (np.asarray(labels) == 1)))


def model() -> nn.Module:
    """The trained reference model (``edgeline export export/reference/autoencoder.py:model``)."""
    return train(build(), make_data())
