"""Issue 53: an operator left float is named with its module and source line in the manifest, the export report and
`edgeline bundle show`, for the LiteRT family; a share is never the only place it shows. Real litert-torch, vela
and LiteRT, nothing mocked.

The model is one of its own: a digits MLP (sklearn's 8x8 digits, trained here) whose hidden features pass through
``spread``, a submodule computing their running sum (``torch.cumsum``). LiteRT has no int8 CUMSUM: the int8 model
computes it in float between a DEQUANTIZE and a QUANTIZE, and vela leaves it to the CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.training import digit_features, trained_model

SOURCE = """\
from pathlib import Path

import torch
from torch import nn


class RunningSum(nn.Module):
    def forward(self, x):
        return torch.cumsum(x, dim=1)


class NamingMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 32)
        self.spread = RunningSum()
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        x = torch.relu(self.fc1(x / 16.0))
        return self.head(self.spread(x))


def naming_mlp():
    model = NamingMLP()
    weights = Path(__file__).with_name("naming_mlp.pt")
    if weights.exists():
        model.load_state_dict(torch.load(weights))
    return model.eval()
"""

FILE = "naming_models.py"
LINE = SOURCE.splitlines().index("        return torch.cumsum(x, dim=1)") + 1
WHERE = f"spread ({FILE}:{LINE})"  # the module and the model's line that made CUMSUM
TRAIN = 1400  # the digits before are trained on (and calibrate); those after are held out
VALIDATION = 200


@pytest.fixture(scope="module")
def model() -> Path:
    """The model's source file, its trained weights beside it: made once for this code (tests/cache.py)."""
    features, labels = digit_features()
    x, y = features[:TRAIN], labels[:TRAIN]
    # a running sum's scale wants a small step
    return trained_model(SOURCE, FILE, "naming_mlp", "naming_mlp.pt", x, y, epochs=30, lr=0.003)


def _edgeline(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edgeline.cli", *args],
        capture_output=True, text=True, timeout=900, check=False, env=dict(os.environ),
    )  # fmt: skip


