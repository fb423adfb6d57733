"""Train a reference model once and leave in a directory everything an export run needs.

    OUT/
      model.pt2         torch.export program of the trained float model, batch-1 example input
      calibration.npz   x: 128 training-distribution samples, float32
      validation.npz    x: held-out inputs, labels: int64 (class ids, or 0/1 anomaly labels)
      labels.txt        one label per line (classifiers and detectors)
      reference.json    name, task, labels, input_shape, float_accuracy, seed (+ threshold for anomaly models,
                        + image: the pre-processing of image models)

A detector (task ``detect``) has images with boxes instead of arrays, in the YOLO layout (``images/NNNN.png``,
``labels/NNNN.txt``: ``class cx cy w h`` normalised), and its own figures:

      calibration/      128 training-distribution images
      validation/       the held-out images (at least 300)
      reference.json    ... float_accuracy null (accuracy means nothing for boxes), float_map50 and float_map50_95
                        (COCO mAP of the float model on validation/, read through its own pre-processing), head

``reference.json`` is removed before and written (atomically) after everything else, so a directory
with a matching ``reference.json`` is a finished one, and :func:`prepare` returns it without training.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from edgeline.export.reference.registry import AnomalyReferenceModule, DetectorReferenceModule, load_reference

if TYPE_CHECKING:
    import numpy as np
    from torch import nn

    from edgeline.detection import MeanAveragePrecision

__all__ = [
    "CALIBRATION_FILE",
    "LABELS_FILE",
    "MODEL_FILE",
    "REFERENCE_FILE",
    "VALIDATION_FILE",
    "Prepared",
    "find_prepared",
    "held_out_map",
    "prepare",
]

MODEL_FILE = "model.pt2"
CALIBRATION_FILE = "calibration.npz"
VALIDATION_FILE = "validation.npz"
LABELS_FILE = "labels.txt"
REFERENCE_FILE = "reference.json"
CALIBRATION_FOLDER = "calibration"
VALIDATION_FOLDER = "validation"
"""A detector's calibration and validation images, each in the YOLO layout."""


@dataclass(frozen=True)
class Prepared:
    """A prepared reference model: where its files are and what ``reference.json`` says.

    ``float_accuracy`` is the float model's held-out accuracy; for an anomaly model, the accuracy of
    "score above ``threshold``" against the anomaly labels; ``None`` for a detector, whose figures are
    ``float_map50`` and ``float_map50_95``. ``threshold`` is ``None`` for classifiers and detectors.
    """

    name: str
    task: str
    labels: tuple[str, ...]
    input_shape: tuple[int, ...]
    float_accuracy: float | None
    threshold: float | None
    seed: int
    directory: Path
    image: str | None = None
    """An image model's pre-processing (its module's ``IMAGE_PREPROCESS``, ``--preprocess`` text); None for others."""
    head: str | None = None
    """A detector's output layout (``--head``: ``edgeline.detection.HEADS``); None for other tasks."""
    float_map50: float | None = None
    """A detector's COCO mAP@0.5 on the held-out images (:func:`held_out_map`); None for other tasks."""
    float_map50_95: float | None = None
    """The same at IoU 0.5:0.95."""

    @property
    def is_detector(self) -> bool:
        return self.task == "detect"

    @property
    def model_path(self) -> Path:
        return self.directory / MODEL_FILE

    @property
    def calibration_path(self) -> Path:
        """``calibration.npz``, or a detector's folder of images."""
        return self.directory / (CALIBRATION_FOLDER if self.is_detector else CALIBRATION_FILE)

    @property
    def validation_path(self) -> Path:
        """``validation.npz``, or a detector's folder of images."""
        return self.directory / (VALIDATION_FOLDER if self.is_detector else VALIDATION_FILE)

    @property
    def labels_path(self) -> Path | None:
        return self.directory / LABELS_FILE if self.task in ("classify", "detect") else None

    @property
    def reference_path(self) -> Path:
        return self.directory / REFERENCE_FILE

    @property
    def files(self) -> tuple[Path, ...]:
        """Every file of the directory (a detector's image folders among them), ``reference.json`` last."""
        data_files = (self.model_path, self.calibration_path, self.validation_path)
        labels = () if self.labels_path is None else (self.labels_path,)
        return (*data_files, *labels, self.reference_path)

    def export_command(self, profile: str = "rpi5") -> str:
        """The ``edgeline export`` command line that takes this model to a device profile.

        Beyond model, profile and samples it names what the export cannot guess: the class names of a
        classifier, for an anomaly model the task and the threshold ``float_accuracy`` was measured with, for a
        detector the task, its head and its class names.
        """
        words = ["edgeline", "export", os.fspath(self.model_path), "--profile", profile]
        words += ["--calibration", os.fspath(self.calibration_path), "--validation", os.fspath(self.validation_path)]
        if self.head is not None:
            words += ["--task", self.task, "--head", self.head]
        if self.labels_path is not None:
            words += ["--labels", os.fspath(self.labels_path)]
        if self.threshold is not None:
            words += ["--task", self.task, "--threshold", repr(self.threshold)]
        if self.image is not None:  # a .pt2 does not carry its module's declaration: the command says it
            words += ["--preprocess", self.image]
        return shlex.join(words)

    def to_json(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            "name": self.name,
            "task": self.task,
            "labels": list(self.labels),
            "input_shape": list(self.input_shape),
            "float_accuracy": self.float_accuracy,
        }
        if self.float_map50 is not None:
            document["float_map50"] = self.float_map50
        if self.float_map50_95 is not None:
            document["float_map50_95"] = self.float_map50_95
        if self.head is not None:
            document["head"] = self.head
        if self.threshold is not None:
            document["threshold"] = self.threshold
        if self.image is not None:
            document["image"] = self.image
        document["seed"] = self.seed
        return document

    @classmethod
    def from_json(cls, document: dict[str, Any], directory: Path) -> Prepared:
        def number(value: Any) -> float | None:
            return None if value is None else float(value)

        image, head = document.get("image"), document.get("head")
        return cls(
            name=str(document["name"]),
            task=str(document["task"]),
            labels=tuple(str(label) for label in document["labels"]),
            input_shape=tuple(int(size) for size in document["input_shape"]),
            float_accuracy=number(document["float_accuracy"]),  # a detector's is null
            threshold=number(document.get("threshold")),
            seed=int(document["seed"]),
            directory=directory,
            image=None if image is None else str(image),
            head=None if head is None else str(head),
            float_map50=number(document.get("float_map50")),
            float_map50_95=number(document.get("float_map50_95")),
        )


