"""Every user mistake gets exit code 2 and one clear line on stderr, never a traceback.

Almost every mistake is caught before any conversion starts, so these tests stay quick. The operator that LiteRT
cannot lower needs a real conversion; it and the out-of-range labels test ask for fp32, the cheapest one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from edgeline.cli import main
from edgeline.device_profiles import profile_ids

from .conftest import CLASSES, IMAGE_SHAPE

RunError = Callable[..., str]


@pytest.fixture
def user_error(capsys: pytest.CaptureFixture[str]) -> RunError:
    """Run ``edgeline ARGV``; assert exit code 2, no traceback and one error line; return that line."""

    def run(*argv: str | Path) -> str:
        args = [str(arg) for arg in argv]
        code = main(args)
        captured = capsys.readouterr()
        assert "Traceback" not in captured.out + captured.err
        assert code == 2, f"exit code {code}; stderr:\n{captured.err}"
        action = args[1] if args[0] in ("profiles", "reference") else None  # commands with actions name them
        prefix = f"edgeline {args[0]}{f' {action}' if action else ''}: error: "
        lines = [line for line in captured.err.splitlines() if line.startswith(prefix)]
        assert len(lines) == 1, captured.err
        assert captured.err.rstrip("\n").endswith(lines[0]), "the error line must be the last thing printed"
        return lines[0].removeprefix(prefix)

    return run


def _write(path: Path, source: str) -> Path:
    path.write_text(source, encoding="utf-8")
    return path


@pytest.fixture
def export_args(tiny_model_file: Path, sample_files: dict[str, Path], tmp_path: Path) -> list[str | Path]:
    """A valid export command line up to its options; tests add or replace what they break."""
    return [
        "export",
        f"{tiny_model_file}:model",
        "--profile",
        "rpi5",
        "--calibration",
        sample_files["calibration"],
        "--out",
        tmp_path / "out" / "tiny",
    ]


def _with_model(args: list[str | Path], spec: str) -> list[str | Path]:
    return [args[0], spec, *args[2:]]


def _replace(args: list[str | Path], option: str, value: str | Path) -> list[str | Path]:
    args = list(args)
    args[args.index(option) + 1] = value
    return args


# ---------------------------------------------------------------------------------------------------------------------
# edgeline export: profile, model, options


@pytest.mark.export
def test_unknown_profile_lists_the_valid_ones(user_error: RunError, export_args: list[str | Path]) -> None:
    message = user_error(*_replace(export_args, "--profile", "rpi9"))
    assert "unknown profile 'rpi9'" in message
    for profile in ("jetson-orin-nano", "rpi-zero-2w", "rpi4", "rpi5", "x86-64"):
        assert profile in message


@pytest.mark.export
def test_a_model_file_that_does_not_exist(user_error: RunError, export_args: list[str | Path], tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.py"
    message = user_error(*_with_model(export_args, f"{missing}:model"))
    assert message == f"model file {missing}: no such file"


@pytest.mark.export
def test_a_missing_function_lists_the_callables(
    user_error: RunError, export_args: list[str | Path], tiny_model_file: Path
) -> None:
    message = user_error(*_with_model(export_args, f"{tiny_model_file}:nope"))
    assert "has no function 'nope'" in message
    assert "callables there: Tiny, model" in message


@pytest.mark.export
def test_a_function_returning_something_else_than_a_module(
    user_error: RunError, export_args: list[str | Path], tmp_path: Path
) -> None:
    source = _write(tmp_path / "not_a_module.py", "def model():\n    return [1, 2, 3]\n")
    message = user_error(*_with_model(export_args, f"{source}:model"))
    assert message == f"{source}:model returned list, expected a torch.nn.Module"


@pytest.mark.export
def test_a_model_file_whose_import_raises(user_error: RunError, export_args: list[str | Path], tmp_path: Path) -> None:
    source = _write(tmp_path / "broken.py", "import math\n\nraise RuntimeError('no GPU here')\n\ndef model(): ...\n")
    message = user_error(*_with_model(export_args, f"{source}:model"))
    assert f"importing {source} failed: RuntimeError: no GPU here" in message
    assert f"{source}:3" in message  # where it raised


@pytest.mark.export
def test_a_function_that_raises(user_error: RunError, export_args: list[str | Path], tmp_path: Path) -> None:
    source = _write(tmp_path / "raises.py", "def model():\n    raise ValueError('weights not found')\n")
    message = user_error(*_with_model(export_args, f"{source}:model"))
    assert "raised ValueError: weights not found" in message


@pytest.mark.export
@pytest.mark.parametrize("spec", ["tiny.py", "tiny", ":model", "tiny.py:"])
def test_a_model_spec_without_file_and_function(user_error: RunError, export_args: list[str | Path], spec: str) -> None:
    message = user_error(*_with_model(export_args, spec))
    assert f"MODEL {spec!r}: expected path/to/file.py:function, package.module:function or a .pt2 file" in message


@pytest.mark.export
def test_an_unknown_backend_lists_the_valid_ones(user_error: RunError, export_args: list[str | Path]) -> None:
    from edgeline.export.backends import EXPORT_BACKENDS

    choices = ", ".join(f"'{name}'" for name in sorted(EXPORT_BACKENDS))
    expected = f"argument --backend: invalid choice: 'tensorrt' (choose from {choices})"
    assert user_error(*export_args, "--backend", "tensorrt", "--precision", "fp32") == expected
    assert user_error(*export_args, "--backend", "tensorrt") == expected


@pytest.mark.export
def test_a_precision_the_backend_cannot_export_lists_the_valid_ones(
    user_error: RunError, export_args: list[str | Path], tmp_path: Path
) -> None:
    message = user_error(*export_args, "--backend", "executorch-xnnpack", "--precision", "fp16")
    assert message == "executorch-xnnpack does not export fp16; valid: fp32, int8-dynamic, int8-static"
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.export
def test_a_profile_without_the_asked_target_lists_its_targets(
    user_error: RunError, export_args: list[str | Path]
) -> None:
    message = user_error(*export_args, "--precision", "int8-dynamic")
    assert "profile rpi5 has no target matching */int8-dynamic" in message
    assert "litert/int8-static, executorch-xnnpack/int8-static, litert/fp16, litert/fp32" in message


@pytest.mark.export
def test_an_existing_output_directory_is_left_alone_without_force(
    user_error: RunError, export_args: list[str | Path], tmp_path: Path
) -> None:
    out = tmp_path / "out" / "tiny"
    out.mkdir(parents=True)
    (out / "notes.txt").write_text("keep me", encoding="utf-8")
    (out / "model.tflite").write_bytes(b"\x00\x01")
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    message = user_error(*export_args, "--backend", "litert", "--precision", "fp32")
    assert message == f"output directory {out} exists; pass --force to replace it"
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before
    assert sorted(path.name for path in out.parent.iterdir()) == ["tiny"], "no staging directory may be left behind"


@pytest.mark.export
def test_an_output_path_that_is_a_file_is_refused(
    user_error: RunError, export_args: list[str | Path], tmp_path: Path
) -> None:
    out = tmp_path / "out" / "tiny"
    out.parent.mkdir(parents=True)
    out.write_text("a file", encoding="utf-8")
    message = user_error(*export_args)
    assert "exists; pass --force to replace it" in message
    assert out.read_text(encoding="utf-8") == "a file"


@pytest.mark.export
def test_an_invalid_bundle_name(user_error: RunError, export_args: list[str | Path]) -> None:
    message = user_error(*export_args, "--name", "../evil")
    assert message == "--name '../evil': a bundle name is letters, digits, '.', '_' and '-' (128 at most)"


@pytest.mark.export
def test_a_name_taken_from_the_model_file_is_checked_too(
    user_error: RunError, export_args: list[str | Path], tiny_model_file: Path, tmp_path: Path
) -> None:
    spaced = _write(tmp_path / "my model.py", tiny_model_file.read_text(encoding="utf-8"))
    message = user_error(*_with_model(export_args, f"{spaced}:model"))
    assert message.startswith(f"the name taken from {spaced}:model (give --name) 'my model': a bundle name is")


# ---------------------------------------------------------------------------------------------------------------------
# edgeline export: sample files


@pytest.mark.export
def test_a_calibration_file_that_does_not_exist(
    user_error: RunError, export_args: list[str | Path], tmp_path: Path
) -> None:
    missing = tmp_path / "missing.npz"
    message = user_error(*_replace(export_args, "--calibration", missing))
    assert message == f"calibration file {missing}: no such file"


@pytest.mark.export
def test_a_calibration_file_that_is_not_an_npz(
    user_error: RunError, export_args: list[str | Path], tmp_path: Path
) -> None:
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    message = user_error(*_replace(export_args, "--calibration", garbage))
    assert message.startswith(f"calibration file {garbage}: not a readable .npz file")


@pytest.mark.export
def test_a_calibration_file_saved_with_np_save(
    user_error: RunError, export_args: list[str | Path], tmp_path: Path
) -> None:
    """A single array saved with ``np.save`` (a common slip) is not an .npz: say so, do not crash."""
    single = tmp_path / "calibration.npy"
    np.save(single, np.zeros((4, *IMAGE_SHAPE), dtype=np.float32))
    message = user_error(*_replace(export_args, "--calibration", single))
    assert str(single) in message
    assert ".npz" in message


@pytest.mark.export
def test_a_calibration_file_with_the_wrong_number_of_arrays(
    user_error: RunError, export_args: list[str | Path], tmp_path: Path
) -> None:
    path = tmp_path / "two.npz"
    np.savez(path, image=np.zeros((4, *IMAGE_SHAPE), np.float32), mask=np.zeros((4, *IMAGE_SHAPE), np.float32))
    message = user_error(*_replace(export_args, "--calibration", path))
    assert "holds 2 input arrays (image, mask) but the model's forward takes 1 (image)" in message


@pytest.mark.export
def test_a_calibration_sample_shape_the_model_rejects(
    user_error: RunError, export_args: list[str | Path], tmp_path: Path
) -> None:
    path = tmp_path / "small.npz"
    np.savez(path, image=np.zeros((4, 1, 7, 7), np.float32))
    message = user_error(*_replace(export_args, "--calibration", path))
    assert "the model rejected a calibration sample of shape [1, 1, 7, 7]" in message


@pytest.mark.export
@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.bool_])
def test_a_calibration_file_with_a_non_float_dtype(
    user_error: RunError, export_args: list[str | Path], tmp_path: Path, dtype: type
) -> None:
    path = tmp_path / "ints.npz"
    np.savez(path, image=np.zeros((4, *IMAGE_SHAPE), dtype=dtype))
    message = user_error(*_replace(export_args, "--calibration", path))
    assert f"[image]: dtype {np.dtype(dtype)}, expected floating point" in message


@pytest.mark.export
def test_validation_samples_of_another_shape_than_calibration(
    user_error: RunError, export_args: list[str | Path], tmp_path: Path
) -> None:
    path = tmp_path / "validation.npz"
    np.savez(path, image=np.zeros((4, 1, 8, 9), np.float32))
    message = user_error(*export_args, "--validation", path)
    assert "sample shape [1, 8, 9] differs from the calibration's [1, 8, 8]" in message


@pytest.mark.export
def test_validation_labels_of_the_wrong_count(
    user_error: RunError, export_args: list[str | Path], tmp_path: Path
) -> None:
    path = tmp_path / "validation.npz"
    np.savez(path, image=np.zeros((4, *IMAGE_SHAPE), np.float32), labels=np.arange(3))
    message = user_error(*export_args, "--validation", path)
    assert "[labels]: 3 labels for 4 samples" in message


@pytest.mark.export
def test_a_labels_file_with_the_wrong_count(
    user_error: RunError, export_args: list[str | Path], tmp_path: Path
) -> None:
    labels = _write(tmp_path / "labels.txt", "cat\ndog\nbird\n")
    message = user_error(*export_args, "--labels", labels)
    assert message == f"--labels gives 3 labels but the model has {CLASSES} outputs"


@pytest.mark.export
def test_a_labels_file_that_does_not_exist(user_error: RunError, export_args: list[str | Path], tmp_path: Path) -> None:
    message = user_error(*export_args, "--labels", tmp_path / "labels.txt")
    assert message.startswith(f"--labels {tmp_path / 'labels.txt'}: ")


@pytest.mark.export
def test_validation_labels_outside_the_model_classes(
    user_error: RunError, export_args: list[str | Path], tmp_path: Path
) -> None:
    """Labels 0..9 fit a 10-class model; 10 and -1 do not. Refuse them with a clear line, not an IndexError."""
    path = tmp_path / "validation.npz"
    labels = np.array([0, 3, 9, 10, -1, 2])
    np.savez(path, image=np.zeros((6, *IMAGE_SHAPE), np.float32), labels=labels)
    message = user_error(*export_args, "--validation", path, "--backend", "litert", "--precision", "fp32")
    assert "labels" in message
    assert "10" in message


# ---------------------------------------------------------------------------------------------------------------------
# edgeline export: an operator one backend cannot lower

ANTIALIASED_RESIZE_MODEL = '''\
import torch.nn.functional as F
from torch import nn


class Resize(nn.Module):
    """Antialiased bilinear downscaling (aten._upsample_bilinear2d_aa): ExecuTorch runs it, litert-torch cannot."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 10)

    def forward(self, image):
        small = F.interpolate(image, size=(4, 4), mode="bilinear", antialias=True)
        return self.fc(small.flatten(1))


