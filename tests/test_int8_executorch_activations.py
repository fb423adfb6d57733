"""ExecuTorch XNNPACK int8 for PReLU, ELU, SELU, CELU, Softplus, Mish and LayerNorm (issue 53): real torch.export,
the XNNPACK quantizer and partitioner, ExecuTorch's runtime; nothing mocked.

Before, XNNPACK's int8 export failed on PReLU and Softplus (its channels-last pass), left ELU, SELU and LayerNorm to
ExecuTorch's portable kernels in float, and counted every operator between a dequantize and a quantize as int8,
although XNNPACK runs EXP, LOG, TANH and RSQRT in fp32 between conversions of its own. Now each activation is written
in a form its quantizer annotates and its partitioner takes (``xnnpack_int8_forms``), every operator runs on XNNPACK,
and the placement counts as int8 only what XNNPACK computes on int8 tensors (``xnnpack_int8_kernel``).

Models of their own: a small CNN of sklearn's 8x8 digits whose every activation is the one under test, its input
centred so that the activations see negative values, and a CNN with LayerNorm over the channels (permuted, as
ConvNeXt writes it) and over the features of its hidden linear layer; trained here, cached by content.
"""

from __future__ import annotations

import hashlib
import inspect
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.cache import cached, cached_export
from tests.training import digit_images, train_classifier

TRAIN = 1400  # the digits before are trained on (the first CALIBRATION calibrate); those after are held out
CALIBRATION = 64

MODELS = '''\
from pathlib import Path

import torch
from torch import nn

ACTIVATIONS = {
    "prelu": lambda width: nn.PReLU(width),
    "elu": lambda width: nn.ELU(alpha=0.8),
    "selu": lambda width: nn.SELU(),
    "celu": lambda width: nn.CELU(alpha=0.6),
    "softplus": lambda width: nn.Softplus(beta=1.5),
    "mish": lambda width: nn.Mish(),
    "relu": lambda width: nn.ReLU(),
}


class ChannelNorm(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.norm = nn.LayerNorm(channels)

    def forward(self, x):
        return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class OffsetCNN(nn.Module):
    """Raw pixels (0..16) centred on 0 in forward(); optionally a LayerNorm before each hidden activation."""

    def __init__(self, activation, norm=False):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 3, padding=1)
        self.norm1 = ChannelNorm(6) if norm else nn.Identity()
        self.act1 = ACTIVATIONS[activation](6)
        self.conv2 = nn.Conv2d(6, 12, 3, stride=2, padding=1)
        self.act2 = ACTIVATIONS[activation](12)
        self.fc1 = nn.Linear(12 * 4 * 4, 24)
        self.norm3 = nn.LayerNorm(24) if norm else nn.Identity()
        self.act3 = ACTIVATIONS[activation](24)
        self.fc2 = nn.Linear(24, 10)

    def forward(self, x):
        x = (x - 8.0) / 4.0
        x = self.act1(self.norm1(self.conv1(x)))
        x = self.act2(self.conv2(x))
        return self.fc2(self.act3(self.norm3(self.fc1(torch.flatten(x, 1)))))


def _trained(model, name):
    weights = Path(__file__).with_name(name + ".pt")
    if weights.exists():
        model.load_state_dict(torch.load(weights))
    return model.eval()
'''

ACTIVATIONS = ("prelu", "elu", "selu", "celu", "softplus", "mish")
NORM = "layernorm"
NAMES = (*ACTIVATIONS, NORM)
FLOAT_IN_XNNPACK: dict[str, Counter[str]] = {
    "softplus": Counter({"aten.exp.default": 3, "aten.log.default": 3}),
    "mish": Counter({"aten.exp.default": 3, "aten.log.default": 3, "aten.tanh.default": 3}),
    NORM: Counter({"aten.rsqrt.default": 2}),
}
"""What XNNPACK computes in fp32 inside its delegate (between conversions): everything else is int8."""


