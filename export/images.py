"""Image folders as ``--calibration`` / ``--validation``, read through the device's own pre-processing.

    calibration DIR/          any images, in any sub-folders: the model's inputs
    validation  DIR/CLASS/    one sub-folder per class (torchvision's ImageFolder layout), classes in sorted folder
                              order unless --labels names them; a folder without sub-folders: unlabelled images

Each image is read with ``edgeline.imaging.read_image`` and made into input 0 by ``FramePrep``: the function the
daemon applies to a camera's frames, so what export measures is what the device computes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from edgeline import imaging
from edgeline.errors import EdgelineError
from edgeline.export.errors import CalibrationError
from edgeline.export.loading import LoadedModel
from edgeline.imaging import IMAGE_SUFFIXES, MAX_IMAGES, FramePrep, image_preprocess, read_image
from edgeline.manifest import ImagePreprocess, TensorSpec
from edgeline.samples import SampleSet

__all__ = [
    "MAX_IMAGES",
    "MAX_IMAGE_SAMPLE_BYTES",
    "image_input",
    "list_images",
    "read_class_folders",
    "read_image_folder",
    "sample_buffer",
]

MAX_IMAGE_SAMPLE_BYTES = 2 * 1024**3
"""The most the inputs made from one folder may take in memory (float32): checked before an image is read."""


def image_input(
    loaded: LoadedModel, keys: Mapping[str, object], samples: SampleSet | None, where: str
) -> tuple[ImagePreprocess, FramePrep]:
    """The manifest's ``image`` and its ``FramePrep`` for the model's input 0, whose shape comes from the samples
    (an .npz), the model (a .pt2's example input, a module's ``INPUT_SHAPE``), or the keys' ``size``."""
    names = loaded.forward_parameters or ("input_0",)
    if len(names) != 1:
        raise CalibrationError(f"{where}: an image pre-processing feeds one input; the model takes {', '.join(names)}")
    if samples is not None:
        shape: tuple[int, ...] | None = (1, *samples.inputs[0].shape[1:])
    elif loaded.input_shape is not None:
        shape = loaded.input_shape
    elif "size" in keys:
        size = keys["size"]
        assert isinstance(size, tuple)  # parse_preprocess / preprocess_table made it
        height, width = size
        channels = 1 if keys.get("color") == "gray" else 3
        shape = (1, channels, height, width) if keys.get("layout", "nchw") == "nchw" else (1, height, width, channels)
    else:
        raise CalibrationError(
            f"{where}: the model's input shape is not known before it runs ({loaded.source} is a function); give "
            "size=HxW in --preprocess (or the [preprocess] table), or calibration samples as an .npz"
        )
    spec = TensorSpec(name=names[0], dtype="float32", shape=shape)
    try:
        image = image_preprocess(keys, spec)
        return image, FramePrep(image, spec)
    except EdgelineError as exc:
        raise CalibrationError(f"{where}: {exc}") from exc


def list_images(folder: Path, role: str) -> list[Path]:
    """Every image file under ``folder``, recursively, in path order (at most ``MAX_IMAGES``):
    ``edgeline.imaging.list_images``, whose limit is a ``CalibrationError`` here."""
    try:
        return imaging.list_images(folder, role)
    except EdgelineError as exc:
        raise CalibrationError(str(exc)) from exc


def sample_buffer(count: int, prep: FramePrep, where: str) -> np.ndarray:
    """An empty float32 array for ``count`` inputs of ``prep``'s shape, refused (before anything is read) when it
    would take more than ``MAX_IMAGE_SAMPLE_BYTES``; ``where`` starts the error."""
    shape = prep.input_spec.shape
    per_sample = shape[1:] if len(shape) == 4 else shape
    needed = count * math.prod(per_sample) * 4
    if needed > MAX_IMAGE_SAMPLE_BYTES:
        raise CalibrationError(
            f"{where}: {count:,} images of input {list(shape)} take {needed / 2**30:.1f} GiB as "
            f"float32, more than {MAX_IMAGE_SAMPLE_BYTES // 2**30} GiB; give a smaller folder"
        )
    return np.empty((count, *per_sample), dtype=np.float32)


def _read(paths: list[Path], prep: FramePrep, role: str, folder: Path) -> np.ndarray:
    out = sample_buffer(len(paths), prep, f"{role} folder {folder}")
    per_sample = out.shape[1:]
    for index, path in enumerate(paths):
        try:
            out[index] = prep(read_image(path)).reshape(per_sample)
        except EdgelineError as exc:
            raise CalibrationError(f"{role} folder {folder}: {exc}") from exc
    return out


def _no_images(folder: Path, role: str) -> CalibrationError:
    return CalibrationError(f"{role} folder {folder}: no images ({', '.join(IMAGE_SUFFIXES)}) in it or its sub-folders")


def read_image_folder(folder: Path, role: str, prep: FramePrep) -> SampleSet:
    """Every image under ``folder`` (recursively, in path order) as input 0; no labels."""
    paths = list_images(folder, role)
    if not paths:
        raise _no_images(folder, role)
    return SampleSet([_read(paths, prep, role, folder)], None, str(folder))


def read_class_folders(
    folder: Path, prep: FramePrep, labels: tuple[str, ...] | None
) -> tuple[SampleSet, tuple[str, ...] | None]:
    """A validation folder: one sub-folder per class (its images, recursively), class index = the folder's place
    in sorted order, or in ``labels`` (``--labels``) when given. Without sub-folders: unlabelled images. Returns the
    samples and the class names the labels index (None: unlabelled)."""
    role = "validation"
    classes = sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        return read_image_folder(folder, role, prep), None
    loose = [p.name for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES]
    if loose:
        raise CalibrationError(
            f"{role} folder {folder}: {loose[0]} is not in a class sub-folder (one sub-folder per class: "
            f"{', '.join(classes[:5])})"
        )
    names = labels if labels is not None else tuple(classes)
    unknown = [name for name in classes if name not in names]
    if unknown:
        raise CalibrationError(
            f"{role} folder {folder}: class sub-folder {unknown[0]!r} is not among --labels ({', '.join(names)})"
        )
    paths: list[Path] = []
    indices: list[int] = []
    for name in classes:
        found = list_images(folder / name, role)
        if not found:
            raise _no_images(folder / name, role)
        paths += found
        indices += [names.index(name)] * len(found)
        if len(paths) > MAX_IMAGES:
            raise CalibrationError(f"{role} folder {folder}: more than {MAX_IMAGES:,} images")
    inputs = _read(paths, prep, role, folder)
    return SampleSet([inputs], np.asarray(indices, dtype=np.int64), str(folder)), names
