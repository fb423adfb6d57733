"""The reference detector on synthetic shapes (edgeline.export.reference.shapes): held-out mAP through edgeline's own
numpy decoding and NMS, data that is the seed's alone, the YOLO layout it writes read back as written, and classes
that differ by colour alone, so that a BGR/RGB mistake shows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from edgeline.detection import HEADS, Detections, MeanAveragePrecision, detect, mean_average_precision
from edgeline.export.reference import shapes
from edgeline.export.reference.data import rng_for
from tests.cache import cached

pytestmark = pytest.mark.export


def trained(seed: int = 0) -> torch.nn.Module:
    """The detector ``shapes.train`` makes from ``seed``'s data, trained once for this code (tests/cache.py)."""

    def make(directory: Path) -> None:
        train, _ = shapes.make_data(seed)
        torch.save(shapes.train(shapes.build(seed), train, seed=seed).state_dict(), directory / "detector.pt")

    entry = cached("shapes-detector", [seed], make, folders=("export/reference",))
    model = shapes.build(seed)
    model.load_state_dict(torch.load(entry / "detector.pt", weights_only=True))
    return model.eval()


def detections(model: torch.nn.Module, images: np.ndarray) -> list[Detections]:
    with torch.no_grad():
        outputs = model(torch.tensor(shapes.to_inputs(images))).numpy()
    head = HEADS[shapes.HEAD]
    return [
        detect(outputs[i : i + 1], head, (shapes.SIZE, shapes.SIZE), score_threshold=0.001) for i in range(len(outputs))
    ]


@pytest.fixture(scope="module")
def held_out() -> shapes.ShapesData:
    return shapes.make_data(0)[1]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return trained()


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
    spec = TensorSpec(name="images", dtype="float32", shape=(1, *shapes.INPUT_SHAPE))
    prep = FramePrep(image_preprocess(parse_preprocess(shapes.IMAGE_PREPROCESS), spec), spec)
    read = read_detection_dataset(tmp_path, "validation", prep, shapes.LABELS)
    assert len(read) == 6
    for index in range(6):
        np.testing.assert_allclose(read.boxes[index] * shapes.SIZE, data.boxes[index], atol=1e-3)
        assert read.classes[index].tolist() == data.classes[index].tolist()
    np.testing.assert_allclose(read.samples.inputs[0], shapes.to_inputs(data.images), atol=1e-6)