def _factories() -> str:
    made = [f"\n\ndef {name}():\n    return _trained(OffsetCNN({name!r}), {name!r})\n" for name in ACTIVATIONS]
    return "".join(made) + f"\n\ndef {NORM}():\n    return _trained(OffsetCNN('relu', norm=True), {NORM!r})\n"


@pytest.fixture(scope="module")
def models() -> Path:
    """The models' source file, each one's trained weights beside it (trained once for this code)."""
    images, labels = digit_images()

    def make(directory: Path) -> None:
        import torch

        from edgeline.export.loading import load_model

        source = directory / "xnnpack_activations.py"
        source.write_text(MODELS + _factories(), encoding="utf-8")
        weights = hashlib.sha256()
        for name in NAMES:
            torch.manual_seed(0)
            module = load_model(f"{source}:{name}").module
            train_classifier(module, torch.from_numpy(images[:TRAIN]), torch.from_numpy(labels[:TRAIN]), epochs=15)
            torch.save(module.state_dict(), directory / f"{name}.pt")
            weights.update((directory / f"{name}.pt").read_bytes())
        # the bundles' cache key holds the source file's contents: these weights are part of it
        source.write_text(MODELS + _factories() + f"\n# weights: {weights.hexdigest()}\n", encoding="utf-8")

    data = hashlib.sha256(images.tobytes() + labels.tobytes()).hexdigest()
    inputs = [MODELS, _factories(), TRAIN, data, inspect.getsource(train_classifier)]
    return cached("trained", inputs, make) / "xnnpack_activations.py"


@pytest.fixture(scope="module")
def samples(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    images, labels = digit_images()
    folder = tmp_path_factory.mktemp("samples")
    np.savez(folder / "calibration.npz", x=images[:CALIBRATION])
    np.savez(folder / "validation.npz", x=images[TRAIN:], labels=labels[TRAIN:])
    return folder / "calibration.npz", folder / "validation.npz"


def _bundle(models: Path, samples: tuple[Path, Path], name: str) -> Path:
    """``name`` exported by ``edgeline export --profile rpi5 --backend executorch-xnnpack --precision int8-static``
    (plain int8), once for this code."""
    calibration, validation = samples
    target = ("--profile", "rpi5", "--backend", "executorch-xnnpack", "--precision", "int8-static")
    options = ("--calibration", calibration, "--validation", validation, "--no-mixed-precision")
    return cached_export(f"{models}:{name}", *target, *options)


@pytest.mark.export
@pytest.mark.parametrize("name", NAMES)
def test_every_operator_runs_on_xnnpack_in_int8_but_what_it_computes_in_fp32(
    name: str, models: Path, samples: tuple[Path, Path]
) -> None:
    """The export succeeds; every operator is delegated to XNNPACK; the placement counts as float exactly the
    operators XNNPACK computes in fp32 (EXP, LOG, TANH, RSQRT), named with the module and line that made them, and
    the rest as int8; the bundle classifies the held-out digits as the float model does."""
    import torch

    from edgeline.bundle import read_bundle
    from edgeline.export.loading import load_model
    from edgeline.model import load

    bundle = _bundle(models, samples, name)
    placement = read_bundle(bundle).manifest.placement
    assert placement is not None and placement.ops is not None
    assert placement.accelerator == "xnnpack"
    assert placement.accelerator_ops == placement.ops, placement.fallback
    expected = FLOAT_IN_XNNPACK.get(name, Counter())
    assert Counter(placement.fallback) == expected, placement.fallback
    assert placement.quantized_ops == placement.ops - sum(expected.values())
    for operator in expected:  # each named with the module whose code made it and the model's line
        assert placement.fallback_sources.get(operator), placement.fallback_sources
        assert all("xnnpack_activations.py:" in where for where in placement.fallback_sources[operator])

    images, labels = digit_images()
    held_out, truth = images[TRAIN:], labels[TRAIN:]
    module = load_model(f"{models}:{name}").module
    with torch.no_grad():
        expected_classes = module(torch.from_numpy(held_out)).argmax(1).numpy()
    deployed = load(bundle)
    found = np.array([int(np.argmax(deployed.predict(image[None])[0])) for image in held_out])
    float_accuracy, int8_accuracy = np.mean(expected_classes == truth), np.mean(found == truth)
    assert float_accuracy >= 0.9
    assert np.mean(found == expected_classes) >= 0.95, (float_accuracy, int8_accuracy)
    assert int8_accuracy >= float_accuracy - 0.02, (float_accuracy, int8_accuracy)


def _lowered(module: Any, images: np.ndarray) -> Any:
    """``module`` quantized and lowered as the XNNPACK exporter does it: the edge program's graph module."""
    import torch
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    from edgeline.export.backends.executorch_xnnpack import partitioner_configs, quantized_module

    calibration = [(torch.from_numpy(images[i : i + 1]),) for i in range(16)]
    quantized = quantized_module(module, calibration[0], calibration, dynamic=False)
    program = torch.export.export(quantized, calibration[0])
    edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner(configs=partitioner_configs())])
    return edge.exported_program().graph_module


