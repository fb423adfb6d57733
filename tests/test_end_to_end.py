"""End to end, with real parts: every reference model x {executorch-xnnpack, litert} x {fp32, int8-static}
is trained on its data, exported, verified and run through the device runtime. The detector (``shapes``) is exported
as ``edgeline reference prepare`` says (its head, labels and pre-processing, YOLO folders of images), judged by mAP
and run on its held-out images.

Slow (minutes on 2 cores) and part of the test command all the same.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import edgeline
from edgeline.cli import main
from edgeline.export.reference import REFERENCE_MODELS, Prepared
from edgeline.samples import read_npz, sample_set
from tests.cache import cached_reference

pytestmark = pytest.mark.export

BACKENDS = ("executorch-xnnpack", "litert")
PRECISIONS = ("fp32", "int8-static")

# Budgets wide open: this matrix checks that every combination converts and runs, and asserts fidelity
# itself below; the digits test uses the real rpi5 profile and its 1-point budget.
OPEN_PROFILE = """
id = "test-open"
name = "test profile with open budgets"
description = "every target accepted; fidelity asserted by the tests themselves"
memory_mb = 4096
os = "any"
[cpu]
name = "any"
arch = "x86_64"
cores = 2
isa_features = []
[[targets]]
backend = "litert"
precision = "fp32"
threads = 1
[budgets]
max_accuracy_drop = 100.0
max_map_drop = 100.0
"""


@pytest.fixture(scope="session")
def references() -> dict[str, Prepared]:
    """Trained once for this code (tests/cache.py), shared with the other tests that need them."""
    return {name: cached_reference(name) for name in sorted(REFERENCE_MODELS)}


@pytest.fixture(scope="session")
def open_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("profiles") / "test-open.toml"
    path.write_text(OPEN_PROFILE)
    return path


def export_args(ref: Prepared, profile: str | Path, backend: str, precision: str, out: Path) -> list[str]:
    args = [
        "export", str(ref.model_path), "--profile", str(profile),
        "--calibration", str(ref.calibration_path), "--validation", str(ref.validation_path),
        "--backend", backend, "--precision", precision, "--out", str(out), "--json",
    ]  # fmt: skip
    if ref.task == "classify":
        args += ["--labels", str(ref.labels_path)]
    elif ref.task == "detect":
        assert ref.head is not None and ref.image is not None
        args += ["--task", ref.task, "--head", ref.head, "--labels", str(ref.labels_path), "--preprocess", ref.image]
    else:
        args += ["--task", ref.task]
    return args


def infer_json(bundle: Path, samples: Path, capsys: pytest.CaptureFixture[str]) -> list[dict]:
    capsys.readouterr()
    assert main(["infer", str(bundle), "--input", str(samples), "--json"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(REFERENCE_MODELS))
def test_reference_model_exports_verifies_and_runs(
    name: str,
    backend: str,
    precision: str,
    references: dict[str, Prepared],
    open_profile: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    ref = references[name]
    out = tmp_path / "bundle"
    assert main(export_args(ref, open_profile, backend, precision, out)) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bundle"] == str(out)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["precision"] == precision
    assert manifest["backend"] == {"litert": "litert", "executorch-xnnpack": "executorch"}[backend]
    fidelity = manifest["fidelity"]
    assert fidelity["status"] == "measured"
    if ref.task == "detect":
        _check_detector(ref, out, fidelity, precision, capsys)
        return
    assert fidelity["samples"] == len(read_npz(ref.validation_path)["x"])
    if precision == "fp32":
        assert fidelity["max_abs_error"] < 1e-3
        assert fidelity["cosine_min"] > 0.9999
    if ref.task == "classify":
        assert fidelity["top1_agreement"] >= (0.99 if precision == "fp32" else 0.95)
        assert fidelity["accuracy"] >= fidelity["accuracy_float"] - 0.03
    else:
        assert fidelity["cosine_min"] > 0.95  # 640-value reconstructions: cosine is meaningful here
        assert fidelity["anomaly_agreement"] >= 0.9

    assert main(["verify", str(out)]) == 0
    records = infer_json(out, ref.validation_path, capsys)
    validation = read_npz(ref.validation_path)
    assert len(records) == len(validation["x"])
    # The CLI's outputs are the Model's outputs for the same samples.
    model = edgeline.load(out)
    samples = sample_set(validation, model.inputs, "validation")
    for index in (0, len(samples) - 1):
        expected = model.predict(*samples.sample(index))
        np.testing.assert_allclose(np.array(records[index]["outputs"][0]), expected[0], rtol=1e-6, atol=1e-6)
    if ref.task == "classify":
        assert {r["label"] for r in records} <= set(ref.labels)
    else:
        assert all(isinstance(r["anomaly"], bool) for r in records)


def _check_detector(
    ref: Prepared, out: Path, fidelity: dict, precision: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A detector's bundle: mAP measured against its held-out images' objects, the float model's the one
    reference.json holds; verified; and ``edgeline infer`` on the images answers boxes that find the objects."""
    from edgeline.detection import Detections, mean_average_precision
    from edgeline.export.detection_data import read_detection_dataset
    from edgeline.imaging import FramePrep, image_preprocess, parse_preprocess
    from edgeline.manifest import TensorSpec

    assert ref.image is not None and ref.float_map50 is not None
    spec = TensorSpec(name="images", dtype="float32", shape=(1, *ref.input_shape))
    prep = FramePrep(image_preprocess(parse_preprocess(ref.image), spec), spec)
    held_out = read_detection_dataset(ref.validation_path, "validation", prep, ref.labels)
    assert fidelity["samples"] == len(held_out) >= 300
    assert fidelity["map50_float"] == pytest.approx(ref.float_map50, abs=1e-3)
    # fp32 keeps the float model's boxes; int8 within the 0.02 of mAP@0.5
    assert fidelity["map50"] >= fidelity["map50_float"] - (0.002 if precision == "fp32" else 0.02), fidelity
    assert fidelity["map50_agreement"] >= (0.99 if precision == "fp32" else 0.9), fidelity
    if precision == "fp32":
        assert fidelity["cosine_min"] > 0.9999

    assert main(["verify", str(out)]) == 0
    records = infer_json(out, ref.validation_path, capsys)
    assert [Path(r["image"]).name for r in records] == [path.name for path in held_out.paths]
    found = []
    for record in records:
        detections = record["detections"]
        assert {d["label"] for d in detections} <= set(ref.labels)
        boxes = np.array([d["box"] for d in detections], dtype=np.float64).reshape(-1, 4)
        scores = np.array([d["score"] for d in detections], dtype=np.float32)
        found.append(Detections(boxes, scores, np.array([d["class_index"] for d in detections], dtype=np.int64)))
    # the answers (over the score threshold, boxes normalised to the image) find the objects nearly as well as the
    # evaluation, which keeps every candidate
    answered = mean_average_precision(found, held_out.truths)
    assert answered.map50 >= fidelity["map50"] - 0.05, (answered, fidelity)


