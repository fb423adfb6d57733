"""A detector's answers: the manifest's ``postprocess.detection`` checked against output 0's shape, boxes mapped back
through the letterbox to the frame they came from (right on any frame size), per-run overrides, and the raw
candidates kept out of the answer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from edgeline.imaging import FramePrep, frame_geometry
from edgeline.manifest import Manifest
from edgeline.postprocess import interpret

pytestmark = pytest.mark.quick

BASE = Path(__file__).parent / "data" / "colour-fp32" / "manifest.json"
INPUT = 96
CLASSES = ("cat", "dog")


def manifest(**detection: Any) -> Manifest:
    """The committed colour bundle's manifest made a 96x96 letterboxing detector of (1, 6, 144) (YOLOv8's layout)."""
    document = json.loads(BASE.read_text(encoding="utf-8"))
    document["inputs"][0]["shape"] = [1, 3, INPUT, INPUT]
    document["outputs"][0]["shape"] = detection.pop("output_shape", [1, 4 + len(CLASSES), 144])
    document["image"].update(size=[INPUT, INPUT], resize="letterbox")
    settings = {"head": "yolov8", "layout": "attributes-first", "input_size": [INPUT, INPUT], **detection}
    document["postprocess"] = {"kind": "detect", "labels": list(CLASSES), "detection": settings}
    return Manifest.model_validate(document)


def output_with(boxes_xyxy: np.ndarray, classes: list[int], scores: list[float]) -> np.ndarray:
    """(1, 6, 144): the given candidates first, the rest faint."""
    output = np.zeros((1, 4 + len(CLASSES), 144), dtype=np.float32)
    output[0, 0:2, :] = 48.0
    output[0, 2:4, :] = 4.0
    output[0, 4:, :] = 0.01
    for i, (box, kind, score) in enumerate(zip(boxes_xyxy, classes, scores, strict=True)):
        output[0, 0:2, i] = (box[:2] + box[2:]) / 2
        output[0, 2:4, i] = box[2:] - box[:2]
        output[0, 4 + kind, i] = score
    return output


@pytest.mark.parametrize(("height", "width"), [(120, 200), (300, 100), (96, 96), (1080, 1920)])
def test_boxes_come_back_in_the_frame_s_own_coordinates_whatever_its_shape(height: int, width: int) -> None:
    found = manifest()
    geometry = frame_geometry(found.image, height, width)  # type: ignore[arg-type]
    assert geometry == FramePrep(found.image, found.inputs[0]).geometry(height, width)  # type: ignore[arg-type]
    wanted = np.asarray([[0.25, 0.25, 0.75, 0.75], [0.1, 0.6, 0.3, 0.95]])  # normalised to the frame
    in_input = geometry.to_input(wanted)
    answer = interpret(found.postprocess, [], [output_with(in_input, [1, 0], [0.9, 0.8])], geometry=geometry)
    detections = answer.as_dict()["detections"]
    assert [(d["label"], d["class_index"]) for d in detections] == [("dog", 1), ("cat", 0)]
    assert [d["score"] for d in detections] == pytest.approx([0.9, 0.8])
    np.testing.assert_allclose([d["box"] for d in detections], wanted, atol=1e-4)
    # within a pixel of the frame, on every frame size
    assert np.abs((np.asarray([d["box"] for d in detections]) - wanted) * [width, height, width, height]).max() < 1.0


def test_without_a_frame_boxes_are_normalised_to_the_input() -> None:
    found = manifest()
    box = np.asarray([[24.0, 48.0, 72.0, 96.0]])
    answer = interpret(found.postprocess, [], [output_with(box, [0], [0.7])]).as_dict()
    assert answer["detections"][0]["box"] == pytest.approx([0.25, 0.5, 0.75, 1.0])


def test_the_run_may_override_the_thresholds_and_the_cap() -> None:
    found = manifest(score_threshold=0.5, max_detections=5)
    boxes = np.asarray([[i * 10.0, 0.0, i * 10.0 + 8, 8.0] for i in range(8)])
    output = output_with(boxes, [0] * 8, [0.9, 0.8, 0.7, 0.6, 0.45, 0.4, 0.35, 0.3])
    assert len(interpret(found.postprocess, [], [output]).detections or ()) == 4
    looser = interpret(found.postprocess, [], [output], overrides={"score_threshold": 0.2})
    assert len(looser.detections or ()) == 5  # the manifest's cap
    capped = interpret(found.postprocess, [], [output], overrides={"score_threshold": 0.2, "max_detections": 2})
    assert [d["score"] for d in capped.detections or ()] == pytest.approx([0.9, 0.8])
    with pytest.raises(ValueError, match="unknown detection override"):
        interpret(found.postprocess, [], [output], overrides={"nms": 0.5})


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"output_shape": [1, 144, 6]}, "head yolov8 expects output 0 of shape (1, 4+C, N)"),
        ({"output_shape": [1, 9, 144]}, "5 class scores per candidate, but there are 2 labels"),
        ({"iou_threshold": 1.5}, "iou_threshold"),
        ({"input_size": [0, 96]}, "(height, width) must be 1..65535"),
        ({"layout": "diagonal"}, "layout"),
    ],
)
def test_a_detection_manifest_that_does_not_fit_its_model_is_refused(changes: dict[str, Any], expected: str) -> None:
    with pytest.raises(ValidationError) as caught:
        manifest(**changes)
    assert expected in str(caught.value)


def test_kind_detect_and_the_detection_table_go_together() -> None:
    document = json.loads(BASE.read_text(encoding="utf-8"))
    document["postprocess"] = {"kind": "detect"}
    with pytest.raises(ValidationError, match="kind 'detect' needs 'detection'"):
        Manifest.model_validate(document)
