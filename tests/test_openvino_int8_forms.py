"""OpenVINO int8 runs PReLU inside its int8 layers (issue 53): real torch.export, OpenVINO's PyTorch frontend, NNCF
and the CPU plugin; nothing mocked.

torch.export decomposes ``nn.PReLU`` into ``where(x > 0, x, weight * x)`` before OpenVINO's frontend sees it (the
frontend decomposes the program with torch's table again, and has no FX translator for ``aten.prelu``), and the CPU
plugin ran that Greater, Multiply and Select as a float kernel between int8 layers: 5 of 9 operators int8 on a
digits CNN with three PReLUs. ``restore_prelu`` makes them OpenVINO's PRelu again, which the plugin computes as a
post-op of the int8 convolution or fully connected layer before it.

The model: a small CNN of sklearn's 8x8 digits with a PReLU after each hidden layer (per channel after the two
convolutions and the hidden Linear), its input centred so the PReLUs see negative values; trained here, cached by
content.

LayerNorm runs in int8 too. OpenVINO's frontend makes ``nn.LayerNorm`` an MVN over the array's last axes, with its
weight's Multiply and bias's Add. Over the channels of a convolution's output, permuted as ConvNeXt does, that MVN
normalises the last axis of a 4-D array, which the CPU plugin's MVN does not take: it decomposed it into an int8
ReduceMean and Subtract and a float RMS and Add (beside a float requantization; 13 of 19 operators int8 on a digits CNN
with two such norms and one over a Linear's features, whose MVN ran in int8 but left its requantization alone in
float). ``row_layer_norms`` makes each an MVN over a [rows, features, 1] array, with the activation after it moved
next to it, which the plugin computes in int8 with the weight, bias, activation and requantization fused. Its model:
a CNN of its own with a GELU after the first permuted LayerNorm and a ReLU after the second and after the one over
the Linear's features. A transformer's LayerNorm, over the features of a [batch, tokens, features] array, ran its MVN
in int8 but its weight and bias apart in float (the plugin's post-ops are per channel, axis 1: the tokens); made
rows too, they fuse: a two-block ViT-like model of its own, patches of the digits, 49 of 59 operators int8 before.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.cache import cached_export
from tests.training import digit_images, trained_model

TRAIN = 1400  # the digits before are trained on (the first CALIBRATION calibrate); those after are held out
CALIBRATION = 64
BUDGET = 1.0  # x86-64's max_accuracy_drop, in points


def _plain_int8(model: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``edgeline export MODEL --profile x86-64 --backend openvino --precision int8-static --no-mixed-precision``
    (plain int8: mixed precision would move layers to float), calibrated on the first CALIBRATION digits, validated on
    the held-out ones; once for this code."""
    images, labels = digit_images()
    folder = tmp_path_factory.mktemp("samples")
    np.savez(folder / "calibration.npz", x=images[:CALIBRATION])
    np.savez(folder / "validation.npz", x=images[TRAIN:], labels=labels[TRAIN:])
    target = ("--profile", "x86-64", "--backend", "openvino", "--precision", "int8-static")
    options = ("--calibration", folder / "calibration.npz", "--validation", folder / "validation.npz")
    return cached_export(model, *target, *options, "--no-mixed-precision")


def _held_out_accuracies(model: str, bundle: Path) -> tuple[float, float]:
    """The float model's and the bundle's accuracy on the held-out digits, each computed here."""
    import torch

    from edgeline.export.loading import load_model
    from edgeline.model import load

    images, labels = digit_images()
    held_out, truth = images[TRAIN:], labels[TRAIN:]
    with torch.no_grad():
        expected = load_model(model).module(torch.from_numpy(held_out)).argmax(1).numpy()
    deployed = load(bundle)
    found = np.array([int(np.argmax(deployed.predict(image[None])[0])) for image in held_out])
    return float(np.mean(expected == truth)), float(np.mean(found == truth))


MODEL = """\
from pathlib import Path

import torch
from torch import nn


class PReLUCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 3, padding=1)
        self.act1 = nn.PReLU(6)
        self.conv2 = nn.Conv2d(6, 12, 3, stride=2, padding=1)
        self.act2 = nn.PReLU(12)
        self.fc1 = nn.Linear(12 * 4 * 4, 24)
        self.act3 = nn.PReLU(24)
        self.fc2 = nn.Linear(24, 10)

    def forward(self, x):
        x = (x - 8.0) / 4.0
        x = self.act2(self.conv2(self.act1(self.conv1(x))))
        return self.fc2(self.act3(self.fc1(torch.flatten(x, 1))))


def prelu():
    model = PReLUCNN()
    weights = Path(__file__).with_name("prelu.pt")
    if weights.exists():
        model.load_state_dict(torch.load(weights))
    return model.eval()
"""


