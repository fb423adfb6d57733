"""What the simulated sensors replay: samples of a prepared reference model, or any .npz file.

``edgeline reference prepare NAME --out DIR`` writes ``DIR/NAME/validation.npz`` (``x``: held-out inputs,
``labels``: class ids, or 0/1 anomaly labels). A sensor kind feeds one or two of those reference models:

    vibration  autoencoder       640 log-mel values (5 frames x 128 bins) of a machine; labels 0 normal, 1 anomaly
    keyword    ds_cnn            49x10 MFCC-like features of a spoken keyword; 12 classes
    camera     resnet8 (or vww)  3x32x32 colour frames, 10 classes (vww: 3x96x96, person / no_person)
    digits     digits            1x8x8 images of handwritten digits (the real scikit-learn set); 10 classes

The shapes repeat ``edgeline.export.reference``'s catalogue (sim may not import ``export``); a test keeps them equal.
The reference detector (``shapes``) is not here: its held-out data are images with boxes (``DIR/shapes/validation/``
in the YOLO layout), which a camera feeds, not a sensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from edgeline.errors import EdgelineError

if TYPE_CHECKING:  # `edgeline sim --help` lists the sensors: reading them needs no numpy
    import numpy as np

__all__ = [
    "MODEL_SHAPES",
    "SENSORS",
    "SENSOR_MODELS",
    "VALIDATION_FILE",
    "Samples",
    "load_sensor_samples",
    "resolve_model",
]

VALIDATION_FILE = "validation.npz"
SAMPLES_KEY = "x"

SENSOR_MODELS: dict[str, tuple[str, ...]] = {
    "vibration": ("autoencoder",),
    "keyword": ("ds_cnn",),
    "camera": ("resnet8", "vww"),
    "digits": ("digits",),
}
"""Sensor kind → the reference models it can feed, its default first."""

SENSORS: tuple[str, ...] = tuple(SENSOR_MODELS)

MODEL_SHAPES: dict[str, tuple[int, ...]] = {
    "autoencoder": (640,),
    "ds_cnn": (1, 49, 10),
    "resnet8": (3, 32, 32),
    "vww": (3, 96, 96),
    "digits": (1, 8, 8),
}
"""Reference model → the shape of one sample (without the batch axis)."""


@dataclass(frozen=True, eq=False)
class Samples:
    """Samples to replay: ``x`` float32 ``(N, ...)``, ``labels`` int64 ``(N,)`` or None, and where they came from."""

    x: np.ndarray
    labels: np.ndarray | None
    source: str

    def __post_init__(self) -> None:
        if self.x.ndim < 1 or len(self.x) == 0:
            raise EdgelineError(f"{self.source}: no samples to replay (array of shape {list(self.x.shape)})")
        if self.labels is not None and self.labels.shape != (len(self.x),):
            raise EdgelineError(
                f"{self.source}: labels of shape {list(self.labels.shape)} do not match {len(self.x)} samples"
            )

    def __len__(self) -> int:
        return len(self.x)

    @property
    def sample_size(self) -> int:
        """Values in one sample (one message's ``data``)."""
        return math.prod(self.x.shape[1:])


def resolve_model(sensor: str, model: str | None = None) -> str:
    """The reference model ``sensor`` feeds: ``model`` if that sensor can feed it, else its default."""
    if sensor not in SENSOR_MODELS:
        raise EdgelineError(f"unknown sensor {sensor!r}; valid: {', '.join(SENSORS)}")
    choices = SENSOR_MODELS[sensor]
    if model is None:
        return choices[0]
    if model not in choices:
        raise EdgelineError(f"sensor {sensor} cannot feed model {model!r}; valid: {', '.join(choices)}")
    return model


def load_sensor_samples(data: Path | str | None, model: str) -> Samples:
    """The samples at ``data`` for reference ``model``.

    ``data`` is an .npz file (replayed whatever its shape), or a directory holding ``validation.npz`` itself
    or in ``MODEL/`` (the ``--out`` of ``edgeline reference prepare``), whose samples must fit ``model``.
    """
    hint = f"prepare one with `edgeline reference prepare {model} --out DIR`, then pass --data DIR"
    if data is None:
        raise EdgelineError(f"no data to replay: {hint}, or --data FILE.npz")
    path = Path(data)
    if path.is_dir():
        candidates = [path / VALIDATION_FILE, path / model / VALIDATION_FILE]
        found = next((candidate for candidate in candidates if candidate.is_file()), None)
        if found is None:
            raise EdgelineError(f"--data {path}: neither {candidates[0]} nor {candidates[1]} exists; {hint}")
        samples = _read(found)
        expected = MODEL_SHAPES.get(model)
        if expected is not None and samples.x.shape[1:] != expected:
            raise EdgelineError(
                f"{found}: samples of shape {list(samples.x.shape[1:])} do not fit model {model} "
                f"(expected {list(expected)}); is this the right directory?"
            )
        return samples
    if not path.exists():
        raise EdgelineError(f"--data {path}: no such file or directory; {hint}")
    return _read(path)


def _read(path: Path) -> Samples:
    import numpy as np

    from edgeline.arrays import all_finite
    from edgeline.samples import LABELS_KEY, read_npz

    arrays = read_npz(path, "sample")
    labels = arrays.pop(LABELS_KEY, None)
    if SAMPLES_KEY in arrays:
        x = arrays[SAMPLES_KEY]
    elif len(arrays) == 1:
        x = next(iter(arrays.values()))
    else:
        raise EdgelineError(
            f"{path}: holds arrays {', '.join(sorted(arrays))}; name the samples {SAMPLES_KEY!r} "
            f"(and the labels {LABELS_KEY!r})"
        )
    if not np.issubdtype(x.dtype, np.number) or np.issubdtype(x.dtype, np.complexfloating):
        raise EdgelineError(f"{path}: samples of dtype {x.dtype} are not real numbers")
    if x.ndim < 2:
        raise EdgelineError(f"{path}: samples of shape {list(x.shape)}; expected (N, ...) with N samples first")
    with np.errstate(over="ignore"):
        x32 = x.astype(np.float32, copy=False)
    if not all_finite(x32):
        raise EdgelineError(f"{path}: samples hold NaN or Inf (after conversion to float32)")
    if labels is not None:
        if not np.issubdtype(labels.dtype, np.integer):
            raise EdgelineError(f"{path}: labels of dtype {labels.dtype}; expected integers")
        labels = labels.astype(np.int64, copy=False)
    return Samples(x32, labels, str(path))
