"""Every activation with an integer kernel is int8 in an int8-static LiteRT model, and GELU runs on TFLite Micro.

One small digits CNN per activation (sklearn's 8x8 digits, trained here, cached by content): real litert-torch, real
LiteRT and TFLite Micro kernels. For each, the int8-static model is counted operator by operator (none may compute
in float: ``nn.SiLU`` once stayed float32, LOGISTIC and MUL between a DEQUANTIZE and a QUANTIZE, and ``nn.Tanh``
failed to convert at all) and classifies the held-out digits as the float model does. GELU, which TFLite Micro has
no kernel for, goes to a microcontroller as its tanh approximation, said in the manifest and the report.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edgeline.device_profiles import Precision
from tests.cache import cached
from tests.test_full_integer import TRAIN, _float_predictions, _predictions, _request, _run_export, _train, digits

__all__ = ["digits"]  # the fixture, shared with test_full_integer

pytestmark = pytest.mark.export


MODELS = '''\
from pathlib import Path

import torch
from torch import nn

ACTIVATIONS = {
    "silu": nn.SiLU,
    "hardswish": nn.Hardswish,
    "hardsigmoid": nn.Hardsigmoid,
    "sigmoid": nn.Sigmoid,
    "tanh": nn.Tanh,
    "gelu": nn.GELU,
}


class DigitsCNN(nn.Module):
    """Two convolutions and two linear layers, each followed by the activation under test."""

    def __init__(self, activation):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.act1 = ACTIVATIONS[activation]()
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.act2 = ACTIVATIONS[activation]()
        self.fc1 = nn.Linear(16 * 4 * 4, 32)
        self.act3 = ACTIVATIONS[activation]()
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = x / 16.0
        x = self.act2(self.conv2(self.act1(self.conv1(x))))
        return self.fc2(self.act3(self.fc1(torch.flatten(x, 1))))


def build(activation):
    model = DigitsCNN(activation)
    weights = Path(__file__).with_name(f"{activation}.pt")
    if weights.exists():
        model.load_state_dict(torch.load(weights))
    return model
'''

ACTIVATIONS = ("silu", "hardswish", "hardsigmoid", "sigmoid", "tanh", "gelu")


@pytest.fixture(scope="module")
def models(digits: tuple[np.ndarray, np.ndarray]) -> Path:
    """The models' source file and each one's trained weights beside it (trained once for this code)."""
    import torch

    images, labels = digits

    def make(directory: Path) -> None:
        source = directory / "activation_models.py"
        source.write_text(MODELS + "".join(f"\n\ndef {a}():\n    return build({a!r})\n" for a in ACTIVATIONS))
        for activation in ACTIVATIONS:
            torch.manual_seed(0)
            module = _module(source, activation)
            _train(module, images[:TRAIN], labels[:TRAIN], log_probabilities=False)
            torch.save(module.state_dict(), directory / f"{activation}.pt")

    data = hashlib.sha256(images.tobytes() + labels.tobytes()).hexdigest()
    return cached("trained", [MODELS, ACTIVATIONS, TRAIN, inspect.getsource(_train), data], make) / (
        "activation_models.py"
    )


def _module(source: Path, activation: str) -> Any:
    from edgeline.export.loading import load_model

    return load_model(f"{source}:{activation}").module


def _operators(path: Path) -> list[tuple[str, bool]]:
    """(TFLite operator, computes in int8) for every operator of the model but the (de)quantizations."""
    from ai_edge_litert.interpreter import Interpreter

    from edgeline.export.placement import tflite_records

    records = tflite_records(Interpreter(model_path=str(path)), Precision.INT8_STATIC)
    return [(record.name, record.quantized) for record in records]


def _agrees(module: Any, backend: str, path: Path, digits: tuple[np.ndarray, np.ndarray]) -> None:
    images, labels = digits
    held_out, truth = images[TRAIN:], labels[TRAIN:]
    expected = _float_predictions(module, held_out).argmax(1)
    found = _predictions(backend, path, held_out).argmax(1)
    float_accuracy, int8_accuracy = np.mean(expected == truth), np.mean(found == truth)
    assert float_accuracy >= 0.9
    assert np.mean(found == expected) >= 0.95, (float_accuracy, int8_accuracy)
    assert int8_accuracy >= float_accuracy - 0.02, (float_accuracy, int8_accuracy)


LitertExport = Callable[[str], tuple[Any, Any, Path]]


@pytest.fixture(scope="module")
def litert_int8(
    models: Path, digits: tuple[np.ndarray, np.ndarray], tmp_path_factory: pytest.TempPathFactory
) -> LitertExport:
    """An activation's model converted by the LiteRT exporter at int8-static (the module, what the exporter returned,
    its folder), once for this module's tests: the operator count and the SiLU test ask for the same conversion.
    Never modified here."""
    from edgeline.export.backends.litert import LiteRTExporter

    made: dict[str, tuple[Any, Any, Path]] = {}

    def export(activation: str) -> tuple[Any, Any, Path]:
        if activation not in made:
            out = tmp_path_factory.mktemp(f"litert-{activation}")
            module = _module(models, activation)
            made[activation] = (module, LiteRTExporter().export(_request(module, digits[0], out)), out)
        return made[activation]

    return export


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_every_operator_of_an_int8_litert_model_is_int8_whatever_its_activation(
    activation: str, litert_int8: LitertExport, digits: tuple[np.ndarray, np.ndarray]
) -> None:
    module, exported, out = litert_int8(activation)
    operators = _operators(out / exported.model_file)
    floating = [op for op, quantized in operators if not quantized]
    assert not floating, f"{activation}: float operators {floating} in {operators}"
    assert exported.placement is not None
    assert exported.placement.quantized_ops == exported.placement.ops == len(operators)
    assert exported.rewrites == ()  # LiteRT has kernels for every one: nothing approximated
    _agrees(module, "litert", out / exported.model_file, digits)


def test_silu_is_written_as_the_sigmoid_and_multiplication_it_is(litert_int8: LitertExport) -> None:
    """What the LiteRT model of ``nn.SiLU`` computes: LOGISTIC then MUL, in int8, twice per activation layer's
    tensor (never a float pair between a DEQUANTIZE and a QUANTIZE)."""
    _, exported, out = litert_int8("silu")
    operators = [op for op, _ in _operators(out / exported.model_file)]
    assert operators.count("LOGISTIC") == 3 and operators.count("MUL") >= 3, operators


def test_gelu_goes_to_tflite_micro_as_its_tanh_approximation(
    models: Path, digits: tuple[np.ndarray, np.ndarray], tmp_path: Path
) -> None:
    from edgeline.export.backends.tflite_micro import TFLiteMicroExporter

    module = _module(models, "gelu")
    exported = TFLiteMicroExporter().export(_request(module, digits[0], tmp_path))
    operators = _operators(tmp_path / exported.model_file)
    assert "GELU" not in [op for op, _ in operators] and "TANH" in [op for op, _ in operators], operators
    assert all(quantized for _, quantized in operators), operators
    (rewrite,) = exported.rewrites
    assert (rewrite.operator, rewrite.count) == ("aten.gelu", 3)
    assert "tanh approximation" in rewrite.replacement and "TFLite Micro" in rewrite.reason
    _agrees(module, "tflite-micro", tmp_path / exported.model_file, digits)


def test_a_gelu_model_exports_for_cortex_m4_and_the_bundle_says_gelu_was_approximated(
    models: Path, digits: tuple[np.ndarray, np.ndarray], tmp_path: Path
) -> None:
    from edgeline.export.report import format_report

    report = _run_export(f"{models}:gelu", "cortex-m4", digits, tmp_path)
    outcomes = [(o.backend, o.status, o.reason) for o in report.outcomes]
    assert report.selected is not None and report.selected.backend == "tflite-micro", outcomes
    manifest = json.loads((tmp_path / "bundle" / "manifest.json").read_text())
    (rewrite,) = manifest["quantization"]["rewrites"]
    assert rewrite["operator"] == "aten.gelu" and rewrite["count"] == 3
    assert manifest["fidelity"]["accuracy"] >= manifest["fidelity"]["accuracy_float"] - 0.02
    text = format_report(report)
    assert "tflite-micro int8-static: aten.gelu (3) computes the tanh approximation" in text, text
    assert report.as_dict()["targets"][0]["rewrites"][0]["operator"] == "aten.gelu"