@pytest.fixture(scope="module")
def model_file() -> Path:
    """The model's source file, its trained weights beside it (trained once for this code)."""
    images, labels = digit_images()
    return trained_model(MODEL, "openvino_prelu.py", "prelu", "prelu.pt", images[:TRAIN], labels[:TRAIN], epochs=15)


@pytest.fixture(scope="module")
def bundle(model_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``edgeline export --profile x86-64 --backend openvino --precision int8-static`` (plain int8), once for this
    code."""
    return _plain_int8(f"{model_file}:prelu", tmp_path_factory)


@pytest.mark.export
def test_prelu_runs_inside_the_int8_layers_and_the_bundle_keeps_the_accuracy(model_file: Path, bundle: Path) -> None:
    """No float part of the placement computes a PReLU (before: ``Greater+Multiply+Select`` x3, one per PReLU, 5 of 9
    operators int8), none is tied to a PReLU module; the bundle classifies the held-out digits within the profile's
    budget of the float model."""
    from edgeline.bundle import read_bundle

    placement = read_bundle(bundle).manifest.placement
    assert placement is not None and placement.ops is not None and placement.quantized_ops is not None
    for kind in placement.fallback:
        assert not {"Greater", "Select", "PRelu"} & set(kind.split("+")), placement.fallback
    for kind, where in placement.fallback_sources.items():
        assert not any(place.startswith("act") for place in where), (kind, where)
    assert placement.ops - placement.quantized_ops == sum(placement.fallback.values())
    assert sum(placement.fallback.values()) <= 1, placement.fallback  # at most the input's quantization

    float_accuracy, int8_accuracy = _held_out_accuracies(f"{model_file}:prelu", bundle)
    assert float_accuracy >= 0.9
    assert 100 * (float_accuracy - int8_accuracy) <= BUDGET, (float_accuracy, int8_accuracy)


@pytest.mark.export
def test_the_ir_holds_one_prelu_per_module_computing_what_torch_does(model_file: Path) -> None:
    """The IR ``to_openvino`` converts (as every OpenVINO export does) has three PRelu operators, named after the
    torch.export node the Select was (so placement names their module), and no Select; in f32 it computes the torch
    module's outputs."""
    import openvino as ov
    import torch

    from edgeline.device_profiles import Precision
    from edgeline.export.backends import ExportRequest
    from edgeline.export.backends.openvino import operator_modules, to_openvino
    from edgeline.export.loading import load_model

    images, _ = digit_images()
    module = load_model(f"{model_file}:prelu").module
    example = (torch.from_numpy(images[:1]),)
    request = ExportRequest(
        module=module,
        example_inputs=example,
        calibration=[],
        precision=Precision.FP32,
        out_dir=Path("."),
        input_names=("x",),
    )
    model, program = to_openvino(ov, request)
    kinds = [op.get_type_name() for op in model.get_ordered_ops()]
    assert kinds.count("PRelu") == 3 and "Select" not in kinds and "Greater" not in kinds, kinds
    modules = operator_modules(model, program, module)
    prelus = [op.get_friendly_name() for op in model.get_ordered_ops() if op.get_type_name() == "PRelu"]
    assert sorted(modules.get(name, "") for name in prelus) == ["act1", "act2", "act3"], prelus

    compiled = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    batch = images[TRAIN : TRAIN + 16]
    with torch.no_grad():
        wanted = module(torch.from_numpy(batch)).numpy()
    got = np.concatenate([compiled(image[None])[0] for image in batch])
    np.testing.assert_allclose(got, wanted, rtol=1e-4, atol=1e-4)


@pytest.mark.quick
@pytest.mark.parametrize(
    ("slope_shape", "made"),
    [((1, 8, 1, 1), 1), ((8, 1, 1), 1), ((1,), 1), ((1, 1, 1, 4), 0), ((1, 8, 4, 4), 0)],
    ids=["per channel", "per channel unbatched", "one for all", "along the last axis", "per element"],
)
def test_only_a_prelu_s_exact_form_becomes_prelu(slope_shape: tuple[int, ...], made: int) -> None:
    """``where(x > 0, x, slope * x)`` built here as OpenVINO's frontend converts it: made PRelu where the slope is one
    value or one per channel (PRelu's axis 1), left as it is otherwise (a slope along another axis, one per element);
    the model computes the same either way."""
    import openvino as ov
    import openvino.opset13 as ops

    from edgeline.export.openvino_forms import restore_prelu

    rng = np.random.default_rng(0)
    x = ops.parameter([1, 8, 4, 4], np.float32, name="x")
    above = ops.greater(x, ops.constant(np.float32(0)))
    slope = ops.constant(rng.uniform(0.05, 0.5, slope_shape).astype(np.float32))
    chosen = ops.select(above, x, ops.multiply(slope, x))
    chosen.set_friendly_name("where/aten.where.self/Select")
    model = ov.Model([ops.result(ops.relu(ops.negative(chosen)))], [x])
    sample = rng.normal(size=(1, 8, 4, 4)).astype(np.float32)
    before = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})(sample)[0]

    assert restore_prelu(model) == made
    kinds = [op.get_type_name() for op in model.get_ordered_ops()]
    assert kinds.count("PRelu") == made and kinds.count("Select") == 1 - made, kinds
    if made:
        prelu = next(op for op in model.get_ordered_ops() if op.get_type_name() == "PRelu")
        assert prelu.get_friendly_name() == "where/aten.where.self/PRelu"
    after = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})(sample)[0]
    np.testing.assert_allclose(after, before, rtol=1e-6, atol=1e-6)


