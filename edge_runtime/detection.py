"""Object detection without torch: a detector's raw output read by its head's layout, class-aware non-maximum
suppression with ONNX's semantics, and COCO's mean average precision.

A head says how the output holds its candidates (``HEADS``; any other layout by ``Head``'s fields):

    yolov8    (1, 4+C, N)  cx, cy, w, h in input pixels, then C class scores (already sigmoid), no objectness
    yolov5    (1, N, 5+C)  cx, cy, w, h, objectness, then C class scores
    end2end   (1, M, 6)    x1, y1, x2, y2, score, class: suppression already done in the model, never done twice

NMS follows ONNX's ``NonMaxSuppression`` as onnxruntime computes it (tests hold it equal on random boxes): per class,
in descending score order, a box is suppressed when its IoU with a kept box of its class is strictly greater than the
threshold; IoU in float32 from each box's corners, zero for boxes that do not overlap or have no area. Kept boxes come
out in descending score order, at most ``max_detections`` of them: the first ``max_detections`` a class-aware pass in
global score order keeps, which is what per-class NMS, merged by score and capped, keeps.

mAP is COCO's (``pycocotools``' ``COCOeval`` for boxes, area range "all", 100 detections per image and class): a
detection matches the unmatched truth of its class with the highest IoU at or above the threshold; precision is
interpolated at 101 recall points; classes without a truth are left out of the mean. Tests hold it equal to
pycocotools on random cases.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

import numpy as np

from edgeline.errors import EdgelineError

__all__ = [
    "HEADS",
    "Detections",
    "Head",
    "MeanAveragePrecision",
    "check_output",
    "decode",
    "detect",
    "head_from_config",
    "mean_average_precision",
    "nms",
]

Layout = Literal["attributes-first", "boxes-first", "end2end"]
BoxFormat = Literal["xywh", "xyxy", "yxyx"]
BoxSpace = Literal["pixels", "normalised"]
Activation = Literal["none", "sigmoid"]

LAYOUTS: tuple[Layout, ...] = ("attributes-first", "boxes-first", "end2end")
BOX_FORMATS: tuple[BoxFormat, ...] = ("xywh", "xyxy", "yxyx")
BOX_SPACES: tuple[BoxSpace, ...] = ("pixels", "normalised")
ACTIVATIONS: tuple[Activation, ...] = ("none", "sigmoid")

SCORE_THRESHOLD = 0.25
"""Answers' default: a candidate scoring at or under it is no detection (Ultralytics' ``conf`` default)."""
IOU_THRESHOLD = 0.45
"""Answers' default: boxes of one class overlapping by more are one object (YOLOv5's ``iou_thres``)."""
MAX_DETECTIONS = 100
"""Answers' default, and COCO's ``maxDets``."""
PRE_NMS_TOP_K = 1000
"""Candidates kept for NMS, the best by score: bounds its work on a model that scores everything high."""
EVALUATION_SCORE_THRESHOLD = 0.001
"""mAP's: nearly every candidate counts, as COCO evaluations run (a threshold would cut the recall curve short)."""


@dataclass(frozen=True)
class Head:
    """How a detector's output 0 holds its candidates (see the module)."""

    name: str
    layout: Layout
    box_format: BoxFormat = "xywh"
    box_space: BoxSpace = "pixels"
    objectness: bool = False
    score_activation: Activation = "none"
    has_nms: bool = False

    @property
    def shape_text(self) -> str:
        """The output's shape in words, for errors."""
        if self.layout == "end2end":
            return "(1, M, 6): x1, y1, x2, y2, score, class per row"
        attributes = "5+C" if self.objectness else "4+C"
        what = f"{self.box_format} box, {'objectness, ' if self.objectness else ''}C class scores"
        if self.layout == "attributes-first":
            return f"(1, {attributes}, N): {what} per column"
        return f"(1, N, {attributes}): {what} per row"

    @property
    def attributes(self) -> int:
        """Values per candidate before the class scores."""
        return 4 + int(self.objectness)


HEADS: dict[str, Head] = {
    "yolov8": Head("yolov8", "attributes-first"),
    "yolov5": Head("yolov5", "boxes-first", objectness=True),
    "end2end": Head("end2end", "end2end", box_format="xyxy", has_nms=True),
}

_CHOICES: dict[str, tuple[str, ...]] = {
    "layout": LAYOUTS,
    "box_format": BOX_FORMATS,
    "box_space": BOX_SPACES,
    "score_activation": ACTIVATIONS,
}