def _name(node: Any) -> str:
    """``aten.exp.default``."""
    return str(getattr(node.target, "__name__", node.target))


def _delegated_nodes(graph_module: Any) -> list[Any]:
    nodes = []
    for node in graph_module.graph.nodes:
        lowered = getattr(graph_module, str(node.target), None) if node.op == "get_attr" else None
        original = getattr(lowered, "original_module", None)
        if original is not None:
            nodes += [n for n in original.graph_module.graph.nodes if n.op == "call_function"]
    return nodes


@pytest.mark.export
def test_xnnpack_s_implicit_conversions_are_read_as_this_code_expects(models: Path) -> None:
    """The placement reads the XNNPACK partitioner's "implicit" tags on the quantize and dequantize nodes of the
    lowered module's graph (``executorch.backends.xnnpack.utils.quant_utils``, not a documented API): they are there
    and mean what this code takes them to (else this fails, and the placement falls back to the partitioner's configs,
    whose reading must agree on this model: EXP and LOG fp32, the rest int8). The Softplus model's EXP and LOG read
    dequantizations XNNPACK converts to fp32; its ADD reads int8."""
    from executorch.backends.xnnpack.utils.quant_utils import is_dequant, is_tagged_as_implicit_q_dq

    from edgeline.export.backends import executorch_xnnpack
    from edgeline.export.loading import load_model

    images, _ = digit_images()
    graph_module = _lowered(load_model(f"{models}:softplus").module, images)
    nodes = _delegated_nodes(graph_module)
    computing = [n for n in nodes if not ("quantize_per_" in _name(n) or "dequantize_per_" in _name(n))]
    kinds = {_name(n).split(".")[-2] for n in computing}
    assert {"exp", "log", "add", "relu", "mul", "convolution", "linear"} <= kinds, kinds
    for node in computing:
        reads = [arg for arg in node.all_input_nodes if is_dequant(arg)]
        kind = _name(node).split(".")[-2]
        if kind in ("exp", "log"):
            assert reads and not any(is_tagged_as_implicit_q_dq(arg) for arg in reads), node
            assert not executorch_xnnpack.xnnpack_int8_kernel(node)
        elif kind in ("add", "convolution", "linear"):
            assert reads and all(is_tagged_as_implicit_q_dq(arg) for arg in reads), node
            assert executorch_xnnpack.xnnpack_int8_kernel(node)
    by_configs = executorch_xnnpack._static_quant_targets()
    assert not by_configs["exp.default"] and not by_configs["log.default"] and not by_configs["tanh.default"]
    assert by_configs["add.Tensor"] and by_configs["elu.default"] and by_configs["relu.default"]
    for node in computing:  # the fallback's reading: the same, operator by operator
        assert by_configs.get(".".join(_name(node).split(".")[-2:])) == executorch_xnnpack.xnnpack_int8_kernel(node)