LAYER_NORM_MODEL = """\
from pathlib import Path

import torch
from torch import nn


class ChannelNorm(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.norm = nn.LayerNorm(channels, eps=1e-6)

    def forward(self, x):
        return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class NormCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 3, padding=1)
        self.norm1 = ChannelNorm(6)
        self.act1 = nn.GELU()
        self.conv2 = nn.Conv2d(6, 12, 3, stride=2, padding=1)
        self.norm2 = ChannelNorm(12)
        self.act2 = nn.ReLU()
        self.fc1 = nn.Linear(12 * 4 * 4, 24)
        self.norm3 = nn.LayerNorm(24)
        self.act3 = nn.ReLU()
        self.fc2 = nn.Linear(24, 10)

    def forward(self, x):
        x = (x - 8.0) / 4.0
        x = self.act2(self.norm2(self.conv2(self.act1(self.norm1(self.conv1(x))))))
        return self.fc2(self.act3(self.norm3(self.fc1(torch.flatten(x, 1)))))


def layer_norm():
    model = NormCNN()
    weights = Path(__file__).with_name("layer_norm.pt")
    if weights.exists():
        model.load_state_dict(torch.load(weights))
    return model.eval()
"""


@pytest.fixture(scope="module")
def layer_norm_file() -> Path:
    """The LayerNorm model's source file, its trained weights beside it (trained once for this code)."""
    images, labels = digit_images()
    return trained_model(
        LAYER_NORM_MODEL,
        "openvino_layer_norm.py",
        "layer_norm",
        "layer_norm.pt",
        images[:TRAIN],
        labels[:TRAIN],
        epochs=15,
    )