def head_from_config(config: Mapping[str, Any], where: str = "the export config") -> Head:
    """A head from ``head`` (a name of ``HEADS``, the base) and any of ``layout``, ``box_format``, ``box_space``,
    ``objectness``, ``score_activation``, ``has_nms`` over it; without ``head``, ``layout`` is required."""
    known = {f.name for f in fields(Head)} - {"name"}
    unknown = sorted(set(config) - known - {"head"})
    if unknown:
        raise EdgelineError(f"{where}: unknown detection head key(s) {', '.join(unknown)}; "
                            f"known: head, {', '.join(sorted(known))}")  # fmt: skip
    base_name = config.get("head")
    if base_name is not None:
        if not isinstance(base_name, str) or base_name not in HEADS:
            raise EdgelineError(f"{where}: unknown head {base_name!r}; known: {', '.join(HEADS)}")
        head = HEADS[base_name]
    elif "layout" in config:
        head = Head("custom", "boxes-first")  # the layout is among the changes below
    else:
        raise EdgelineError(f"{where}: a detection head needs 'head' ({', '.join(HEADS)}) or a 'layout' "
                            f"({', '.join(LAYOUTS)})")  # fmt: skip
    changes: dict[str, Any] = {}
    for key in sorted(known & set(config)):
        value = config[key]
        if key in _CHOICES and value not in _CHOICES[key]:
            raise EdgelineError(f"{where}: {key} = {value!r} is not one of {', '.join(_CHOICES[key])}")
        if key in ("objectness", "has_nms") and not isinstance(value, bool):
            raise EdgelineError(f"{where}: {key} must be true or false, not {value!r}")
        changes[key] = value
    if changes:
        head = replace(head, name="custom", **changes)
    if head.layout == "end2end" and not head.has_nms:
        raise EdgelineError(f"{where}: layout 'end2end' is a model that suppresses its own boxes: has_nms is true")
    return head


def check_output(head: Head, shape: Sequence[int], classes: int | None = None, *, where: str = "output 0") -> int:
    """The number of classes ``head`` reads from an output of ``shape``; ``EdgelineError`` in one line saying what
    the shape says when the head does not fit it (with ``classes``, e.g. from the labels, the count must agree)."""
    shape = tuple(int(d) for d in shape)
    declared = f"head {head.name} expects {where} of shape {head.shape_text}"
    if len(shape) != 3 or shape[0] != 1:
        raise EdgelineError(f"{declared}; the model's is {shape}, not one batch of candidates")
    if head.layout == "end2end":
        if shape[2] != 6:
            raise EdgelineError(f"{declared}; the model's is {shape}: {shape[2]} values per row, not 6"
                                f"{_hint(head, shape, classes)}")  # fmt: skip
        return classes if classes is not None else 0
    attributes, boxes = (shape[1], shape[2]) if head.layout == "attributes-first" else (shape[2], shape[1])
    found = attributes - head.attributes
    if found < 1:
        raise EdgelineError(f"{declared}; the model's is {shape}: {attributes} values per candidate leave no class "
                            f"score{_hint(head, shape, classes)}")  # fmt: skip
    if classes is not None and found != classes:
        raise EdgelineError(f"{declared}; the model's is {shape}: {found} class scores per candidate, but there are "
                            f"{classes} labels{_hint(head, shape, classes)}")  # fmt: skip
    if classes is None and attributes > boxes:
        raise EdgelineError(f"{declared}; the model's is {shape}: {boxes} candidates of {attributes} values each "
                            f"({found} classes) reads the wrong axis{_hint(head, shape, classes)}")  # fmt: skip
    return found


def _hint(head: Head, shape: tuple[int, ...], classes: int | None) -> str:
    """``": it reads as --head X"`` when another of ``HEADS`` fits ``shape`` (and ``classes``) as it is."""
    fits = []
    for name, other in HEADS.items():
        if other.layout == head.layout and other.objectness == head.objectness:
            continue
        if other.layout == "end2end":
            if shape[2] == 6:
                fits.append(name)
            continue
        attributes, boxes = (shape[1], shape[2]) if other.layout == "attributes-first" else (shape[2], shape[1])
        found = attributes - other.attributes
        if found >= 1 and (found == classes if classes is not None else attributes <= boxes):
            fits.append(name)
    return f": it reads as --head {' or '.join(fits)}" if fits else ""


@dataclass(frozen=True)
class Detections:
    """Kept boxes in descending score order: ``boxes`` (K, 4) x1, y1, x2, y2 (input pixels, or the frame's
    normalised coordinates once mapped), ``scores`` (K,), ``classes`` (K,) int."""

    boxes: np.ndarray
    scores: np.ndarray
    classes: np.ndarray

    def __len__(self) -> int:
        return int(self.scores.shape[0])