@pytest.mark.export
def test_an_exp_xnnpack_runs_in_fp32_counts_as_float_where_the_old_rule_said_int8(models: Path) -> None:
    """The same lowered program, placed with and without XNNPACK's reading: without it (every operator between a
    dequantize and a quantize counted int8, the rule before) the EXP and LOG of Softplus were int8; with it, float,
    still on XNNPACK."""
    from edgeline.device_profiles import Precision
    from edgeline.export.backends.executorch_xnnpack import xnnpack_int8_kernel
    from edgeline.export.loading import load_model
    from edgeline.export.placement import executorch_placement

    images, _ = digit_images()
    graph_module = _lowered(load_model(f"{models}:softplus").module, images)
    before = executorch_placement(graph_module, Precision.INT8_STATIC, "xnnpack")
    after = executorch_placement(graph_module, Precision.INT8_STATIC, "xnnpack", xnnpack_int8_kernel)
    assert before.fallback == {} and before.quantized_ops == before.ops
    assert after.fallback == {"aten.exp.default": 3, "aten.log.default": 3}
    assert after.accelerator_ops == after.ops == before.ops
    assert after.quantized_macs is not None and after.macs is not None and after.quantized_macs < after.macs


# -- the forms compute the same function (no export: one operator's graph, built here) -------------------------------


def _one_operator(target: Any, arguments: tuple[Any, ...], example: Any, **attributes: Any) -> Any:
    """A GraphModule computing ``target(x, *arguments)``, a string among ``arguments`` naming one of ``attributes``
    (a parameter, read by ``get_attr``), each node's ``meta["val"]`` its value on ``example`` and a module path."""
    import torch

    root = torch.nn.Module()
    for name, value in attributes.items():
        root.register_parameter(name, torch.nn.Parameter(value))
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    args = tuple(graph.get_attr(a) if isinstance(a, str) else a for a in arguments)
    result = graph.call_function(target, (x, *args))
    graph.output(result)
    module = torch.fx.GraphModule(root, graph)
    values: dict[Any, Any] = {x: example}
    for node in graph.nodes:
        if node.op == "get_attr":
            values[node] = attributes[str(node.target)].detach()
        elif node.op == "call_function":
            values[node] = target(*(values.get(a, a) if isinstance(a, torch.fx.Node) else a for a in node.args))
        if node in values:
            node.meta["val"] = values[node]
    result.meta["nn_module_stack"] = {"L__self___act": ("act", "torch.nn.Module")}
    return module


CASES = (
    "prelu per channel", "prelu one alpha", "elu", "selu", "celu", "softplus", "softplus beta", "mish", "layer_norm",
    "layer_norm plain", "silu", "division", "subtraction",
)  # fmt: skip
"""The cases' names, for collection without torch (the device tier collects every module)."""


def _cases() -> dict[str, tuple[Any, ...]]:
    import torch

    aten = torch.ops.aten
    torch.manual_seed(0)
    return {
        "prelu per channel": (aten.prelu.default, ("weight",), (2, 5, 3, 3), {"weight": torch.rand(5) - 0.3}),
        "prelu one alpha": (aten.prelu.default, ("weight",), (4, 7), {"weight": torch.tensor([0.2])}),
        "elu": (aten.elu.default, (0.7, 1.3, 0.8), (3, 6), {}),
        "selu": (aten.selu.default, (), (3, 6), {}),
        "celu": (aten.celu.default, (0.5,), (2, 4, 3, 3), {}),
        "softplus": (aten.softplus.default, (1.0, 20.0), (3, 6), {}),
        "softplus beta": (aten.softplus.default, (2.5, 20.0), (3, 6), {}),
        "mish": (aten.mish.default, (), (2, 4, 3, 3), {}),
        "layer_norm": (
            aten.layer_norm.default,
            ([6], "weight", "bias", 1e-5),
            (2, 3, 6),
            {"weight": torch.rand(6) + 0.5, "bias": torch.randn(6)},
        ),
        "layer_norm plain": (aten.layer_norm.default, ([6],), (4, 6), {}),
        "silu": (aten.silu.default, (), (3, 6), {}),
        "division": (aten.div.Tensor, (16.0,), (3, 6), {}),
        "subtraction": (aten.sub.Tensor, (8.0,), (3, 6), {}),
    }


