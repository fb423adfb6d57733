"""``edgeline export --preprocess`` / ``[preprocess]``: an image model's pre-processing written into the bundle, and
image folders as calibration and validation read through the device's own ``FramePrep``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from edgeline.cli import main
from edgeline.imaging import FramePrep, read_image
from edgeline.manifest import ImagePreprocess, TensorSpec
from tests.camera_bundle import MODEL  # a colour classifier: the strongest channel's mean

pytestmark = pytest.mark.export

CLASSES = {"blue": 2, "green": 1, "red": 0}  # folder name -> the RGB channel that dominates its images
SIZES = ((30, 40), (48, 20), (33, 33), (60, 90))


def _picture(rng: np.random.Generator, channel: int, size: tuple[int, int]) -> np.ndarray:
    image = rng.integers(0, 70, (*size, 3))
    image[:, :, channel] += 150
    return image.astype(np.uint8)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("preprocess")
    (root / "colour.py").write_text(MODEL, encoding="utf-8")
    rng = np.random.default_rng(5)
    for name, channel in CLASSES.items():
        for index, size in enumerate(SIZES):
            for folder in (root / "validation" / name, root / "calibration" / "nested" / name):
                folder.mkdir(parents=True, exist_ok=True)
                Image.fromarray(_picture(rng, channel, size)).save(folder / f"{index}.png")
    (root / "calibration" / "notes.txt").write_text("not an image: skipped by its suffix\n")
    return root


def _export(workspace: Path, out: Path, *extra: str) -> dict:
    code = main(
        ["export", f"{workspace / 'colour.py'}:model", "--profile", "x86-64", "--backend", "onnxruntime",
         "--precision", "fp32", "--calibration", str(workspace / "calibration"),
         "--validation", str(workspace / "validation"), "--out", str(out), *extra]
    )  # fmt: skip
    assert code == 0
    return json.loads((out / "manifest.json").read_text(encoding="utf-8"))


def test_the_manifest_carries_image_and_golden_inputs_are_frameprep_of_the_images(
    workspace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = _export(workspace, tmp_path / "bundle", "--preprocess", "resize=letterbox,pad=0,size=24x24")
    image = ImagePreprocess.model_validate(manifest["image"])
    assert image == ImagePreprocess(size=(24, 24), resize="letterbox", pad=0)
    assert manifest["postprocess"]["labels"] == sorted(CLASSES)  # the class sub-folders, sorted
    fidelity = manifest["fidelity"]
    assert fidelity["status"] == "measured" and fidelity["samples"] == len(CLASSES) * len(SIZES)
    assert fidelity["accuracy_float"] == 1.0 and fidelity["accuracy"] == 1.0
    prep = FramePrep(image, TensorSpec(name="image", dtype="float32", shape=(1, 3, 24, 24)))
    paths = [workspace / "validation" / name / f"{i}.png" for name in sorted(CLASSES) for i in range(len(SIZES))]
    with np.load(tmp_path / "bundle" / "golden.npz") as golden:
        inputs = golden["input_0"]
    expected = np.concatenate([prep(read_image(path)) for path in paths[: len(inputs)]])
    np.testing.assert_array_equal(inputs, expected)
    capsys.readouterr()
    assert main(["bundle", "show", str(tmp_path / "bundle")]) == 0
    assert "image:        24x24 rgb, letterbox (pad 0), (x * 0.003922 - 0) / 1, nchw" in capsys.readouterr().out


def test_bgr_declared_for_an_rgb_trained_model_is_refused_naming_the_colour_mistake(
    workspace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "export.toml"
    config.write_text('[preprocess]\nresize = "squash"\nsize = [24, 24]\ncolor = "bgr"\n', encoding="utf-8")
    code = main(
        ["export", f"{workspace / 'colour.py'}:model", "--profile", "x86-64", "--backend", "onnxruntime",
         "--precision", "fp32", "--calibration", str(workspace / "calibration"),
         "--validation", str(workspace / "validation"), "--out", str(tmp_path / "bgr"), "--config", str(config)]
    )  # fmt: skip
    assert code != 0 and not (tmp_path / "bgr").exists()
    err = capsys.readouterr().err
    # red and blue swap places: only the green images are still right (a third), and all of them in RGB
    assert "accuracy 33.3 with the images in bgr order and 100.0 in rgb" in err, err
    said = [line for line in err.splitlines() if "error:" in line]  # (the progress lines go to stderr too)
    assert "--preprocess color=rgb" in err and "Traceback" not in err and len(said) == 1, err


def test_an_image_folder_without_a_preprocessing_is_refused(
    workspace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        ["export", f"{workspace / 'colour.py'}:model", "--profile", "x86-64", "--backend", "onnxruntime",
         "--precision", "fp32", "--calibration", str(workspace / "calibration"), "--out", str(tmp_path / "no")]
    )  # fmt: skip
    assert code != 0
    err = capsys.readouterr().err
    assert "is a folder of images" in err and "--preprocess" in err and "Traceback" not in err


def test_a_module_that_declares_its_preprocessing_needs_no_flag(workspace: Path, tmp_path: Path) -> None:
    declared = tmp_path / "declared.py"
    declared.write_text(MODEL + '\nIMAGE_PREPROCESS = {"resize": "center-crop", "size": [16, 16]}\n', encoding="utf-8")
    code = main(
        ["export", f"{declared}:model", "--profile", "x86-64", "--backend", "onnxruntime", "--precision", "fp32",
         "--calibration", str(workspace / "calibration"), "--validation", str(workspace / "validation"),
         "--out", str(tmp_path / "declared")]
    )  # fmt: skip
    assert code == 0
    manifest = json.loads((tmp_path / "declared" / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["image"]["resize"] == "center-crop" and manifest["image"]["size"] == [16, 16]
    assert manifest["fidelity"]["accuracy_float"] == 1.0


@pytest.mark.parametrize("name", ["vww", "resnet8"])
def test_the_reference_image_models_declare_a_preprocessing_that_fits_them(name: str, tmp_path: Path) -> None:
    from edgeline.export.reference import load_reference
    from edgeline.export.reference.preparation import Prepared
    from edgeline.imaging import image_preprocess, parse_preprocess

    module = load_reference(name)
    text = module.IMAGE_PREPROCESS  # type: ignore[attr-defined]
    image = image_preprocess(
        parse_preprocess(text), TensorSpec(name="x", dtype="float32", shape=(1, *module.INPUT_SHAPE))
    )
    assert (image.color, image.scale, image.layout) == ("rgb", pytest.approx(1 / 255), "nchw")
    prepared = Prepared(name, "classify", module.LABELS, module.INPUT_SHAPE, 1.0, None, 0, tmp_path, image=text)
    assert f"--preprocess {text}" in prepared.export_command()
    assert Prepared.from_json(prepared.to_json(), tmp_path) == prepared
