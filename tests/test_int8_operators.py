"""Every operator with an integer kernel on the target runs in integer: PReLU, ELU, SELU, CELU, Mish, Softplus and
LayerNorm, on LiteRT, TFLite Micro and the Ethos-U (issue 53).

Models of their own (sklearn's 8x8 digits, trained here, cached by content): a CNN whose every activation is the one
under test, its inputs centred so that activations see negative values well below -1, and a transformer-shaped
token mixer (each image row a token) with LayerNorm over the features. Real litert-torch, LiteRT, TFLite Micro and
vela; nothing mocked. Before: PReLU was RELU, MUL, MUL, SUB in float; ELU, Mish and Softplus reached no
microcontroller (SELECT); ELU clipped its input at about -1 in LiteRT int8; Mish, Softplus and LayerNorm stayed
float; GELU went to the Ethos-U as its 50-operator tanh form.
"""

from __future__ import annotations

import hashlib
import inspect
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.cache import cached
from tests.test_full_integer import CALIBRATION, TRAIN, _float_predictions, _predictions, _request, _train, digits
from tests.test_int8_activations import _agrees

__all__ = ["digits"]  # the fixture, shared with test_full_integer

pytestmark = pytest.mark.export

MODELS = '''\
from pathlib import Path

import torch
from torch import nn

ACTIVATIONS = {
    "prelu": lambda width: nn.PReLU(width),
    "elu": lambda width: nn.ELU(),
    "selu": lambda width: nn.SELU(),
    "celu": lambda width: nn.CELU(alpha=0.5),
    "mish": lambda width: nn.Mish(),
    "softplus": lambda width: nn.Softplus(),
    "gelu": lambda width: nn.GELU(),
}


class CentredCNN(nn.Module):
    """Centres the raw pixels (0..16) on 0, so the first activation sees values down to about -3."""

    def __init__(self, activation):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 12, 3, padding=1), ACTIVATIONS[activation](12),
            nn.Conv2d(12, 16, 3, stride=2, padding=1), ACTIVATIONS[activation](16),
        )
        self.head = nn.Sequential(nn.Linear(16 * 4 * 4, 24), ACTIVATIONS[activation](24), nn.Linear(24, 10))

    def forward(self, x):
        x = (x - 8.0) / 3.0
        return self.head(torch.flatten(self.features(x), 1))


class TokenMixer(nn.Module):
    """Each image row a token of 8 pixels: embedding, LayerNorm, MLP with a residual, LayerNorm, a linear head
    over all tokens."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 24)
        self.norm1 = nn.LayerNorm(24)
        self.mlp = nn.Sequential(nn.Linear(24, 48), nn.ReLU(), nn.Linear(48, 24))
        self.norm2 = nn.LayerNorm(24)
        self.head = nn.Linear(8 * 24, 10)

    def forward(self, x):
        tokens = self.norm1(self.embed(x.flatten(1, 2) / 16.0))
        tokens = self.norm2(tokens + self.mlp(tokens))
        return self.head(tokens.flatten(1))


def _trained(model, name):
    weights = Path(__file__).with_name(name + ".pt")
    if weights.exists():
        model.load_state_dict(torch.load(weights))
    return model
'''

ACTIVATIONS = ("prelu", "elu", "selu", "celu", "mish", "softplus", "gelu")
MIXER = "layernorm"
NAMES = (*ACTIVATIONS, MIXER)


def _factories() -> str:
    made = [f"\n\ndef {a}():\n    return _trained(CentredCNN({a!r}), {a!r})\n" for a in ACTIVATIONS]
    return "".join(made) + f"\n\ndef {MIXER}():\n    return _trained(TokenMixer(), {MIXER!r})\n"


@pytest.fixture(scope="module")
def models(digits: tuple[np.ndarray, np.ndarray]) -> Path:
    """The models' source file and each one's trained weights beside it (trained once for this code)."""
    import torch

    images, labels = digits

    def make(directory: Path) -> None:
        source = directory / "operator_models.py"
        source.write_text(MODELS + _factories())
        for name in NAMES:
            torch.manual_seed(0)
            module = _module(source, name)
            _train(module, images[:TRAIN], labels[:TRAIN], log_probabilities=False)
            torch.save(module.state_dict(), directory / f"{name}.pt")

    data = hashlib.sha256(images.tobytes() + labels.tobytes()).hexdigest()
    return cached("trained", [MODELS, _factories(), TRAIN, inspect.getsource(_train), data], make) / (
        "operator_models.py"
    )


