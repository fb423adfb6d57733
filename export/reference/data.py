"""The data side of the reference models: one frozen container and the numpy helpers the models share.

Everything here is numpy; scikit-learn is imported only where its bundled, local data is read. Nothing is
downloaded. Each reference module turns these pieces into its own :class:`Dataset`:

    digits       real scikit-learn digits, the stratified 25 % held-out split
    resnet8      the same real digits, upscaled to 32x32 and tinted (a stand-in for CIFAR-10)
    ds_cnn       synthetic MFCC-like features (documented in ``ds_cnn``)
    vww          real scikit-learn sample photos with real digit glyphs pasted in (documented in ``vww``)
    autoencoder  synthetic log-mel frames of a machine (documented in ``autoencoder``)
    shapes       synthetic shapes on textured backgrounds, with their boxes (documented in ``shapes``): a
                 :class:`DetectionDataset` of :class:`DetectionImages`, written in the YOLO layout by
                 :func:`write_yolo`
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "CALIBRATION_SIZE",
    "DIGITS_SPLIT_SEED",
    "Dataset",
    "DetectionDataset",
    "DetectionImages",
    "DigitsSplit",
    "bilinear_resize",
    "calibration_indices",
    "calibration_subset",
    "load_digits_split",
    "rng_for",
    "write_yolo",
]

CALIBRATION_SIZE = 128
"""Samples in every calibration set: drawn from the training distribution, never from validation."""

DIGITS_SPLIT_SEED = 0
"""The digits held-out split is fixed, whatever seed a model is trained with, so accuracies compare."""


def _frozen(array: np.ndarray, dtype: type[np.generic]) -> np.ndarray:
    out = np.ascontiguousarray(array, dtype=dtype)
    if out is array:
        out = out.copy()
    out.setflags(write=False)
    return out


@dataclass(frozen=True, eq=False)
class Dataset:
    """The arrays one reference model is trained, calibrated and validated with.

    Inputs are float32 with the batch first, labels int64. For the autoencoder ``train_y`` is all zeros (it
    trains on normal data only) and ``validation_y`` holds the anomaly labels (0 normal, 1 anomaly).
    The arrays are read-only copies: a dataset cannot be changed after it was made.
    """

    train_x: np.ndarray
    train_y: np.ndarray
    calibration_x: np.ndarray
    validation_x: np.ndarray
    validation_y: np.ndarray

    def __post_init__(self) -> None:
        for name in ("train_x", "calibration_x", "validation_x"):
            object.__setattr__(self, name, _frozen(getattr(self, name), np.float32))
        for name in ("train_y", "validation_y"):
            object.__setattr__(self, name, _frozen(getattr(self, name), np.int64))
        sample_shape = self.train_x.shape[1:]
        for name in ("calibration_x", "validation_x"):
            if getattr(self, name).shape[1:] != sample_shape:
                raise ValueError(f"{name} has samples of shape {getattr(self, name).shape[1:]}, train_x {sample_shape}")
        for x_name, y_name in (("train_x", "train_y"), ("validation_x", "validation_y")):
            x, y = getattr(self, x_name), getattr(self, y_name)
            if y.shape != (len(x),):
                raise ValueError(f"{y_name} has shape {y.shape}, expected ({len(x)},) to match {x_name}")

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one sample, without the batch dimension."""
        return tuple(self.train_x.shape[1:])


@dataclass(frozen=True, eq=False)
class DetectionImages:
    """Images ``(N, H, W, 3)`` uint8 RGB and per image its objects: ``boxes`` ``(K, 4)`` x1, y1, x2, y2 in pixels,
    ``classes`` ``(K,)`` int64. The arrays are read-only copies."""

    images: np.ndarray
    boxes: tuple[np.ndarray, ...]
    classes: tuple[np.ndarray, ...]

    def __post_init__(self) -> None:
        images = _frozen(self.images, np.uint8)
        if images.ndim != 4 or images.shape[3] != 3:
            raise ValueError(f"images have shape {images.shape}, expected (N, H, W, 3)")
        if not len(self.boxes) == len(self.classes) == len(images):
            raise ValueError(f"{len(images)} images, {len(self.boxes)} box arrays, {len(self.classes)} class arrays")
        boxes = tuple(_frozen(np.reshape(b, (-1, 4)), np.float32) for b in self.boxes)
        classes = tuple(_frozen(np.reshape(c, (-1,)), np.int64) for c in self.classes)
        for index, (b, c) in enumerate(zip(boxes, classes, strict=True)):
            if len(b) != len(c):
                raise ValueError(f"image {index}: {len(b)} boxes, {len(c)} classes")
        object.__setattr__(self, "images", images)
        object.__setattr__(self, "boxes", boxes)
        object.__setattr__(self, "classes", classes)

    def __len__(self) -> int:
        return int(self.images.shape[0])

    def subset(self, indices: Sequence[int]) -> DetectionImages:
        """The images at ``indices``, in that order, with their objects."""
        chosen = [int(index) for index in indices]
        return DetectionImages(
            self.images[chosen], tuple(self.boxes[i] for i in chosen), tuple(self.classes[i] for i in chosen)
        )


