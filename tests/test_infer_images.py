"""``edgeline infer --input IMAGE|DIR|GLOB [--annotate OUTDIR]``: image files through the bundle's own pre-processing,
one answer per image (a bad file one error line, the others answered), and annotated copies drawn by
``edgeline.annotate`` (boxes at their pixels, clipped at the image's edge; a classifier's caption), written without
following anything planted in OUTDIR. The image bundle is the committed colour classifier (16x16, blue/green/red)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from edgeline.annotate import BAR_ROWS, annotate, box_line_width, class_colour
from edgeline.cli import main

COLOUR_BUNDLE = Path(__file__).parent / "data" / "colour-fp32"
GREY = 60
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (20, 40, 210)}


def grey(height: int, width: int) -> np.ndarray:
    return np.full((height, width, 3), GREY, dtype=np.uint8)


def box(box: list[float], class_index: int = 1, label: str = "dog", score: float = 0.9) -> dict[str, object]:
    return {"box": box, "class_index": class_index, "label": label, "score": score}


# -- drawing -----------------------------------------------------------------------------------------------------------


@pytest.mark.quick
@pytest.mark.parametrize(("height", "width"), [(120, 200), (480, 640)])
def test_a_box_is_drawn_on_its_own_pixels_of_a_non_square_image_with_its_label_beside_it(
    height: int, width: int
) -> None:
    image = grey(height, width)
    drawn = annotate(image, {"detections": [box([0.25, 0.5, 0.75, 0.9])]})
    colour = class_colour(1)
    line = box_line_width(height, width)
    # the box's pixel edges: columns 0.25 W .. 0.75 W - 1, rows 0.5 H .. 0.9 H - 1, the line drawn inwards
    left, right, top, bottom = width // 4, 3 * width // 4 - 1, height // 2, round(0.9 * height) - 1
    middle_row, middle_column = (top + bottom) // 2, (left + right) // 2
    for row, column in [
        (middle_row, left),
        (middle_row, left + line - 1),
        (middle_row, right),
        (middle_row, right - line + 1),
        (bottom, middle_column),
        (bottom - line + 1, middle_column),
        (top, right - 1),
    ]:
        assert tuple(drawn[row, column]) == colour, (row, column)
    for row, column in [
        (middle_row, left - 1),
        (middle_row, left + line),
        (middle_row, right + 1),
        (middle_row, right - line),
        (bottom + 1, middle_column),
        (bottom - line, middle_column),
        (top + line, middle_column),
    ]:
        assert tuple(drawn[row, column]) == (GREY,) * 3, (row, column)
    # the label and score: a patch in the class's colour just above the box's corner, with text in it
    patch = drawn[top - 10 : top, left : left + 40].reshape(-1, 3)
    values = {tuple(pixel) for pixel in patch}
    assert colour in values and len(values) > 1
    assert (drawn[:, :left] == GREY).all() and (drawn[: top - 20] == GREY).all()  # nothing else changed
    assert (image == GREY).all()  # the input untouched


@pytest.mark.quick
def test_a_box_partly_outside_the_image_is_clipped_to_it() -> None:
    image = grey(100, 160)
    drawn = annotate(image, {"detections": [box([-0.25, 0.3, 0.5, 1.4], class_index=0)]})
    colour = class_colour(0)
    assert tuple(drawn[30, 0]) == colour and tuple(drawn[30, 79]) == colour  # the top edge, from the image's edge
    assert tuple(drawn[60, 79]) == colour  # the right edge, down to the image's bottom
    assert tuple(drawn[99, 79]) == colour
    assert (drawn[31:, 0] == GREY).all()  # no left edge: it is outside
    assert (drawn[99, :79] == GREY).all()  # no bottom edge: outside too
    assert (drawn[:, 80:] == GREY).all()
    entirely_outside = annotate(image, {"detections": [box([1.2, 1.2, 1.5, 1.5]), box([0.5, -0.9, 0.9, -0.1])]})
    assert (entirely_outside == GREY).all()


@pytest.mark.quick
def test_no_detections_leave_the_image_as_it_was_and_a_caption_is_a_bar_with_text() -> None:
    image = np.random.default_rng(0).integers(0, 256, (50, 70, 3), dtype=np.uint8)
    assert np.array_equal(annotate(image, {"detections": []}), image)
    assert np.array_equal(annotate(image, {}), image)
    captioned = annotate(image, {"label": "red", "score": 0.9}, caption="red 0.90")
    assert np.array_equal(captioned[BAR_ROWS:], image[BAR_ROWS:])
    bar = captioned[:BAR_ROWS]
    assert (bar == 0).mean() > 0.8 and (bar.max(axis=2) > 150).any()  # black, with the text drawn on it


@pytest.mark.quick
@pytest.mark.parametrize("pixel", ["bgr", "gray"])
def test_boxes_are_drawn_in_the_image_s_own_pixel_order(pixel: str) -> None:
    image = np.full((60, 80), GREY, dtype=np.uint8) if pixel == "gray" else grey(60, 80)
    drawn = annotate(image, {"detections": [box([0.5, 0.5, 1.0, 1.0], class_index=3)]}, pixel=pixel)
    red, green, blue = class_colour(3)
    wanted = (blue, green, red) if pixel == "bgr" else round(0.299 * red + 0.587 * green + 0.114 * blue)
    assert drawn.shape == image.shape
    got = drawn[45, 79]
    assert (tuple(got) if pixel == "bgr" else int(got)) == wanted


@pytest.mark.quick
def test_without_pillow_boxes_and_plain_label_patches_are_drawn_all_the_same() -> None:
    """A device without the images extra (Pillow blocked from import, in a fresh interpreter): the same box pixels,
    the labels' patches plain, and an image file to infer is refused naming the extra."""
    code = (
        "import sys; sys.modules['PIL'] = None\n"
        "import numpy as np\n"
        "from edgeline.annotate import annotate, class_colour\n"
        "image = np.full((120, 200, 3), 60, dtype=np.uint8)\n"
        "found = {'box': [0.25, 0.5, 0.75, 0.9], 'class_index': 1, 'label': 'dog', 'score': 0.9}\n"
        "drawn = annotate(image, {'detections': [found]})\n"
        "assert tuple(drawn[80, 50]) == tuple(drawn[80, 149]) == tuple(drawn[107, 100]) == class_colour(1)\n"
        "assert (drawn[50:60, 50:80] == class_colour(1)).all()  # the patch, without text\n"
        "from edgeline.imaging import read_image\n"
        "read_image(sys.argv[1])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(COLOUR_BUNDLE / "manifest.json")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1 and "reading images needs Pillow: pip install 'edgeline[images]'" in result.stderr


# -- infer on images ---------------------------------------------------------------------------------------------------


@pytest.fixture
def images(tmp_path: Path) -> Path:
    """A folder of coloured images (PNG and JPEG, one in a sub-folder) and one .png that is not an image."""
    folder = tmp_path / "shots"
    (folder / "sub").mkdir(parents=True)
    sizes = {"red": (30, 40), "green": (24, 64), "blue": (50, 20)}
    for name, (height, width) in sizes.items():
        array = np.empty((height, width, 3), dtype=np.uint8)
        array[:] = COLOURS[name]
        place = folder / "sub" / f"{name}.jpg" if name == "green" else folder / f"{name}.png"
        Image.fromarray(array).save(place)
    (folder / "broken.png").write_bytes(b"this is not a PNG\n")
    return folder


def run_bundle(capsys: pytest.CaptureFixture[str], bundle: Path, *args: str | Path) -> tuple[int, str, str]:
    code = main(["infer", str(bundle), *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def run(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    return run_bundle(capsys, COLOUR_BUNDLE, *args)


@pytest.mark.quick
def test_a_folder_of_images_answers_each_with_its_size_and_a_bad_file_is_one_error_line(
    images: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "--input", images, "--json")
    assert code == 1  # one failed
    records = [json.loads(line) for line in out.splitlines()]
    assert [Path(r["image"]).relative_to(images).as_posix() for r in records] == [
        "blue.png",
        "broken.png",
        "red.png",
        "sub/green.jpg",
    ]
    answered = {Path(r["image"]).stem: r for r in records if "error" not in r}
    assert {name: r["label"] for name, r in answered.items()} == {"blue": "blue", "red": "red", "green": "green"}
    assert (answered["green"]["width"], answered["green"]["height"]) == (64, 24)
    assert len(answered["red"]["outputs"][0][0]) == 3  # a classifier's outputs, as infer prints them for samples
    assert set(answered["red"]) >= {"image", "width", "height", "label", "class_index", "score"}
    failed = records[1]
    assert "broken.png" in failed["error"] and "not an image" in failed["error"]
    error_lines = [line for line in err.splitlines() if "broken.png" in line]
    assert len(error_lines) == 1 and "Traceback" not in err

    code, out, err = run(capsys, "--input", images, "--show", "2")
    assert code == 1
    lines = out.splitlines()
    assert lines[0].startswith(f"{images / 'blue.png'} (20x50): label=blue")
    assert lines[1].startswith(f"{images / 'red.png'} (40x30): label=red")
    assert lines[2] == "... 1 more images"
    assert lines[3].startswith("4 images (1 failed) through colour v1")


@pytest.mark.quick
def test_one_image_and_a_glob_pattern(images: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--input", images / "sub" / "green.jpg", "--json")
    assert code == 0
    (record,) = [json.loads(line) for line in out.splitlines()]
    assert record["label"] == "green" and record["image"] == str(images / "sub" / "green.jpg")

    code, out, _ = run(capsys, "--input", f"{images}/**/*.jpg", "--json")
    assert code == 0 and [json.loads(line)["label"] for line in out.splitlines()] == ["green"]
    code, out, _ = run(capsys, "--input", f"{images}/[br]*.png", "--json")
    records = [json.loads(line) for line in out.splitlines()]
    assert code == 1 and [Path(r["image"]).name for r in records] == ["blue.png", "broken.png", "red.png"]

    os.mkfifo(images / "pipe.png")  # a folder's listing leaves it out; a pattern names it: refused, not read
    code, out, err = run(capsys, "--input", images, "--json")
    assert code == 1 and "pipe.png" not in out
    code, out, err = run(capsys, "--input", f"{images}/p*.png", "--json")
    assert code == 1 and json.loads(out)["error"] == f"image {images / 'pipe.png'}: not a regular file"

    code, _, err = run(capsys, "--input", f"{images}/*.gif")
    assert code == 2 and err.strip().endswith(f"--input {images}/*.gif: no file matches it")


@pytest.mark.quick
def test_annotate_writes_a_copy_of_each_image_with_its_caption_mirroring_sub_folders(
    images: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = tmp_path / "out" / "annotated"  # made, parents too
    code, out, _ = run(capsys, "--input", images, "--annotate", out_dir)
    assert code == 1 and f"annotated copies in {out_dir}" in out
    written = sorted(p.relative_to(out_dir).as_posix() for p in out_dir.rglob("*") if p.is_file())
    assert written == ["blue.png", "red.png", "sub/green.jpg"]
    with Image.open(out_dir / "sub" / "green.jpg") as copy:
        assert copy.format == "JPEG" and copy.size == (64, 24)
        green = np.asarray(copy.convert("RGB"))
    with Image.open(out_dir / "red.png") as copy:
        assert copy.format == "PNG"
        red = np.asarray(copy.convert("RGB"))
    assert (red[BAR_ROWS:] == COLOURS["red"]).all()  # the image below the caption, exactly (PNG)
    assert (red[:BAR_ROWS] == 0).mean() > 0.5 and (red[:BAR_ROWS].max(axis=2) > 150).any()
    assert np.abs(green[BAR_ROWS:].astype(int) - COLOURS["green"]).max() < 40  # JPEG: near


@pytest.mark.quick
def test_annotate_refuses_a_link_or_fifo_planted_in_outdir_and_writes_the_other_copies(
    images: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    (out_dir / "red.png").symlink_to(target)
    os.mkfifo(out_dir / "blue.png")  # opening it to write would wait for a reader
    code, _, err = run(capsys, "--input", images, "--annotate", out_dir)
    assert code == 1 and target.read_text() == "keep me"
    assert (out_dir / "red.png").is_symlink() and stat.S_ISFIFO((out_dir / "blue.png").lstat().st_mode)
    assert (out_dir / "sub" / "green.jpg").is_file()
    refused = sorted(line for line in err.splitlines() if "edgeline never writes through" in line)
    assert len(refused) == 2
    assert (
        f"{out_dir / 'blue.png'} is a FIFO" in refused[0] and f"{out_dir / 'red.png'} is a symbolic link" in refused[1]
    )

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    other = tmp_path / "other"
    other.mkdir()
    (other / "sub").symlink_to(elsewhere, target_is_directory=True)  # a planted folder: not followed either
    code, _, err = run(capsys, "--input", images, "--annotate", other)
    assert code == 1 and not any(elsewhere.iterdir()) and (other / "red.png").is_file()
    assert f"{other / 'sub'} is a symbolic link" in err


@pytest.mark.quick
def test_images_for_a_bundle_without_an_image_pre_processing_and_thresholds_for_a_classifier_are_refused(
    images: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bundle = tmp_path / "no-image"
    shutil.copytree(COLOUR_BUNDLE, bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["image"] = None
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    assert main(["infer", str(bundle), "--input", str(images / "red.png")]) == 2
    err = capsys.readouterr().err
    assert "--input: the bundle colour v1 does not say how a frame becomes its input" in err
    assert len(err.splitlines()) == 1

    code, _, err = run(capsys, "--input", images, "--score-threshold", "0.5", "--max-detections", "3")
    assert code == 2 and "--score-threshold, --max-detections: for detectors; colour is a classify model" in err
    code, _, err = run(capsys, "--input", images, "--iou-threshold", "1.5")
    assert code == 2 and "1.5 is out of range; valid: 0 to 1" in err
    code, _, err = run(capsys, "--input", images, "--annotate", images)
    assert code == 2 and "is the input's own folder" in err


# -- a detector --------------------------------------------------------------------------------------------------------


def _iou(a: np.ndarray, b: np.ndarray) -> float:
    width = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    height = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = width * height
    return float(inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter))


def bands(image: np.ndarray, box: np.ndarray) -> np.ndarray:
    """The pixels within 2 of a box's edges (pixel coordinates), across the middle of each edge: (N, 3)."""
    x1, y1, x2, y2 = (round(float(v)) for v in box)
    row, column = (y1 + y2) // 2, (x1 + x2) // 2
    across = [image[row, max(0, x - 2) : x + 3] for x in (x1, x2 - 1)]
    across += [image[max(0, y - 2) : y + 3, column] for y in (y1, y2 - 1)]
    return np.concatenate(across).reshape(-1, 3)


@pytest.mark.export
def test_a_detector_s_boxes_on_held_out_images_match_the_truths_and_are_drawn_where_they_are(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The reference detector (``edgeline reference prepare shapes``) exported as its printed command says (on
    onnxruntime fp32, the entry tests/test_shapes_reference.py makes too), run on held-out images: square ones, and
    non-square ones (the left 48 of 96 columns: the letterbox pads them by 24 a side) whose boxes must come back in
    their own coordinates (read in the input's, their widths would be halved: IoU 0.5 at most)."""
    import shlex

    from edgeline.export.reference import shapes
    from edgeline.export.reference.data import rng_for
    from tests.cache import cached_export, cached_reference

    words = shlex.split(cached_reference("shapes").export_command("rpi5"))
    bundle = cached_export(words[2], *words[3:], "--backend", "onnxruntime", "--precision", "fp32")
    capsys.readouterr()  # what a first export printed
    data = shapes.make_images(160, rng_for(0, "shapes-validation"))
    folder = tmp_path / "held-out"
    folder.mkdir()
    truths: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    made = Counter[bool]()
    for index, (image, boxes, classes) in enumerate(zip(data.images, data.boxes, data.classes, strict=True)):
        # non-square where it can be: the left or right 48 columns, where no shape straddles the cut
        inside = [(boxes[:, 0] >= left) & (boxes[:, 2] <= left + 48) for left in (0, 48)]
        left = next((left for left, kept in zip((0, 48), inside, strict=True) if kept.any()
                     and ((boxes[:, 2] <= left) | (boxes[:, 0] >= left + 48) | kept).all()), None)  # fmt: skip
        square = left is None
        if made[square] >= (24 if square else 16):
            continue
        if left is not None:
            kept = inside[left // 48]
            image, boxes, classes = image[:, left : left + 48], boxes[kept] - [left, 0, left, 0], classes[kept]
        made[square] += 1
        name = f"{index:03d}-{'square' if square else 'narrow'}.png"
        Image.fromarray(np.ascontiguousarray(image)).save(folder / name)
        truths[name] = (boxes, classes)

    annotated = tmp_path / "annotated"
    code, out, err = run_bundle(capsys, bundle, "--input", folder, "--json", "--annotate", annotated)
    assert code == 0, err
    records = {Path(r["image"]).name: r for r in map(json.loads, out.splitlines())}
    assert set(records) == set(truths)
    matched, total, drawn_on_edges = Counter[bool](), Counter[bool](), 0
    for name, (boxes, classes) in truths.items():
        record = records[name]
        width, height = record["width"], record["height"]
        square = width == height
        assert (height, width) == (96, 96 if square else 48) and square == name.endswith("-square.png")
        assert "outputs" not in record  # a detector's raw candidates stay out of the answer
        found = [
            (np.asarray(d["box"]) * [width, height, width, height], d["class_index"]) for d in record["detections"]
        ]
        with Image.open(annotated / name) as copy:
            drawn = np.asarray(copy.convert("RGB"))
        for truth, kind in zip(boxes, classes.tolist(), strict=True):
            total[square] += 1
            if max((_iou(box, truth) for box, k in found if k == kind), default=0.0) <= 0.5:
                continue
            matched[square] += 1
            # the copy has the box's line in the class's colour on the truth's edges (within 2 pixels): on one of
            # them at least, as another box's label may cover the others
            drawn_on_edges += any((bands(drawn, truth) == class_colour(kind)).all(axis=1))
    assert made == {True: 24, False: 16} and total[False] >= 16, total
    assert all(matched[square] >= 0.85 * total[square] for square in (True, False)), (matched, total)
    assert drawn_on_edges >= 0.9 * matched.total(), (drawn_on_edges, matched)

    # the thresholds of this run, not the manifest's
    code, out, _ = run_bundle(capsys, bundle, "--input", folder, "--json", "--max-detections", "1")
    assert code == 0 and all(len(json.loads(line)["detections"]) <= 1 for line in out.splitlines())
    code, out, _ = run_bundle(capsys, bundle, "--input", folder, "--json", "--score-threshold", "1")
    assert code == 0 and all(json.loads(line)["detections"] == [] for line in out.splitlines())
    inputs = tmp_path / "inputs.npz"
    name = json.loads((bundle / "manifest.json").read_text())["inputs"][0]["name"]
    np.savez(inputs, **{name: shapes.to_inputs(data.images[:4])})  # samples, as infer took them before images
    code, out, _ = run_bundle(capsys, bundle, "--input", inputs, "--json", "--max-detections", "1")
    answers = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and len(answers) == 4 and [len(answer["detections"]) for answer in answers] == [1] * 4
    first_name = min(name for name in records if name.endswith("-square.png") and len(records[name]["detections"]) > 1)
    code, out, _ = run_bundle(capsys, bundle, "--input", folder / first_name)
    first = out.splitlines()[0]
    record = records[first_name]
    assert first.startswith(f"{folder / first_name} (96x96): {len(record['detections'])} detections: ")
    best = record["detections"][0]
    pixels = " ".join(f"{value * 96:.0f}" for value in best["box"])
    assert f"{best['label']} {best['score']:.2f} [{pixels}]" in first
