"""How a converted bundle compares with the float torch model, measured through edgeline itself."""

from __future__ import annotations

import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import numpy as np

from edgeline.detection import COCO_MAX_DETECTIONS, EVALUATION_SCORE_THRESHOLD, mean_average_precision
from edgeline.export.budgets import drop_interval
from edgeline.export.metrics import accuracy, confusion_matrix, cosine_similarity_rows, macro_f1
from edgeline.export.progress import Progress
from edgeline.isa import instruction_set
from edgeline.manifest import Fidelity, Postprocess
from edgeline.model import Model
from edgeline.postprocess import frame_detections, interpret
from edgeline.samples import SampleSet

__all__ = ["FloatReference", "compare_outputs", "measure_fidelity", "run_float"]

REFERENCE = "torch eager float32"


@dataclass(frozen=True)
class FloatReference:
    outputs: list[list[np.ndarray]]  # per sample, per output


FLOAT_BATCH = 64
"""Samples per call of the float model when it can take several (see ``run_float``)."""

Outputs = list[np.ndarray]
Call = Callable[[list[np.ndarray]], Outputs]


def run_float(module: Any, samples: SampleSet, progress: Progress | None = None) -> FloatReference:
    """The float model's outputs for every sample, each as the model returns it for that sample alone.

    A module exported with a batch of 1 (a ``.pt2``) refuses a batch, and one call per sample costs about a
    millisecond of overhead at best. So the samples go through in batches of ``FLOAT_BATCH``: called directly when
    the module takes a batch, else vectorised over the batch with ``torch.vmap`` (each sample still sees its batch
    of 1). Either way is used only when it gives the first samples' outputs as single calls do; otherwise one call
    per sample.
    """
    import torch

    with torch.no_grad():
        batched = _batched_call(module, samples)
        step = FLOAT_BATCH if batched is not None else 1
        results: list[Outputs] = []
        for start in range(0, len(samples), step):
            if batched is None:
                results.append(_single(module, samples.sample(start)))
            else:
                outputs = batched([array[start : start + step] for array in samples.inputs])
                results.extend([output[i : i + 1] for output in outputs] for i in range(outputs[0].shape[0]))
            if progress is not None:
                progress.count(len(results), len(samples))
    return FloatReference(results)


def _outputs(raw: Any) -> tuple[Any, ...]:
    return tuple(raw) if isinstance(raw, tuple | list) else (raw,)


def _single(module: Any, arrays: list[np.ndarray]) -> Outputs:
    import torch

    return [o.detach().numpy().astype(np.float32) for o in _outputs(module(*(torch.from_numpy(a) for a in arrays)))]


def _batched_call(module: Any, samples: SampleSet) -> Call | None:
    """A way to call ``module`` on a batch whose outputs, sample by sample, are what single calls give; or None."""
    import torch

    def direct(arrays: list[np.ndarray]) -> Outputs:
        return [o.numpy().astype(np.float32) for o in _outputs(module(*(torch.from_numpy(a) for a in arrays)))]

    def one(*tensors: Any) -> tuple[Any, ...]:
        return tuple(o.squeeze(0) for o in _outputs(module(*(t.unsqueeze(0) for t in tensors))))

    def vectorised(arrays: list[np.ndarray]) -> Outputs:
        return [o.numpy().astype(np.float32) for o in torch.vmap(one)(*(torch.from_numpy(a) for a in arrays))]

    if len(samples) < 2:
        return None
    expected = [_single(module, samples.sample(i)) for i in range(2)]
    for candidate in (direct, vectorised):
        try:
            got = candidate([array[:2] for array in samples.inputs])
        except Exception:  # the module refuses this way of calling it (a shape guard, an op vmap cannot batch)
            continue
        if all(_same(got, expected[i], i) for i in range(2)):
            return candidate
    return None


def _same(batch: Outputs, single: Outputs, index: int) -> bool:
    if len(batch) != len(single):
        return False
    for whole, alone in zip(batch, single, strict=True):
        part = whole[index : index + 1]
        if part.shape != alone.shape or not np.allclose(part, alone, rtol=1e-4, atol=1e-5):
            return False
    return True


def _detection_fields(
    reference: Sequence[Sequence[np.ndarray]],
    converted: Sequence[Sequence[np.ndarray]],
    samples: SampleSet,
    post: Postprocess,
) -> dict[str, float | None]:
    """A detector's mAP: both models' detections decoded and suppressed as the device does it, at COCO's
    evaluation threshold (``EVALUATION_SCORE_THRESHOLD``, at most 100 per image), boxes in the image's normalised
    coordinates; against the images' objects when labelled, and the bundle's against the float model's (over the
    answers' score threshold) always."""
    geometries = samples.geometries or [None] * len(samples)
    evaluation = {"score_threshold": EVALUATION_SCORE_THRESHOLD, "max_detections": COCO_MAX_DETECTIONS}
    float_found, bundle_found, float_kept = [], [], []
    for index, geometry in enumerate(geometries):
        float_found.append(frame_detections(post, reference[index][0], geometry, evaluation))
        bundle_found.append(frame_detections(post, converted[index][0], geometry, evaluation))
        float_kept.append(frame_detections(post, reference[index][0], geometry))
    agreement = mean_average_precision(bundle_found, [(d.boxes, d.classes) for d in float_kept])
    # (the float model finding nothing at all leaves nothing to agree with: not a measure then)
    fields: dict[str, float | None] = {"map50_agreement": agreement.map50 if agreement.truths else None}
    if samples.truths is not None:
        bundle_map = mean_average_precision(bundle_found, samples.truths)
        float_map = mean_average_precision(float_found, samples.truths)
        fields.update(map50=bundle_map.map50, map50_95=bundle_map.map50_95, map50_float=float_map.map50,
                      map50_95_float=float_map.map50_95)  # fmt: skip
    return fields


