"""The reference detector on synthetic shapes (edgeline.export.reference.shapes): held-out mAP through edgeline's own
numpy decoding and NMS, data that is the seed's alone, the YOLO layout it writes read back as written, and classes
that differ by colour alone, so that a BGR/RGB mistake shows; ``edgeline reference prepare shapes``: its folders,
its measured mAP, preparing again without training, and the export command it prints, run."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch

from edgeline.detection import HEADS, Detections, MeanAveragePrecision, detect, mean_average_precision
from edgeline.export.reference import Prepared, shapes
from edgeline.export.reference.data import rng_for
from tests.cache import cached_export, cached_reference

pytestmark = pytest.mark.export


@pytest.fixture(scope="module")
def prepared() -> Prepared:
    """``edgeline reference prepare shapes``'s directory, trained once for this code (tests/cache.py): never modified
    here."""
    return cached_reference("shapes")


def detections(model: torch.nn.Module, images: np.ndarray) -> list[Detections]:
    """One image at a time: the exported program takes a batch of one."""
    head = HEADS[shapes.HEAD]
    found = []
    with torch.no_grad():
        for image in shapes.to_inputs(images):
            output = model(torch.tensor(image[None])).numpy()
            found.append(detect(output, head, (shapes.SIZE, shapes.SIZE), score_threshold=0.001))
    return found


@pytest.fixture(scope="module")
def held_out() -> shapes.ShapesData:
    return shapes.make_images(shapes.VALIDATION_IMAGES, rng_for(0, "shapes-validation"))


@pytest.fixture(scope="module")
def model(prepared: Prepared) -> torch.nn.Module:
    return torch.export.load(prepared.model_path).module()


@pytest.fixture(scope="module")
def result(model: torch.nn.Module, held_out: shapes.ShapesData) -> MeanAveragePrecision:
    truths = list(zip(held_out.boxes, held_out.classes, strict=True))
    return mean_average_precision(detections(model, held_out.images), truths)


def test_the_reference_detector_finds_the_held_out_shapes(
    model: torch.nn.Module, held_out: shapes.ShapesData, result: MeanAveragePrecision
) -> None:
    assert len(held_out) >= 300
    assert result.map50 >= 0.9, result
    assert min(result.per_class.values()) >= 0.8, result.per_class
    # what the model outputs is YOLOv8's layout: (1, 4+C, N), boxes in input pixels, scores in [0, 1]
    with torch.no_grad():
        output = model(torch.tensor(shapes.to_inputs(held_out.images[:1]))).numpy()
    assert output.shape == (1, 4 + len(shapes.LABELS), shapes.GRID**2)
    assert output[0, :4].max() > 20 and output[0, 4:].min() >= 0 and output[0, 4:].max() <= 1


def test_fed_bgr_the_detector_confuses_the_classes_that_differ_by_colour(
    model: torch.nn.Module, held_out: shapes.ShapesData, result: MeanAveragePrecision
) -> None:
    truths = list(zip(held_out.boxes, held_out.classes, strict=True))
    right = result
    swapped = mean_average_precision(detections(model, held_out.images[..., ::-1]), truths)
    red, blue = shapes.LABELS.index("red_circle"), shapes.LABELS.index("blue_circle")
    assert swapped.per_class[red] < 0.5 * right.per_class[red] and swapped.per_class[blue] < 0.5 * right.per_class[blue]
    assert swapped.map50 < right.map50 - 0.2


def test_the_data_is_the_seed_s_and_training_and_held_out_images_differ() -> None:
    first, again = shapes.make_images(20, rng_for(3, "t")), shapes.make_images(20, rng_for(3, "t"))
    assert np.array_equal(first.images, again.images)
    assert all(np.array_equal(a, b) for a, b in zip(first.boxes, again.boxes, strict=True))
    other = shapes.make_images(20, rng_for(4, "t"))
    assert not np.array_equal(first.images, other.images)
    counts = [len(c) for c in first.classes]
    assert min(counts) >= 1 and max(counts) <= 4
    sides = np.concatenate([b[:, 2:] - b[:, :2] for b in first.boxes])
    assert sides.min() >= 8 and sides.max() <= 48


def test_the_yolo_layout_it_writes_reads_back_as_its_boxes(tmp_path: Path) -> None:
    from edgeline.export.detection_data import read_detection_dataset
    from edgeline.imaging import FramePrep, image_preprocess, parse_preprocess
    from edgeline.manifest import TensorSpec

    data = shapes.make_images(6, rng_for(5, "t"))
    shapes.write_yolo(data, tmp_path)
    assert sorted(path.name for path in (tmp_path / "labels").iterdir()) == [f"{i:04d}.txt" for i in range(6)]
    spec = TensorSpec(name="images", dtype="float32", shape=(1, *shapes.INPUT_SHAPE))
    prep = FramePrep(image_preprocess(parse_preprocess(shapes.IMAGE_PREPROCESS), spec), spec)
    read = read_detection_dataset(tmp_path, "validation", prep, shapes.LABELS)
    assert len(read) == 6
    for index in range(6):
        np.testing.assert_allclose(read.boxes[index] * shapes.SIZE, data.boxes[index], atol=1e-3)
        assert read.classes[index].tolist() == data.classes[index].tolist()
    np.testing.assert_allclose(read.samples.inputs[0], shapes.to_inputs(data.images), atol=1e-6)


def _frame_prep() -> object:
    from edgeline.imaging import FramePrep, image_preprocess, parse_preprocess
    from edgeline.manifest import TensorSpec

    spec = TensorSpec(name="images", dtype="float32", shape=(1, *shapes.INPUT_SHAPE))
    return FramePrep(image_preprocess(parse_preprocess(shapes.IMAGE_PREPROCESS), spec), spec)


def test_prepare_shapes_writes_yolo_folders_the_program_and_its_measured_map(
    prepared: Prepared, model: torch.nn.Module, held_out: shapes.ShapesData
) -> None:
    from edgeline.export.detection_data import read_detection_dataset
    from edgeline.export.reference.data import CALIBRATION_SIZE, calibration_indices
    from edgeline.export.reference.preparation import held_out_map

    directory = prepared.directory
    assert sorted(path.name for path in directory.iterdir()) == [
        "calibration", "labels.txt", "model.pt2", "reference.json", "validation",
    ]  # fmt: skip
    assert json.loads((directory / "reference.json").read_text()) == {
        "name": "shapes",
        "task": "detect",
        "labels": list(shapes.LABELS),
        "input_shape": [3, 96, 96],
        "float_accuracy": None,
        "float_map50": prepared.float_map50,
        "float_map50_95": prepared.float_map50_95,
        "head": "yolov8",
        "image": shapes.IMAGE_PREPROCESS,
        "seed": 0,
    }
    assert (directory / "labels.txt").read_text().splitlines() == list(shapes.LABELS)
    assert prepared.float_map50 is not None and prepared.float_map50_95 is not None
    assert prepared.float_map50 >= 0.9 and 0.3 < prepared.float_map50_95 < prepared.float_map50

    # Both folders are the YOLO layout the export reads: validation is the held-out stream, image for image;
    # calibration, training images (the first one chosen, made again from the training stream).
    prep = _frame_prep()
    validation = read_detection_dataset(prepared.validation_path, "validation", prep, shapes.LABELS)  # type: ignore[arg-type]
    assert len(validation) == len(held_out) >= 300
    np.testing.assert_allclose(validation.samples.inputs[0], shapes.to_inputs(held_out.images), atol=1e-6)
    calibration = read_detection_dataset(prepared.calibration_path, "calibration", prep, shapes.LABELS)  # type: ignore[arg-type]
    assert len(calibration) == CALIBRATION_SIZE and calibration.objects >= CALIBRATION_SIZE
    first = int(calibration_indices(shapes.TRAIN_IMAGES, 0)[0])
    training = shapes.make_images(first + 1, rng_for(0, "shapes-train"))
    np.testing.assert_allclose(
        calibration.samples.inputs[0][0], shapes.to_inputs(training.images[first:])[0], atol=1e-6
    )
    np.testing.assert_allclose(calibration.boxes[0] * shapes.SIZE, training.boxes[first], atol=1e-3)

    # The exported program, one image at a time, has the mAP prepare measured on the trained model.
    measured, _ = held_out_map(model, prepared, batch_size=1)
    assert measured.map50 == pytest.approx(prepared.float_map50, abs=2e-3)
    assert measured.map50_95 == pytest.approx(prepared.float_map50_95, abs=2e-3)


def test_prepare_shapes_again_does_not_train_and_prints_the_detector_s_export_command(
    prepared: Prepared, capsys: pytest.CaptureFixture[str]
) -> None:
    from edgeline.cli import main

    directory = prepared.directory
    before = {path: path.stat().st_mtime_ns for path in directory.rglob("*")}
    out_dir = directory.parent
    assert main(["reference", "prepare", "shapes", "--out", os.fspath(out_dir)]) == 0
    out = capsys.readouterr().out
    assert f"shapes: float mAP@0.5 {prepared.float_map50:.4f}, mAP@0.5:0.95 {prepared.float_map50_95:.4f}" in out
    assert "already prepared" in out
    shapes_dir = out_dir / "shapes"
    assert (
        f"edgeline export {shapes_dir / 'model.pt2'} --profile rpi5 --calibration {shapes_dir / 'calibration'} "
        f"--validation {shapes_dir / 'validation'} --task detect --head yolov8 --labels {shapes_dir / 'labels.txt'} "
        f"--preprocess {shapes.IMAGE_PREPROCESS}"
    ) in out
    assert {path: path.stat().st_mtime_ns for path in directory.rglob("*")} == before
    assert main(["reference", "prepare", "shapes", "--out", os.fspath(out_dir), "--json"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)
    assert entry["reused"] is True and entry["float_accuracy"] is None and entry["head"] == "yolov8"
    assert entry["float_map50"] == prepared.float_map50 and entry["export"] == prepared.export_command("rpi5")


def test_the_printed_export_command_exports_the_detector_with_its_map(prepared: Prepared) -> None:
    """The command ``prepare`` prints, run as printed (on onnxruntime fp32: the cheapest target, once for this code,
    tests/cache.py): the bundle is a yolov8 detector of the four labels, and its fidelity is mAP, the float model's
    the one reference.json holds."""
    words = shlex.split(prepared.export_command("rpi5"))
    assert words[:2] == ["edgeline", "export"]
    bundle = cached_export(words[2], *words[3:], "--backend", "onnxruntime", "--precision", "fp32")
    manifest = json.loads((bundle / "manifest.json").read_text())
    detection = manifest["postprocess"]["detection"]
    assert manifest["postprocess"]["kind"] == "detect" and manifest["postprocess"]["labels"] == list(shapes.LABELS)
    assert (detection["head"], detection["input_size"]) == ("yolov8", [96, 96])
    assert manifest["image"]["resize"] == "letterbox"
    fidelity = manifest["fidelity"]
    assert (fidelity["status"], fidelity["samples"]) == ("measured", shapes.VALIDATION_IMAGES)
    assert fidelity["map50_float"] == pytest.approx(prepared.float_map50, abs=1e-3)
    assert fidelity["map50_95_float"] == pytest.approx(prepared.float_map50_95, abs=1e-3)
    assert fidelity["map50"] == pytest.approx(fidelity["map50_float"], abs=2e-3)  # fp32: the same boxes
    assert fidelity["map50_95"] == pytest.approx(fidelity["map50_95_float"], abs=2e-3)
    assert fidelity["map50_agreement"] >= 0.99