@pytest.mark.parametrize("backend", BACKENDS)
def test_digits_int8_accuracy_within_one_point_of_float(
    backend: str, references: dict[str, Prepared], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ref = references["digits"]
    out = tmp_path / "digits"
    assert main(export_args(ref, "rpi5", backend, "int8-static", out)) == 0
    capsys.readouterr()
    records = infer_json(out, ref.validation_path, capsys)
    labels = read_npz(ref.validation_path)["labels"]
    bundle_accuracy = np.mean([r["class_index"] == label for r, label in zip(records, labels, strict=True)])
    fidelity = json.loads((out / "manifest.json").read_text())["fidelity"]
    assert fidelity["accuracy"] == pytest.approx(bundle_accuracy)
    assert fidelity["accuracy_float"] >= 0.95
    assert abs(fidelity["accuracy_float"] - bundle_accuracy) * 100 <= 1.0


def test_profile_targets_in_order_first_within_budget_wins(
    references: dict[str, Prepared], open_profile: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A profile whose first target misses its size budget: the report says why, and the next one wins."""
    ref = references["digits"]
    assert main(export_args(ref, open_profile, "litert", "fp32", tmp_path / "fp32")) == 0
    capsys.readouterr()
    fp32_size = (tmp_path / "fp32" / "model.tflite").stat().st_size
    profile = tmp_path / "tight.toml"
    profile.write_text(
        OPEN_PROFILE.replace('id = "test-open"', 'id = "tight"').replace(
            "[budgets]", '[[targets]]\nbackend = "litert"\nprecision = "int8-static"\nthreads = 1\n[budgets]'
        )
        + f"max_model_bytes = {fp32_size - 1}\n"
    )
    out = tmp_path / "bundle"
    args = [a for a in export_args(ref, profile, "litert", "fp32", out) if a not in ("--backend", "--precision")]
    args.remove("litert")
    args.remove("fp32")
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    first, second = report["targets"]
    assert (first["precision"], first["status"]) == ("fp32", "rejected")
    assert "model size" in first["reason"]
    assert (second["precision"], second["status"]) == ("int8-static", "selected")
    assert json.loads((out / "manifest.json").read_text())["precision"] == "int8-static"