def find_prepared(name: str, out_dir: Path | str, *, seed: int = 0) -> Prepared | None:
    """The finished preparation of ``name`` with ``seed`` in ``out_dir``, or ``None`` if there is none."""
    directory = Path(out_dir)
    try:
        document = json.loads((directory / REFERENCE_FILE).read_text(encoding="utf-8"))
        prepared = Prepared.from_json(document, directory)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if prepared.name != name or prepared.seed != seed:
        return None
    if not all(_present(path) for path in prepared.files):
        return None
    return prepared


def _present(path: Path) -> bool:
    """A file, or a folder in the YOLO layout (a detector's images)."""
    return path.is_file() or (path.is_dir() and (path / "images").is_dir() and (path / "labels").is_dir())


def prepare(name: str, out_dir: Path | str, *, seed: int = 0) -> Prepared:
    """Train reference model ``name`` with ``seed`` and write its files into ``out_dir``.

    Returns at once, without training, when ``out_dir`` already holds that model prepared with that seed.
    Prints nothing. Raises :class:`~edgeline.errors.EdgelineError` for an unknown name.
    """
    module = load_reference(name)
    directory = Path(out_dir)
    existing = find_prepared(name, directory, seed=seed)
    if existing is not None:
        return existing

    import numpy as np
    import torch

    from edgeline.export.reference.training import accuracy

    directory.mkdir(parents=True, exist_ok=True)
    # A reference.json left from an earlier run must not vouch for files being rewritten now.
    (directory / REFERENCE_FILE).unlink(missing_ok=True)
    if module.TASK == "detect":
        return _prepare_detector(cast(DetectorReferenceModule, module), directory, seed)

    data = module.make_data(seed)
    model = module.train(module.build(seed), data, seed=seed)
    threshold: float | None = None
    if module.TASK == "anomaly":
        anomaly_module = cast(AnomalyReferenceModule, module)
        threshold = anomaly_module.anomaly_threshold(model, data.calibration_x)
        float_accuracy = anomaly_module.thresholded_accuracy(model, data.validation_x, data.validation_y, threshold)
    else:
        float_accuracy = accuracy(model, data.validation_x, data.validation_y)

    prepared = Prepared(
        name=module.NAME,
        task=module.TASK,
        labels=tuple(module.LABELS),
        input_shape=tuple(module.INPUT_SHAPE),
        float_accuracy=float_accuracy,
        threshold=threshold,
        seed=seed,
        directory=directory,
        image=getattr(module, "IMAGE_PREPROCESS", None),
    )
    example = torch.tensor(data.validation_x[:1])
    torch.export.save(torch.export.export(model, (example,)), prepared.model_path)
    np.savez(prepared.calibration_path, x=data.calibration_x)
    np.savez(prepared.validation_path, x=data.validation_x, labels=data.validation_y)
    if prepared.labels_path is not None:
        prepared.labels_path.write_text("".join(f"{label}\n" for label in prepared.labels), encoding="utf-8")
    _write_atomically(prepared.reference_path, json.dumps(prepared.to_json(), indent=2) + "\n")
    return prepared


