"""Placement and precision, counted from the converted model: a declared int8 that is mostly float, or convolutions
left in float by int8-dynamic, is seen, budgeted and reported; converter failures name the operator and the model's
line; the same command gives the same bundle whatever the process's hash seed."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from edgeline.cli import main
from edgeline.device_profiles import Precision

pytestmark = pytest.mark.export

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "tests" / "data" / "unseen_models.py"
CONVERSIONS = {"QUANTIZE", "DEQUANTIZE"}


@pytest.fixture(scope="module")
def sequences(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Seeded sequences (32 steps x 4 channels): calibration, and validation with 5 classes of labels; short ones
    (4 steps) for a test about what a converter's failure says, where every other backend is tried on the model and
    each of the 32 steps unrolled is a share of every conversion."""
    root = tmp_path_factory.mktemp("sequences")
    rng = np.random.default_rng(7)
    np.savez(root / "cal.npz", x=rng.normal(size=(24, 32, 4)).astype(np.float32))
    np.savez(root / "val.npz", x=rng.normal(size=(12, 32, 4)).astype(np.float32), labels=rng.integers(0, 5, 12))
    images = rng.random((16, 1, 16, 16)).astype(np.float32)
    np.savez(root / "images.npz", x=images)
    np.savez(root / "short.npz", x=rng.normal(size=(24, 4, 4)).astype(np.float32))
    return {
        "calibration": root / "cal.npz",
        "validation": root / "val.npz",
        "images": root / "images.npz",
        "short": root / "short.npz",
    }


def profile_with(tmp_path: Path, targets: list[tuple[str, str]], **budgets: float) -> Path:
    """rpi5 with other targets (fewer ExecuTorch exports: each costs tens of seconds here) and budgets."""
    text = (REPO / "device_profiles" / "profiles" / "rpi5.toml").read_text()
    head, _, rest = text.partition("[[targets]]")
    budget_block = rest[rest.index("[budgets]") :]
    for key, value in budgets.items():
        budget_block = "\n".join(line for line in budget_block.splitlines() if not line.startswith(f"{key} "))
        budget_block += f"\n{key} = {value}\n"
    blocks = "".join(f'[[targets]]\nbackend = "{b}"\nprecision = "{p}"\nthreads = 4\n\n' for b, p in targets)
    path = tmp_path / "board.toml"
    path.write_text(head.replace('id = "rpi5"', 'id = "board"') + blocks + budget_block)
    return path


def tflite_operator_names(path: Path) -> list[str]:
    """The model's operators read from the flatbuffer with LiteRT's generated schema: a second way to count."""
    from ai_edge_litert import schema_py_generated as schema

    model = schema.ModelT.InitFromPackedBuf(path.read_bytes(), 0)
    names = {value: name for name, value in vars(schema.BuiltinOperator).items() if not name.startswith("_")}
    codes = [max(code.builtinCode, code.deprecatedBuiltinCode) for code in model.operatorCodes]
    return [names[codes[op.opcodeIndex]] for op in model.subgraphs[0].operators]