def model():
    return Resize()
'''


@pytest.mark.export
def test_an_operator_litert_cannot_lower_names_it_and_the_backend_that_can(
    user_error: RunError, export_args: list[str | Path], tmp_path: Path
) -> None:
    source = _write(tmp_path / "resize.py", ANTIALIASED_RESIZE_MODEL)
    args = _with_model(export_args, f"{source}:model")
    message = user_error(*args, "--backend", "litert", "--precision", "fp32")
    assert message.startswith("litert could not convert the model to fp32")
    assert "aten._upsample_bilinear2d_aa" in message
    assert re.search(r"; backends that convert it at fp32: [^;]*\bexecutorch-xnnpack\b", message), message
    assert "litert converts it at" not in message  # the operator fails at every precision
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir()), "nothing may be left behind"


# ---------------------------------------------------------------------------------------------------------------------
# edgeline infer and profiles


@pytest.mark.quick
def test_infer_on_a_missing_bundle(user_error: RunError, sample_files: dict[str, Path], tmp_path: Path) -> None:
    missing = tmp_path / "no-bundle"
    message = user_error("infer", missing, "--input", sample_files["validation"])
    assert message == f"{missing}: no such bundle"


@pytest.mark.quick
def test_infer_on_a_directory_that_is_not_a_bundle(
    user_error: RunError, sample_files: dict[str, Path], tmp_path: Path
) -> None:
    message = user_error("infer", tmp_path, "--input", sample_files["validation"])
    assert message == f"{tmp_path}: not a bundle (no manifest.json)"


@pytest.mark.quick
def test_infer_on_a_file(user_error: RunError, sample_files: dict[str, Path]) -> None:
    message = user_error("infer", sample_files["calibration"], "--input", sample_files["validation"])
    assert "a bundle is a directory holding manifest.json" in message


@pytest.mark.quick
def test_infer_with_inputs_of_the_wrong_shape(user_error: RunError, litert_bundle: Path, tmp_path: Path) -> None:
    path = tmp_path / "wrong.npz"
    np.savez(path, image=np.zeros((3, 1, 4, 4), np.float32))
    message = user_error("infer", litert_bundle, "--input", path)
    assert f"{path}[image]: shape [3, 1, 4, 4] does not fit model input" in message
    assert "(expected [N, 1, 8, 8])" in message


@pytest.mark.quick
def test_infer_with_a_missing_input_file(user_error: RunError, litert_bundle: Path, tmp_path: Path) -> None:
    message = user_error("infer", litert_bundle, "--input", tmp_path / "nothing.npz")
    assert message == f"input file {tmp_path / 'nothing.npz'}: no such file"


@pytest.mark.quick
def test_infer_with_an_input_saved_with_np_save(user_error: RunError, litert_bundle: Path, tmp_path: Path) -> None:
    path = tmp_path / "samples.npy"
    np.save(path, np.zeros((2, *IMAGE_SHAPE), np.float32))
    message = user_error("infer", litert_bundle, "--input", path)
    assert str(path) in message and ".npz" in message


@pytest.mark.quick
def test_infer_with_nan_in_the_inputs(user_error: RunError, litert_bundle: Path, tmp_path: Path) -> None:
    images = np.zeros((2, *IMAGE_SHAPE), np.float32)
    images[1, 0, 3, 3] = np.nan
    path = tmp_path / "nan.npz"
    np.savez(path, image=images)
    message = user_error("infer", litert_bundle, "--input", path)
    assert "contains NaN or Inf" in message


@pytest.mark.quick
def test_profiles_show_an_unknown_id(user_error: RunError) -> None:
    message = user_error("profiles", "show", "nope")
    assert f"unknown profile 'nope'; valid profiles: {', '.join(profile_ids())}" in message


@pytest.mark.export
def test_validation_labels_that_are_not_whole_numbers_are_refused(
    user_error: RunError, export_args: list[str | Path], tmp_path: Path
) -> None:
    path = tmp_path / "validation.npz"
    np.savez(path, image=np.zeros((4, *IMAGE_SHAPE), np.float32), labels=np.array([0.0, 1.0, 2.5, 3.0]))
    message = user_error(*export_args, "--validation", path)
    assert f"{path}[labels]: labels are class indices (whole numbers); found 2.5 at index 2" in message


@pytest.mark.export
def test_labels_stored_as_whole_floats_count_as_classes(
    export_args: list[str | Path], sample_files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """numpy and pandas often store class indices as floats: they are classes (accuracy measured), never ignored."""
    with np.load(sample_files["validation"]) as data:
        image, labels = data["image"], data["labels"]
    path = tmp_path / "validation.npz"
    np.savez(path, image=image, labels=labels.astype(np.float64))
    args = [*_replace(export_args, "--out", tmp_path / "floats"), "--validation", path, "--backend", "litert",
            "--precision", "fp32", "--json"]  # fmt: skip
    assert main([str(arg) for arg in args]) == 0
    (target,) = json.loads(capsys.readouterr().out)["targets"]
    assert target["fidelity"]["accuracy"] is not None and target["fidelity"]["accuracy_float"] is not None
