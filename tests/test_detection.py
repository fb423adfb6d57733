"""edgeline.detection: heads read by their layout, wrong declarations refused in one line, NMS never run twice, and
mAP on cases whose answer is known by construction (tests/test_detection_oracles.py holds both to the ecosystem's)."""

from __future__ import annotations

import numpy as np
import pytest

from edgeline.detection import (
    HEADS,
    Detections,
    Head,
    check_output,
    decode,
    detect,
    head_from_config,
    mean_average_precision,
    nms,
)
from edgeline.errors import EdgelineError

pytestmark = pytest.mark.quick

# three objects, two classes, in a 96 x 128 (height x width) input: x1, y1, x2, y2
OBJECTS = np.asarray([[10, 12, 40, 50], [60, 20, 120, 70], [15, 60, 35, 90]], dtype=np.float32)
KINDS = np.asarray([0, 1, 0])
SIZE = (96, 128)


def candidates(rng: np.random.Generator, noise: int = 40) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per object a strong candidate and two weaker shifted copies, plus faint noise boxes: boxes, class scores."""
    boxes, scores = [], []
    for box, kind in zip(OBJECTS, KINDS, strict=True):
        for strength, shift in ((0.9, 0.0), (0.6, 2.0), (0.5, -1.5)):
            boxes.append(box + shift)
            row = np.full(2, 0.02, dtype=np.float32)
            row[kind] = strength
            scores.append(row)
    for _ in range(noise):
        corner = rng.uniform(0, 90, size=2)
        boxes.append(np.r_[corner, corner + rng.uniform(4, 30, size=2)])
        scores.append(rng.uniform(0, 0.1, size=2))
    return np.asarray(boxes, np.float32), np.asarray(scores, np.float32), np.arange(len(boxes))


def xywh(boxes: np.ndarray) -> np.ndarray:
    return np.concatenate([(boxes[:, :2] + boxes[:, 2:]) / 2, boxes[:, 2:] - boxes[:, :2]], axis=1)


def assert_found_the_objects(found: Detections) -> None:
    assert len(found) == 3
    order = np.argsort(found.boxes[:, 0])
    np.testing.assert_allclose(found.boxes[order], OBJECTS[np.argsort(OBJECTS[:, 0])], atol=1e-4)
    assert found.classes[order].tolist() == KINDS[np.argsort(OBJECTS[:, 0])].tolist()
    assert np.all(np.diff(found.scores) <= 0)


def test_a_yolov8_output_gives_each_object_once() -> None:
    boxes, scores, _ = candidates(np.random.default_rng(0))
    output = np.concatenate([xywh(boxes), scores], axis=1).T[None]  # (1, 4+C, N)
    assert output.shape == (1, 6, len(boxes))
    assert_found_the_objects(detect(output, HEADS["yolov8"], SIZE))


def test_a_yolov5_output_multiplies_objectness_into_the_score() -> None:
    boxes, scores, _ = candidates(np.random.default_rng(1))
    objectness = np.full((len(boxes), 1), 0.5, dtype=np.float32)
    objectness[:9] = 1.0
    output = np.concatenate([xywh(boxes), objectness, scores], axis=1)[None]  # (1, N, 5+C)
    found = detect(output, HEADS["yolov5"], SIZE)
    assert_found_the_objects(found)
    assert found.scores.max() == pytest.approx(0.9)
    decoded = decode(output, HEADS["yolov5"], SIZE)
    assert decoded.scores[1] == pytest.approx(0.6) and decoded.scores[-1] < 0.05 + 1e-6


def test_an_end2end_output_is_never_suppressed_again() -> None:
    """Two overlapping boxes of one class that the model kept (its own NMS said so) stay two detections."""
    rows = np.asarray([[10, 10, 50, 50, 0.9, 0], [12, 11, 52, 49, 0.8, 0], [0, 0, 5, 5, 0.1, 1], [0, 0, 0, 0, 0, 0]],
                      dtype=np.float32)[None]  # fmt: skip
    found = detect(rows, HEADS["end2end"], SIZE)
    assert len(found) == 2 and found.classes.tolist() == [0, 0]
    assert len(nms(found.boxes, found.scores, found.classes, 0.45)) == 1  # a second NMS would have lost one


@pytest.mark.parametrize(("box_format", "space"), [("xyxy", "pixels"), ("yxyx", "normalised"), ("xywh", "normalised")])
def test_a_layout_declared_by_keys_reads_its_boxes(box_format: str, space: str) -> None:
    boxes, scores, _ = candidates(np.random.default_rng(2))
    raw = {"xyxy": boxes, "yxyx": boxes[:, [1, 0, 3, 2]], "xywh": xywh(boxes)}[box_format]
    if space == "normalised":
        raw = raw / np.asarray([SIZE[1], SIZE[0]] * 2 if box_format != "yxyx" else [SIZE[0], SIZE[1]] * 2, np.float32)
    logits = np.log(scores / (1 - scores))  # the head applies the sigmoid itself
    output = np.concatenate([raw, logits], axis=1)[None]
    head = head_from_config({"layout": "boxes-first", "box_format": box_format, "box_space": space,
                             "score_activation": "sigmoid"})  # fmt: skip
    assert head == Head("custom", "boxes-first", box_format, space, False, "sigmoid", False)  # type: ignore[arg-type]
    assert_found_the_objects(detect(output, head, SIZE))


def test_thresholds_and_the_cap_are_the_caller_s() -> None:
    boxes, scores, _ = candidates(np.random.default_rng(3))
    output = np.concatenate([xywh(boxes), scores], axis=1).T[None]
    head = HEADS["yolov8"]
    assert len(detect(output, head, SIZE, max_detections=2)) == 2
    assert len(detect(output, head, SIZE, score_threshold=0.95)) == 0
    # with suppression off (IoU must exceed 1), every candidate over the threshold is kept
    assert len(detect(output, head, SIZE, iou_threshold=1.0)) == 9
    assert len(detect(output, head, SIZE, score_threshold=0.55, pre_nms_top_k=4)) == 3


def test_nan_scores_are_no_detection() -> None:
    boxes, scores, _ = candidates(np.random.default_rng(4))
    scores[0] = np.nan
    output = np.concatenate([xywh(boxes), scores], axis=1).T[None]
    found = detect(output, HEADS["yolov8"], SIZE)
    assert np.isfinite(found.scores).all() and len(found) == 3


@pytest.mark.parametrize(
    ("head", "shape", "classes", "expected"),
    [
        ("yolov8", (1, 8400, 84), None, "reads the wrong axis: it reads as --head yolov5"),
        ("yolov8", (1, 84, 8400), 3, "80 class scores per candidate, but there are 3 labels"),
        ("yolov5", (1, 85, 8400), None, "reads the wrong axis: it reads as --head yolov8"),
        ("yolov5", (1, 8400, 5), None, "5 values per candidate leave no class score"),
        ("end2end", (1, 84, 8400), None, "8400 values per row, not 6: it reads as --head yolov8"),
        ("yolov8", (84, 8400), None, "not one batch of candidates"),
        ("yolov8", (2, 84, 8400), None, "not one batch of candidates"),
    ],
)
def test_a_wrong_head_is_refused_in_one_line_saying_what_the_shape_says(
    head: str, shape: tuple[int, ...], classes: int | None, expected: str
) -> None:
    with pytest.raises(EdgelineError) as caught:
        check_output(HEADS[head], shape, classes)
    text = str(caught.value)
    assert expected in text and f"head {head} expects output 0 of shape" in text and "\n" not in text


def test_a_right_head_counts_the_classes() -> None:
    assert check_output(HEADS["yolov8"], (1, 84, 8400)) == 80
    assert check_output(HEADS["yolov5"], (1, 25200, 85), 80) == 80
    assert check_output(HEADS["end2end"], (1, 300, 6), 80) == 80


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"head": "yolov9"}, "unknown head 'yolov9'; known: yolov8, yolov5, end2end"),
        ({"head": ["yolov8"]}, "unknown head ['yolov8']; known: yolov8"),
        ({"box_format": "xyxy"}, "needs 'head' (yolov8, yolov5, end2end) or a 'layout'"),
        ({"layout": "columns"}, "layout = 'columns' is not one of attributes-first, boxes-first, end2end"),
        ({"head": "yolov8", "box_space": "percent"}, "box_space = 'percent' is not one of pixels, normalised"),
        ({"head": "yolov8", "objectness": "yes"}, "objectness must be true or false, not 'yes'"),
        ({"head": "yolov8", "anchors": 3}, "unknown detection head key(s) anchors"),
        ({"layout": "end2end", "has_nms": False}, "layout 'end2end' is a model that suppresses its own boxes"),
    ],
)
def test_a_broken_head_declaration_is_refused_naming_the_key(config: dict[str, object], expected: str) -> None:
    with pytest.raises(EdgelineError, match=r"^export\.toml: ") as caught:
        head_from_config(config, "export.toml")
    assert expected in str(caught.value)


def test_a_named_head_with_changes_is_that_head_changed() -> None:
    assert head_from_config({"head": "yolov5"}) is HEADS["yolov5"]
    changed = head_from_config({"head": "yolov8", "score_activation": "sigmoid"})
    assert (changed.layout, changed.score_activation, changed.name) == ("attributes-first", "sigmoid", "custom")


def test_map_is_one_for_the_truth_and_zero_for_nothing() -> None:
    truths = [(OBJECTS, KINDS), (OBJECTS[:1], KINDS[:1])]
    perfect = [Detections(OBJECTS, np.asarray([0.9, 0.8, 0.7]), KINDS), Detections(OBJECTS[:1], np.ones(1), KINDS[:1])]
    result = mean_average_precision(perfect, truths)
    assert (result.map50, result.map50_95) == pytest.approx((1.0, 1.0)) and (result.truths, result.detections) == (4, 4)
    empty = Detections(np.zeros((0, 4)), np.zeros(0), np.zeros(0, np.int64))
    assert mean_average_precision([empty, empty], truths).map50 == 0.0


def test_map_at_half_overlap_counts_at_50_not_above() -> None:
    """A box shifted so that its IoU with the truth is 0.58 is a hit at 0.50 and 0.55 and a miss above: mAP@0.5 is 1,
    mAP@0.5:0.95 two tenths."""
    truth = np.asarray([[0.0, 0.0, 100.0, 100.0]])
    shift = 100 * (1 - 0.58) / (1 + 0.58)  # IoU of two 100-wide squares offset by s along x: (100-s)/(100+s)
    found = Detections(truth + np.asarray([shift, 0, shift, 0]), np.ones(1), np.zeros(1, np.int64))
    result = mean_average_precision([found], [(truth, np.zeros(1, np.int64))])
    assert result.map50 == pytest.approx(1.0) and result.map50_95 == pytest.approx(0.2)


def test_nms_suppresses_only_over_the_threshold_and_only_within_a_class() -> None:
    square = np.asarray([0.0, 0.0, 10.0, 10.0], np.float32)
    half = square + np.asarray([5, 0, 5, 0], np.float32)  # IoU 1/3 with square
    boxes = np.stack([square, half, half])
    assert nms(boxes, np.asarray([0.9, 0.8, 0.7]), np.asarray([0, 0, 1]), 1 / 3).tolist() == [0, 1, 2]
    assert nms(boxes, np.asarray([0.9, 0.8, 0.7]), np.asarray([0, 0, 1]), 0.3).tolist() == [0, 2]
    assert nms(boxes, np.asarray([0.9, 0.8, 0.7]), np.asarray([0, 0, 0]), 0.3).tolist() == [0]
    with pytest.raises(ValueError, match="iou_threshold"):
        nms(boxes, np.ones(3), np.zeros(3), 1.5)


def test_the_export_command_offers_exactly_the_heads_detection_knows() -> None:
    from edgeline.export.cli import HEAD_NAMES  # kept apart so that registering the command imports no numpy

    assert sorted(HEAD_NAMES) == sorted(HEADS)


def test_the_run_flags_name_exactly_the_settings_an_answer_may_override() -> None:
    from edgeline.arguments import DETECTION_FLAGS  # kept apart so that registering the commands imports no numpy
    from edgeline.postprocess import DETECTION_OVERRIDES

    assert DETECTION_FLAGS == DETECTION_OVERRIDES