@dataclass(frozen=True, eq=False)
class DetectionDataset:
    """The images a reference detector is trained, calibrated and validated with. ``calibration`` is
    ``CALIBRATION_SIZE`` training images (:func:`calibration_indices`), ``validation`` held-out ones."""

    train: DetectionImages
    calibration: DetectionImages
    validation: DetectionImages


def write_yolo(data: DetectionImages, root: Path) -> None:
    """``root/images/NNNN.png`` and ``root/labels/NNNN.txt`` (``class cx cy w h``, normalised to the image): the YOLO
    layout (``edgeline.export.detection_data`` reads it back)."""
    from PIL import Image

    (root / "images").mkdir(parents=True, exist_ok=True)
    (root / "labels").mkdir(parents=True, exist_ok=True)
    height, width = data.images.shape[1:3]
    digits = max(4, len(str(len(data) - 1)))
    for index in range(len(data)):
        name = f"{index:0{digits}d}"
        Image.fromarray(data.images[index]).save(root / "images" / f"{name}.png")
        lines = [
            f"{kind} {(x1 + x2) / 2 / width:.6f} {(y1 + y2) / 2 / height:.6f} "
            f"{(x2 - x1) / width:.6f} {(y2 - y1) / height:.6f}\n"
            for (x1, y1, x2, y2), kind in zip(data.boxes[index].tolist(), data.classes[index].tolist(), strict=True)
        ]
        (root / "labels" / f"{name}.txt").write_text("".join(lines), encoding="utf-8")


def rng_for(seed: int, stream: str) -> np.random.Generator:
    """A generator for one named use of a seed, so adding a use never shifts the numbers of another."""
    return np.random.default_rng([seed, *stream.encode()])


def calibration_indices(count: int, seed: int, size: int = CALIBRATION_SIZE) -> np.ndarray:
    """Which ``size`` of ``count`` training samples calibrate: chosen without replacement, in their original order."""
    if count < size:
        raise ValueError(f"need at least {size} training samples for calibration, have {count}")
    return np.sort(rng_for(seed, "calibration").choice(count, size=size, replace=False))


def calibration_subset(train_x: np.ndarray, seed: int, size: int = CALIBRATION_SIZE) -> np.ndarray:
    """``size`` training samples, chosen without replacement and kept in their original order."""
    return np.asarray(train_x[calibration_indices(len(train_x), seed, size)], dtype=np.float32)


def _interpolation_matrix(size_in: int, size_out: int) -> np.ndarray:
    # Half-pixel centres, edges clamped: the same sampling as torch's bilinear with align_corners=False.
    source = (np.arange(size_out) + 0.5) * (size_in / size_out) - 0.5
    source = np.clip(source, 0.0, size_in - 1)
    low = np.floor(source).astype(np.int64)
    high = np.minimum(low + 1, size_in - 1)
    weight_high = source - low
    matrix = np.zeros((size_out, size_in), dtype=np.float64)
    np.add.at(matrix, (np.arange(size_out), low), 1.0 - weight_high)
    np.add.at(matrix, (np.arange(size_out), high), weight_high)
    return matrix


def bilinear_resize(images: np.ndarray, height: int, width: int) -> np.ndarray:
    """Resize the last two axes of ``images`` to ``(height, width)`` bilinearly (no antialiasing)."""
    rows = _interpolation_matrix(images.shape[-2], height).astype(np.float32)
    cols = _interpolation_matrix(images.shape[-1], width).astype(np.float32)
    return np.asarray(rows @ np.asarray(images, dtype=np.float32) @ cols.T, dtype=np.float32)


@dataclass(frozen=True, eq=False)
class DigitsSplit:
    """scikit-learn's 8x8 digits scaled to [0, 1], split 75/25 stratified by class."""

    train_images: np.ndarray
    train_labels: np.ndarray
    validation_images: np.ndarray
    validation_labels: np.ndarray


def load_digits_split() -> DigitsSplit:
    """The real digits that ship with scikit-learn (no download), split with :data:`DIGITS_SPLIT_SEED`."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = np.asarray(digits.images, dtype=np.float32) / 16.0
    labels = np.asarray(digits.target, dtype=np.int64)
    train_images, validation_images, train_labels, validation_labels = train_test_split(
        images, labels, test_size=0.25, stratify=labels, random_state=DIGITS_SPLIT_SEED
    )
    return DigitsSplit(
        train_images=train_images,
        train_labels=train_labels,
        validation_images=validation_images,
        validation_labels=validation_labels,
    )
