"""Issue 53: what an OpenVINO int8 model leaves in float is named by the model's modules and lines in the manifest, the
export report and `edgeline bundle show`, not by the CPU plugin's fused nodes (``Subgraph``, ``Eltwise``); a share is
never the only place it shows. Real torch.export, OpenVINO's converter, NNCF and the CPU plugin, nothing mocked.

The model is one of its own: a CNN on sklearn's 8x8 digits (scaled to [0, 1] outside it) with a PReLU inside an
``nn.Sequential`` (``features.1``) and ``gate``, a module of the model's file computing Mish written out
(``x * tanh(softplus(x))``). NNCF quantizes the convolutions and the head; the PReLU runs inside the int8 convolution
before it (``restore_prelu``: tests/test_openvino_int8_forms.py), and the CPU plugin computes the gate's softplus, tanh
and products in float.
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

from tests.training import digit_images, trained_model

SOURCE = """\
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


class SoftGate(nn.Module):
    def forward(self, x):
        return x * torch.tanh(F.softplus(x))


class GatedCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.PReLU(8), nn.Conv2d(8, 16, 3, stride=2, padding=1)
        )
        self.gate = SoftGate()
        self.head = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x):
        x = self.gate(self.features(x))
        return self.head(torch.flatten(x, 1))


def gated_cnn():
    model = GatedCNN()
    weights = Path(__file__).with_name("gated_cnn.pt")
    if weights.exists():
        model.load_state_dict(torch.load(weights))
    return model.eval()
"""

FILE = "openvino_naming_models.py"
GATE = f"gate ({FILE}:{SOURCE.splitlines().index('        return x * torch.tanh(F.softplus(x))') + 1})"
TRAIN = 1400  # the digits before are trained on (and calibrate); those after are held out
VALIDATION = 200


@pytest.fixture(scope="module")
def model() -> Path:
    """The model's source file, its trained weights beside it: made once for this code (tests/cache.py)."""
    images, labels = digit_images()
    x, y = images[:TRAIN] / 16.0, labels[:TRAIN]
    return trained_model(SOURCE, FILE, "gated_cnn", "gated_cnn.pt", x, y, epochs=15)


def _edgeline(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edgeline.cli", *args],
        capture_output=True, text=True, timeout=900, check=False, env=dict(os.environ),
    )  # fmt: skip