def _module(source: Path, name: str) -> Any:
    from edgeline.export.loading import load_model

    return load_model(f"{source}:{name}").module


def _operators(path: Path) -> list[tuple[str, bool]]:
    """(TFLite operator, computes in int8) for every operator of the model but the (de)quantizations."""
    from ai_edge_litert.interpreter import Interpreter

    from edgeline.backends.ethos_u import operator_names
    from edgeline.device_profiles import Precision
    from edgeline.export.placement import tflite_records

    records = tflite_records(Interpreter(model_path=str(path)), Precision.INT8_STATIC)
    assert "SELECT" not in operator_names(path)  # TFLite Micro has SELECT_V2 only
    return [(record.name, record.quantized) for record in records]


def _float_operators(path: Path) -> Counter[str]:
    return Counter(name for name, quantized in _operators(path) if not quantized)


class _Exports:
    """Each (model, exporter) converted once for this module's tests; never modified here."""

    def __init__(self, models: Path, images: np.ndarray, factory: pytest.TempPathFactory) -> None:
        self.models, self.images, self.factory = models, images, factory
        self.made: dict[tuple[str, str], tuple[Any, Any, Path]] = {}

    def __call__(self, name: str, exporter: str) -> tuple[Any, Any, Path]:
        """(the float module, what the exporter returned, its folder)."""
        key = (name, exporter)
        if key not in self.made:
            from edgeline.export.backends import get_exporter

            out = self.factory.mktemp(f"{exporter}-{name}")
            module = _module(self.models, name)
            profile = {"ethos-u": "ethos-u55-128", "tflite-micro": "cortex-m4"}.get(exporter)
            exported = get_exporter(exporter).export(_request(module, self.images, out, profile=profile))
            self.made[key] = (module, exported, out)
        return self.made[key]


@pytest.fixture(scope="module")
def exports(models: Path, digits: tuple[np.ndarray, np.ndarray], tmp_path_factory: pytest.TempPathFactory) -> _Exports:
    return _Exports(models, digits[0], tmp_path_factory)


@pytest.mark.parametrize("name", [n for n in NAMES if n != "gelu"])
def test_every_operator_of_the_litert_int8_model_is_int8(
    name: str, exports: _Exports, digits: tuple[np.ndarray, np.ndarray]
) -> None:
    module, exported, out = exports(name, "litert")
    path = out / exported.model_file
    assert _float_operators(path) == Counter(), _operators(path)
    _agrees(module, "litert", path, digits)


def test_prelu_is_tflite_s_prelu(exports: _Exports) -> None:
    _, exported, out = exports("prelu", "litert")
    names = Counter(name for name, _ in _operators(out / exported.model_file))
    assert names["PRELU"] == 3, names  # one each, not RELU, MUL, MUL, SUB
    assert names["SUB"] == 1  # the model's own centring


