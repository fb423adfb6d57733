"""Mixed precision's ``kept_float`` never says more than the model file holds (issue 53): real litert-torch, LiteRT,
the dynamo ONNX exporter and onnxruntime's quantizer; nothing mocked.

The model is a digits CNN whose ``act1`` output has one channel 300 times the others (the outlier trick of
``tests/outlier_model.py``), read by a 1x1 convolution (``mix``) and by a max pool into a side branch (``pool1``,
``side``). Mixed precision asks to keep ``act1``'s tensor float: ``conv1`` (fused with ``act1``), ``mix`` and
``pool1``. The LiteRT converter carries the int8 scale of ``side``'s input back through the max pool, and the whole
group comes out int8, weights included: the model file computes none of the four in float, so it is no better than
plain int8 and the target is rejected; the export report said all four stayed float32. Each module the export says
it kept float is looked up among the operators of the model file, read here by tensor name, independently of the
exporter.
ONNX Runtime, on the same model: a max pool left out of quantization between a DequantizeLinear and a QuantizeLinear
is an integer kernel all the same, and is not claimed float.
"""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edgeline.device_profiles import Precision
from tests.training import digit_images, trained_model

pytestmark = pytest.mark.export

TRAIN = 1400
OUTLIER = 300.0
GROUP = ("conv1", "act1", "mix", "pool1")
"""What mixed precision asks to keep float: act1's maker (conv1, fused with it) and its two readers."""

SOURCE = """\
from pathlib import Path

import torch
from torch import nn


class Add(nn.Module):
    def forward(self, a, b):
        return a + b


class BranchCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 9, 3, padding=1)
        self.act1 = nn.ReLU()
        self.mix = nn.Conv2d(9, 16, 1)
        self.act2 = nn.ReLU()
        self.pool2 = nn.MaxPool2d(2)
        self.pool1 = nn.MaxPool2d(2)
        self.side = nn.Conv2d(9, 16, 1)
        self.add = Add()
        self.conv3 = nn.Conv2d(16, 32, 3, padding=1)
        self.act3 = nn.ReLU()
        self.drop = nn.Dropout(0.1)
        self.fc = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x):
        x = x / 16.0
        y = self.act1(self.conv1(x))
        x = self.add(self.pool2(self.act2(self.mix(y))), self.side(self.pool1(y)))
        x = self.act3(self.conv3(x))
        return self.fc(torch.flatten(x, 1))


def branch():
    model = BranchCNN()
    weights = Path(__file__).with_name("branch.pt")
    if weights.exists():
        model.load_state_dict(torch.load(weights))
    return model.eval()
"""


def _trained_model() -> Path:
    images, labels = digit_images()

    def plant(module: Any) -> None:  # the same function, one channel of act1's output OUTLIER times the others
        module.conv1.weight[8] *= OUTLIER
        module.conv1.bias[8] *= OUTLIER
        module.mix.weight[:, 8] /= OUTLIER
        module.side.weight[:, 8] /= OUTLIER

    x, y = images[:TRAIN], labels[:TRAIN]
    return trained_model(SOURCE, "branch_model.py", "branch", "branch.pt", x, y, key=[OUTLIER], edit=plant)


@pytest.fixture(scope="module")
def litert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, list[str], Path]:
    """The export report of ``--backend litert --precision int8-static`` on rpi4, its progress lines, and the model
    file of the mixed-precision build, converted again by the exporter with the group the report says was tried."""
    from edgeline.export.errors import BudgetError
    from edgeline.export.pipeline import ExportOptions, run_export
    from edgeline.export.progress import Progress

    images, labels = digit_images()
    folder = tmp_path_factory.mktemp("kept")
    np.savez(folder / "cal.npz", x=images[:32])
    np.savez(folder / "val.npz", x=images[TRAIN : TRAIN + 64], labels=labels[TRAIN : TRAIN + 64])
    lines = io.StringIO()
    with pytest.raises(BudgetError) as missed:  # plain int8 and every group tried miss the accuracy budget
        run_export(
            ExportOptions(
                model=f"{_trained_model()}:branch",
                profile="rpi4",
                calibration=folder / "cal.npz",
                validation=folder / "val.npz",
                out=folder / "bundle",
                backend="litert",
                precision=Precision.INT8_STATIC,
            ),
            progress=Progress(lines, live=False),
        )
    report = missed.value.report
    return report, lines.getvalue().splitlines(), folder


def _mixed_file(folder: Path, keep: tuple[str, ...], backend: str = "litert") -> Path:
    """The model file ``backend``'s exporter writes with ``keep`` kept float (the conversion is deterministic)."""
    import torch

    from edgeline.export.backends import ExportRequest, get_exporter
    from edgeline.export.loading import load_model

    images, _ = digit_images()
    calibration = [(torch.from_numpy(images[i : i + 1]),) for i in range(32)]
    module = load_model(f"{_trained_model()}:branch").module
    out = folder / f"mixed-{backend}"
    out.mkdir(exist_ok=True)
    request = ExportRequest(module, calibration[0], calibration, Precision.INT8_STATIC, out, ("x",), keep_float=keep)
    return out / get_exporter(backend).export(request).model_file