@pytest.fixture(scope="module")
def openvino(model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """``edgeline export`` of the model for x86-64, OpenVINO int8-static: the bundle, and the report it printed."""
    images, labels = digit_images()
    folder = tmp_path_factory.mktemp("openvino-naming")
    np.savez(folder / "cal.npz", x=images[:32] / 16.0)
    held_out = slice(TRAIN, TRAIN + VALIDATION)
    np.savez(folder / "val.npz", x=images[held_out] / 16.0, labels=labels[held_out])
    out = folder / "bundle"
    done = _edgeline(
        "export", f"{model}:gated_cnn", "--profile", "x86-64", "--backend", "openvino", "--precision", "int8-static",
        "--calibration", str(folder / "cal.npz"), "--validation", str(folder / "val.npz"), "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return out, done.stdout


def _placement(bundle: Path) -> dict[str, Any]:
    placement: dict[str, Any] = json.loads((bundle / "manifest.json").read_text(encoding="utf-8"))["placement"]
    return placement


FALLBACK = {"FakeQuantize": 1, "Greater+Select+Tanh+Multiply": 1, "SoftPlus": 1}
"""The runtime graph's float nodes, by what each computes: the input's quantization, and the gate's softplus (an
Eltwise) and the rest of it (a Snippets kernel). Before, ``Subgraph x3, Eltwise``, unnamed (PReLU among them)."""
SOURCES = {"FakeQuantize": ["input x"], "Greater+Select+Tanh+Multiply": [GATE], "SoftPlus": [GATE]}
LEFT_OUT = f"float: FakeQuantize in input x; Greater+Select+Tanh+Multiply in {GATE}; SoftPlus in {GATE}"


@pytest.mark.export
def test_the_manifest_names_the_modules_and_lines_of_what_stays_float(openvino: tuple[Path, str]) -> None:
    placement = _placement(openvino[0])
    assert placement["fallback"] == FALLBACK, placement
    assert placement["fallback_sources"] == SOURCES, placement
    assert placement["quantized_ops"] == placement["ops"] - sum(FALLBACK.values())  # counted as the share counts


@pytest.mark.export
def test_the_export_report_prints_where_what_stays_float_comes_from(openvino: tuple[Path, str]) -> None:
    _, report = openvino
    assert f"openvino int8-static: {LEFT_OUT}" in report.splitlines(), report


@pytest.mark.export
def test_bundle_show_prints_where_what_stays_float_comes_from(openvino: tuple[Path, str]) -> None:
    bundle, _ = openvino
    shown = _edgeline("bundle", "show", str(bundle))
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    placement = next(i for i, line in enumerate(lines) if line.startswith("placement:"))
    assert "fallback: FakeQuantize x1, Greater+Select+Tanh+Multiply x1, SoftPlus x1" in lines[placement], shown.stdout
    assert lines[placement + 1] == f"left out:     {LEFT_OUT}", shown.stdout
    as_json = json.loads(_edgeline("bundle", "show", str(bundle), "--json").stdout)
    assert as_json["placement"]["fallback_sources"] == SOURCES
    assert as_json["placement"]["left_out"] == LEFT_OUT


@pytest.mark.quick
def test_a_float_kernel_is_named_by_the_ir_operators_it_computes_and_the_code_that_made_them() -> None:
    """The naming rules on the CPU plugin's runtime graph of an IR built here, named as OpenVINO's PyTorch frontend
    names a torch.export program's operators, with every node left float (an int8 model with nothing quantized):
    a Snippets kernel (``Subgraph``) and an ``Eltwise`` are named by the IR's operators they fused, a ``Reduce`` keeps
    its kind; each is tied to the model's code by the torch.export node its operators are named after, and an
    operator whose node the program does not name is left unnamed (never guessed)."""
    import openvino as ov
    import openvino.opset13 as ops

    from edgeline.device_profiles import Precision
    from edgeline.export.backends.openvino import openvino_placement

    def named(node: Any, name: str) -> Any:
        node.set_friendly_name(name)
        return node

    x = ops.parameter([1, 8, 4, 4], np.float32, name="x")
    above = named(ops.greater(x, ops.constant(np.float32(0))), "gt/aten.gt.Scalar/Greater")
    slope = ops.constant(np.full((1, 8, 1, 1), 0.25, np.float32))
    scaled = named(ops.multiply(x, slope), "mul/aten.mul.Tensor/Multiply")
    prelu = named(ops.select(above, x, scaled), "where/aten.where.self/Select")
    mean = named(ops.reduce_mean(prelu, ops.constant(np.array([2, 3])), True), "mean/aten.mean.dim/ReduceMean")
    log = named(ops.log(ops.abs(mean)), "log/aten.log.default/Log")
    model = ov.Model([ops.result(log)], [x])
    sources = {"gt": "act (m.py:6)", "mul": "act (m.py:6)", "where": "act (m.py:6)", "mean": "forward() (m.py:9)"}
    placement = openvino_placement(ov.Core(), model, Precision.INT8_STATIC, None, True, "f32", sources=sources)
    assert placement.fallback == {"Greater+Multiply+Select": 1, "Log": 1, "Reduce": 1}, placement
    assert placement.fallback_sources == {"Greater+Multiply+Select": ["act (m.py:6)"], "Reduce": ["forward() (m.py:9)"]}
    assert placement.describe_sources() == (
        "float: Greater+Multiply+Select in act (m.py:6); Log (not recorded); Reduce in forward() (m.py:9)"
    )
