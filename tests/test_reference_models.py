"""The reference models: registry, architectures, data, training, ``prepare`` and ``edgeline reference``."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from edgeline.errors import EdgelineError
from edgeline.export.reference import (
    CATALOGUE,
    REFERENCE_MODELS,
    Prepared,
    autoencoder,
    find_prepared,
    load_reference,
    prepare,
)
from edgeline.export.reference import cli as reference_cli
from edgeline.export.reference.data import CALIBRATION_SIZE, Dataset, bilinear_resize
from edgeline.export.reference.training import accuracy
from tests.cache import cached_reference

NAMES = ("digits", "resnet8", "ds_cnn", "vww", "autoencoder", "shapes")
ARRAY_NAMES = tuple(name for name in NAMES if CATALOGUE[name].task != "detect")
"""Models whose data are arrays (``Dataset``); a detector's are images with boxes (tests/test_shapes_reference.py)."""
ROOT = Path(__file__).resolve().parents[1]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgeline")
    reference_cli.register(parser.add_subparsers(dest="command", required=True))
    return parser


def _run_cli(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    code: int = args.func(args)
    return code


@pytest.fixture(scope="module")
def prepared_digits() -> Prepared:
    """Trained once for this code (tests/cache.py); never modified here."""
    return cached_reference("digits")


# --- registry -----------------------------------------------------------------------------------------------


@pytest.mark.quick
def test_registry_lists_all_six() -> None:
    assert tuple(REFERENCE_MODELS) == NAMES
    assert REFERENCE_MODELS["digits"] == "edgeline.export.reference.digits"
    assert set(CATALOGUE) == set(NAMES)


@pytest.mark.quick
def test_importing_the_package_and_its_cli_does_not_import_torch() -> None:
    code = "import sys, edgeline.export.reference, edgeline.export.reference.cli; sys.exit('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr or "torch was imported"


@pytest.mark.quick
def test_unknown_name_raises_with_the_valid_names(tmp_path: Path) -> None:
    with pytest.raises(EdgelineError) as caught:
        load_reference("lenet")
    assert "'lenet'" in str(caught.value)
    for name in NAMES:
        assert name in str(caught.value)
    with pytest.raises(EdgelineError):
        prepare("lenet", tmp_path / "lenet")
    assert not (tmp_path / "lenet").exists()


# --- architectures and data ---------------------------------------------------------------------------------


@pytest.mark.export
@pytest.mark.parametrize("name", NAMES)
def test_module_matches_catalogue_and_exports_batch_one(name: str) -> None:
    module = load_reference(name)
    info = CATALOGUE[name]
    declared = {"name": module.NAME, "task": module.TASK, "shape": module.INPUT_SHAPE, "labels": len(module.LABELS)}
    assert declared == {"name": name, "task": info.task, "shape": info.input_shape, "labels": info.label_count}
    model = module.build(seed=0)
    assert not model.training
    example = torch.rand(1, *module.INPUT_SHAPE)
    with torch.no_grad():
        output = model(example)
    if module.TASK == "detect":  # the layout its head names, one score per label
        from edgeline.detection import HEADS, check_output

        assert check_output(HEADS[module.HEAD], tuple(output.shape), len(module.LABELS)) == len(module.LABELS)
    else:
        expected = (1, len(module.LABELS)) if module.TASK == "classify" else (1, *module.INPUT_SHAPE)
        assert tuple(output.shape) == expected
    exported = torch.export.export(model, (example,)).module()
    with torch.no_grad():
        torch.testing.assert_close(exported(example), output)


@pytest.mark.quick
def test_build_is_seeded_and_leaves_the_global_rng_alone() -> None:
    module = load_reference("ds_cnn")
    state = torch.random.get_rng_state()
    first, second, other = module.build(seed=3), module.build(seed=3), module.build(seed=4)
    assert torch.equal(torch.random.get_rng_state(), state)
    weights = [next(iter(model.parameters())) for model in (first, second, other)]
    assert torch.equal(weights[0], weights[1])
    assert not torch.equal(weights[0], weights[2])


@pytest.mark.export
@pytest.mark.parametrize("name", ARRAY_NAMES)
def test_make_data_gives_frozen_arrays_of_the_declared_shape(name: str) -> None:
    module = load_reference(name)
    data = module.make_data(seed=0)
    assert data.input_shape == module.INPUT_SHAPE
    assert data.calibration_x.shape == (CALIBRATION_SIZE, *module.INPUT_SHAPE)
    for array in (data.train_x, data.calibration_x, data.validation_x):
        assert array.dtype == np.float32
        assert np.isfinite(array).all()
        assert not array.flags.writeable
    assert data.train_y.dtype == data.validation_y.dtype == np.int64
    assert 200 <= len(data.validation_x) <= 450
    if module.TASK == "classify":
        assert set(np.unique(data.validation_y)) == set(range(len(module.LABELS)))
    else:
        assert set(np.unique(data.validation_y)) == {0, 1}
        assert not data.train_y.any()


@pytest.mark.quick
def test_dataset_refuses_mismatched_arrays() -> None:
    x = np.zeros((4, 2), dtype=np.float32)
    with pytest.raises(ValueError, match="validation_y"):
        Dataset(train_x=x, train_y=np.zeros(4), calibration_x=x, validation_x=x, validation_y=np.zeros(3))
    with pytest.raises(ValueError, match="calibration_x"):
        Dataset(train_x=x, train_y=np.zeros(4), calibration_x=x[:, :1], validation_x=x, validation_y=np.zeros(4))


@pytest.mark.quick
def test_bilinear_resize_matches_torch() -> None:
    images = np.random.default_rng(0).random((2, 3, 8, 11), dtype=np.float32)
    expected = torch.nn.functional.interpolate(
        torch.from_numpy(images), size=(32, 20), mode="bilinear", align_corners=False
    )
    np.testing.assert_allclose(bilinear_resize(images, 32, 20), expected.numpy(), atol=1e-5)


# --- prepare ------------------------------------------------------------------------------------------------


@pytest.mark.export
def test_prepare_digits_writes_everything(prepared_digits: Prepared) -> None:
    directory = prepared_digits.directory
    assert sorted(path.name for path in directory.iterdir()) == [
        "calibration.npz",
        "labels.txt",
        "model.pt2",
        "reference.json",
        "validation.npz",
    ]
    with np.load(directory / "calibration.npz", allow_pickle=False) as calibration:
        assert calibration.files == ["x"]
        assert calibration["x"].shape == (CALIBRATION_SIZE, 1, 8, 8)
        assert calibration["x"].dtype == np.float32
    with np.load(directory / "validation.npz", allow_pickle=False) as validation:
        assert sorted(validation.files) == ["labels", "x"]
        x, labels = validation["x"], validation["labels"]
    assert x.dtype == np.float32 and labels.dtype == np.int64 and x.shape == (450, 1, 8, 8)
    assert (directory / "labels.txt").read_text().splitlines() == [str(digit) for digit in range(10)]
    document = json.loads((directory / "reference.json").read_text())
    assert document == {
        "name": "digits",
        "task": "classify",
        "labels": [str(digit) for digit in range(10)],
        "input_shape": [1, 8, 8],
        "float_accuracy": prepared_digits.float_accuracy,
        "seed": 0,
    }

    program = torch.export.load(directory / "model.pt2").module()
    measured = accuracy(program, x, labels, batch_size=1)
    assert measured >= 0.95
    assert measured == pytest.approx(prepared_digits.float_accuracy, abs=1 / len(labels))


@pytest.mark.export
def test_prepare_again_is_a_noop(prepared_digits: Prepared) -> None:
    before = {path: path.stat().st_mtime_ns for path in prepared_digits.directory.iterdir()}
    again = prepare("digits", prepared_digits.directory)
    assert again == prepared_digits
    assert {path: path.stat().st_mtime_ns for path in prepared_digits.directory.iterdir()} == before


@pytest.mark.export
def test_a_directory_without_its_reference_json_is_not_prepared(prepared_digits: Prepared, tmp_path: Path) -> None:
    assert find_prepared("digits", prepared_digits.directory) == prepared_digits
    assert find_prepared("digits", prepared_digits.directory, seed=1) is None
    assert find_prepared("resnet8", prepared_digits.directory) is None
    partial = tmp_path / "digits"
    partial.mkdir()
    for path in prepared_digits.files[:-1]:
        (partial / path.name).write_bytes(path.read_bytes())
    assert find_prepared("digits", partial) is None


@pytest.mark.export
def test_training_is_deterministic() -> None:
    module = load_reference("digits")
    data = module.make_data()
    first, second = (module.train(module.build(), data).state_dict() for _ in range(2))
    for key, value in first.items():
        assert torch.equal(value, second[key]), key


@pytest.mark.export
def test_autoencoder_separates_anomalies() -> None:
    """The trained autoencoder (``prepare``'s, cached once for this code and shared with the end-to-end tests): its
    reconstruction error flags the anomalous frames and almost none of the normal ones."""
    program = torch.export.load(cached_reference("autoencoder").model_path).module()
    data = autoencoder.make_data()
    scores = autoencoder.anomaly_scores(program, data.validation_x, batch_size=1)  # exported for one sample a call
    normal, anomalous = scores[data.validation_y == 0], scores[data.validation_y == 1]
    assert anomalous.mean() > 2 * normal.mean()
    threshold = float(np.percentile(autoencoder.anomaly_scores(program, data.calibration_x, batch_size=1), 99.0))
    assert np.mean(normal > threshold) < 0.1
    assert np.mean((scores > threshold) == (data.validation_y == 1)) > 0.8


# --- slower training ----------------------------------------------------------------------------------------


@pytest.mark.export
@pytest.mark.parametrize(("name", "minimum"), [("ds_cnn", 0.9), ("resnet8", 0.9), ("vww", 0.8)])
def test_trained_model_reaches_its_accuracy_and_exports(name: str, minimum: float) -> None:
    """``prepare`` trains it (once for this code: tests/cache.py, shared with the end-to-end tests) and saves it
    exported; the exported program, run here on the held-out data, has the accuracy prepare measured on the
    trained model."""
    prepared = cached_reference(name)
    assert prepared.float_accuracy >= minimum
    with np.load(prepared.validation_path, allow_pickle=False) as validation:
        x, labels = validation["x"], validation["labels"]
    program = torch.export.load(prepared.model_path).module()
    assert accuracy(program, x, labels, batch_size=1) == pytest.approx(prepared.float_accuracy, abs=1 / len(labels))


# --- command line -------------------------------------------------------------------------------------------


@pytest.mark.quick
def test_reference_list_through_register(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run_cli(["reference", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[1:]] == list(NAMES)


@pytest.mark.quick
def test_edgeline_reference_list(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        from edgeline.cli import main
    except ImportError as exc:  # pragma: no cover - another folder's module is mid-edit
        pytest.skip(f"edgeline.cli does not import: {exc}")
    assert main(["reference", "list"]) == 0
    out = capsys.readouterr().out
    for name in NAMES:
        assert name in out


@pytest.mark.export
def test_reference_prepare_reuses_and_prints_the_next_command(
    prepared_digits: Prepared, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = prepared_digits.directory.parent
    before = prepared_digits.reference_path.stat().st_mtime_ns
    assert _run_cli(["reference", "prepare", "digits", "--out", os.fspath(out_dir)]) == 0
    out = capsys.readouterr().out
    assert f"digits: float accuracy {prepared_digits.float_accuracy:.4f}" in out
    assert "already prepared" in out
    assert (
        f"edgeline export {out_dir / 'digits' / 'model.pt2'} --profile rpi5 "
        f"--calibration {out_dir / 'digits' / 'calibration.npz'} "
        f"--validation {out_dir / 'digits' / 'validation.npz'} --labels {out_dir / 'digits' / 'labels.txt'}"
    ) in out
    assert prepared_digits.reference_path.stat().st_mtime_ns == before


@pytest.mark.export
def test_reference_prepare_json_is_one_document(prepared_digits: Prepared, capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = prepared_digits.directory.parent
    assert _run_cli(["reference", "prepare", "digits", "--out", os.fspath(out_dir), "--json"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)
    assert entry["name"] == "digits" and entry["reused"] is True
    assert entry["float_accuracy"] == prepared_digits.float_accuracy and entry["seed"] == prepared_digits.seed
    assert entry["directory"] == os.fspath(prepared_digits.directory)
    assert entry["export"] == prepared_digits.export_command("rpi5")


@pytest.mark.quick
def test_export_command_of_an_anomaly_model_names_task_and_threshold(tmp_path: Path) -> None:
    prepared = Prepared("autoencoder", "anomaly", (), (640,), 0.99, 0.0125, 0, tmp_path / "my models" / "ae")
    assert prepared.labels_path is None
    assert prepared.export_command("rpi4") == (
        f"edgeline export '{tmp_path}/my models/ae/model.pt2' --profile rpi4 "
        f"--calibration '{tmp_path}/my models/ae/calibration.npz' "
        f"--validation '{tmp_path}/my models/ae/validation.npz' --task anomaly --threshold 0.0125"
    )


@pytest.mark.quick
def test_a_detector_s_export_command_names_task_head_labels_and_preprocess(tmp_path: Path) -> None:
    from edgeline.export.reference import shapes

    directory = tmp_path / "my models" / "shapes"
    prepared = Prepared(
        "shapes", "detect", shapes.LABELS, (3, 96, 96), None, None, 0, directory,
        image=shapes.IMAGE_PREPROCESS, head="yolov8", float_map50=0.97, float_map50_95=0.71,
    )  # fmt: skip
    assert prepared.files == tuple(
        directory / name for name in ("model.pt2", "calibration", "validation", "labels.txt", "reference.json")
    )
    assert prepared.export_command("rpi4") == (
        f"edgeline export '{directory}/model.pt2' --profile rpi4 --calibration '{directory}/calibration' "
        f"--validation '{directory}/validation' --task detect --head yolov8 --labels '{directory}/labels.txt' "
        f"--preprocess {shapes.IMAGE_PREPROCESS}"
    )
    document = prepared.to_json()
    assert document["float_accuracy"] is None and document["float_map50"] == 0.97 and document["head"] == "yolov8"
    assert Prepared.from_json(json.loads(json.dumps(document)), directory) == prepared


@pytest.mark.quick
def test_reference_list_shows_the_detector(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run_cli(["reference", "list"]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("shapes ")]
    assert line.split()[:4] == ["shapes", "detect", "3x96x96", "4"]
    assert line.endswith("synthetic: shapes on textured backgrounds")
    assert _run_cli(["reference", "list", "--json"]) == 0
    entries = {entry["name"]: entry for entry in json.loads(capsys.readouterr().out)}
    assert entries["shapes"] == {
        "name": "shapes",
        "task": "detect",
        "input_shape": [3, 96, 96],
        "label_count": 4,
        "data": "synthetic: shapes on textured backgrounds",
    }


@pytest.mark.quick
@pytest.mark.parametrize("names", [["lenet"], ["all", "digits"]])
def test_reference_prepare_refuses_bad_names(names: list[str], tmp_path: Path) -> None:
    with pytest.raises(EdgelineError, match="digits"):
        _run_cli(["reference", "prepare", *names, "--out", os.fspath(tmp_path)])
    assert list(tmp_path.iterdir()) == []