def _sigmoid(values: np.ndarray) -> np.ndarray:
    out: np.ndarray = 0.5 * (np.tanh(0.5 * values) + 1.0)  # no overflow for large negative logits
    return out.astype(np.float32, copy=False)


def _corners(raw: np.ndarray, box_format: BoxFormat) -> np.ndarray:
    if box_format == "xywh":
        half = raw[:, 2:4] / 2
        return np.concatenate([raw[:, 0:2] - half, raw[:, 0:2] + half], axis=1)
    if box_format == "yxyx":
        return raw[:, [1, 0, 3, 2]]
    return raw


def decode(output: np.ndarray, head: Head, input_size: tuple[int, int]) -> Detections:
    """Every candidate of ``output`` (checked by ``check_output``): boxes x1, y1, x2, y2 in input pixels
    (``input_size`` is height, width), each candidate's best class and its score (objectness times it when the head
    has one; a candidate with a NaN score has a NaN score). Not filtered, not suppressed, in the output's order."""
    return _decoded(output, head, input_size, None, None)


def _decoded(
    output: np.ndarray, head: Head, input_size: tuple[int, int], threshold: float | None, top_k: int | None
) -> Detections:
    """``decode``'s candidates, or with ``threshold`` only those scoring over it (finite), the best ``top_k`` of them
    in the output's order. Scores come first: the best class's score is a row-wise maximum, then the class and the
    box are found for the candidates kept only (an argmax over 80 classes of 8,400 candidates costs five times the
    maximum)."""
    output = np.asarray(output, dtype=np.float32)
    check_output(head, output.shape)
    height, width = input_size
    if head.layout == "end2end":
        rows = output[0]
        scores = rows[:, 4]
        if head.score_activation == "sigmoid":
            scores = _sigmoid(scores)
        kinds = rows[:, 5]
        valid = np.isfinite(kinds) & (np.abs(kinds) < 2**31)
        scores = np.where(valid, scores, np.float32(np.nan))  # a row without a class is no detection
        chosen = _chosen(scores, threshold, top_k)
        boxes = _corners(rows[chosen, 0:4], head.box_format)
        classes = np.rint(kinds[chosen]).astype(np.int64)
        scores = scores[chosen]
    else:
        # (A, N): each attribute a contiguous row (a maximum down the rows is vectorised; across a transposed view
        # it reads memory out of order)
        columns = output[0] if head.layout == "attributes-first" else np.ascontiguousarray(output[0].T)
        class_scores = columns[head.attributes :]
        scores = class_scores.max(axis=0)  # NaN anywhere in a column makes its maximum NaN
        if head.score_activation == "sigmoid":  # monotonic: the sigmoid of the maximum is the maximum's
            scores = _sigmoid(scores)
        if head.objectness:
            objectness = columns[4]
            scores = scores * (_sigmoid(objectness) if head.score_activation == "sigmoid" else objectness)
        chosen = _chosen(scores, threshold, top_k)
        classes = np.argmax(class_scores[:, chosen], axis=0).astype(np.int64)
        boxes = _corners(columns[0:4, chosen].T, head.box_format)
        scores = scores[chosen]
    boxes = np.ascontiguousarray(boxes, dtype=np.float32)
    if head.box_space == "normalised":
        boxes = boxes * np.asarray([width, height, width, height], dtype=np.float32)
    return Detections(boxes, np.ascontiguousarray(scores, dtype=np.float32), classes)


def _chosen(scores: np.ndarray, threshold: float | None, top_k: int | None) -> np.ndarray | slice:
    if threshold is None:
        return slice(None)
    chosen = np.flatnonzero(np.isfinite(scores) & (scores > np.float32(threshold)))
    if top_k is not None and chosen.size > top_k:
        best = np.argpartition(-scores[chosen], top_k - 1)[:top_k]
        chosen = np.sort(chosen[best])
    return chosen