def test_a_recurrent_int8_model_that_computes_in_float_is_rejected_and_the_choice_moves_on(
    tmp_path: Path, sequences: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    profile = profile_with(tmp_path, [("litert", "int8-static"), ("litert", "fp16")])
    out = tmp_path / "lstm"
    code = main(
        ["export", f"{MODELS}:lstm_autoencoder", "--profile", str(profile),
         "--calibration", str(sequences["calibration"]), "--out", str(out), "--all", "--json"]
    )  # fmt: skip
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    int8, fp16 = report["targets"]
    assert int8["status"] == "rejected"
    placement = int8["placement"]
    assert placement["accelerator"] is None and placement["accelerator_ops"] is None
    assert placement["quantized_ops"] / placement["ops"] < 0.8  # rpi5's budget
    assert int8["quantized_share"] == pytest.approx(placement["quantized_ops"] / placement["ops"])
    assert placement["quantized_macs"] / placement["macs"] < 0.8  # the work: what the budget judges
    macs = f"{placement['quantized_macs']}/{placement['macs']} MACs"
    assert f"of the work ({macs}; {placement['quantized_ops']}/{placement['ops']} ops) in int8-static" in int8["reason"]
    top = max(placement["fallback"], key=placement["fallback"].get)
    assert f"{top} x{placement['fallback'][top]}" in int8["reason"]
    assert fp16["status"] == "selected"
    manifest = json.loads((out / "litert-fp16" / "manifest.json").read_text())
    assert manifest["placement"]["quantized_ops"] is None  # fp16 declares no integer precision
    assert manifest["placement"]["ops"] == len(
        [n for n in tflite_operator_names(out / "litert-fp16" / "model.tflite") if n not in CONVERSIONS]
    )


def test_int8_placement_matches_an_independent_count_of_the_flatbuffer(
    tmp_path: Path, sequences: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "unet"
    code = main(
        ["export", f"{MODELS}:unet", "--profile", "rpi5", "--backend", "litert", "--precision", "int8-static",
         "--calibration", str(sequences["images"]), "--out", str(out), "--json"]
    )  # fmt: skip
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    placement = json.loads((out / "manifest.json").read_text())["placement"]
    names = tflite_operator_names(out / "model.tflite")
    work = Counter(n for n in names if n not in CONVERSIONS)
    assert placement["ops"] == sum(work.values())
    assert placement["quantized_ops"] + sum(placement["fallback"].values()) == placement["ops"]
    assert set(placement["fallback"]) <= set(work)
    assert report["targets"][0]["quantized_share"] == pytest.approx(placement["quantized_ops"] / placement["ops"])


def test_executorch_int8_dynamic_leaves_convolutions_in_float_and_says_so(
    tmp_path: Path, sequences: dict[str, Path]
) -> None:
    import torch

    from edgeline.export.backends import ExportRequest
    from edgeline.export.backends.executorch_xnnpack import XnnpackExporter

    sys.path.insert(0, str(MODELS.parent))
    try:
        from unseen_models import unet  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(MODELS.parent))
    images = np.load(sequences["images"])["x"]
    samples = [(torch.from_numpy(images[i : i + 1]),) for i in range(4)]
    request = ExportRequest(unet(), samples[0], samples, Precision.INT8_DYNAMIC, tmp_path, ("x",))
    placement = XnnpackExporter().export(request).placement
    assert placement is not None
    assert placement.accelerator == "xnnpack"
    # XNNPACK's dynamic quantizer takes only the 1x1 convolution (channels-last matmul); the 3x3 ones stay float
    # in float: the 3x3 convolutions; off XNNPACK: the upsampling (ExecuTorch's portable kernel runs it)
    assert placement.fallback == {"aten.convolution.default": 3, "aten.upsample_nearest2d.vec": 1}
    assert placement.accelerator_ops == placement.ops - 1
    # the rest (the 1x1 convolution, and the activations, pooling and concatenation, which have no weights)
    assert placement.quantized_ops == placement.ops - 3
    assert placement.quantized_share is not None and placement.quantized_share < 0.8  # rpi5 rejects it
    assert placement.accelerator_ops is not None and placement.accelerator_ops <= placement.ops


def test_a_converter_failure_names_the_operator_the_line_and_where_to_go(
    tmp_path: Path, sequences: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        ["export", f"{MODELS}:gru_classifier", "--profile", str(profile_with(tmp_path, [("litert", "int8-static")])),
         "--backend", "litert", "--precision", "int8-static",
         "--calibration", str(sequences["short"]), "--out", str(tmp_path / "gru")]
    )  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err
    (error,) = [line for line in err.splitlines() if line.startswith("edgeline export: error:")]
    line = next(n for n, text in enumerate(MODELS.read_text().splitlines(), 1) if "self.gru(x)" in text)
    assert f"at torch.nn.GRU in gru ({MODELS}:{line}: states, _ = self.gru(x))" in error
    assert "IndexError" in error  # what the converter said stays, after what it was doing
    assert "backends that convert it at int8-static: executorch-xnnpack" in error
    assert "litert converts it at fp32, fp16, int8-dynamic" in error


def test_the_same_command_gives_the_same_bundle_whatever_the_hash_seed(
    tmp_path: Path, sequences: dict[str, Path]
) -> None:
    digests = []
    for seed in ("1", "2"):
        out = tmp_path / f"seed-{seed}"
        done = subprocess.run(
            [sys.executable, "-m", "edgeline.cli", "export", f"{MODELS}:unet", "--profile", "rpi5",
             "--backend", "litert", "--precision", "int8-static",
             "--calibration", str(sequences["images"]), "--out", str(out), "-q"],
            capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONHASHSEED=seed),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["export"]["python_hash_seed"] == "0"  # the command pinned it before converting
        digests.append(hashlib.sha256((out / "model.tflite").read_bytes()).hexdigest())
    assert digests[0] == digests[1]
