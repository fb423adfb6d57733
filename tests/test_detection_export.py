"""``edgeline export --task detect --head HEAD``: detectors the tests never trained (tests/detector_variants.py, made
of the reference shapes detector) exported with each head through real converters and runtimes, on held-out
synthetic images in the YOLO layout; mAP as the fidelity check, written in the manifest and equal to what the
bundle gives through ``edgeline.load``; boxes on a non-square image within a pixel of the float model's; the int8
trap (pixel boxes sharing an output with scores) rewritten away, or caught by the mAP budget where it cannot be;
BGR fed to an RGB detector refused; wrong head declarations refused in one line."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from edgeline.cli import main
from edgeline.detection import mean_average_precision
from edgeline.export.loading import load_model
from edgeline.export.reference import shapes
from edgeline.imaging import FramePrep, read_image
from edgeline.model import load
from edgeline.postprocess import frame_detections
from tests.cache import cached_reference
from tests.detector_variants import HEADS, NESTED_FILE, UPSCALED_FILE, UPSCALED_OPAQUE_FILE, write_variants

pytestmark = pytest.mark.export

VALIDATION_IMAGES = 400
SUBSET = 120


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The variants' model files with the reference detector's trained weights, its calibration and validation
    folders (YOLO layout; validation: the held-out images), and labels.txt."""
    prepared = cached_reference("shapes")  # trained once for this code; never modified here
    root = tmp_path_factory.mktemp("detectors")
    program = torch.export.load(prepared.model_path)
    weights = shapes.build(0).state_dict()
    torch.save({key: program.state_dict[key] for key in weights}, root / "detector.pt")
    write_variants(root)
    for name, path in (("calibration", prepared.calibration_path), ("validation", prepared.validation_path)):
        (root / name).symlink_to(path, target_is_directory=True)
    (root / "labels.txt").write_text("".join(f"{label}\n" for label in shapes.LABELS), encoding="utf-8")
    return root


def export(workspace: Path, out: Path, model: str, *extra: str, backend: str = "litert",
           precision: str = "int8-static") -> tuple[int, dict[str, Any] | None]:  # fmt: skip
    code = main(
        ["export", f"{workspace / model}:model", "--profile", "rpi5", "--backend", backend, "--precision", precision,
         "--calibration", str(workspace / "calibration"), "--validation", str(workspace / "validation"),
         "--labels", str(workspace / "labels.txt"), "--out", str(out), *extra]
    )  # fmt: skip
    manifest = out / "manifest.json"
    return code, json.loads(manifest.read_text(encoding="utf-8")) if manifest.is_file() else None


def _truths(workspace: Path) -> tuple[list[Path], list[tuple[np.ndarray, np.ndarray]]]:
    """The validation images and their objects, read back from the YOLO files (boxes x1, y1, x2, y2 normalised)."""
    paths = sorted((workspace / "validation" / "images").iterdir())
    truths = []
    for path in paths:
        rows = np.loadtxt(workspace / "validation" / "labels" / f"{path.stem}.txt", ndmin=2).reshape(-1, 5)
        centre, size = rows[:, 1:3], rows[:, 3:5]
        truths.append((np.concatenate([centre - size / 2, centre + size / 2], axis=1), rows[:, 0].astype(np.int64)))
    return paths, truths


