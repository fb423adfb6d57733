"""Full-integer int8 for models that normalise their input in forward() or end in log_softmax: real litert-torch,
vela and TFLite Micro; nothing mocked.

Three small classifiers of sklearn's digits (8x8 images of raw pixel values 0..16), trained here: a CNN that starts
with ``(x - mean) / std`` (a buffer and a constant tensor), an MLP that scales by Python numbers and ends in
``log_softmax``, and a CNN that log-compresses its input (TFLite Micro has no int8 LOG: the input stays float). The
first two convert with int8 inputs, outputs and operators, vela places them on the Ethos-U (all but LOG_SOFTMAX,
which it has no NPU form for), and TFLite Micro classifies the held-out digits as the float model does; the third is
refused naming the logarithm and the model's line.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edgeline.device_profiles import Precision, load_profile
from tests.cache import cached
from tests.training import train_classifier

pytestmark = pytest.mark.export

MODELS = '''\
from pathlib import Path

import torch
from torch import nn


class NormalisingCNN(nn.Module):
    """Normalises its input itself, with the training set's statistics: a buffer and a constant tensor."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.tensor(4.88))
        self.std = torch.tensor(6.02)
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.fc = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x):
        x = (x - self.mean) / self.std
        x = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.fc(torch.flatten(x, 1))


class LogSoftmaxMLP(nn.Module):
    """Scales its input with Python numbers; log-probabilities out (trained with the NLL loss)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = x.flatten(1) / 16.0 - 0.5
        return torch.log_softmax(self.fc2(torch.relu(self.fc1(x))), dim=1)


class LogCompressedCNN(nn.Module):
    """Log-compresses its raw pixels: TFLite Micro has no int8 LOG, so the model's first operator is float. (It
    divided each image by its own brightest pixel until TFLite Micro's int8 DIV took that.)"""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x):
        x = torch.log1p(x)
        return self.fc(torch.flatten(torch.relu(self.conv(x)), 1))


def _trained(model):
    weights = Path(__file__).with_name(type(model).__name__ + ".pt")
    if weights.exists():
        model.load_state_dict(torch.load(weights))
    return model


def normalising_cnn():
    return _trained(NormalisingCNN())


def log_softmax_mlp():
    return _trained(LogSoftmaxMLP())


def log_compressed_cnn():
    return _trained(LogCompressedCNN())