def test_elu_in_int8_keeps_its_input_below_minus_one(
    digits: tuple[np.ndarray, np.ndarray], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A layer whose pre-activations reach -4, then ELU, as the model's output, now TFLite's int8 ELU (a lookup
    table over its whole input range): ELU's output within 3 of its int8 steps of the float model's, below -1 as
    above (the converter's own lowering requantized ELU's input to its output's range, about -1 at the bottom, in
    the models of issue 53)."""
    import torch
    from torch import nn

    from edgeline.export.backends.litert import LiteRTExporter

    torch.manual_seed(0)
    module = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ELU()).eval()
    with torch.no_grad():
        module[1].weight.mul_(0.5)
    images = digits[0][:CALIBRATION]  # within the calibrated ranges: what is left is ELU's own error
    with torch.no_grad():
        before = module[1](torch.from_numpy(images).flatten(1))
    assert float((before < -1.5).float().mean()) > 0.1  # the case under test is there
    out = tmp_path_factory.mktemp("elu-output")
    exported = LiteRTExporter().export(_request(module, digits[0], out))
    expected = _float_predictions(module, images)
    found = _predictions("litert", out / exported.model_file, images)
    from edgeline.backends import open_session

    (spec,) = open_session("litert", out / exported.model_file).output_specs()
    assert spec.quantization is not None
    step = float(np.max(spec.quantization.scale))
    names = Counter(name for name, _ in _operators(out / exported.model_file))
    assert names["ELU"] == 1, names
    assert float(np.abs(found - expected).max()) < 3 * step


@pytest.mark.parametrize("name", ["prelu", "elu", "selu", "celu", "mish", "softplus", "gelu", MIXER])
def test_tflite_micro_runs_it_in_int8(name: str, exports: _Exports, digits: tuple[np.ndarray, np.ndarray]) -> None:
    """On TFLite Micro's kernels: every operator int8 but Softplus's EXP and LOG, which have no int8 kernel there."""
    module, exported, out = exports(name, "tflite-micro")
    path = out / exported.model_file
    allowed = Counter({"EXP": 3, "LOG": 3, "ADD": 3}) if name == "softplus" else Counter()
    assert _float_operators(path) - allowed == Counter(), _operators(path)
    _agrees(module, "tflite-micro", path, digits)


@pytest.mark.parametrize("name", ["prelu", "elu", "selu", "mish", "softplus", "gelu", MIXER])
def test_vela_places_the_whole_model_on_the_npu(name: str, exports: _Exports) -> None:
    """One NPU piece, nothing left to the CPU; GELU as vela's GELU (a lookup table), not the tanh form."""
    from edgeline.backends.ethos_u import operator_names
    from edgeline.export.backends.ethos_u import MODEL_FILE

    _, exported, out = exports(name, "ethos-u")
    compiled = operator_names(out / MODEL_FILE)
    assert compiled.count("ethos-u") == 1, compiled
    assert [op for op in compiled if op != "ethos-u"] == [], compiled
    assert exported.placement.accelerator_share == 1.0
    if name == "gelu":
        assert not exported.rewrites  # no approximation: the GELU the model computes
        from edgeline.backends.ethos_u import CPU_MODEL

        assert "GELU" in operator_names(out / CPU_MODEL)


def test_an_ethos_u_microcontroller_bundle_with_lookup_tables_is_verified_by_litert(exports: _Exports) -> None:
    """TFLite Micro has no int8 EXP: what vela maps to the NPU's lookup tables is checked by LiteRT's kernels, and
    the bundle says so."""
    _, exported, _ = exports("mish", "ethos-u")
    assert exported.verification.backend == "litert"
    assert "EXP" in exported.verification.measured_with


def test_litert_torch_is_restored_after_each_conversion() -> None:
    """The PRELU and ELU lowerings reach into litert-torch's lowering registry and decomposition tables: they are
    as this code expects (else this fails, and conversion falls back to litert-torch's own forms), and each
    conversion leaves them as they were."""
    import torch
    from litert_torch import fx_infra
    from litert_torch.backend.lowerings import registry

    from edgeline.export.tflite_operators import forms_available, operator_forms

    assert forms_available()
    prelu, elu = torch.ops.aten._prelu_kernel.default, torch.ops.aten.elu.default

    def state() -> tuple[Any, ...]:
        convert, lower = fx_infra.decomp.pre_convert_decomp(), fx_infra.decomp.pre_lower_decomp()
        return tuple(
            (op in convert and convert[op], op in lower and lower[op], registry.lookup(op)) for op in (prelu, elu)
        )

    before = state()
    with operator_forms(elu=True) as ready:
        assert ready
        assert registry.lookup(prelu) is not before[0][2]
        assert prelu not in fx_infra.decomp.pre_convert_decomp()
    assert state() == before


def test_an_elu_that_mixed_precision_keeps_float_stays_float(
    models: Path, digits: tuple[np.ndarray, np.ndarray], tmp_path: Path
) -> None:
    """The int8 ELU is made from the float ELU the converter writes between a DEQUANTIZE and a QUANTIZE; one in a
    layer kept float (mixed precision) stays as it is."""
    from dataclasses import replace

    from edgeline.export.backends.litert import write_tflite

    request = replace(_request(_module(models, "elu"), digits[0], tmp_path), keep_float=("features.1",))
    write_tflite(request, tmp_path / "mixed.tflite")
    elus = [quantized for name, quantized in _operators(tmp_path / "mixed.tflite") if name == "ELU"]
    assert sorted(elus) == [False, True, True], elus  # features.1 float; features.3 and head.1 int8