@pytest.fixture(scope="module")
def layer_norm_bundle(layer_norm_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``edgeline export --profile x86-64 --backend openvino --precision int8-static`` (plain int8), once for this
    code."""
    return _plain_int8(f"{layer_norm_file}:layer_norm", tmp_path_factory)


@pytest.mark.export
def test_layer_norms_run_in_int8_and_the_bundle_keeps_the_accuracy(
    layer_norm_file: Path, layer_norm_bundle: Path
) -> None:
    """No float part of the placement computes a LayerNorm or the activation after it (before: ``RMS`` x2 and
    ``Add`` x2 in the two permuted norms, ``FakeQuantize`` after the third; 13 of 19 operators int8), none is tied to
    a norm or activation module; at most the input's quantization is float; every layer is in the layer report; the
    bundle classifies the held-out digits within the profile's budget of the float model."""
    from edgeline.bundle import read_bundle

    manifest = read_bundle(layer_norm_bundle).manifest
    placement = manifest.placement
    assert placement is not None and placement.ops is not None and placement.quantized_ops is not None
    for kind in placement.fallback:
        assert not {"RMS", "MVN", "ReduceMean", "Add", "Multiply", "Gelu", "Relu"} & set(kind.split("+")), kind
    for kind, where in placement.fallback_sources.items():
        assert not any(place.startswith(("norm", "act")) for place in where), (kind, where)
    assert placement.ops - placement.quantized_ops == sum(placement.fallback.values())
    assert sum(placement.fallback.values()) <= 1, placement.fallback  # at most the input's quantization
    assert manifest.quantization is not None
    reported = {layer.module for layer in manifest.quantization.layers}
    assert {"norm1.norm", "act1", "norm2.norm", "act2", "norm3", "act3"} <= reported, reported

    float_accuracy, int8_accuracy = _held_out_accuracies(f"{layer_norm_file}:layer_norm", layer_norm_bundle)
    assert float_accuracy >= 0.9
    assert 100 * (float_accuracy - int8_accuracy) <= BUDGET, (float_accuracy, int8_accuracy)


@pytest.mark.export
def test_the_ir_normalises_rows_computing_what_torch_does(layer_norm_file: Path) -> None:
    """The IR ``to_openvino`` converts has three MVNs, each over axes [1, 2] of a [rows, features, 1] array (the
    pixels' channels, the Linear's features), each named after its LayerNorm's torch.export node, the activation
    after each reading its bias's Add; in f32 it computes the torch module's outputs."""
    import openvino as ov
    import torch

    from edgeline.device_profiles import Precision
    from edgeline.export.backends import ExportRequest
    from edgeline.export.backends.openvino import operator_modules, to_openvino
    from edgeline.export.loading import load_model

    images, _ = digit_images()
    module = load_model(f"{layer_norm_file}:layer_norm").module
    request = ExportRequest(
        module=module,
        example_inputs=(torch.from_numpy(images[:1]),),
        calibration=[],
        precision=Precision.FP32,
        out_dir=Path("."),
        input_names=("x",),
    )
    model, program = to_openvino(ov, request)
    mvns = [op for op in model.get_ordered_ops() if op.get_type_name() == "MVN"]
    shapes = [[int(d) for d in op.get_output_partial_shape(0).to_shape()] for op in mvns]
    assert shapes == [[64, 6, 1], [16, 12, 1], [1, 24, 1]], shapes
    for mvn in mvns:
        assert list(mvn.input(1).get_source_output().get_node().get_data()) == [1, 2]
    modules = operator_modules(model, program, module)
    assert [modules.get(op.get_friendly_name()) for op in mvns] == ["norm1.norm", "norm2.norm", "norm3"]
    activations = {op.get_type_name(): op for op in model.get_ordered_ops() if op.get_type_name() in ("Gelu", "Relu")}
    gelu = activations["Gelu"]
    assert gelu.input(0).get_source_output().get_node().get_type_name() == "Add"
    assert modules.get(gelu.get_friendly_name()) == "act1"

    compiled = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    batch = images[TRAIN : TRAIN + 16]
    with torch.no_grad():
        wanted = module(torch.from_numpy(batch)).numpy()
    got = np.concatenate([compiled(image[None])[0] for image in batch])
    np.testing.assert_allclose(got, wanted, rtol=1e-4, atol=1e-4)


@pytest.mark.quick
@pytest.mark.parametrize(
    ("shape", "axes", "weight_shape", "after", "made"),
    [
        ((1, 4, 4, 8), [-1], (8,), "permute, relu", 1),
        ((1, 4, 4, 8), [3], (8,), "", 1),
        ((1, 24), [1], (24,), "relu", 1),
        ((1, 4, 4, 8), [-1], (1, 4, 1, 8), "permute, relu", 1),
        ((1, 6, 24), [2], (24,), "relu", 1),
        ((1, 6, 24), [2], (), "relu", 0),
        ((1, 8, 4, 4), [2, 3], (1, 8, 1, 1), "relu", 0),
    ],
    ids=[
        "permuted channels",
        "channels, nothing after",
        "features",
        "weight along another axis",
        "a sequence's features",
        "a sequence's features, no weight or bias",
        "instance norm",
    ],
)
def test_only_layer_norms_the_plugin_would_not_run_as_an_int8_mvn_are_made_rows(
    shape: tuple[int, ...], axes: list[int], weight_shape: tuple[int, ...], after: str, made: int
) -> None:
    """A layer norm built here as OpenVINO's frontend converts it (MVN, the weight's Multiply, the bias's Add, then
    what follows): made an MVN over [rows, features, 1] where the CPU plugin would decompose it (a 4-D array's last
    axis) or fuse no requantization into it (2-D), the activation after it (through a permute) moved next to it; a
    weight that varies along an axis it does not normalise left after it, with what follows; a 3-D array's last axis
    (a transformer's features), whose weight and bias the plugin would compute apart in float (its post-ops are per
    channel, axis 1); left as it is where the plugin runs it as an MVN with its post-ops (a 3-D array's last axis with
    no weight or bias, an instance norm's [2, 3]); the model computes the same either way."""
    import openvino as ov
    import openvino.opset13 as ops

    from edgeline.export.openvino_forms import row_layer_norms

    rng = np.random.default_rng(0)
    x = ops.parameter(list(shape), np.float32, name="x")
    normed = ops.mvn(x, ops.constant(np.array(axes, np.int64)), True, 1e-5, "inside_sqrt")
    normed.set_friendly_name("native_layer_norm/aten.native_layer_norm.default/MVN")
    value = normed
    if weight_shape:  # () for a layer norm without weight and bias (elementwise_affine=False)
        scaled = ops.multiply(normed, ops.constant(rng.uniform(0.5, 1.5, weight_shape).astype(np.float32)))
        value = ops.add(scaled, ops.constant(rng.normal(size=shape[-1]).astype(np.float32)))
    if "permute" in after:
        value = ops.transpose(value, ops.constant(np.array([0, 3, 1, 2], np.int64)))
    if "relu" in after:
        value = ops.relu(value)
        value.set_friendly_name("relu/aten.relu.default/Relu")
    model = ov.Model([ops.result(value)], [x])
    sample = rng.normal(size=shape).astype(np.float32)
    before = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})(sample)[0]

    assert row_layer_norms(model) == made
    mvn = next(op for op in model.get_ordered_ops() if op.get_type_name() == "MVN")
    rows = [int(d) for d in mvn.get_output_partial_shape(0).to_shape()]
    if made:
        assert rows == [int(np.prod(shape[:-1])), shape[-1], 1], rows
        assert list(mvn.input(1).get_source_output().get_node().get_data()) == [1, 2]
        assert mvn.get_friendly_name() == "native_layer_norm/aten.native_layer_norm.default/MVN"
    else:
        assert rows == list(shape), rows
    if made and "relu" in after:
        relu = next(op for op in model.get_ordered_ops() if op.get_type_name() == "Relu")
        reads = relu.input(0).get_source_output().get_node().get_type_name()
        assert reads == ("Add" if len(weight_shape) == 1 else "Transpose"), reads  # next to the norm's Add, or left
    after_ = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})(sample)[0]
    np.testing.assert_allclose(after_, before, rtol=1e-5, atol=1e-5)


