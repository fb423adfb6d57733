"""A real detector bundle (the reference shapes detector, int8 through LiteRT) behind ``edgeline run --camera``: every
frame of a folder of non-square pictures answered once, its boxes the bundle's own in the frame's coordinates (the
letterbox undone) and where the objects are, and no raw candidates in the answers."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from edgeline.detection import Detections, mean_average_precision
from edgeline.imaging import FramePrep, read_image
from edgeline.model import load
from edgeline.postprocess import frame_detections
from tests.cache import cached_export, cached_reference

pytestmark = pytest.mark.export

FRAMES = 24
WIDTH, HEIGHT, LEFT = 160, 96, 40
"""Each held-out 96x96 picture pasted at x = 40 on a 160x96 grey frame: the letterbox has bands above and below."""


def _objects(label_file: Path) -> tuple[np.ndarray, np.ndarray]:
    """A YOLO label file's boxes as x1, y1, x2, y2 normalised to the 160x96 frame the picture was pasted on."""
    rows = np.loadtxt(label_file, ndmin=2).reshape(-1, 5)
    x1, y1 = rows[:, 1] - rows[:, 3] / 2, rows[:, 2] - rows[:, 4] / 2
    x2, y2 = rows[:, 1] + rows[:, 3] / 2, rows[:, 2] + rows[:, 4] / 2
    side = 96
    boxes = np.stack([(x1 * side + LEFT) / WIDTH, y1, (x2 * side + LEFT) / WIDTH, y2], axis=1)
    return boxes, rows[:, 0].astype(np.int64)


def test_a_detector_answers_every_frame_with_boxes_where_the_objects_are(tmp_path: Path) -> None:
    prepared = cached_reference("shapes")
    words = shlex.split(prepared.export_command())[3:]  # after "edgeline export MODEL"
    bundle = cached_export(prepared.model_path, *words, "--backend", "litert", "--precision", "int8-static")
    manifest = json.loads((bundle / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["postprocess"]["detection"]["box_space"] == "normalised"  # int8: divided in the model
    frames = tmp_path / "frames"
    frames.mkdir()
    pictures = sorted((prepared.validation_path / "images").iterdir())[:FRAMES]
    truths = []
    for index, picture in enumerate(pictures):
        canvas = np.full((HEIGHT, WIDTH, 3), 100, dtype=np.uint8)
        canvas[:, LEFT : LEFT + 96] = read_image(picture)
        Image.fromarray(canvas).save(frames / f"{index:03d}.png")
        truths.append(_objects(prepared.validation_path / "labels" / f"{picture.stem}.txt"))
    done = subprocess.run(
        [sys.executable, "-m", "edgeline.cli", "run", str(bundle), "--camera", f"belt={frames}", "--state-dir",
         str(tmp_path / "state")],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    answers: list[dict[str, Any]] = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [a["frame"] for a in answers] == list(range(FRAMES)), done.stderr[-2000:]
    assert all("outputs" not in a for a in answers)  # the boxes are the answer, not 144 x 8 raw candidates
    found = []
    for answer in answers:
        detections = answer["detections"]
        assert all(0.0 <= v <= 1.0 for d in detections for v in d["box"])
        assert all(d["label"] == manifest["postprocess"]["labels"][d["class_index"]] for d in detections)
        found.append(
            Detections(
                np.asarray([d["box"] for d in detections], dtype=np.float64).reshape(-1, 4),
                np.asarray([d["score"] for d in detections], dtype=np.float32),
                np.asarray([d["class_index"] for d in detections], dtype=np.int64),
            )
        )
    # the daemon's answers are the bundle's own detections on those frames, mapped back through the letterbox
    model = load(bundle)
    prep = FramePrep(model.manifest.image, model.inputs[0])  # type: ignore[arg-type]
    for index, answer in enumerate(found):
        frame = read_image(frames / f"{index:03d}.png")
        expected = frame_detections(model.manifest.postprocess, model.predict(prep(frame))[0],
                                    prep.geometry(HEIGHT, WIDTH))  # fmt: skip
        assert np.array_equal(answer.classes, expected.classes), index
        np.testing.assert_allclose(answer.boxes, expected.boxes, atol=1e-5)  # (answers round to 5 places)
    # and where the objects are: the pictures shrink to 0.6 in the letterbox, smaller than the detector was
    # trained on, so not as well as on its own 96x96 images, but far from chance
    result = mean_average_precision(found, truths)
    assert result.map50 >= 0.5 and result.per_class, result
