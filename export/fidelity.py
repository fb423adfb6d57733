"""How a converted bundle compares with the float torch model, measured through edgeline itself."""

from __future__ import annotations

import platform
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import numpy as np

from edgeline.export.metrics import accuracy, confusion_matrix, cosine_similarity_rows, macro_f1
from edgeline.manifest import Fidelity, Postprocess
from edgeline.model import Model
from edgeline.postprocess import interpret
from edgeline.samples import SampleSet

__all__ = ["FloatReference", "measure_fidelity", "run_float"]

REFERENCE = "torch eager float32"


@dataclass(frozen=True)
class FloatReference:
    outputs: list[list[np.ndarray]]  # per sample, per output


def run_float(module: Any, samples: SampleSet) -> FloatReference:
    import torch

    results = []
    with torch.no_grad():
        for index in range(len(samples)):
            raw = module(*(torch.from_numpy(array) for array in samples.sample(index)))
            outputs = raw if isinstance(raw, (tuple, list)) else (raw,)
            results.append([output.detach().numpy().astype(np.float32) for output in outputs])
    return FloatReference(results)


def _runtime_description(model: Model) -> str:
    package = model.manifest.runtime.package if model.backend == model.manifest.backend else model.backend
    try:
        package_version = version(package)
    except PackageNotFoundError:
        package_version = "?"
    return f"edgeline {model.backend} ({package} {package_version}) on host {platform.machine()}"


def measure_fidelity(model: Model, reference: FloatReference, samples: SampleSet, post: Postprocess) -> Fidelity:
    converted = [model.predict(*samples.sample(i)) for i in range(len(samples))]
    float_flat = np.stack([np.concatenate([o.reshape(-1) for o in outs]) for outs in reference.outputs])
    conv_flat = np.stack([np.concatenate([o.reshape(-1) for o in outs]) for outs in converted])
    error = np.abs(float_flat - conv_flat)
    fields: dict[str, Any] = {
        "max_abs_error": float(error.max()),
        "mean_abs_error": float(error.mean()),
        "cosine_min": float(cosine_similarity_rows(float_flat, conv_flat).min()),
    }
    labels = samples.labels
    if post.kind == "classify":
        float_pred = np.array([int(np.argmax(outs[0])) for outs in reference.outputs])
        conv_pred = np.array([int(np.argmax(outs[0])) for outs in converted])
        fields["top1_agreement"] = float(np.mean(float_pred == conv_pred))
        if labels is not None:
            classes = int(reference.outputs[0][0].size)
            truth = labels.astype(np.int64)
            fields.update(
                accuracy=accuracy(truth, conv_pred),
                accuracy_float=accuracy(truth, float_pred),
                macro_f1=macro_f1(truth, conv_pred, classes),
                macro_f1_float=macro_f1(truth, float_pred, classes),
                confusion=confusion_matrix(truth, conv_pred, classes).tolist(),
                confusion_float=confusion_matrix(truth, float_pred, classes).tolist(),
            )
    elif post.kind == "anomaly":
        flags = []
        for index in range(len(samples)):
            inputs = samples.sample(index)
            flags.append(
                (
                    bool(interpret(post, inputs, reference.outputs[index]).anomaly),
                    bool(interpret(post, inputs, converted[index]).anomaly),
                )
            )
        float_flags = np.array([f for f, _ in flags])
        conv_flags = np.array([c for _, c in flags])
        fields["anomaly_agreement"] = float(np.mean(float_flags == conv_flags))
        if labels is not None:
            truth = labels.astype(bool)
            fields.update(accuracy=accuracy(truth, conv_flags), accuracy_float=accuracy(truth, float_flags))
    return Fidelity(
        status="measured",
        reference=REFERENCE,
        samples=len(samples),
        measured_with=_runtime_description(model),
        **fields,
    )
