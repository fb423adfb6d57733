"""Detection datasets as ``--calibration`` / ``--validation`` of ``--task detect``, read through the device's own
pre-processing.

    DIR/images/**/NAME.EXT      the YOLO layout (Ultralytics', most detection datasets ship in it): per image, a
    DIR/labels/**/NAME.txt      label file at the same place under labels/, one line per object,
                                ``class cx cy w h`` normalised to the image; no label file: an image of background
    FILE.json                   COCO: images (file_name relative to the JSON's folder, or to its images/ folder),
                                annotations with bbox [x, y, w, h] in pixels, categories (their order by id is the
                                class order); crowd annotations are left out

Each image becomes input 0 through ``FramePrep`` (the daemon's function for camera frames), and its truths stay in
the image's own coordinates, normalised to [0, 1]: a detection is compared with them after its box is mapped back
through the same geometry (``Geometry.to_frame``), so letterboxing is checked, not assumed.

A malformed line, a class outside the labels, a box outside the image or of no area is an error naming the file and
line. Sizes are checked before anything is read: at most ``MAX_IMAGES`` images, ``MAX_LABEL_BYTES`` per label file,
``MAX_COCO_BYTES`` of JSON.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgeline.errors import EdgelineError
from edgeline.export.errors import CalibrationError
from edgeline.export.images import MAX_IMAGES, list_images, sample_buffer
from edgeline.imaging import IMAGE_SUFFIXES, FramePrep, Geometry, read_image
from edgeline.samples import SampleSet

__all__ = ["MAX_COCO_BYTES", "MAX_LABEL_BYTES", "DetectionSet", "is_detection_dataset", "read_detection_dataset"]

MAX_LABEL_BYTES = 1024 * 1024
"""The largest YOLO label file read (about 30,000 objects)."""
MAX_COCO_BYTES = 512 * 1024 * 1024
"""The largest COCO JSON read (COCO 2017's train annotations are 448 MB)."""
EDGE_TOLERANCE = 1e-3
"""How far past the image's edge (normalised) a label's box may reach: rounding in the tools that write them."""


@dataclass(frozen=True, eq=False)
class DetectionSet:
    """Images as input 0 (``samples``) with, per image, its truths (``boxes`` (K, 4) x1, y1, x2, y2 normalised to
    the image, ``classes`` (K,)), where the image lands in the input (``geometries``) and its file (``paths``)."""

    samples: SampleSet
    boxes: tuple[np.ndarray, ...]
    classes: tuple[np.ndarray, ...]
    geometries: tuple[Geometry, ...]
    paths: tuple[Path, ...]
    labels: tuple[str, ...] | None
    """Class names: ``--labels``, or a COCO file's categories; None when neither names them."""

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def truths(self) -> list[tuple[np.ndarray, np.ndarray]]:
        return list(zip(self.boxes, self.classes, strict=True))

    @property
    def objects(self) -> int:
        return sum(len(c) for c in self.classes)


def is_detection_dataset(path: Path) -> bool:
    """A folder in the YOLO layout (it has images/ and labels/), or a .json file."""
    if path.is_dir():
        return (path / "images").is_dir() and (path / "labels").is_dir()
    return path.suffix.lower() == ".json"


def read_detection_dataset(path: Path, role: str, prep: FramePrep, labels: tuple[str, ...] | None) -> DetectionSet:
    """The dataset at ``path`` (see the module) for ``role`` (``calibration``/``validation``, for errors)."""
    if path.is_dir():
        return _read_yolo(path, role, prep, labels)
    return _read_coco(path, role, prep, labels)


def _read_yolo(root: Path, role: str, prep: FramePrep, labels: tuple[str, ...] | None) -> DetectionSet:
    images_dir, labels_dir = root / "images", root / "labels"
    paths = list_images(images_dir, role)
    if not paths:
        raise CalibrationError(f"{role} dataset {root}: no images ({', '.join(IMAGE_SUFFIXES)}) under images/")
    truths = []
    for path in paths:
        label_file = (labels_dir / path.relative_to(images_dir)).with_suffix(".txt")
        truths.append(_yolo_labels(label_file, labels))
    return _assemble(paths, truths, role, root, prep, labels)


def _yolo_labels(path: Path, labels: tuple[str, ...] | None) -> tuple[np.ndarray, np.ndarray]:
    if not path.exists():
        return np.zeros((0, 4), dtype=np.float64), np.zeros(0, dtype=np.int64)
    if path.is_symlink() or not path.is_file():
        raise CalibrationError(f"label file {path}: not a regular file")
    size = path.stat().st_size
    if size > MAX_LABEL_BYTES:
        raise CalibrationError(f"label file {path}: {size:,} bytes, more than {MAX_LABEL_BYTES:,}")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise CalibrationError(f"label file {path}: not UTF-8 text") from None
    boxes, classes = [], []
    for number, line in enumerate(text.splitlines(), start=1):
        words = line.split()
        if not words:
            continue
        where = f"label file {path}, line {number}"
        if len(words) != 5:
            what = (
                "a segment (polygon), not a box" if len(words) > 5 and len(words) % 2 == 1 else f"{len(words)} values"
            )
            raise CalibrationError(f"{where}: {what}; a line is 'class cx cy w h', normalised to the image")
        try:
            kind = int(words[0])
            cx, cy, w, h = (float(word) for word in words[1:])
        except ValueError:
            raise CalibrationError(
                f"{where}: {line.strip()!r} is not 'class cx cy w h' (an integer, four numbers)"
            ) from None
        box = (cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2)
        _check_box(box, kind, labels, where, f"cx {cx:g} cy {cy:g} w {w:g} h {h:g}")
        boxes.append(box)
        classes.append(kind)
    return np.asarray(boxes, dtype=np.float64).reshape(-1, 4), np.asarray(classes, dtype=np.int64)


def _check_box(box: tuple[float, ...], kind: int, labels: tuple[str, ...] | None, where: str, shown: str) -> None:
    if kind < 0 or (labels is not None and kind >= len(labels)):
        known = f"0..{len(labels) - 1} ({len(labels)} labels)" if labels is not None else "0 or more"
        raise CalibrationError(f"{where}: class {kind} is not among the classes {known}")
    if not all(math.isfinite(v) for v in box):
        raise CalibrationError(f"{where}: a box of NaN or infinity ({shown})")
    if box[2] <= box[0] or box[3] <= box[1]:
        raise CalibrationError(f"{where}: a box of no area ({shown})")
    if min(box) < -EDGE_TOLERANCE or max(box) > 1 + EDGE_TOLERANCE:
        raise CalibrationError(f"{where}: the box ({shown}) reaches outside the image: coordinates are normalised "
                               "to [0, 1]")  # fmt: skip


def _read_coco(path: Path, role: str, prep: FramePrep, labels: tuple[str, ...] | None) -> DetectionSet:
    if not path.is_file():  # a FIFO would block the read
        what = "not a regular file" if path.exists() else "no such file"
        raise CalibrationError(f"{role} dataset {path}: {what}")
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise CalibrationError(f"{role} dataset {path}: cannot be read ({exc.strerror})") from None
    if size > MAX_COCO_BYTES:
        raise CalibrationError(f"{role} dataset {path}: {size:,} bytes, more than {MAX_COCO_BYTES:,}")
    try:
        document = json.loads(path.read_bytes())
    except (UnicodeDecodeError, ValueError) as exc:
        raise CalibrationError(f"{role} dataset {path}: not COCO JSON ({exc})") from None
    where = f"{role} dataset {path}"
    if not isinstance(document, dict) or not all(isinstance(document.get(k), list) for k in ("images", "categories")):
        raise CalibrationError(f"{where}: not COCO JSON: it needs lists 'images', 'annotations' and 'categories'")
    categories = sorted(_items(document["categories"], ("id", "name"), where, "category"), key=lambda c: c["id"])
    _unique([c["id"] for c in categories], where, "category")
    index_of = {c["id"]: i for i, c in enumerate(categories)}
    names = tuple(str(c["name"]) for c in categories)
    if labels is not None and labels != names:
        raise CalibrationError(f"{where}: its categories ({', '.join(names)}) are not --labels ({', '.join(labels)})")
    images = _items(document["images"], ("id", "file_name", "width", "height"), where, "image")
    if len(images) > MAX_IMAGES:
        raise CalibrationError(f"{where}: more than {MAX_IMAGES:,} images")
    if not images:
        raise CalibrationError(f"{where}: no images")
    _unique([image["id"] for image in images], where, "image")
    by_image: dict[Any, list[tuple[tuple[float, ...], int]]] = {image["id"]: [] for image in images}
    sizes = {image["id"]: (image["width"], image["height"]) for image in images}
    for number, annotation in enumerate(_items(document.get("annotations", []), ("image_id", "category_id", "bbox"),
                                               where, "annotation")):  # fmt: skip
        here = f"{where}, annotation {number} (id {annotation.get('id', '?')})"
        if annotation.get("iscrowd"):
            continue
        if annotation["image_id"] not in by_image:
            raise CalibrationError(f"{here}: image_id {annotation['image_id']!r} is not among the images")
        if annotation["category_id"] not in index_of:
            raise CalibrationError(f"{here}: category_id {annotation['category_id']!r} is not among the categories")
        bbox = annotation["bbox"]
        if not (isinstance(bbox, list) and len(bbox) == 4 and all(isinstance(v, int | float) for v in bbox)):
            raise CalibrationError(f"{here}: bbox must be [x, y, w, h] numbers, not {bbox!r}")
        width, height = sizes[annotation["image_id"]]
        x, y, w, h = (float(v) for v in bbox)
        box = (x / width, y / height, (x + w) / width, (y + h) / height)
        kind = index_of[annotation["category_id"]]
        _check_box(box, kind, names, here, f"bbox [{x:g}, {y:g}, {w:g}, {h:g}] in {width}x{height}")
        by_image[annotation["image_id"]].append((box, kind))
    paths = []
    for image in images:
        text = str(image["file_name"])
        name = Path(text)
        if not text or "\x00" in text or name.is_absolute() or ".." in name.parts:
            raise CalibrationError(f"{where}: image file_name {str(name)!r} must be relative, inside {path.parent}")
        found = path.parent / name
        paths.append(found if found.exists() else path.parent / "images" / name)
    truths = [
        (np.asarray([b for b, _ in by_image[i["id"]]], dtype=np.float64).reshape(-1, 4),
         np.asarray([k for _, k in by_image[i["id"]]], dtype=np.int64))
        for i in images
    ]  # fmt: skip
    return _assemble(paths, truths, role, path, prep, labels or names, sizes=[sizes[i["id"]] for i in images])


def _items(value: object, keys: tuple[str, ...], where: str, what: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise CalibrationError(f"{where}: {what}s must be a list")
    for number, item in enumerate(value):
        if not isinstance(item, dict) or any(key not in item for key in keys):
            raise CalibrationError(f"{where}: {what} {number} needs {', '.join(keys)}")
        for key in ("width", "height"):
            if key in keys and not (type(item[key]) is int and item[key] > 0):
                raise CalibrationError(f"{where}: {what} {number}: {key} must be a positive integer")
        for key in ("id", "image_id", "category_id"):
            if key in keys and type(item[key]) is not int:
                raise CalibrationError(f"{where}: {what} {number}: {key} must be an integer, not {item[key]!r}")
    return value


def _unique(ids: list[int], where: str, what: str) -> None:
    seen: set[int] = set()
    for number in ids:
        if number in seen:
            raise CalibrationError(f"{where}: two {what}s have id {number}")
        seen.add(number)


def _assemble(
    paths: list[Path],
    truths: list[tuple[np.ndarray, np.ndarray]],
    role: str,
    source: Path,
    prep: FramePrep,
    labels: tuple[str, ...] | None,
    *,
    sizes: list[tuple[int, int]] | None = None,
) -> DetectionSet:
    inputs = sample_buffer(len(paths), prep, f"{role} dataset {source}")
    per_sample = inputs.shape[1:]
    geometries = []
    for index, path in enumerate(paths):
        if not path.is_file():  # a FIFO named by a COCO file would block the read
            what = "not a regular file" if path.exists() else "no such file"
            raise CalibrationError(f"{role} dataset {source}: image {path}: {what}")
        try:
            image = read_image(path)
        except EdgelineError as exc:
            raise CalibrationError(f"{role} dataset {source}: {exc}") from exc
        height, width = image.shape[:2]
        if sizes is not None and sizes[index] != (width, height):
            raise CalibrationError(f"{role} dataset {source}: image {path} is {width}x{height}, the JSON says "
                                   f"{sizes[index][0]}x{sizes[index][1]}")  # fmt: skip
        inputs[index] = prep(image).reshape(per_sample)
        geometries.append(prep.geometry(height, width))
    return DetectionSet(
        samples=SampleSet([inputs], None, str(source), geometries=geometries, truths=truths),
        boxes=tuple(t[0] for t in truths),
        classes=tuple(t[1] for t in truths),
        geometries=tuple(geometries),
        paths=tuple(paths),
        labels=labels,
    )
