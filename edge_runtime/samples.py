"""Sample files (.npz, one array per model input, first axis = samples) and fitting arrays to inputs."""

from __future__ import annotations

import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from edgeline.errors import PayloadError
from edgeline.manifest import TensorSpec

__all__ = ["LABELS_KEY", "SampleSet", "read_npz", "sample_set"]

LABELS_KEY = "labels"


def read_npz(path: str | Path, role: str = "input") -> dict[str, np.ndarray]:
    """Load every array of an .npz file (no pickles), or say clearly why it cannot be read."""
    path = Path(path)
    if not path.is_file():
        raise PayloadError(f"{role} file {path}: no such file")
    try:
        loaded = np.load(path, allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):
            raise PayloadError(
                f"{role} file {path}: holds one bare array (saved with np.save), not an .npz file; "
                "save it with np.savez(path, NAME=array), one array per model input"
            )
        with loaded as data:
            arrays = {key: data[key] for key in data.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError, NotImplementedError, RuntimeError) as exc:
        # NotImplementedError: an unknown compression; RuntimeError: an encrypted member
        raise PayloadError(f"{role} file {path}: not a readable .npz file ({exc})") from exc
    if not arrays:
        raise PayloadError(f"{role} file {path}: holds no arrays")
    return arrays


class SampleSet:
    """Samples matched to a model's inputs: ``inputs[i]`` has shape (N, *input_i.shape[1:])."""

    def __init__(self, inputs: list[np.ndarray], labels: np.ndarray | None, source: str):
        self.inputs = inputs
        self.labels = labels
        self.source = source

    def __len__(self) -> int:
        return int(self.inputs[0].shape[0])

    def sample(self, index: int) -> list[np.ndarray]:
        return [array[index : index + 1] for array in self.inputs]


def _as_samples(array: np.ndarray, spec: TensorSpec, where: str) -> np.ndarray:
    per_sample = spec.shape[1:] if spec.shape and spec.shape[0] == 1 else spec.shape
    if array.shape == tuple(per_sample):
        array = array[np.newaxis]
    if array.shape[1:] != tuple(per_sample):
        raise PayloadError(
            f"{where}: shape {list(array.shape)} does not fit model input {spec.name!r} "
            f"(expected [N, {', '.join(map(str, per_sample))}])"
        )
    if not np.issubdtype(array.dtype, np.number) or np.issubdtype(array.dtype, np.complexfloating):
        raise PayloadError(f"{where}: dtype {array.dtype} is not a real number type")
    return array.astype(np.float32, copy=False)


def sample_set(arrays: dict[str, np.ndarray], specs: Sequence[TensorSpec], source: str) -> SampleSet:
    """Match named arrays to model inputs: by input name when all names match, else in file order."""
    labels = arrays.get(LABELS_KEY)
    data = {key: value for key, value in arrays.items() if key != LABELS_KEY}
    if len(data) != len(specs):
        raise PayloadError(
            f"{source}: holds {len(data)} input arrays ({', '.join(data) or 'none'}) "
            f"but the model takes {len(specs)} ({', '.join(s.name for s in specs)})"
        )
    names = [spec.name for spec in specs]
    ordered = [data[name] for name in names] if set(data) == set(names) else list(data.values())
    keys = names if set(data) == set(names) else list(data)
    inputs = [_as_samples(a, s, f"{source}[{k}]") for a, s, k in zip(ordered, specs, keys, strict=True)]
    counts = {array.shape[0] for array in inputs}
    if len(counts) != 1:
        raise PayloadError(f"{source}: input arrays disagree on the number of samples: {sorted(counts)}")
    if labels is not None and labels.shape[:1] != inputs[0].shape[:1]:
        raise PayloadError(f"{source}[labels]: {labels.shape[0]} labels for {inputs[0].shape[0]} samples")
    return SampleSet(inputs, labels, source)