def test_an_int8_detector_keeps_its_boxes_and_its_map_is_what_the_bundle_gives(
    workspace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, manifest = export(workspace, tmp_path / "bundle", HEADS["yolov8"], "--head", "yolov8", "--json")
    assert code == 0 and manifest is not None
    report = json.loads(capsys.readouterr().out)
    fidelity, detection = manifest["fidelity"], manifest["postprocess"]["detection"]
    assert manifest["precision"] == "int8-static" and fidelity["samples"] == VALIDATION_IMAGES
    assert fidelity["map50_float"] >= 0.9 and fidelity["map50"] >= fidelity["map50_float"] - 0.02, fidelity
    assert fidelity["map50_95"] > 0.6 and fidelity["map50_agreement"] > 0.95, fidelity
    # the trap avoided: the pixel boxes were divided inside the model before they met the scores
    assert detection["box_space"] == "normalised" and detection["box_scaling"].startswith("divided by the input")
    assert report["box_scaling"] == detection["box_scaling"]
    layers = manifest["quantization"]["layers"]  # the rewritten model keeps its layers' names (torch.fx)
    assert {"features.2", "distances", "scores"} <= {layer["module"] for layer in layers}, layers
    # what the manifest says is what the bundle gives on the device, image by image
    model = load(tmp_path / "bundle")
    paths, truths = _truths(workspace)
    prep = FramePrep(model.manifest.image, model.inputs[0])  # type: ignore[arg-type]
    found = []
    for path in paths:
        image = read_image(path)
        outputs = model.predict(prep(image))
        found.append(frame_detections(model.manifest.postprocess, outputs[0], prep.geometry(*image.shape[:2]),
                                      {"score_threshold": 0.001}))  # fmt: skip
    again = mean_average_precision(found, truths)
    assert again.map50 == pytest.approx(fidelity["map50"], abs=1e-9)
    assert again.map50_95 == pytest.approx(fidelity["map50_95"], abs=1e-9)


@pytest.mark.parametrize("head", sorted(HEADS))
def test_each_head_exports_and_its_boxes_are_the_float_model_s_within_a_pixel(
    head: str, workspace: Path, tmp_path: Path
) -> None:
    code, manifest = export(workspace, tmp_path / "bundle", HEADS[head], "--head", head, backend="onnxruntime",
                            precision="fp32")  # fmt: skip
    assert code == 0 and manifest is not None
    fidelity = manifest["fidelity"]
    assert manifest["postprocess"]["detection"]["head"] == head
    assert fidelity["map50"] == pytest.approx(fidelity["map50_float"], abs=1e-3) and fidelity["map50"] > 0.85
    # a non-square picture: a held-out image on a wider background (its letterbox has bands above and below)
    picture = np.full((96, 200, 3), 90, dtype=np.uint8)
    picture[:, 60:156] = read_image(sorted((workspace / "validation" / "images").iterdir())[3])
    model = load(tmp_path / "bundle")
    prep = FramePrep(model.manifest.image, model.inputs[0])  # type: ignore[arg-type]
    geometry = prep.geometry(*picture.shape[:2])
    post = model.manifest.postprocess
    bundle = frame_detections(post, model.predict(prep(picture))[0], geometry)
    with torch.no_grad():
        reference = load_model(f"{workspace / HEADS[head]}:model").module(torch.from_numpy(prep(picture))).numpy()
    expected = frame_detections(post, reference, geometry)
    assert len(bundle) == len(expected) >= 1
    assert np.array_equal(bundle.classes, expected.classes)
    pixels = np.abs(bundle.boxes - expected.boxes) * [200, 96, 200, 96]
    assert pixels.max() < 1.0, pixels


def test_pixel_boxes_beside_scores_lose_int8_s_scores_unless_rewritten_and_the_map_budget_catches_it(
    workspace: Path, tmp_path: Path
) -> None:
    """A 384x384 detector whose boxes (0 to 384) and scores (0 to 1) make one output: in int8 they would share a
    step of 1.5. Where the output is the concatenation, edgeline divides the boxes inside the model and the int8
    bundle holds its mAP."""
    code, rewritten = export(workspace, tmp_path / "rewritten", UPSCALED_FILE, "--head", "yolov8",
                             "--no-mixed-precision")  # fmt: skip
    assert code == 0 and rewritten is not None
    fidelity = rewritten["fidelity"]
    assert rewritten["postprocess"]["detection"]["box_space"] == "normalised"
    assert fidelity["map50"] >= fidelity["map50_float"] - 0.02, fidelity


def test_a_head_module_that_makes_the_output_has_its_boxes_divided_inside_it(workspace: Path, tmp_path: Path) -> None:
    """As a YOLO model is built (its last module, the head, concatenates), the concatenation is one module down:
    rewritten there, every layer still named as the original's in the layer report."""
    code, manifest = export(workspace, tmp_path / "nested", NESTED_FILE, "--head", "yolov8", "--no-mixed-precision")
    assert code == 0 and manifest is not None
    detection, fidelity = manifest["postprocess"]["detection"], manifest["fidelity"]
    assert detection["box_space"] == "normalised" and detection["box_scaling"].startswith("divided"), detection
    assert fidelity["map50"] >= fidelity["map50_float"] - 0.02, fidelity
    layers = {layer["module"] for layer in manifest["quantization"]["layers"]}
    assert {"backbone.2", "head.distances", "head.scores"} <= layers, layers


def test_where_the_boxes_cannot_be_rewritten_int8_misses_the_map_budget_and_says_why(
    workspace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Mixed precision tries by the mAP budget too (the layers int8 hurts most kept float, one at a time); here the
    loss is the output's one scale, which no layer kept float restores, and the export says all of it."""
    code, opaque = export(workspace, tmp_path / "opaque", UPSCALED_OPAQUE_FILE, "--head", "yolov8")
    assert code != 0 and opaque is None
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "misses the rpi5 budgets: mAP@0.5 drop" in errors[0], errors
    assert "in float one at a time (mixed precision) did not meet it" in errors[0], errors
    # each group tried says what it measured and what became of it (issue 53: "did not meet" with no reason)
    assert ": mAP@0.5 drop " in errors[0] and "no better: put back in int8)" in errors[0], errors
    assert "the boxes were left in pixels: output 0 is not made by a concatenation" in errors[0], errors


def test_the_automatic_choice_passes_over_int8_targets_that_lose_the_boxes_map(
    workspace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """rpi5's targets in order: LiteRT int8, ExecuTorch int8, LiteRT fp16. For the detector whose pixel boxes
    cannot be divided, both int8 targets miss the mAP budget and the choice is fp16, as an expert's would be."""
    code = main(
        ["export", f"{workspace / UPSCALED_OPAQUE_FILE}:model", "--head", "yolov8", "--profile", "rpi5",
         "--calibration", str(workspace / "calibration"), "--validation", str(workspace / "validation"),
         "--labels", str(workspace / "labels.txt"), "--out", str(tmp_path / "auto"), "--no-mixed-precision", "--json"]
    )  # fmt: skip
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    rows = {(t["backend"], t["precision"]): t for t in report["targets"]}
    for target in (("litert", "int8-static"), ("executorch-xnnpack", "int8-static")):
        assert rows[target]["status"] == "rejected" and "mAP@0.5 drop" in rows[target]["reason"], rows[target]
    chosen = rows[("litert", "fp16")]
    assert chosen["status"] == "selected", chosen
    assert chosen["fidelity"]["map50"] >= chosen["fidelity"]["map50_float"] - 0.005
    assert report["box_scaling"].startswith("left in pixels")


def test_bgr_fed_to_an_rgb_detector_is_refused(
    workspace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, manifest = export(workspace, tmp_path / "bgr", HEADS["yolov8"], "--head", "yolov8", "--preprocess",
                            "color=bgr", backend="onnxruntime", precision="fp32")  # fmt: skip
    assert code != 0 and manifest is None
    err = capsys.readouterr().err
    assert "with the images in bgr order" in err and "it was trained on rgb" in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    ("model", "flags", "said"),
    [
        (HEADS["yolov8"], ["--head", "yolov5"], "head yolov5 expects output 0 of shape (1, N, 5+C)"),
        (HEADS["yolov8"], ["--head", "end2end"], "144 values per row, not 6: it reads as --head yolov8"),
        (HEADS["yolov5"], ["--head", "yolov8"], "it reads as --head yolov5"),
        (HEADS["yolov8"], ["--task", "detect"], "--task detect needs the output's layout: --head"),
        (HEADS["yolov8"], ["--head", "yolov8", "--task", "classify"], "use --task detect"),
    ],
)
def test_a_wrong_head_declaration_is_refused_in_one_line(
    model: str, flags: list[str], said: str, workspace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, manifest = export(workspace, tmp_path / "wrong", model, *flags, backend="onnxruntime", precision="fp32")
    assert code != 0 and manifest is None
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and said in errors[0] and "Traceback" not in errors[0], errors


def test_a_detection_table_describes_a_head_and_sets_the_answers_defaults(workspace: Path, tmp_path: Path) -> None:
    config = tmp_path / "export.toml"
    config.write_text('[detection]\nlayout = "attributes-first"\nscore_threshold = 0.4\nmax_detections = 7\n',
                      encoding="utf-8")  # fmt: skip
    code, manifest = export(workspace, tmp_path / "custom", HEADS["yolov8"], "--config", str(config),
                            backend="onnxruntime", precision="fp32")  # fmt: skip
    assert code == 0 and manifest is not None
    detection = manifest["postprocess"]["detection"]
    assert (detection["head"], detection["layout"], detection["box_format"]) == ("custom", "attributes-first", "xywh")
    assert (detection["score_threshold"], detection["max_detections"]) == (0.4, 7)
    assert math.isclose(manifest["fidelity"]["map50"], manifest["fidelity"]["map50_float"], abs_tol=1e-3)


@pytest.mark.parametrize(
    ("backend", "profile"),
    [("executorch-xnnpack", "rpi5"), ("openvino", "intel-core-ultra"), ("qnn-htp", "qcs6490"),
     ("tflite-micro", "cortex-m4"), ("ethos-u", "ethos-u55-128")],
)  # fmt: skip
def test_every_int8_target_measures_the_detector_s_map_through_its_own_runtime(
    backend: str, profile: str, workspace: Path, tmp_path: Path
) -> None:
    """The targets the profiles list, a 96x96 detector for the microcontrollers; on a third of the held-out images
    (the whole set is the benchmark's: benchmarks/results/detection.md)."""
    subset = tmp_path / "validation"
    for folder in ("images", "labels"):
        (subset / folder).mkdir(parents=True)
    for picture in sorted((workspace / "validation" / "images").iterdir())[:SUBSET]:
        shutil.copyfile(picture, subset / "images" / picture.name)  # (a label file that is a link is refused)
        label = workspace / "validation" / "labels" / f"{picture.stem}.txt"
        shutil.copyfile(label, subset / "labels" / label.name)
    code = main(
        ["export", f"{workspace / HEADS['yolov8']}:model", "--head", "yolov8", "--profile", profile, "--backend",
         backend, "--precision", "int8-static", "--calibration", str(workspace / "calibration"), "--validation",
         str(subset), "--labels", str(workspace / "labels.txt"), "--out", str(tmp_path / "bundle")]
    )  # fmt: skip
    assert code == 0
    manifest = json.loads((tmp_path / "bundle" / "manifest.json").read_text(encoding="utf-8"))
    fidelity = manifest["fidelity"]
    assert fidelity["status"] == "measured" and fidelity["samples"] == SUBSET
    assert fidelity["map50_float"] > 0.9 and fidelity["map50"] >= fidelity["map50_float"] - 0.02, fidelity
    assert manifest["postprocess"]["detection"]["box_space"] == "normalised"
