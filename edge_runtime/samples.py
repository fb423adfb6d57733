"""Sample files (.npz, one array per model input, first axis = samples) and fitting arrays to inputs."""

from __future__ import annotations

import math
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edgeline.errors import BundleError, PayloadError
from edgeline.manifest import Golden, TensorSpec

__all__ = [
    "GOLDEN_MAX_BYTES",
    "LABELS_KEY",
    "SampleSet",
    "check_sample_counts",
    "class_indices",
    "match_inputs",
    "read_golden",
    "read_npz",
    "sample_set",
]

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


GOLDEN_MAX_BYTES = 256 * 1024 * 1024
"""The most golden.npz may inflate to, all arrays together (the exporter writes 8 samples, or 32 for a float
golden: 160 MB for 32 images of 640x640x3 in float32)."""
_NPY_HEADER_MAX = 10_000


def read_golden(
    path: Path, golden: Golden, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """golden.npz's ``input_<i>`` and ``output_<j>`` arrays, read member by member: each member's header (shape and
    dtype) is checked against the manifest (``golden.samples`` rows of each tensor's shape) before a byte of it is
    inflated, the whole against ``GOLDEN_MAX_BYTES``, and nothing else in the file is read. What the archive says
    about its own sizes is never trusted: a member is read for exactly the bytes its checked header implies.
    Raises ``BundleError`` naming the file and the member."""
    where = f"golden file {path}"
    n = golden.samples
    # as the exporter writes them: inputs as sample files hold them (``_as_samples``), outputs concatenated
    wanted = [(f"input_{i}", _sample_shape(spec, n)) for i, spec in enumerate(inputs)]
    wanted += [
        (f"output_{j}", (n * spec.shape[0], *spec.shape[1:]) if spec.shape else (n,)) for j, spec in enumerate(outputs)
    ]
    total = 0
    arrays: list[np.ndarray] = []
    try:
        with zipfile.ZipFile(path) as archive:
            names = set(archive.namelist())
            for key, shape in wanted:
                member = f"{key}.npy"
                if member not in names:
                    raise BundleError(f"{where}: lacks {key}")
                with archive.open(member) as stream:
                    dtype = _checked_header(stream, shape, f"{where}: {key}")
                    total += math.prod(shape) * dtype.itemsize
                    if total > GOLDEN_MAX_BYTES:
                        raise BundleError(
                            f"{where}: its arrays come to more than {GOLDEN_MAX_BYTES // 2**20} MiB (at {key})"
                        )
                    arrays.append(_read_exactly(stream, shape, dtype, f"{where}: {key}"))
    except (OSError, zipfile.BadZipFile, EOFError, NotImplementedError, RuntimeError, ValueError) as exc:
        raise BundleError(f"{where}: not a readable .npz file ({exc})") from exc
    return arrays[: len(inputs)], arrays[len(inputs) :]


def _sample_shape(spec: TensorSpec, samples: int) -> tuple[int, ...]:
    return (samples, *(spec.shape[1:] if spec.shape and spec.shape[0] == 1 else spec.shape))


def _checked_header(stream: Any, shape: tuple[int, ...], where: str) -> np.dtype[Any]:
    from numpy.lib import format as npy

    try:
        version = npy.read_magic(stream)
        if version == (1, 0):
            got, fortran, dtype = npy.read_array_header_1_0(stream, max_header_size=_NPY_HEADER_MAX)
        elif version == (2, 0):
            got, fortran, dtype = npy.read_array_header_2_0(stream, max_header_size=_NPY_HEADER_MAX)
        else:
            raise BundleError(f"{where}: .npy format {version[0]}.{version[1]} (1.0 or 2.0 expected)")
    except ValueError as exc:
        raise BundleError(f"{where}: not a .npy array ({exc})") from exc
    if dtype.hasobject or dtype.kind not in "biuf" or dtype.itemsize > 8:
        raise BundleError(f"{where}: dtype {dtype} (a plain number type expected)")
    if tuple(got) != shape:
        raise BundleError(f"{where}: shape {list(got)}, the manifest says {list(shape)}")
    if fortran:
        raise BundleError(f"{where}: a Fortran-ordered array (C order expected)")
    return dtype


def _read_exactly(stream: Any, shape: tuple[int, ...], dtype: np.dtype[Any], where: str) -> np.ndarray:
    array = np.empty(shape, dtype)
    view = array.reshape(-1).view(np.uint8).data
    done = 0
    while done < len(view):
        chunk = stream.read(min(len(view) - done, 1 << 20))
        if not chunk:
            raise BundleError(f"{where}: {done} of {len(view)} bytes (the member ends early)")
        view[done : done + len(chunk)] = chunk
        done += len(chunk)
    return array


class SampleSet:
    """Samples matched to a model's inputs: ``inputs[i]`` has shape (N, *input_i.shape[1:]). A detector's images
    also carry, per sample, where the image landed in the input (``geometries``: ``edgeline.imaging.Geometry``,
    which maps boxes back to the image) and, when labelled, its objects (``truths``: (K, 4) boxes x1, y1, x2, y2
    normalised to the image, (K,) class indices)."""

    def __init__(
        self,
        inputs: list[np.ndarray],
        labels: np.ndarray | None,
        source: str,
        *,
        geometries: Sequence[Any] | None = None,
        truths: Sequence[tuple[np.ndarray, np.ndarray]] | None = None,
    ):
        self.inputs = inputs
        self.labels = labels
        self.source = source
        self.geometries = None if geometries is None else tuple(geometries)
        self.truths = None if truths is None else tuple(truths)

    def __len__(self) -> int:
        return int(self.inputs[0].shape[0])

    def sample(self, index: int) -> list[np.ndarray]:
        return [array[index : index + 1] for array in self.inputs]

    def subset(self, indices: Sequence[int]) -> SampleSet:
        """The samples at ``indices``, in that order, with their labels, geometries and truths."""
        chosen = np.asarray(indices, dtype=np.int64)
        return SampleSet(
            [array[chosen] for array in self.inputs],
            None if self.labels is None else self.labels[chosen],
            self.source,
            geometries=None if self.geometries is None else [self.geometries[i] for i in indices],
            truths=None if self.truths is None else [self.truths[i] for i in indices],
        )


def _as_samples(array: np.ndarray, spec: TensorSpec, where: str) -> np.ndarray:
    per_sample = _sample_shape(spec, 1)[1:]
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


def match_inputs(
    arrays: dict[str, np.ndarray], names: Sequence[str] | None, source: str, *, taker: str = "the model"
) -> tuple[list[str], list[np.ndarray], np.ndarray | None]:
    """The one way sample files meet a model: ``labels`` split off, the other arrays taken by name, in the order of
    the input ``names``. Arrays saved unnamed (numpy's ``arr_0``, ``arr_1``, ...) are taken by the position in
    their names; any other names that differ from the inputs' are refused, naming both lists (``names`` None: the
    model does not name its inputs, so any names, in file order). Returns the keys, the arrays and the labels."""
    labels = arrays.get(LABELS_KEY)
    data = {key: value for key, value in arrays.items() if key != LABELS_KEY}
    if names is None:
        keys = list(data)
    else:
        if len(data) != len(names):
            raise PayloadError(
                f"{source}: holds {len(data)} input arrays ({', '.join(data) or 'none'}) "
                f"but {taker} takes {len(names)} ({', '.join(names)})"
            )
        unnamed = [f"arr_{index}" for index in range(len(names))]
        if set(data) == set(names):
            keys = list(names)
        elif set(data) == set(unnamed):
            keys = unnamed
        else:
            example = ", ".join(f"{name}=..." for name in names)
            raise PayloadError(
                f"{source}: array names ({', '.join(data)}) differ from the inputs {taker} takes "
                f"({', '.join(names)}); name each array after its input, e.g. np.savez(path, {example}), "
                f"or save them unnamed in that order ({', '.join(unnamed)})"
            )
    return keys, [data[key] for key in keys], class_indices(labels, source)


def class_indices(labels: np.ndarray | None, source: str) -> np.ndarray | None:
    """``labels`` as int64 class indices. Floats that hold whole numbers (as numpy and pandas often store them) are
    indices too; anything else is refused, never ignored."""
    if labels is None:
        return None
    where = f"{source}[labels]"
    if labels.dtype.kind in "biu":
        return labels.astype(np.int64, copy=False)
    if labels.dtype.kind != "f":
        raise PayloadError(f"{where}: dtype {labels.dtype}; labels are class indices (whole numbers)")
    flat = labels.reshape(-1)
    bad = ~np.isfinite(flat)
    bad[~bad] = (flat[~bad] != np.round(flat[~bad])) | (np.abs(flat[~bad]) >= 2**53)
    if bad.any():
        index = int(np.argmax(bad))
        raise PayloadError(
            f"{where}: labels are class indices (whole numbers); found {float(flat[index])} at index {index}"
        )
    return labels.astype(np.int64)


def check_sample_counts(inputs: Sequence[np.ndarray], labels: np.ndarray | None, source: str) -> None:
    """Every input array, and the labels, hold the same number of samples (the first axis)."""
    counts = {array.shape[0] for array in inputs}
    if len(counts) != 1:
        raise PayloadError(f"{source}: input arrays disagree on the number of samples: {sorted(counts)}")
    if labels is not None and labels.shape[:1] != inputs[0].shape[:1]:
        raise PayloadError(f"{source}[labels]: {labels.shape[0]} labels for {inputs[0].shape[0]} samples")


def sample_set(arrays: dict[str, np.ndarray], specs: Sequence[TensorSpec], source: str) -> SampleSet:
    """Match named arrays to model inputs (``match_inputs``) and check each against its input's shape."""
    keys, ordered, labels = match_inputs(arrays, [spec.name for spec in specs], source)
    inputs = [_as_samples(a, s, f"{source}[{k}]") for a, s, k in zip(ordered, specs, keys, strict=True)]
    check_sample_counts(inputs, labels, source)
    return SampleSet(inputs, labels, source)