@pytest.mark.quick
@pytest.mark.parametrize("case", CASES)
def test_each_form_computes_the_same_function(case: str) -> None:
    """Each rewrite, in float, before any quantizer: the original operator gone (ELU: as XNNPACK's), the same values
    as it on random inputs (negative and positive, past Softplus's threshold), every new operator with the module of
    the one it replaced (the placement and the layer report name it)."""
    import torch

    from edgeline.export.graph import module_path
    from edgeline.export.xnnpack_forms import xnnpack_int8_forms

    cases = _cases()
    assert tuple(cases) == CASES
    target, arguments, shape, attributes = cases[case]
    generator = torch.Generator().manual_seed(1)
    example = torch.randn(shape, generator=generator) * 6
    original = _one_operator(target, arguments, example, **attributes)
    rewritten = _one_operator(target, arguments, example, **attributes)
    assert xnnpack_int8_forms(rewritten) == 1
    operators = [n for n in rewritten.graph.nodes if n.op == "call_function"]
    if target == torch.ops.aten.elu.default:  # XNNPACK's ELU: an explicit alpha, no scale (its node ignores them)
        assert all(len(n.args) == 2 and not n.kwargs for n in operators if n.target == target), operators
    else:
        assert target not in {n.target for n in operators}
    assert all(module_path(n) == "act" for n in operators), [module_path(n) for n in operators]
    for _ in range(5):
        x = torch.randn(shape, generator=generator) * 8
        with torch.no_grad():
            torch.testing.assert_close(rewritten(x), original(x), atol=1e-5, rtol=1e-5)


LEFT_SOURCE = """\
import torch
from torch import nn


class CumulativeCNN(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        return self.conv2(torch.cumsum(self.conv1(x), dim=-1))


def model():
    return CumulativeCNN().eval()
"""


@pytest.mark.export
def test_what_executorch_s_own_kernels_run_between_conversions_counts_as_float(tmp_path: Path) -> None:
    """XNNPACK takes no cumulative sum: ExecuTorch's portable kernel runs it, on the float tensor a dequantize gives it,
    although a dequantize and a quantize frame it in the int8 graph. It counts as float (and off XNNPACK), the two
    convolutions as int8 on XNNPACK."""
    import torch

    from edgeline.device_profiles import Precision
    from edgeline.export.backends import ExportRequest, get_exporter
    from edgeline.export.loading import load_model

    source = tmp_path / "cumulative.py"
    source.write_text(LEFT_SOURCE, encoding="utf-8")
    module = load_model(f"{source}:model").module
    images, _ = digit_images()
    calibration = [(torch.from_numpy(images[i : i + 1] / 16.0),) for i in range(16)]
    (tmp_path / "out").mkdir()
    request = ExportRequest(module, calibration[0], calibration, Precision.INT8_STATIC, tmp_path / "out", ("x",))
    placement = get_exporter("executorch-xnnpack").export(request).placement
    assert placement is not None
    (cumsum,) = [name for name in placement.fallback if "cumsum" in name]
    assert placement.fallback_sources[cumsum] == ["forward() (cumulative.py:13)"]
    assert placement.ops is not None and placement.quantized_ops == placement.accelerator_ops == placement.ops - 1
