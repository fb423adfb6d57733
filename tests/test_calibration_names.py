"""Sample files meet a model by their arrays' names: each array named after a parameter of ``forward`` (in any order)
is that parameter's, numpy's default names (``arr_0``, ``arr_1``, ...) map by the position in the name, and any
other names are refused with one line naming the file, the names found and the names expected, by ``edgeline
export`` for calibration and validation files and by ``edgeline infer`` on the device alike.

The model takes two inputs of different shapes, so arrays taken in the wrong order cannot pass unnoticed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgeline.cli import main
from tests.cache import cached_export
from tests.tiny_bundle import COMMITTED_BUNDLE, IMAGE_SHAPE, PAIR_MODEL_SOURCE

IMAGE, MASK = (4,), (2,)  # one sample of each: (1, 4) and (1, 2)


def _images(rng: np.random.Generator, count: int) -> np.ndarray:
    return rng.random((count, *IMAGE), dtype=np.float32)


def _masks(rng: np.random.Generator, count: int) -> np.ndarray:
    return rng.random((count, *MASK), dtype=np.float32)


def _error_line(capsys: pytest.CaptureFixture[str], command: str, args: list[str | Path]) -> str:
    """Run ``edgeline COMMAND ARGS``; assert exit code 2 and no traceback; return the one error line."""
    capsys.readouterr()
    code = main([command, *map(str, args)])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert code == 2, f"exit code {code}; stderr:\n{captured.err}"
    prefix = f"edgeline {command}: error: "
    lines = [line.removeprefix(prefix) for line in captured.err.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, captured.err
    return lines[0]


@pytest.fixture(scope="module")
def pair_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pair_model") / "pair.py"
    path.write_text(PAIR_MODEL_SOURCE, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def pair_samples(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Calibration saved unnamed but written last-first (``arr_1`` before ``arr_0``); validation named after
    forward's parameters but in the other order, with labels. Both only fit the model when taken by name."""
    root = tmp_path_factory.mktemp("pair_samples")
    rng = np.random.default_rng(20260417)
    calibration, validation = root / "calibration.npz", root / "validation.npz"
    np.savez(calibration, arr_1=_masks(rng, 16), arr_0=_images(rng, 16))
    np.savez(validation, mask=_masks(rng, 8), labels=rng.integers(0, 3, 8), image=_images(rng, 8))
    return {"calibration": calibration, "validation": validation}


@pytest.fixture(scope="module")
def pair_bundle(pair_model: Path, pair_samples: dict[str, Path]) -> Path:
    """Exported once for this code (tests/cache.py); never modified here."""
    return cached_export(
        f"{pair_model}:model", "--profile", "rpi5", "--calibration", pair_samples["calibration"],
        "--validation", pair_samples["validation"], "--backend", "litert", "--precision", "fp32",
    )  # fmt: skip


@pytest.mark.export
@pytest.mark.workstation
def test_arrays_are_taken_by_name_and_numpys_default_names_by_position(
    pair_bundle: Path, pair_samples: dict[str, Path]
) -> None:
    """The bundle's golden inputs are the validation file's arrays, each in its parameter's place, and its labels
    stayed the labels (the file's third array, between the other two)."""
    validation = np.load(pair_samples["validation"])
    golden = np.load(pair_bundle / "golden.npz")
    count = golden["input_0"].shape[0]
    np.testing.assert_array_equal(golden["input_0"], validation["image"][:count])
    np.testing.assert_array_equal(golden["input_1"], validation["mask"][:count])


@pytest.mark.export
@pytest.mark.workstation
@pytest.mark.parametrize("role", ["calibration", "validation"])
@pytest.mark.parametrize(
    "names", [("image", "masks"), ("arr_0", "mask"), ("arr_0", "arr_2"), ("input_0", "input_1")], ids="-".join
)
def test_a_file_whose_array_names_differ_from_forwards_is_refused_naming_both(
    role: str,
    names: tuple[str, str],
    pair_model: Path,
    pair_samples: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    rng = np.random.default_rng(5)
    path = tmp_path / f"{role}.npz"
    np.savez(path, **{names[0]: _images(rng, 8), names[1]: _masks(rng, 8)})  # in forward's order: still refused
    files = {**pair_samples, role: path}
    args: list[str | Path] = [
        f"{pair_model}:model", "--profile", "rpi5", "--calibration", files["calibration"],
        "--validation", files["validation"], "--backend", "litert", "--precision", "fp32", "--out", tmp_path / "out",
    ]  # fmt: skip
    message = _error_line(capsys, "export", args)
    assert message.startswith(f"{role} file {path}: array names ({', '.join(names)}) differ from ")
    assert "the inputs the model's forward takes (image, mask)" in message
    assert not (tmp_path / "out").exists()


@pytest.mark.export
@pytest.mark.workstation
def test_infer_on_the_device_takes_arrays_the_same_way(
    pair_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The bundle's inputs are named after forward's parameters: a file for ``edgeline infer`` matches them as a
    calibration file matches forward."""
    rng = np.random.default_rng(9)
    image, mask = _images(rng, 3), _masks(rng, 3)
    outputs = []
    for arrays in ({"mask": mask, "image": image}, {"arr_1": mask, "arr_0": image}):
        path = tmp_path / "inputs.npz"
        np.savez(path, **arrays)
        capsys.readouterr()
        assert main(["infer", str(pair_bundle), "--input", str(path), "--json"]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]
    wrong = tmp_path / "wrong.npz"
    np.savez(wrong, image=image, masks=mask)
    message = _error_line(capsys, "infer", [pair_bundle, "--input", wrong])
    assert message.startswith(
        f"{wrong}: array names (image, masks) differ from the inputs the model takes (image, mask)"
    )


@pytest.mark.quick
@pytest.mark.device
def test_infer_refuses_a_one_input_file_named_otherwise_and_takes_arr_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The committed tiny bundle takes one input, ``image``: a single array named otherwise is not taken for it
    silently; saved unnamed (``arr_0``), it is."""
    images = np.random.default_rng(3).random((2, *IMAGE_SHAPE), dtype=np.float32)
    wrong = tmp_path / "pictures.npz"
    np.savez(wrong, picture=images)
    message = _error_line(capsys, "infer", [COMMITTED_BUNDLE, "--input", wrong])
    assert message.startswith(f"{wrong}: array names (picture) differ from the inputs the model takes (image)")
    unnamed = tmp_path / "unnamed.npz"
    np.savez(unnamed, images)
    capsys.readouterr()
    assert main(["infer", str(COMMITTED_BUNDLE), "--input", str(unnamed), "--json"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2
