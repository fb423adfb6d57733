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
from tests.camera_bundle import COMMITTED as COLOUR_BUNDLE

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


@pytest.fixture(scope="module")
def bundle() -> Path:
    prepared = cached_reference("shapes")
    words = shlex.split(prepared.export_command())[3:]  # after "edgeline export MODEL"
    return cached_export(prepared.model_path, *words, "--backend", "litert", "--precision", "int8-static")


@pytest.fixture(scope="module")
def frames(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[tuple[np.ndarray, np.ndarray]]]:
    """A folder of 160x96 frames, each a held-out picture pasted at x = 40, and each frame's objects."""
    prepared = cached_reference("shapes")
    folder = tmp_path_factory.mktemp("frames")
    pictures = sorted((prepared.validation_path / "images").iterdir())[:FRAMES]
    truths = []
    for index, picture in enumerate(pictures):
        canvas = np.full((HEIGHT, WIDTH, 3), 100, dtype=np.uint8)
        canvas[:, LEFT : LEFT + 96] = read_image(picture)
        Image.fromarray(canvas).save(folder / f"{index:03d}.png")
        truths.append(_objects(prepared.validation_path / "labels" / f"{picture.stem}.txt"))
    return folder, truths


def _run(bundle: Path, frames: Path, state: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edgeline.cli", "run", str(bundle), "--camera", f"belt={frames}", "--state-dir",
         str(state), *flags],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip


def _answers(done: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def test_a_detector_answers_every_frame_with_boxes_where_the_objects_are(
    bundle: Path, frames: tuple[Path, list[tuple[np.ndarray, np.ndarray]]], tmp_path: Path
) -> None:
    folder, truths = frames
    manifest = json.loads((bundle / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["postprocess"]["detection"]["box_space"] == "normalised"  # int8: divided in the model
    done = _run(bundle, folder, tmp_path / "state")
    assert done.returncode == 0, done.stderr[-3000:]
    answers = _answers(done)
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
        frame = read_image(folder / f"{index:03d}.png")
        expected = frame_detections(model.manifest.postprocess, model.predict(prep(frame))[0],
                                    prep.geometry(HEIGHT, WIDTH))  # fmt: skip
        assert np.array_equal(answer.classes, expected.classes), index
        np.testing.assert_allclose(answer.boxes, expected.boxes, atol=1e-5)  # (answers round to 5 places)
    # and where the objects are: the pictures shrink to 0.6 in the letterbox, smaller than the detector was
    # trained on, so not as well as on its own 96x96 images, but far from chance
    result = mean_average_precision(found, truths)
    assert result.map50 >= 0.5 and result.per_class, result


def test_a_run_overrides_the_detector_s_thresholds_and_a_classifier_refuses_them(
    bundle: Path, frames: tuple[Path, list[tuple[np.ndarray, np.ndarray]]], tmp_path: Path
) -> None:
    folder, _ = frames
    done = _run(bundle, folder, tmp_path / "state", "--score-threshold", "0.8", "--max-detections", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    answers = _answers(done)
    assert len(answers) == FRAMES and all(len(a["detections"]) <= 1 for a in answers)
    assert all(d["score"] > 0.8 for a in answers for d in a["detections"])
    assert sum(len(a["detections"]) for a in answers) >= FRAMES // 2  # the confident ones are still there
    refused = _run(COLOUR_BUNDLE, folder, tmp_path / "colour", "--score-threshold", "0.5")
    errors = [line for line in refused.stderr.splitlines() if "error" in line.lower()]
    assert refused.returncode != 0 and len(errors) == 1, refused.stderr[-2000:]
    assert "--score-threshold ([detection] score_threshold): for detectors" in errors[0]
    out_of_range = _run(bundle, folder, tmp_path / "range", "--iou-threshold", "1.5")
    assert out_of_range.returncode != 0 and "--iou-threshold: 1.5 is out of range" in out_of_range.stderr, (
        out_of_range.stderr[-2000:]
    )
    assert "Traceback" not in refused.stderr + out_of_range.stderr