TRANSFORMER_MODEL = """\
from pathlib import Path

import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, width, heads=2):
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(width, width) for _ in range(4))
        self.heads = heads

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = (f(x).reshape(b, n, self.heads, d // self.heads).transpose(1, 2) for f in (self.q, self.k, self.v))
        weights = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, dim=-1)
        return self.out((weights @ v).transpose(1, 2).reshape(b, n, d))


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = Attention(width)
        self.norm2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))


class PatchTransformer(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.patch = nn.Conv2d(1, width, 2, stride=2)
        self.position = nn.Parameter(torch.zeros(1, 16, width))
        self.blocks = nn.Sequential(Block(width), Block(width))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        x = self.patch(x / 16.0).flatten(2).transpose(1, 2) + self.position
        return self.head(self.norm(self.blocks(x)).mean(dim=1))


def transformer():
    model = PatchTransformer()
    weights = Path(__file__).with_name("transformer.pt")
    if weights.exists():
        model.load_state_dict(torch.load(weights))
    return model.eval()
"""


@pytest.fixture(scope="module")
def transformer_file() -> Path:
    """The transformer's source file, its trained weights beside it (trained once for this code)."""
    images, labels = digit_images()
    source, name = TRANSFORMER_MODEL, "openvino_transformer.py"
    return trained_model(source, name, "transformer", "transformer.pt", images[:TRAIN], labels[:TRAIN], epochs=30,
                         lr=0.003)  # fmt: skip


@pytest.mark.export
def test_a_transformer_s_layer_norms_run_in_int8_with_their_weight_and_bias(
    transformer_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """No float part of the placement is tied to a LayerNorm (before: ``Multiply+Add`` x5, one per norm); the layer
    report names every norm; the bundle classifies the held-out digits within the profile's budget of the float
    model."""
    from edgeline.bundle import read_bundle

    bundle = _plain_int8(f"{transformer_file}:transformer", tmp_path_factory)
    manifest = read_bundle(bundle).manifest
    placement = manifest.placement
    assert placement is not None and manifest.quantization is not None
    reported = {layer.module for layer in manifest.quantization.layers}
    assert {"blocks.0.norm1", "blocks.0.norm2", "blocks.1.norm1", "blocks.1.norm2", "norm"} <= reported, reported
    norms = [(kind, where) for kind, where in placement.fallback_sources.items() if "norm" in " ".join(where)]
    assert not norms, norms
    assert not {"MVN", "RMS"} & {op for kind in placement.fallback for op in kind.split("+")}, placement.fallback

    float_accuracy, int8_accuracy = _held_out_accuracies(f"{transformer_file}:transformer", bundle)
    assert float_accuracy >= 0.8
    assert 100 * (float_accuracy - int8_accuracy) <= BUDGET, (float_accuracy, int8_accuracy)
