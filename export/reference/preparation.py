"""Train a reference model once and leave in a directory everything an export run needs.

    OUT/
      model.pt2         torch.export program of the trained float model, batch-1 example input
      calibration.npz   x: 128 training-distribution samples, float32
      validation.npz    x: held-out inputs, labels: int64 (class ids, or 0/1 anomaly labels)
      labels.txt        one label per line (classifiers only)
      reference.json    name, task, labels, input_shape, float_accuracy, seed (+ threshold for anomaly models)

``reference.json`` is removed before and written (atomically) after everything else, so a directory
with a matching ``reference.json`` is a finished one, and :func:`prepare` returns it without training.
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from edgeline.export.reference.registry import AnomalyReferenceModule, load_reference

__all__ = [
    "CALIBRATION_FILE",
    "LABELS_FILE",
    "MODEL_FILE",
    "REFERENCE_FILE",
    "VALIDATION_FILE",
    "Prepared",
    "find_prepared",
    "prepare",
]

MODEL_FILE = "model.pt2"
CALIBRATION_FILE = "calibration.npz"
VALIDATION_FILE = "validation.npz"
LABELS_FILE = "labels.txt"
REFERENCE_FILE = "reference.json"


@dataclass(frozen=True)
class Prepared:
    """A prepared reference model: where its files are and what ``reference.json`` says.

    ``float_accuracy`` is the float model's held-out accuracy; for an anomaly model, the accuracy of
    "score above ``threshold``" against the anomaly labels. ``threshold`` is ``None`` for classifiers.
    """

    name: str
    task: str
    labels: tuple[str, ...]
    input_shape: tuple[int, ...]
    float_accuracy: float
    threshold: float | None
    seed: int
    directory: Path
    image: str | None = None
    """An image model's pre-processing (its module's ``IMAGE_PREPROCESS``, ``--preprocess`` text); None for others."""

    @property
    def model_path(self) -> Path:
        return self.directory / MODEL_FILE

    @property
    def calibration_path(self) -> Path:
        return self.directory / CALIBRATION_FILE

    @property
    def validation_path(self) -> Path:
        return self.directory / VALIDATION_FILE

    @property
    def labels_path(self) -> Path | None:
        return self.directory / LABELS_FILE if self.task == "classify" else None

    @property
    def reference_path(self) -> Path:
        return self.directory / REFERENCE_FILE

    @property
    def files(self) -> tuple[Path, ...]:
        """Every file of the directory, ``reference.json`` last."""
        data_files = (self.model_path, self.calibration_path, self.validation_path)
        labels = () if self.labels_path is None else (self.labels_path,)
        return (*data_files, *labels, self.reference_path)

    def export_command(self, profile: str = "rpi5") -> str:
        """The ``edgeline export`` command line that takes this model to a device profile.

        Beyond model, profile and samples it names what the export cannot guess: the class names of a
        classifier, or, for an anomaly model, the task and the threshold ``float_accuracy`` was measured with.
        """
        words = ["edgeline", "export", os.fspath(self.model_path), "--profile", profile]
        words += ["--calibration", os.fspath(self.calibration_path), "--validation", os.fspath(self.validation_path)]
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
        if self.threshold is not None:
            document["threshold"] = self.threshold
        if self.image is not None:
            document["image"] = self.image
        document["seed"] = self.seed
        return document

    @classmethod
    def from_json(cls, document: dict[str, Any], directory: Path) -> Prepared:
        threshold, image = document.get("threshold"), document.get("image")
        return cls(
            name=str(document["name"]),
            task=str(document["task"]),
            labels=tuple(str(label) for label in document["labels"]),
            input_shape=tuple(int(size) for size in document["input_shape"]),
            float_accuracy=float(document["float_accuracy"]),
            threshold=None if threshold is None else float(threshold),
            seed=int(document["seed"]),
            directory=directory,
            image=None if image is None else str(image),
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
    if not all(path.is_file() for path in prepared.files):
        return None
    return prepared


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


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)