@pytest.fixture(scope="module")
def litert(model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """``edgeline export`` of the model for rpi5, LiteRT int8-static: the bundle, and the report it printed."""
    features, labels = digit_features()
    folder = tmp_path_factory.mktemp("naming")
    np.savez(folder / "cal.npz", x=features[:32])
    np.savez(folder / "val.npz", x=features[TRAIN : TRAIN + VALIDATION], labels=labels[TRAIN : TRAIN + VALIDATION])
    out = folder / "bundle"
    done = _edgeline(
        "export", f"{model}:naming_mlp", "--profile", "rpi5", "--backend", "litert", "--precision", "int8-static",
        "--calibration", str(folder / "cal.npz"), "--validation", str(folder / "val.npz"), "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return out, done.stdout


@pytest.mark.export
def test_the_manifest_names_the_module_and_line_of_the_float_operator(litert: tuple[Path, str]) -> None:
    bundle, _ = litert
    placement = json.loads((bundle / "manifest.json").read_text(encoding="utf-8"))["placement"]
    assert placement["fallback"] == {"CUMSUM": 1}, placement
    assert placement["fallback_sources"] == {"CUMSUM": [WHERE]}, placement


@pytest.mark.export
def test_the_export_report_prints_where_the_float_operator_comes_from(litert: tuple[Path, str]) -> None:
    _, report = litert
    assert f"litert int8-static: float: CUMSUM in {WHERE}" in report.splitlines(), report


@pytest.mark.export
def test_bundle_show_prints_where_the_float_operator_comes_from(litert: tuple[Path, str]) -> None:
    bundle, _ = litert
    shown = _edgeline("bundle", "show", str(bundle))
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    placement = next(i for i, line in enumerate(lines) if line.startswith("placement:"))
    assert "fallback: CUMSUM x1" in lines[placement]  # the line it had: kept
    assert lines[placement + 1] == f"left out:     float: CUMSUM in {WHERE}", shown.stdout
    as_json = json.loads(_edgeline("bundle", "show", str(bundle), "--json").stdout)
    assert as_json["placement"]["fallback_sources"] == {"CUMSUM": [WHERE]}
    assert as_json["placement"]["left_out"] == f"float: CUMSUM in {WHERE}"


def _exported(model: Path, exporter: Any, out_dir: Path, profile: str | None = None) -> Any:
    """The model exported int8-static by ``exporter`` alone (no pipeline), calibrated on 32 training digits."""
    import torch

    from edgeline.device_profiles import Precision, load_profile
    from edgeline.export.backends import ExportRequest
    from edgeline.export.loading import load_model

    features, _ = digit_features()
    calibration = [(torch.from_numpy(features[i : i + 1]),) for i in range(32)]
    request = ExportRequest(
        module=load_model(f"{model}:naming_mlp").module,
        example_inputs=calibration[0],
        calibration=calibration,
        precision=Precision.INT8_STATIC,
        out_dir=out_dir,
        input_names=("x",),
        profile=load_profile(profile) if profile else None,
    )
    return exporter.export(request)


@pytest.fixture(scope="module")
def ethos_u(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The ethos-u exporter's model for the i.MX 93 (its Cortex-A55 runs what vela leaves to the CPU with LiteRT)."""
    from edgeline.export.backends.ethos_u import EthosUExporter

    return _exported(model, EthosUExporter(), tmp_path_factory.mktemp("naming-ethos-u"), "imx93")


@pytest.mark.export
def test_ethos_u_names_the_module_and_line_of_what_vela_leaves_to_the_cpu(ethos_u: Any) -> None:
    placement = ethos_u.placement
    assert placement.accelerator == "ethos-u"
    assert placement.fallback == {"CUMSUM": 1}, placement
    assert placement.fallback_sources == {"CUMSUM": [WHERE]}, placement
    assert placement.describe_sources() == f"off ethos-u: CUMSUM in {WHERE}"


@pytest.fixture(scope="module")
def onnx_placement(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The ONNX Runtime exporter's int8 model (QDQ): ONNX Runtime's quantizer has no int8 CumSum either."""
    from edgeline.export.backends.onnxruntime import OnnxRuntimeExporter

    return _exported(model, OnnxRuntimeExporter(), tmp_path_factory.mktemp("naming-onnx")).placement


@pytest.mark.export
def test_onnx_runtime_names_the_module_and_line_of_the_float_node(onnx_placement: Any) -> None:
    """Its nodes keep the module paths and the stack trace torch's dynamo exporter wrote (``name_scopes``, one full
    path per module level: ``spread``, not ``forward()`` nor a doubled path)."""
    scaling = f"forward() ({FILE}:{SOURCE.splitlines().index('        x = torch.relu(self.fc1(x / 16.0))') + 1})"
    # CumSum sits between a DequantizeLinear and a QuantizeLinear, yet ONNX Runtime has no integer kernel to fuse
    # it into: float (the input's scaling by 16 is float before the model's first quantization)
    assert onnx_placement.fallback == {"CumSum": 1, "Div": 1}, onnx_placement
    assert onnx_placement.fallback_sources == {"CumSum": [WHERE], "Div": [scaling]}, onnx_placement
    assert onnx_placement.describe_sources() == f"float: CumSum in {WHERE}; Div in {scaling}"


@pytest.mark.quick
def test_litert_operators_are_tied_to_the_model_s_code_by_module_then_kind() -> None:
    """The rules of ``ModelSources.name`` on a LiteRT model's records as the converter names their tensors."""
    from edgeline.device_profiles import Precision
    from edgeline.export.placement import GraphOperator, ModelSources, OpRecord, placement_of

    sources = ModelSources(
        operators=(
            GraphOperator("linear", "fc1", "fc1 (m.py:5)"),
            GraphOperator("prelukernel", "act", "act (m.py:6)"),
            GraphOperator("cumsum", "", "forward() (m.py:7)"),
            GraphOperator("cumsum", "", "forward() (m.py:8)"),
        ),
        locations=(
            ("m.Net", ""),
            ("m.Net/torch.nn.modules.linear.Linear_fc1", "fc1"),
            ("m.Net/torch.nn.modules.activation.PReLU_act", "act"),
        ),
    )
    records = [
        OpRecord("FULLY_CONNECTED", False, True, output="m.Net/torch.nn.modules.linear.Linear_fc1;;m.Net;"),
        OpRecord("MUL", False, False, output="m.Net/torch.nn.modules.activation.PReLU_act;2"),  # PReLU, lowered
        OpRecord("SUB", False, False, output="m.Net/torch.nn.modules.activation.PReLU_act;4"),
        OpRecord("CUMSUM", False, False, output="m.Net;3"),  # the model's own forward()
        OpRecord("CUMSUM", False, False, output="serving_default_output_0_output"),  # a model output: kind alone
        OpRecord("TANH", False, False, output="serving_default_output_1_output"),  # nothing tells: not guessed
    ]
    named = sources.name(records)
    assert [record.source for record in named] == [
        "fc1 (m.py:5)", "act (m.py:6)", "act (m.py:6)", "forward() (m.py:7)", "forward() (m.py:8)", "",
    ]  # fmt: skip
    placement = placement_of(named, Precision.INT8_STATIC, accelerator=None)
    assert placement.fallback == {"CUMSUM": 2, "MUL": 1, "SUB": 1, "TANH": 1}
    assert placement.fallback_sources == {
        "CUMSUM": ["forward() (m.py:7)", "forward() (m.py:8)"], "MUL": ["act (m.py:6)"], "SUB": ["act (m.py:6)"],
    }  # fmt: skip
    assert placement.describe_sources() == (
        "float: CUMSUM x2 in forward() (m.py:7), forward() (m.py:8); MUL in act (m.py:6); SUB in act (m.py:6); "
        "TANH (not recorded)"
    )
