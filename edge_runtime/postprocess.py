"""Reading model outputs as answers: labels and scores for classifiers, scores and flags for anomalies, boxes for
detectors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgeline.detection import Detections, detect
from edgeline.imaging import Geometry
from edgeline.manifest import Postprocess

__all__ = ["BOX_DECIMALS", "DETECTION_OVERRIDES", "Interpretation", "frame_detections", "interpret", "softmax"]


@dataclass(frozen=True)
class Interpretation:
    label: str | None = None
    index: int | None = None
    score: float | None = None
    top_k: tuple[tuple[str, float], ...] = ()
    anomaly_score: float | None = None
    anomaly: bool | None = None
    detections: tuple[dict[str, Any], ...] | None = None
    """A detector's: ``box`` [x1, y1, x2, y2] normalised to the frame (or the input), ``class_index``, ``label``,
    ``score``, best first."""

    def as_dict(self) -> dict[str, Any]:
        """The fields that apply to this model kind, ready for JSON."""
        out: dict[str, Any] = {}
        if self.index is not None:
            out.update(label=self.label, class_index=self.index, score=self.score)
            if len(self.top_k) > 1:
                out["top_k"] = [{"label": label, "score": score} for label, score in self.top_k]
        if self.anomaly_score is not None:
            out.update(anomaly_score=self.anomaly_score, anomaly=self.anomaly)
        if self.detections is not None:
            out["detections"] = list(self.detections)
        return out


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max()
    exp = np.exp(shifted)
    result: np.ndarray = exp / exp.sum()
    return result


BOX_DECIMALS = 5
"""A detection's normalised coordinates are rounded to this many places: 0.04 pixels of a 4K frame's width."""


def interpret(
    post: Postprocess,
    inputs: Sequence[np.ndarray],
    outputs: Sequence[np.ndarray],
    *,
    top_k: int = 1,
    geometry: Geometry | None = None,
    overrides: Mapping[str, float] | None = None,
) -> Interpretation:
    """Interpret one sample's float outputs (batch 1) according to the manifest's postprocess. A detector's boxes
    are mapped to the frame through ``geometry`` (where the frame landed in the input: letterbox undone), or
    normalised to the input without one; ``overrides`` replaces its ``score_threshold``, ``iou_threshold``,
    ``max_detections``."""
    if post.kind == "detect":
        return _detections(post, outputs, geometry, overrides or {})
    if post.kind == "classify":
        row = outputs[0].reshape(-1).astype(np.float64)
        labels = post.labels

        def name(index: int) -> str:
            return labels[index] if labels else str(index)

        # Ranked by output (softmax keeps the order, but its rounding could give near outputs one score): the
        # first of equal outputs wins, by argmax or a stable sort.
        if top_k <= 1:  # softmax's score of the best class is 1 / sum(exp(row - best)), in place
            best = int(row.argmax())
            if post.score == "softmax":
                np.subtract(row, row[best], out=row)
                score = 1.0 / float(np.add.reduce(np.exp(row, out=row)))
            else:
                score = float(row[best])
            label = name(best)
            return Interpretation(label=label, index=best, score=score, top_k=((label, score),))
        scores = softmax(row) if post.score == "softmax" else row
        order = np.argsort(-row, kind="stable")[:top_k].tolist()
        best = order[0]
        return Interpretation(
            label=name(best),
            index=best,
            score=float(scores[best]),
            top_k=tuple((name(i), float(scores[i])) for i in order),
        )
    if post.kind == "anomaly":
        assert post.threshold is not None  # the manifest validator guarantees it
        if post.anomaly_score == "reconstruction":
            error = inputs[0].reshape(-1).astype(np.float64) - outputs[0].reshape(-1).astype(np.float64)
            score = float(np.mean(error * error))
        else:
            score = float(outputs[0].reshape(-1)[0])
        return Interpretation(anomaly_score=score, anomaly=score > post.threshold)
    return Interpretation()


DETECTION_OVERRIDES = ("score_threshold", "iou_threshold", "max_detections")


def frame_detections(
    post: Postprocess, output: np.ndarray, geometry: Geometry | None, overrides: Mapping[str, float] | None = None
) -> Detections:
    """A detector's output 0 decoded, thresholded and suppressed by the manifest's settings (``overrides`` over
    them), its boxes x1, y1, x2, y2 normalised to the frame through ``geometry`` (the letterbox undone), or to the
    input without one."""
    settings = post.detection
    assert settings is not None  # the manifest's validator guarantees it
    overrides = overrides or {}
    unknown = set(overrides) - set(DETECTION_OVERRIDES)
    if unknown:
        raise ValueError(f"unknown detection override(s): {', '.join(sorted(unknown))}")
    found = detect(
        output,
        settings.as_head(),
        settings.input_size,
        score_threshold=float(overrides.get("score_threshold", settings.score_threshold)),
        iou_threshold=float(overrides.get("iou_threshold", settings.iou_threshold)),
        max_detections=int(overrides.get("max_detections", settings.max_detections)),
        pre_nms_top_k=settings.pre_nms_top_k,
    )
    if geometry is not None:
        boxes = geometry.to_frame(found.boxes)
    else:
        height, width = settings.input_size
        boxes = np.clip(found.boxes.astype(np.float64) / [width, height, width, height], 0.0, 1.0)
    return Detections(boxes, found.scores, found.classes)


def _detections(
    post: Postprocess, outputs: Sequence[np.ndarray], geometry: Geometry | None, overrides: Mapping[str, float]
) -> Interpretation:
    found = frame_detections(post, outputs[0], geometry, overrides)
    labels = post.labels
    answers = []
    for box, kind, score in zip(np.round(found.boxes, BOX_DECIMALS).tolist(), found.classes.tolist(),
                                found.scores.tolist(), strict=True):  # fmt: skip
        label = labels[kind] if labels is not None and 0 <= kind < len(labels) else str(kind)
        answers.append({"box": box, "class_index": kind, "label": label, "score": score})
    return Interpretation(detections=tuple(answers))
