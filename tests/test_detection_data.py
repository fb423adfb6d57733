"""Detection datasets (YOLO folders, COCO JSON) read through the device's pre-processing: truths kept in the image's
own coordinates and mapped through the letterbox exactly, every broken label named by file and line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from edgeline.export.detection_data import is_detection_dataset, read_detection_dataset
from edgeline.export.errors import CalibrationError
from edgeline.imaging import FramePrep, image_preprocess, parse_preprocess
from edgeline.manifest import TensorSpec

pytestmark = pytest.mark.quick

LABELS = ("square", "bar")


def prep(size: int = 64) -> FramePrep:
    spec = TensorSpec(name="images", dtype="float32", shape=(1, 3, size, size))
    return FramePrep(image_preprocess(parse_preprocess("resize=letterbox,color=rgb,scale=1/255"), spec), spec)


def paint(path: Path, width: int, height: int, boxes: list[tuple[int, int, int, int]]) -> None:
    """A grey image with white rectangles at ``boxes`` (x1, y1, x2, y2 pixels, exclusive ends)."""
    pixels = np.full((height, width, 3), 60, dtype=np.uint8)
    for x1, y1, x2, y2 in boxes:
        pixels[y1:y2, x1:x2] = 255
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)


def yolo_line(kind: int, box: tuple[int, int, int, int], width: int, height: int) -> str:
    x1, y1, x2, y2 = box
    return f"{kind} {(x1 + x2) / 2 / width} {(y1 + y2) / 2 / height} {(x2 - x1) / width} {(y2 - y1) / height}\n"


def yolo_dataset(root: Path) -> dict[str, tuple[int, int, list[tuple[int, int, int, int]], list[int]]]:
    images = {
        "a": (80, 40, [(10, 5, 30, 25), (50, 10, 70, 20)], [0, 1]),  # wide: letterboxed top and bottom
        "sub/b": (30, 60, [(5, 10, 25, 30)], [0]),  # tall, in a sub-folder
        "c": (50, 50, [], []),  # background: no label file
    }
    for name, (width, height, boxes, kinds) in images.items():
        paint(root / "images" / f"{name}.png", width, height, boxes)
        if boxes:
            label = root / "labels" / f"{name}.txt"
            label.parent.mkdir(parents=True, exist_ok=True)
            label.write_text("".join(yolo_line(k, b, width, height) for k, b in zip(kinds, boxes, strict=True)))
    (root / "labels").mkdir(exist_ok=True)
    return images


def test_a_yolo_folder_gives_each_image_its_truths_and_where_it_lands_in_the_input(tmp_path: Path) -> None:
    images = yolo_dataset(tmp_path)
    assert is_detection_dataset(tmp_path) and not is_detection_dataset(tmp_path / "images")
    found = read_detection_dataset(tmp_path, "validation", prep(), LABELS)
    assert [p.relative_to(tmp_path / "images").as_posix() for p in found.paths] == ["a.png", "c.png", "sub/b.png"]
    assert len(found) == 3 and found.objects == 3 and found.samples.inputs[0].shape == (3, 3, 64, 64)
    for index, name in enumerate(["a", "c", "sub/b"]):
        width, height, boxes, kinds = images[name]
        expected = np.asarray(boxes, dtype=np.float64).reshape(-1, 4) / [width, height, width, height]
        np.testing.assert_allclose(found.boxes[index], expected, atol=1e-6)
        assert found.classes[index].tolist() == kinds
        # where the truth lands in the input is where the white pixels are
        geometry = found.geometries[index]
        image = found.samples.inputs[0][index]
        for box in geometry.to_input(expected):
            x1, y1, x2, y2 = np.rint(box).astype(int)
            assert image[:, y1 + 1 : y2 - 1, x1 + 1 : x2 - 1].min() > 0.9  # inside: white (edges blur)
            assert image[:, y1 - 2, x1:x2].max() < 0.5 and image[:, y1:y2, x2 + 1].max() < 0.5  # outside: not
        np.testing.assert_allclose(geometry.to_frame(geometry.to_input(expected)), expected, atol=1e-9)


def test_a_coco_file_reads_as_the_same_truths_as_its_yolo_twin(tmp_path: Path) -> None:
    images = yolo_dataset(tmp_path)
    document = {"images": [], "annotations": [], "categories": [{"id": 7, "name": "square"}, {"id": 9, "name": "bar"}]}
    for number, (name, (width, height, boxes, kinds)) in enumerate(images.items(), start=1):
        document["images"].append({"id": number, "file_name": f"{name}.png", "width": width, "height": height})
        for (x1, y1, x2, y2), kind in zip(boxes, kinds, strict=True):
            document["annotations"].append({"id": len(document["annotations"]) + 1, "image_id": number,
                                            "category_id": (7, 9)[kind], "bbox": [x1, y1, x2 - x1, y2 - y1],
                                            "iscrowd": 0})  # fmt: skip
    document["annotations"].append({"id": 99, "image_id": 1, "category_id": 7, "bbox": [0, 0, 80, 40], "iscrowd": 1})
    (tmp_path / "coco.json").write_text(json.dumps(document))
    coco = read_detection_dataset(tmp_path / "coco.json", "validation", prep(), None)
    yolo = read_detection_dataset(tmp_path, "validation", prep(), LABELS)
    assert coco.labels == LABELS
    by_name = {p.name: i for i, p in enumerate(yolo.paths)}
    for index, path in enumerate(coco.paths):  # found under images/, next to the JSON
        twin = by_name[path.name]
        np.testing.assert_allclose(coco.boxes[index], yolo.boxes[twin], atol=1e-6)
        assert coco.classes[index].tolist() == yolo.classes[twin].tolist()
        np.testing.assert_array_equal(coco.samples.inputs[0][index], yolo.samples.inputs[0][twin])


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("0 0.5 0.5 0.2", "line 2: 4 values; a line is 'class cx cy w h'"),
        ("0 0.1 0.1 0.2 0.1 0.3 0.3", "line 2: a segment (polygon), not a box"),
        ("zero 0.5 0.5 0.2 0.2", "line 2: 'zero 0.5 0.5 0.2 0.2' is not 'class cx cy w h'"),
        ("2 0.5 0.5 0.2 0.2", "line 2: class 2 is not among the classes 0..1 (2 labels)"),
        ("0 0.5 0.5 0 0.2", "line 2: a box of no area"),
        ("0 0.5 0.5 nan 0.2", "line 2: a box of NaN or infinity"),
        ("0 40 20 20 20", "line 2: the box (cx 40 cy 20 w 20 h 20) reaches outside the image"),
    ],
)
def test_a_broken_label_line_is_named_by_file_and_line(tmp_path: Path, line: str, expected: str) -> None:
    paint(tmp_path / "images" / "x.png", 20, 20, [])
    (tmp_path / "labels").mkdir()
    (tmp_path / "labels" / "x.txt").write_text(f"1 0.5 0.5 0.5 0.5\n{line}\n")
    with pytest.raises(CalibrationError) as caught:
        read_detection_dataset(tmp_path, "calibration", prep(), LABELS)
    assert f"label file {tmp_path / 'labels' / 'x.txt'}, {expected}" in str(caught.value)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda d: d.pop("categories"), "not COCO JSON: it needs lists"),
        (lambda d: d["annotations"][0].update(category_id=3), "annotation 0 (id 1): category_id 3 is not among"),
        (lambda d: d["annotations"][0].update(image_id=5), "annotation 0 (id 1): image_id 5 is not among the images"),
        (lambda d: d["annotations"][0].update(bbox=[1, 2, 3]), "bbox must be [x, y, w, h] numbers"),
        (lambda d: d["annotations"][0].update(bbox=[15, 2, 10, 3]), "reaches outside the image"),
        (lambda d: d["images"][0].update(file_name="../x.png"), "must be relative, inside"),
        (lambda d: d["images"][0].update(width=0), "image 0: width must be a positive integer"),
        (lambda d: d["images"][0].update(width=21), "image " + "{x}" + " is 20x20, the JSON says 21x20"),
        (lambda d: d["images"][0].update(id=[1]), "image 0: id must be an integer, not [1]"),
        (lambda d: d["annotations"][0].update(category_id={"a": 1}), "category_id must be an integer"),
        (lambda d: d["images"].append(dict(d["images"][0])), "two images have id 1"),
        (lambda d: d["images"][0].update(file_name="x\x00.png"), "must be relative, inside"),
        (lambda d: d["images"][0].update(file_name="fifo.png"), "fifo.png: not a regular file"),
    ],
)
def test_a_broken_coco_file_is_named_with_what_is_wrong(tmp_path: Path, change, expected: str) -> None:  # type: ignore[no-untyped-def]
    paint(tmp_path / "x.png", 20, 20, [])
    os.mkfifo(tmp_path / "fifo.png")
    document = {"images": [{"id": 1, "file_name": "x.png", "width": 20, "height": 20}],
                "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [2, 2, 5, 5]}],
                "categories": [{"id": 1, "name": "square"}]}  # fmt: skip
    change(document)
    (tmp_path / "d.json").write_text(json.dumps(document))
    with pytest.raises(CalibrationError) as caught:
        read_detection_dataset(tmp_path / "d.json", "validation", prep(), None)
    assert expected.replace("{x}", str(tmp_path / "x.png")) in str(caught.value)


def test_a_label_file_planted_as_a_link_or_oversized_is_refused_unread(tmp_path: Path) -> None:
    paint(tmp_path / "images" / "x.png", 20, 20, [])
    (tmp_path / "labels").mkdir()
    (tmp_path / "labels" / "x.txt").symlink_to("/dev/zero")
    with pytest.raises(CalibrationError, match="not a regular file"):
        read_detection_dataset(tmp_path, "validation", prep(), LABELS)
    (tmp_path / "labels" / "x.txt").unlink()
    with open(tmp_path / "labels" / "x.txt", "wb") as big:
        big.truncate(2 * 1024 * 1024)
    with pytest.raises(CalibrationError, match="2,097,152 bytes, more than 1,048,576"):
        read_detection_dataset(tmp_path, "validation", prep(), LABELS)


def test_a_coco_file_that_is_a_fifo_is_refused_without_being_opened(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "d.json")
    with pytest.raises(CalibrationError, match=r"d\.json: not a regular file"):
        read_detection_dataset(tmp_path / "d.json", "validation", prep(), None)