def _float_modules(path: Path) -> dict[str, set[bool]]:
    """Per module of the model, whether each LiteRT operator whose output tensor is named after it computes in
    float (a non-constant tensor of it is float), read with the interpreter alone."""
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_path=str(path))
    tensors = {detail["index"]: detail for detail in interpreter.get_tensor_details()}
    ops = interpreter._get_ops_details()
    produced = {index for op in ops for index in op["outputs"]}
    inputs = {detail["index"] for detail in interpreter.get_input_details()}
    found: dict[str, set[bool]] = {}
    for op in ops:
        if op["op_name"] in ("QUANTIZE", "DEQUANTIZE"):
            continue
        moving = [i for i in op["inputs"] if i in produced or i in inputs] + list(op["outputs"])
        in_float = any(np.dtype(tensors[i]["dtype"]) == np.float32 for i in moving if i >= 0)
        name = tensors[op["outputs"][0]]["name"]
        for module in re.findall(r"\.[A-Za-z0-9]+_([a-z0-9]+)(?=;|/|$)", name):
            found.setdefault(module, set()).add(in_float)
    return found


def test_litert_claims_float_only_for_modules_its_file_computes_in_float(litert: tuple[Any, list[str], Path]) -> None:
    report, _, folder = litert
    (outcome,) = report.outcomes
    assert outcome.backend == "litert" and outcome.status == "rejected", outcome.reason
    # mixed precision did try the group, and the report says so
    assert f"({', '.join(GROUP)}: " in outcome.reason, outcome.reason
    assert f"the converter computes {', '.join(GROUP)} in int8 all the same" in outcome.reason, outcome.reason
    in_file = _float_modules(_mixed_file(folder, GROUP))
    assert set(GROUP) <= set(in_file), in_file  # every module of the group is tied to operators of the file ...
    assert not any(True in in_file[module] for module in GROUP), in_file  # ... all of them int8
    claimed = [kept.module for kept in outcome.kept_float]
    wrong = [module for module in claimed if True not in in_file.get(module, {True})]
    assert not wrong, f"claimed float, int8 in the file: {wrong}"
    assert outcome.placement.quantized_ops == outcome.placement.ops, outcome.placement


def test_the_progress_line_names_what_the_converter_computes_in_int8(litert: tuple[Any, list[str], Path]) -> None:
    _, lines, _ = litert
    said = [line for line in lines if "the converter computes in integer" in line]
    assert said, lines
    assert "pool1 (MAX_POOL_2D)" in said[0] and "mix (CONV_2D)" in said[0], said


def test_the_report_says_no_layer_of_the_int8_file_stays_float(litert: tuple[Any, list[str], Path]) -> None:
    from edgeline.export.report import format_report

    report, _, _ = litert
    text = format_report(report)
    assert "mixed precision: with every layer int8" not in text, text
    assert not any(f"{module} (" in line and "stays float32" in line for module in GROUP for line in text.splitlines())


@pytest.fixture(scope="module")
def onnx_operators(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    """The operators of the ONNX Runtime int8 model with ``pool1`` and ``mix`` left out of quantization."""
    from edgeline.export.graph import export_program
    from edgeline.export.kept_float import file_operators
    from edgeline.export.loading import load_model

    path = _mixed_file(tmp_path_factory.mktemp("onnx"), ("pool1", "mix"), "onnxruntime")
    module = load_model(f"{_trained_model()}:branch").module
    program = export_program(module, (digit_images()[0][:1],))
    operators = file_operators(path, Precision.INT8_STATIC, program, module, cpu_fusions=True)
    assert operators is not None
    return operators


def _kept(module: str, operator: str) -> Any:
    from edgeline.manifest import KeptFloat

    return KeptFloat(module=module, operator=operator, added_bytes=0, reason="asked by the test")


def test_onnx_a_max_pool_left_out_of_quantization_is_an_integer_kernel_and_not_claimed(
    onnx_operators: list[Any],
) -> None:
    """pool1 reads act1's int8 tensor and side reads it int8: DequantizeLinear, MaxPool, QuantizeLinear, which
    ONNX Runtime runs as one integer kernel. mix, also left out, keeps its float weights: a float Conv."""
    from edgeline.export.kept_float import verify_kept

    verified = verify_kept([_kept("pool1", "MaxPool2d"), _kept("mix", "Conv2d")], onnx_operators)
    assert [k.module for k in verified.kept] == ["mix"], verified
    assert verified.int8 == (("pool1", ("MaxPool",)),)
    assert verified.said() == "pool1 (MaxPool)"


def test_a_module_no_operator_of_the_file_is_named_after_keeps_its_claim_said_unverified(
    onnx_operators: list[Any],
) -> None:
    """drop, a Dropout, computes nothing in an eval-mode model: no node of the file comes from it."""
    from edgeline.export.kept_float import verify_kept

    (kept,) = verify_kept([_kept("drop", "Dropout")], onnx_operators).kept
    assert kept.reason == (
        "asked by the test; not verified in the file: no operator of the converted model is named after it"
    )