def _prepare_detector(module: DetectorReferenceModule, directory: Path, seed: int) -> Prepared:
    import torch

    data = module.make_data(seed)
    model = module.train(module.build(seed), data, seed=seed)
    prepared = Prepared(
        name=module.NAME,
        task=module.TASK,
        labels=tuple(module.LABELS),
        input_shape=tuple(module.INPUT_SHAPE),
        float_accuracy=None,
        threshold=None,
        seed=seed,
        directory=directory,
        image=module.IMAGE_PREPROCESS,
        head=module.HEAD,
    )
    for folder, images in ((prepared.calibration_path, data.calibration), (prepared.validation_path, data.validation)):
        partial = folder.with_name(f".{folder.name}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        module.write_yolo(images, partial)
        if folder.exists():  # an earlier preparation's images: replaced whole, never mixed with these
            shutil.rmtree(folder)
        os.replace(partial, folder)
    measured, example = held_out_map(model, prepared)
    prepared = replace(prepared, float_map50=measured.map50, float_map50_95=measured.map50_95)
    torch.export.save(torch.export.export(model, (torch.tensor(example),)), prepared.model_path)
    assert prepared.labels_path is not None
    prepared.labels_path.write_text("".join(f"{label}\n" for label in prepared.labels), encoding="utf-8")
    _write_atomically(prepared.reference_path, json.dumps(prepared.to_json(), indent=2) + "\n")
    return prepared


def held_out_map(
    model: nn.Module, prepared: Prepared, *, batch_size: int = 256
) -> tuple[MeanAveragePrecision, np.ndarray]:
    """COCO mAP of detector ``model`` on ``prepared``'s validation images, read as the export reads them (through
    the model's pre-processing, ``FramePrep``), decoded by its head and suppressed as the device does it at COCO's
    evaluation threshold, boxes mapped back to the image; and the first image's input (a batch of one).
    ``batch_size=1`` for an exported program."""
    from edgeline.detection import (
        COCO_MAX_DETECTIONS,
        EVALUATION_SCORE_THRESHOLD,
        HEADS,
        Detections,
        detect,
        mean_average_precision,
    )
    from edgeline.export.detection_data import read_detection_dataset
    from edgeline.export.reference.training import predict
    from edgeline.imaging import FramePrep, image_preprocess, parse_preprocess
    from edgeline.manifest import TensorSpec

    assert prepared.image is not None and prepared.head is not None, f"{prepared.name} is not a detector"
    spec = TensorSpec(name="images", dtype="float32", shape=(1, *prepared.input_shape))
    prep = FramePrep(image_preprocess(parse_preprocess(prepared.image), spec), spec)
    held_out = read_detection_dataset(prepared.validation_path, "validation", prep, prepared.labels)
    inputs = held_out.samples.inputs[0]
    outputs = predict(model, inputs, batch_size=batch_size)
    head, input_size = HEADS[prepared.head], (spec.shape[2], spec.shape[3])
    found = []
    for output, geometry in zip(outputs, held_out.geometries, strict=True):
        kept = detect(output[None], head, input_size, score_threshold=EVALUATION_SCORE_THRESHOLD,
                      max_detections=COCO_MAX_DETECTIONS)  # fmt: skip
        found.append(Detections(geometry.to_frame(kept.boxes), kept.scores, kept.classes))
    return mean_average_precision(found, held_out.truths), inputs[:1]


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)