def nms(boxes: np.ndarray, scores: np.ndarray, classes: np.ndarray, iou_threshold: float,
        max_detections: int | None = None) -> np.ndarray:  # fmt: skip
    """Indices of the boxes class-aware NMS keeps (see the module), in descending score order. ``boxes`` are
    (N, 4) corners (any diagonal pair), ``scores`` (N,), ``classes`` (N,)."""
    if not 0.0 <= iou_threshold <= 1.0:
        raise ValueError(f"iou_threshold must be in [0, 1], not {iou_threshold}")
    boxes = np.asarray(boxes, dtype=np.float32).reshape(-1, 4)
    count = boxes.shape[0]
    if count == 0 or max_detections == 0:
        return np.zeros(0, dtype=np.int64)
    order = np.argsort(-np.asarray(scores, dtype=np.float32), kind="stable")
    ordered = boxes[order]
    x1 = np.minimum(ordered[:, 0], ordered[:, 2])
    x2 = np.maximum(ordered[:, 0], ordered[:, 2])
    y1 = np.minimum(ordered[:, 1], ordered[:, 3])
    y2 = np.maximum(ordered[:, 1], ordered[:, 3])
    areas = (x2 - x1) * (y2 - y1)
    kinds = np.asarray(classes)[order]
    threshold = np.float32(iou_threshold)
    alive = np.ones(count, dtype=bool)
    kept: list[int] = []
    limit = count if max_detections is None else min(count, int(max_detections))
    for i in range(count):  # each box once; the vector work is done only for the kept, at most ``limit``
        if not alive[i]:
            continue
        kept.append(i)
        if len(kept) >= limit:
            break
        rest = np.flatnonzero(alive[i + 1 :] & (kinds[i + 1 :] == kinds[i])) + i + 1
        if rest.size == 0:
            continue
        width = np.minimum(x2[i], x2[rest]) - np.maximum(x1[i], x1[rest])
        height = np.minimum(y2[i], y2[rest]) - np.maximum(y1[i], y1[rest])
        inter = width * height
        union = (areas[i] + areas[rest]) - inter
        overlapping = (width > 0) & (height > 0) & (inter > 0) & (areas[i] > 0) & (areas[rest] > 0) & (union > 0)
        with np.errstate(divide="ignore", invalid="ignore"):
            suppressed = overlapping & (inter / np.where(overlapping, union, np.float32(1)) > threshold)
        alive[rest[suppressed]] = False
    result: np.ndarray = order[np.asarray(kept, dtype=np.int64)]
    return result


def detect(
    output: np.ndarray,
    head: Head,
    input_size: tuple[int, int],
    *,
    score_threshold: float = SCORE_THRESHOLD,
    iou_threshold: float = IOU_THRESHOLD,
    max_detections: int = MAX_DETECTIONS,
    pre_nms_top_k: int = PRE_NMS_TOP_K,
) -> Detections:
    """``decode``, then the candidates scoring over ``score_threshold``, the best ``pre_nms_top_k`` of them, then
    ``nms`` (never on a head that has it in the model: there only the threshold and the cap), at most
    ``max_detections`` boxes, best first."""
    found = _decoded(output, head, input_size, score_threshold, pre_nms_top_k)
    boxes, scores, classes = found.boxes, found.scores, found.classes
    if head.has_nms:
        keep = np.argsort(-scores, kind="stable")[:max_detections]
    else:
        keep = nms(boxes, scores, classes, iou_threshold, max_detections)
    return Detections(boxes[keep], scores[keep], classes[keep])


# -- mean average precision ------------------------------------------------------------------------------------------

IOU_THRESHOLDS = np.linspace(0.5, 0.95, 10)
"""COCO's: 0.50, 0.55, ..., 0.95 (mAP@0.5:0.95 averages over them)."""
RECALL_POINTS = np.linspace(0.0, 1.0, 101)
COCO_MAX_DETECTIONS = 100


@dataclass(frozen=True)
class MeanAveragePrecision:
    """COCO's figures: ``map50`` (IoU 0.5), ``map50_95`` (mean over ``IOU_THRESHOLDS``), ``per_class`` AP@0.5 of
    each class with a truth, ``truths`` and ``detections`` counted."""

    map50: float
    map50_95: float
    per_class: dict[int, float]
    truths: int
    detections: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "map50": self.map50,
            "map50_95": self.map50_95,
            "per_class_ap50": {str(k): v for k, v in sorted(self.per_class.items())},
            "truths": self.truths,
            "detections": self.detections,
        }


def _ordered(boxes: np.ndarray) -> np.ndarray:
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    return np.concatenate([np.minimum(boxes[:, :2], boxes[:, 2:]), np.maximum(boxes[:, :2], boxes[:, 2:])], axis=1)


