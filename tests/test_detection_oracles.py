"""edgeline.detection held equal to the ecosystem's own: NMS to onnxruntime's ``NonMaxSuppression``, mAP to
pycocotools' ``COCOeval``, each on seeded random cases (clustered boxes, so that suppression and matching decide)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from edgeline import detection
from edgeline.detection import Detections, mean_average_precision, nms

pytestmark = pytest.mark.quick


def clustered_boxes(rng: np.random.Generator, count: int, *, spread: float = 12.0) -> np.ndarray:
    """x1, y1, x2, y2 around a few centres, some with swapped corners and some without area."""
    centres = rng.uniform(20, 300, size=(max(1, count // 12), 2))
    picked = centres[rng.integers(0, len(centres), size=count)] + rng.normal(0, spread, size=(count, 2))
    sizes = rng.uniform(4, 60, size=(count, 2))
    boxes = np.concatenate([picked - sizes / 2, picked + sizes / 2], axis=1).astype(np.float32)
    swapped = rng.random(count) < 0.1
    boxes[swapped] = boxes[swapped][:, [2, 3, 0, 1]]
    flat = rng.random(count) < 0.03
    boxes[flat, 2] = boxes[flat, 0]
    return boxes


NmsRun = Callable[[np.ndarray, np.ndarray, int, float, float], np.ndarray]


def nms_session() -> NmsRun:
    """onnxruntime's ``NonMaxSuppression`` on one thread: ``run(boxes, scores, per_class, iou, floor)`` with boxes
    (1, N, 4) as y1, x1, y2, x2 (ONNX's ``center_point_box`` 0), scores (1, C, N), at most ``per_class`` kept per
    class, scores at or under ``floor`` left out; returns (K, 3) batch, class, box (benchmarks/detection.py too)."""
    import onnx
    import onnxruntime
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("NonMaxSuppression", ["boxes", "scores", "top", "iou", "floor"], ["selected"])],
        "nms",
        [
            helper.make_tensor_value_info("boxes", TensorProto.FLOAT, [1, None, 4]),
            helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, None, None]),
            helper.make_tensor_value_info("top", TensorProto.INT64, [1]),
            helper.make_tensor_value_info("iou", TensorProto.FLOAT, [1]),
            helper.make_tensor_value_info("floor", TensorProto.FLOAT, [1]),
        ],
        [helper.make_tensor_value_info("selected", TensorProto.INT64, [None, 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    onnx.checker.check_model(model)
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])

    def run(boxes: np.ndarray, scores: np.ndarray, per_class: int, iou: float, floor: float) -> np.ndarray:
        selected: np.ndarray = session.run(None, {
            "boxes": boxes, "scores": scores, "top": np.asarray([per_class], dtype=np.int64),
            "iou": np.asarray([iou], dtype=np.float32), "floor": np.asarray([floor], dtype=np.float32),
        })[0]  # fmt: skip
        return selected

    return run


def onnxruntime_nms(boxes: np.ndarray, scores: np.ndarray, classes: np.ndarray, iou: float, classes_count: int):
    """onnxruntime's selection: (class, box index) pairs in its order (by class, then score)."""
    table = np.full((1, classes_count, len(boxes)), -np.inf, dtype=np.float32)  # a box scores for its class only
    table[0, classes, np.arange(len(boxes))] = scores
    # every real score passes the floor, the -inf of other classes not
    selected = nms_session()(np.ascontiguousarray(boxes[None, :, [1, 0, 3, 2]]), table, len(boxes), iou, -1.0)
    return [(int(c), int(b)) for _, c, b in selected]


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("iou", [0.0, 0.3, 0.45, 0.7, 1.0])
def test_nms_keeps_what_onnxruntime_keeps(seed: int, iou: float) -> None:
    rng = np.random.default_rng(seed)
    count, classes_count = int(rng.integers(1, 400)), int(rng.integers(1, 5))
    boxes = clustered_boxes(rng, count)
    scores = rng.random(count, dtype=np.float32)
    classes = rng.integers(0, classes_count, size=count)
    theirs = onnxruntime_nms(boxes, scores, classes, iou, classes_count)
    mine = nms(boxes, scores, classes, iou)
    assert sorted(theirs) == sorted((int(classes[i]), int(i)) for i in mine)
    # ours is in descending score order; within a class that is onnxruntime's order too
    assert np.all(np.diff(scores[mine]) <= 0)
    by_class = {c: [int(i) for i in mine if classes[i] == c] for c in range(classes_count)}
    assert [(c, b) for c in range(classes_count) for b in by_class[c]] == theirs
    if 0 < iou < 1:
        assert len(mine) < count or count < 3  # the clusters overlap: something was suppressed


@pytest.mark.parametrize("seed", range(4))
def test_a_capped_nms_keeps_the_best_of_what_the_uncapped_keeps(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    boxes = clustered_boxes(rng, 600)
    scores = rng.random(600, dtype=np.float32)
    classes = rng.integers(0, 3, size=600)
    full = nms(boxes, scores, classes, 0.45)
    assert len(full) > 25
    assert nms(boxes, scores, classes, 0.45, max_detections=25).tolist() == full[:25].tolist()


def coco_map(predictions: list[Detections], truths: list[tuple[np.ndarray, np.ndarray]], classes: int):
    """pycocotools' COCOeval on the same boxes: (mAP@0.5:0.95, mAP@0.5)."""
    import contextlib
    import io

    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    def xywh(box: np.ndarray) -> list[float]:
        return [float(box[0]), float(box[1]), float(box[2] - box[0]), float(box[3] - box[1])]

    images = [{"id": i + 1, "width": 640, "height": 640} for i in range(len(truths))]
    annotations = []
    for i, (boxes, kinds) in enumerate(truths):
        for box, kind in zip(boxes, kinds, strict=True):
            width, height = float(box[2] - box[0]), float(box[3] - box[1])
            annotations.append({"id": len(annotations) + 1, "image_id": i + 1, "category_id": int(kind) + 1,
                                "bbox": xywh(box), "area": width * height, "iscrowd": 0})  # fmt: skip
    results = [
        {"image_id": i + 1, "category_id": int(kind) + 1, "bbox": xywh(box), "score": float(score)}
        for i, found in enumerate(predictions)
        for box, score, kind in zip(found.boxes, found.scores, found.classes, strict=True)
    ]
    with contextlib.redirect_stdout(io.StringIO()):
        truth = COCO()
        truth.dataset = {"info": {}, "images": images, "annotations": annotations,
                         "categories": [{"id": k + 1, "name": str(k)} for k in range(classes)]}  # fmt: skip
        truth.createIndex()
        found = truth.loadRes(results) if results else COCO()
        evaluation = COCOeval(truth, found, "bbox")
        evaluation.evaluate()
        evaluation.accumulate()
        evaluation.summarize()
    return float(evaluation.stats[0]), float(evaluation.stats[1])


def random_case(rng: np.random.Generator, images: int, classes: int):
    """Truths per image and detections near them (jittered, some of the wrong class), plus false alarms."""
    predictions, truths = [], []
    for _ in range(images):
        count = int(rng.integers(0, 8))
        centres = rng.uniform(60, 580, size=(count, 2))
        sizes = rng.uniform(10, 120, size=(count, 2))
        true_boxes = np.concatenate([centres - sizes / 2, centres + sizes / 2], axis=1)
        true_classes = rng.integers(0, classes, size=count)
        boxes, scores, kinds = [], [], []
        for box, size, kind in zip(true_boxes, sizes, true_classes, strict=True):
            for _ in range(int(rng.integers(0, 4))):  # duplicates: the second is a false positive
                moved = box + rng.normal(0, 0.15, size=4) * np.r_[size, size] * rng.random()
                boxes.append(np.r_[np.minimum(moved[:2], moved[2:]), np.maximum(moved[:2], moved[2:])])
                scores.append(rng.random())
                kinds.append(kind if rng.random() < 0.85 else rng.integers(0, classes))
        for _ in range(int(rng.integers(0, 5))):
            centre, size = rng.uniform(40, 600, size=2), rng.uniform(8, 90, size=2)
            boxes.append(np.r_[centre - size / 2, centre + size / 2])
            scores.append(rng.random())
            kinds.append(rng.integers(0, classes))
        found = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
        predictions.append(Detections(found, np.asarray(scores, dtype=np.float64), np.asarray(kinds, dtype=np.int64)))
        truths.append((true_boxes, true_classes))
    return predictions, truths


@pytest.mark.parametrize("seed", range(30))
def test_map_is_pycocotools(seed: int) -> None:
    rng = np.random.default_rng(seed)
    classes = int(rng.integers(1, 6))
    predictions, truths = random_case(rng, int(rng.integers(1, 25)), classes)
    mine = mean_average_precision(predictions, truths)
    theirs = coco_map(predictions, truths, classes)
    if mine.truths == 0:  # COCOeval reports -1 when nothing is there to find
        assert theirs == (-1.0, -1.0) and (mine.map50_95, mine.map50) == (0.0, 0.0)
        return
    assert mine.map50_95 == pytest.approx(theirs[0], abs=1e-12)
    assert mine.map50 == pytest.approx(theirs[1], abs=1e-12)


def test_more_than_a_hundred_detections_per_image_and_class_count_as_coco_counts_them() -> None:
    rng = np.random.default_rng(7)
    boxes = clustered_boxes(rng, 180, spread=40).astype(np.float64)
    boxes = np.concatenate([np.minimum(boxes[:, :2], boxes[:, 2:]), np.maximum(boxes[:, :2], boxes[:, 2:]) + 1], 1)
    truths = [(boxes[::3], np.zeros(60, dtype=np.int64))]
    predictions = [Detections(boxes + rng.normal(0, 1, boxes.shape), rng.random(180), np.zeros(180, np.int64))]
    mine = mean_average_precision(predictions, truths)
    assert mine.detections == detection.COCO_MAX_DETECTIONS
    theirs = coco_map(predictions, truths, 1)
    assert (mine.map50_95, mine.map50) == pytest.approx(theirs, abs=1e-12)