def _runtime_description(model: Model) -> str:
    package = model.manifest.runtime.package if model.backend == model.manifest.backend else model.backend
    try:
        package_version = version(package)
    except PackageNotFoundError:
        package_version = "?"
    return f"edgeline {model.backend} ({package} {package_version}) on host {platform.machine()}"


def measure_fidelity(
    model: Model,
    reference: FloatReference,
    samples: SampleSet,
    post: Postprocess,
    progress: Progress | None = None,
    per_sample: list[float] | None = None,
) -> Fidelity:
    """The converted model against the float one on ``samples``; ``per_sample`` (when given) gets each sample's
    relative error, ||float - converted|| / ||float||, in order: what ranks the samples int8 does worst on."""
    converted = []
    for index in range(len(samples)):
        converted.append(model.predict(*samples.sample(index)))
        if progress is not None and ((index + 1) % 50 == 0 or index + 1 == len(samples)):
            progress.count(index + 1, len(samples))
    fidelity = compare_outputs(reference.outputs, converted, samples, post, _runtime_description(model), per_sample)
    return fidelity.model_copy(update={"instruction_set": instruction_set(), "computed_in": model.computes})


def compare_outputs(
    reference: Sequence[Sequence[np.ndarray]],
    converted: Sequence[Sequence[np.ndarray]],
    samples: SampleSet,
    post: Postprocess,
    measured_with: str,
    per_sample: list[float] | None = None,
) -> Fidelity:
    """``converted`` (per sample of ``samples``, per output) against the float model's ``reference`` outputs."""
    float_flat = np.stack([np.concatenate([o.reshape(-1) for o in outs]) for outs in reference])
    conv_flat = np.stack([np.concatenate([o.reshape(-1) for o in outs]) for outs in converted])
    error = np.abs(float_flat - conv_flat)
    if per_sample is not None:
        scale = np.maximum(np.linalg.norm(float_flat.astype(np.float64), axis=1), np.finfo(np.float64).tiny)
        per_sample.extend((np.linalg.norm((float_flat - conv_flat).astype(np.float64), axis=1) / scale).tolist())
    fields: dict[str, Any] = {
        "max_abs_error": float(error.max()),
        "mean_abs_error": float(error.mean()),
        "cosine_min": float(cosine_similarity_rows(float_flat, conv_flat).min()),
    }
    labels = samples.labels
    if post.kind == "classify":
        float_pred = np.array([int(np.argmax(outs[0])) for outs in reference])
        conv_pred = np.array([int(np.argmax(outs[0])) for outs in converted])
        fields["top1_agreement"] = float(np.mean(float_pred == conv_pred))
        fields["disagreeing_samples"] = int(np.count_nonzero(float_pred != conv_pred))
        if labels is not None:
            classes = int(reference[0][0].size)
            truth = labels.astype(np.int64)
            fields.update(_paired_counts(truth == float_pred, truth == conv_pred))
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
                    bool(interpret(post, inputs, reference[index]).anomaly),
                    bool(interpret(post, inputs, converted[index]).anomaly),
                )
            )
        float_flags = np.array([f for f, _ in flags])
        conv_flags = np.array([c for _, c in flags])
        fields["anomaly_agreement"] = float(np.mean(float_flags == conv_flags))
        fields["disagreeing_samples"] = int(np.count_nonzero(float_flags != conv_flags))
        if labels is not None:
            truth = labels.astype(bool)
            fields.update(accuracy=accuracy(truth, conv_flags), accuracy_float=accuracy(truth, float_flags))
            fields.update(_paired_counts(truth == float_flags, truth == conv_flags))
    elif post.kind == "detect":
        fields.update(_detection_fields(reference, converted, samples, post))
    fidelity = Fidelity(
        status="measured",
        reference=REFERENCE,
        samples=len(samples),
        measured_with=measured_with,
        **fields,
    )
    interval = drop_interval(fidelity)
    if interval is None:
        return fidelity
    (low, high), method = interval
    return fidelity.model_copy(update={"drop_interval": (low, high), "drop_interval_method": method})


def _paired_counts(float_right: np.ndarray, bundle_right: np.ndarray) -> dict[str, int]:
    """The samples only the float model decides right (``lost_samples``) and only the bundle does
    (``gained_samples``): the accuracy drop as counts, and its interval's discordant pairs."""
    return {
        "lost_samples": int(np.count_nonzero(float_right & ~bundle_right)),
        "gained_samples": int(np.count_nonzero(bundle_right & ~float_right)),
    }