def _box_iou(detections: np.ndarray, truths: np.ndarray) -> np.ndarray:
    """(D, T) IoU of boxes by their corners (either order) in float64, as COCO's ``bbIou`` computes it (width and
    height, no +1). COCO leaves a detection of negative width or height out when it matches nothing; here such a box
    is read by its corners, as NMS reads it."""
    d = _ordered(detections)[:, None, :]
    t = _ordered(truths)[None, :, :]
    width = np.clip(np.minimum(d[..., 2], t[..., 2]) - np.maximum(d[..., 0], t[..., 0]), 0.0, None)
    height = np.clip(np.minimum(d[..., 3], t[..., 3]) - np.maximum(d[..., 1], t[..., 1]), 0.0, None)
    inter = width * height
    union = ((d[..., 2] - d[..., 0]) * (d[..., 3] - d[..., 1]) + (t[..., 2] - t[..., 0]) * (t[..., 3] - t[..., 1])
             - inter)  # fmt: skip
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(union > 0, inter / np.where(union > 0, union, 1.0), 0.0)


def mean_average_precision(
    predictions: Sequence[Detections], truths: Sequence[tuple[np.ndarray, np.ndarray]]
) -> MeanAveragePrecision:
    """COCO's mAP of ``predictions`` (one ``Detections`` per image) against ``truths`` (per image: (T, 4) boxes
    x1, y1, x2, y2 in the same coordinates, (T,) classes)."""
    if len(predictions) != len(truths):
        raise ValueError(f"{len(predictions)} images of detections against {len(truths)} of truths")
    thresholds = IOU_THRESHOLDS.size
    scores_of: dict[int, list[np.ndarray]] = {}
    matched_of: dict[int, list[np.ndarray]] = {}
    truths_of: dict[int, int] = {}
    detections = 0
    for found, (true_boxes, true_classes) in zip(predictions, truths, strict=True):
        true_boxes = np.asarray(true_boxes, dtype=np.float64).reshape(-1, 4)
        true_classes = np.asarray(true_classes).reshape(-1).astype(np.int64)
        found_classes = np.asarray(found.classes).astype(np.int64)
        for kind in np.union1d(found_classes, true_classes).tolist():
            mine = np.flatnonzero(found_classes == kind)
            theirs = true_boxes[true_classes == kind]
            truths_of[kind] = truths_of.get(kind, 0) + theirs.shape[0]
            if mine.size == 0:
                continue
            mine = mine[np.argsort(-found.scores[mine], kind="mergesort")][:COCO_MAX_DETECTIONS]
            detections += mine.size
            matched = np.zeros((thresholds, mine.size), dtype=bool)
            if theirs.shape[0]:
                ious = _box_iou(np.asarray(found.boxes)[mine].reshape(-1, 4), theirs)
                best = ious.max(axis=1)
                for t, threshold in enumerate(IOU_THRESHOLDS):
                    floor = min(float(threshold), 1 - 1e-10)
                    taken = np.zeros(theirs.shape[0], dtype=bool)
                    for d in np.flatnonzero(best >= floor).tolist():  # best first; a box near no truth matches none
                        # the free truth of highest IoU (COCO: the last of equals)
                        free = np.where(~taken & (ious[d] >= floor), ious[d], -1.0)
                        if free.max() < 0:
                            continue
                        taken[free.size - 1 - int(np.argmax(free[::-1]))] = True
                        matched[t, d] = True
            scores_of.setdefault(kind, []).append(np.asarray(found.scores, dtype=np.float64)[mine])
            matched_of.setdefault(kind, []).append(matched)
    precision: dict[int, np.ndarray] = {}
    for kind, count in truths_of.items():
        if count == 0:
            continue
        if kind not in scores_of:
            precision[kind] = np.zeros(thresholds)
            continue
        scores = np.concatenate(scores_of[kind])
        order = np.argsort(-scores, kind="mergesort")
        matched = np.concatenate(matched_of[kind], axis=1)[:, order]
        true_positives = np.cumsum(matched, axis=1, dtype=np.float64)
        false_positives = np.cumsum(~matched, axis=1, dtype=np.float64)
        ap = np.zeros(thresholds)
        for t in range(thresholds):
            recall = true_positives[t] / count
            precise = true_positives[t] / (true_positives[t] + false_positives[t] + np.spacing(1))
            precise = np.maximum.accumulate(precise[::-1])[::-1]
            points = np.searchsorted(recall, RECALL_POINTS, side="left")
            ap[t] = np.where(points < precise.size, precise[np.minimum(points, precise.size - 1)], 0.0).mean()
        precision[kind] = ap
    if not precision:
        return MeanAveragePrecision(0.0, 0.0, {}, 0, detections)
    table = np.stack(list(precision.values()))
    return MeanAveragePrecision(
        map50=float(table[:, 0].mean()),
        map50_95=float(table.mean()),
        per_class={kind: float(ap[0]) for kind, ap in precision.items()},
        truths=sum(truths_of.values()),
        detections=detections,
    )