'''

# The factories of the models that convert, and the class each builds (its weights file is named after it).
FACTORIES = {"normalising_cnn": "NormalisingCNN", "log_softmax_mlp": "LogSoftmaxMLP"}
SCALED = "log_compressed_cnn"
TRAIN = 1400  # the digits before are trained on (and calibrate); those after are held out
CALIBRATION = 32


@pytest.fixture(scope="module")
def digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    data = load_digits()
    return data.images.astype(np.float32)[:, None], data.target.astype(np.int64)


def _train(module: Any, images: np.ndarray, labels: np.ndarray, log_probabilities: bool) -> None:
    import torch

    torch.manual_seed(0)
    x, y = torch.from_numpy(images), torch.from_numpy(labels)
    train_classifier(module, x, y, loss=torch.nn.functional.nll_loss if log_probabilities else None)


@pytest.fixture(scope="module")
def models(digits: tuple[np.ndarray, np.ndarray]) -> Path:
    """The models' source file, each model's trained weights beside it: trained once for this code (tests/cache.py);
    never modified here."""
    import torch

    from edgeline.export.loading import load_model

    images, labels = digits

    def make(directory: Path) -> None:
        source = directory / "digits_models.py"
        source.write_text(MODELS, encoding="utf-8")
        for factory, cls in {**FACTORIES, SCALED: "LogCompressedCNN"}.items():
            torch.manual_seed(0)
            module = load_model(f"{source}:{factory}").module
            _train(module, images[:TRAIN], labels[:TRAIN], log_probabilities=factory == "log_softmax_mlp")
            torch.save(module.state_dict(), source.with_name(f"{cls}.pt"))

    data = hashlib.sha256(images.tobytes() + labels.tobytes()).hexdigest()
    code = [inspect.getsource(_train), inspect.getsource(train_classifier)]
    inputs = [MODELS, repr(sorted(FACTORIES.items())), SCALED, TRAIN, *code, data]
    return cached("trained", inputs, make) / "digits_models.py"


def _module(models: Path, factory: str) -> Any:
    from edgeline.export.loading import load_model

    return load_model(f"{models}:{factory}").module


def _request(module: Any, images: np.ndarray, out_dir: Path, profile: str | None = None) -> Any:
    import torch

    from edgeline.export.backends import ExportRequest

    calibration = [(torch.from_numpy(images[i : i + 1]),) for i in range(CALIBRATION)]
    return ExportRequest(
        module=module,
        example_inputs=calibration[0],
        calibration=calibration,
        precision=Precision.INT8_STATIC,
        out_dir=out_dir,
        input_names=("x",),
        profile=load_profile(profile) if profile is not None else None,
    )


@pytest.fixture(scope="module")
def ethos_u_exports(
    models: Path, digits: tuple[np.ndarray, np.ndarray], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Any, Path]]:
    """Each model exported by the ethos-u exporter for ethos-u55-128: what it returned, and its folder."""
    from edgeline.export.backends.ethos_u import EthosUExporter

    made = {}
    for factory in FACTORIES:
        out = tmp_path_factory.mktemp(f"ethos-u-{factory}")
        request = _request(_module(models, factory), digits[0], out, profile="ethos-u55-128")
        made[factory] = (EthosUExporter().export(request), out)
    return made


@pytest.mark.parametrize("factory", FACTORIES)
def test_every_operator_of_the_int8_model_is_int8(factory: str, ethos_u_exports: dict[str, tuple[Any, Path]]) -> None:
    from ai_edge_litert.interpreter import Interpreter

    from edgeline.export.backends.ethos_u import check_full_integer
    from edgeline.export.placement import tflite_records

    exported, out = ethos_u_exports[factory]
    int8_model = out / "model_int8.tflite"
    check_full_integer(int8_model, "ethos-u")
    interpreter = Interpreter(model_path=str(int8_model))
    for detail in [*interpreter.get_input_details(), *interpreter.get_output_details()]:
        assert np.dtype(detail["dtype"]) == np.int8, detail["name"]
    records = tflite_records(interpreter, Precision.INT8_STATIC)
    assert [r.name for r in records if not r.quantized] == []
    names = [r.name for r in records]
    if factory == "normalising_cnn":
        assert {"SUB", "MUL"} <= set(names)  # the normalisation, in int8
    else:
        assert names[-1] == "LOG_SOFTMAX"
        (output,) = interpreter.get_output_details()
        assert output["quantization"] == (16 / 256, 127)  # what TFLite's int8 LOG_SOFTMAX requires
    assert exported.placement.quantized_ops == exported.placement.ops


def test_vela_puts_the_normalising_model_wholly_on_the_npu(ethos_u_exports: dict[str, tuple[Any, Path]]) -> None:
    from edgeline.backends.ethos_u import operator_names

    exported, out = ethos_u_exports["normalising_cnn"]
    placement = exported.placement
    assert placement.accelerator == "ethos-u"
    assert placement.accelerator_ops == placement.ops
    assert placement.fallback == {}
    assert [op for op in operator_names(out / "model_vela.tflite") if op != "ethos-u"] == []


def test_vela_leaves_only_log_softmax_to_the_cpu(ethos_u_exports: dict[str, tuple[Any, Path]]) -> None:
    """vela has no NPU form of LOG_SOFTMAX: the Cortex-M runs TFLite Micro's int8 kernel for it."""
    from edgeline.backends.ethos_u import operator_names

    exported, out = ethos_u_exports["log_softmax_mlp"]
    placement = exported.placement
    assert placement.fallback == {"LOG_SOFTMAX": 1}
    assert placement.accelerator_ops == placement.ops - 1
    assert [op for op in operator_names(out / "model_vela.tflite") if op != "ethos-u"] == ["LOG_SOFTMAX"]


def _float_predictions(module: Any, images: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return module(torch.from_numpy(images)).numpy()


def _predictions(backend: str, path: Path, images: np.ndarray) -> np.ndarray:
    """A full-integer model's dequantized outputs, one image at a time, run by ``backend``'s own kernels."""
    from edgeline.backends import open_session
    from edgeline.quantization import dequantize, quantize

    session = open_session(backend, path)
    (spec,), (out,) = session.input_specs(), session.output_specs()
    assert spec.quantization is not None and out.quantization is not None  # full-integer: int8 in and out
    rows = []
    for image in images:
        (raw,) = session.run([quantize(image[None], spec.quantization, np.dtype(np.int8))])
        rows.append(dequantize(raw, out.quantization)[0])
    return np.stack(rows)


def _micro_predictions(path: Path, images: np.ndarray) -> np.ndarray:
    return _predictions("tflite-micro", path, images)


def _run_export(model: str, profile: str, digits: tuple[np.ndarray, np.ndarray], tmp_path: Path) -> Any:
    """``edgeline export`` of ``model`` for ``profile``, calibrated and validated on the digits, into
    ``tmp_path / "bundle"``: its report."""
    from edgeline.export.pipeline import ExportOptions, run_export

    images, labels = digits
    np.savez(tmp_path / "cal.npz", x=images[:CALIBRATION])
    np.savez(tmp_path / "val.npz", x=images[TRAIN : TRAIN + 64], labels=labels[TRAIN : TRAIN + 64])
    return run_export(
        ExportOptions(
            model=model,
            profile=profile,
            calibration=tmp_path / "cal.npz",
            validation=tmp_path / "val.npz",
            out=tmp_path / "bundle",
        )
    )


@pytest.mark.parametrize("factory", FACTORIES)
def test_tflite_micro_classifies_the_held_out_digits_as_the_float_model_does(
    factory: str, models: Path, digits: tuple[np.ndarray, np.ndarray], tmp_path: Path
) -> None:
    from edgeline.export.backends.tflite_micro import TFLiteMicroExporter

    images, labels = digits
    module = _module(models, factory)
    TFLiteMicroExporter().export(_request(module, images, tmp_path))
    held_out, truth = images[TRAIN:], labels[TRAIN:]
    expected = _float_predictions(module, held_out)
    found = _micro_predictions(tmp_path / "model.tflite", held_out)
    float_accuracy = np.mean(expected.argmax(1) == truth)
    int8_accuracy = np.mean(found.argmax(1) == truth)
    assert float_accuracy >= 0.9
    assert np.mean(found.argmax(1) == expected.argmax(1)) >= 0.97
    assert int8_accuracy >= float_accuracy - 0.02
    if factory == "log_softmax_mlp":  # log-probabilities, within a few output steps where they matter
        likely = expected > -4
        assert np.abs(found - expected)[likely].mean() < 4 * 16 / 256


def test_an_operator_without_an_int8_kernel_at_the_input_is_named_with_the_model_s_line(
    models: Path, digits: tuple[np.ndarray, np.ndarray], tmp_path: Path
) -> None:
    from edgeline.export.backends.tflite_micro import TFLiteMicroExporter
    from edgeline.export.errors import LoweringError

    with pytest.raises(LoweringError) as caught:
        TFLiteMicroExporter().export(_request(_module(models, SCALED), digits[0], tmp_path))
    message = str(caught.value)
    line = next(n for n, text in enumerate(MODELS.splitlines(), 1) if "torch.log1p(x)" in text)
    assert message.startswith("tflite-micro: the int8 model's input ")
    assert "is float32, not int8" in message
    assert f"aten.log1p.default ({models}:{line}: x = torch.log1p(x))" in message
    assert caught.value.operators == ("aten.log1p.default",)
    assert "conv" not in message.split("not int8", 1)[1]  # only what stayed float


def test_run_export_for_ethos_u55_picks_the_npu_for_the_normalising_model(
    models: Path, digits: tuple[np.ndarray, np.ndarray], tmp_path: Path
) -> None:
    report = _run_export(f"{models}:normalising_cnn", "ethos-u55-128", digits, tmp_path)
    outcomes = [(o.backend, o.status, o.reason) for o in report.outcomes]
    assert report.selected is not None and report.selected.backend == "ethos-u", outcomes
    manifest = json.loads((tmp_path / "bundle" / "manifest.json").read_text())
    assert manifest["inputs"][0]["dtype"] == "int8"
    placement = manifest["placement"]
    assert placement["accelerator_ops"] == placement["ops"] == placement["quantized_ops"]
    fidelity = manifest["fidelity"]
    assert fidelity["top1_agreement"] >= 0.97
    assert fidelity["accuracy"] >= fidelity["accuracy_float"] - 0.02


def test_layers_kept_float_at_the_model_s_edges_leave_it_full_integer(
    digits: tuple[np.ndarray, np.ndarray], tmp_path: Path
) -> None:
    """Mixed precision on a microcontroller, the first layers kept float as it keeps them (the first convolution's
    output tensor: the convolution, its ReLU and the convolution reading it). The model still takes and gives int8,
    the firmware's contract: the input is dequantized before the float convolution; TFLite Micro's float kernels
    run the two, and every other operator stays int8."""
    import torch
    from ai_edge_litert.interpreter import Interpreter
    from torch import nn

    from edgeline.export.backends.tflite_micro import TFLiteMicroExporter
    from edgeline.export.placement import tflite_records

    torch.manual_seed(0)
    module = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(),
                           nn.Flatten(), nn.Linear(4 * 8 * 8, 10)).eval()  # fmt: skip
    images = digits[0]
    request = _request(module, images, tmp_path)
    request = type(request)(**{**request.__dict__, "keep_float": ("0", "1", "2")})
    exported = TFLiteMicroExporter().export(request)  # check_full_integer: int8 in and out, or a LoweringError
    path = tmp_path / exported.model_file
    records = tflite_records(Interpreter(model_path=str(path)), Precision.INT8_STATIC)
    floating = sorted(record.name for record in records if not record.quantized)
    assert floating == ["CONV_2D", "DEPTHWISE_CONV_2D"], [(r.name, r.quantized) for r in records]
    assert sum(record.quantized for record in records) == len(records) - 2
    held = images[1400:1464]
    got, expected = _micro_predictions(path, held), _float_predictions(module, held)
    cosine = np.sum(got * expected, axis=1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
    assert cosine.min() > 0.98, cosine.min()
