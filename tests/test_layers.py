"""The arithmetic and the bookkeeping behind ``quantization.layers``, without a conversion: SQNR, cosine and the
worst channel against numpy's own computation, the layout search, litert-torch's tensor names read back as module
paths, the ranking, and the layer groups mixed precision keeps float together; and what the layer report asks an
export target's class. The figures measured on real bundles are checked in tests/test_mixed_precision.py. A test
that reads a tiny network's torch.export graph is in the export tier (``tests/tiers.py``), the others are quick."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from edgeline.export.layers import (
    _layout,
    _ranked,
    _Sums,
    export_program,
    fused_into,
    layer_sources,
    measure_layers,
    module_macs,
    module_of_location,
)
from edgeline.manifest import LayerFidelity, worst_layers
from edgeline.samples import SampleSet


def _network() -> Any:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.my_conv = nn.Conv2d(4, 4, 3, padding=1)
            self.act = nn.ReLU()

        def forward(self, x: Any) -> Any:
            return self.act(self.my_conv(x))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Conv2d(1, 4, 3, padding=1)
            self.blocks = nn.Sequential(Block(), Block())
            self.drop = nn.Dropout()
            self.head = nn.Linear(4 * 6 * 6, 3)

        def forward(self, x: Any) -> Any:
            return self.head(self.drop(torch.flatten(self.blocks(self.stem(x)), 1)))

    torch.manual_seed(0)
    return Net().eval()


@pytest.mark.quick
def test_sqnr_cosine_and_the_worst_channel_agree_with_numpy_over_several_samples() -> None:
    rng = np.random.default_rng(0)
    references = [rng.standard_normal((1, 3, 4, 4)) * np.array([1.0, 10.0, 0.1])[None, :, None, None] for _ in range(5)]
    noisy = [r + rng.standard_normal(r.shape) * 0.05 for r in references]
    sums = _Sums()
    for reference, got in zip(references, noisy, strict=True):
        sums.add(reference, got)
    ref, out = np.concatenate([r.ravel() for r in references]), np.concatenate([g.ravel() for g in noisy])
    assert sums.sqnr_db() == pytest.approx(10 * np.log10(np.sum(ref**2) / np.sum((ref - out) ** 2)), rel=1e-9)
    assert sums.cosine() == pytest.approx(ref @ out / np.linalg.norm(ref) / np.linalg.norm(out), rel=1e-9)
    channel = [
        10
        * np.log10(
            sum(np.sum(r[:, c] ** 2) for r in references)
            / sum(np.sum((r[:, c] - g[:, c]) ** 2) for r, g in zip(references, noisy, strict=True))
        )
        for c in range(3)
    ]
    assert sums.channel_sqnr_db() == pytest.approx(min(channel), rel=1e-9)
    assert min(channel) == pytest.approx(channel[2])  # the 0.1-scaled channel: the same noise hurts it most


@pytest.mark.quick
def test_an_exact_layer_has_no_sqnr_and_a_dead_channel_is_not_the_worst() -> None:
    exact = _Sums()
    exact.add(np.ones((1, 2, 3)), np.ones((1, 2, 3)))
    assert exact.sqnr_db() is None and exact.channel_sqnr_db() is None and exact.cosine() == 1.0
    dead = _Sums()
    reference = np.stack([np.linspace(1, 2, 6), np.zeros(6)])[None]  # channel 1 is all zeros (a dead ReLU)
    got = reference + np.array([0.01, 0.001])[None, :, None]
    dead.add(reference, got)
    assert dead.channel_sqnr_db() == pytest.approx(10 * np.log10(np.sum(reference[0, 0] ** 2) / (6 * 0.01**2)))


@pytest.mark.quick
def test_the_layout_search_finds_channels_last_and_settles_square_shapes_by_agreement() -> None:
    rng = np.random.default_rng(1)
    nchw = rng.standard_normal((1, 8, 4, 4)).astype(np.float32)
    assert _layout(nchw, (1, 4, 4, 8), np.transpose(nchw, (0, 2, 3, 1))) == (0, 2, 3, 1)
    assert _layout(nchw, (1, 8, 4, 4), nchw) == (0, 1, 2, 3)
    square = rng.standard_normal((1, 4, 4, 4)).astype(np.float32)
    assert _layout(square, (1, 4, 4, 4), np.transpose(square, (0, 2, 3, 1))) == (0, 2, 3, 1)
    assert _layout(square, (1, 4, 4, 4), square) == (0, 1, 2, 3)
    assert _layout(nchw, (1, 128), nchw.reshape(1, -1)) == (0, 1, 2, 3)  # the same values, flattened
    assert _layout(nchw, (1, 7), nchw.reshape(1, -1)[:, :7]) is None


@pytest.mark.quick
def test_litert_torch_locations_read_back_as_module_paths() -> None:
    net = _network()
    root = f"{type(net).__module__}.{type(net).__qualname__}"
    block = type(net.blocks[0])
    block_class = f"{block.__module__}.{block.__qualname__}"
    location = (
        f"{root}/torch.nn.modules.container.Sequential_blocks/{block_class}_1/torch.nn.modules.conv.Conv2d_my_conv"
    )
    assert module_of_location(location, net) == "blocks.1.my_conv"
    assert module_of_location(f"{root}/torch.nn.modules.linear.Linear_head", net) == "head"
    assert module_of_location(f"{root}/torch.nn.modules.linear.Linear_tail", net) is None
    assert module_of_location("arith.constant", net) is None
    assert module_of_location(root, net) == ""  # the model's own forward


@pytest.mark.quick
def test_the_noise_a_layer_adds_ranks_the_layer_that_lost_accuracy_first() -> None:
    def layer(name: str, relative_noise: float) -> Any:
        from edgeline.export.layers import _Layer

        made = _Layer(name, "Conv2d", (1, 1), (1, 1), (0, 1))
        made.sums.add(np.array([[1.0]]), np.array([[1.0 + math.sqrt(relative_noise)]]))
        return made

    # accumulated relative noise 1e-4, then 1e-4 + 0.01 (b adds 0.01), then a bit more (c adds 1e-3)
    layers = {"a": layer("a", 1e-4), "b": layer("b", 1e-4 + 1e-2), "c": layer("c", 1e-4 + 1e-2 + 1e-3)}
    ranked = _ranked(layers, ["a", "b", "c"])
    assert [entry.added_sqnr_db for entry in ranked] == pytest.approx([40.0, 20.0, 30.0], abs=0.01)
    assert [entry.module for entry in worst_layers(ranked)] == ["b", "c", "a"]
    quieter = LayerFidelity(module="d", operator="ReLU", shape=(1,), sqnr_db=10.0, cosine=0.9, added_sqnr_db=None)
    assert worst_layers((*ranked, quieter), 2) == [ranked[1], ranked[2]]  # a layer that adds no noise is never worst
    # once the signal is lost (noise over half of it), no later layer is blamed: the one that lost it is first
    lost = {"a": layer("a", 1e-4), "b": layer("b", 0.6), "c": layer("c", 0.3), "d": layer("d", 1.9)}
    ranked = _ranked(lost, ["a", "b", "c", "d"])  # c's noise falls again, d's grows: neither is blamed
    assert ranked[2].added_sqnr_db is None and ranked[3].added_sqnr_db is None
    assert [entry.module for entry in worst_layers(ranked)] == ["b", "a"]


@pytest.mark.quick
def test_an_outlier_channel_does_not_make_the_channels_it_crushes_look_dead() -> None:
    """A channel thousands of times the others (a planted outlier) made the mean channel's signal millions of times
    theirs: measured against the mean, the channels it crushes were left out as dead, and the layer read 53 dB."""
    rng = np.random.default_rng(0)
    reference = np.abs(rng.standard_normal((4, 16, 8, 8)))
    reference[:, 8] *= 3000.0
    step = float(reference.max()) / 255.0  # one int8 range for the tensor: the outlier's
    crushed = _Sums()
    crushed.add(reference, np.round(reference / step) * step)
    assert crushed.channel_sqnr_db() == pytest.approx(0.0, abs=0.01)  # every other channel rounds to zero
    dead = _Sums()  # a dead channel is still left out: all zeros, or under 1e-4 of the median channel's signal
    reference[:, 3] = 0.0
    reference[:, 5] *= 1e-3
    dead.add(reference, reference + 1e-4)
    alive = [c for c in range(16) if c not in (3, 5)]
    worst = min(10 * np.log10(np.sum(reference[:, c] ** 2) / (4 * 64 * 1e-8)) for c in alive)
    assert dead.channel_sqnr_db() == pytest.approx(worst, rel=1e-9)


@pytest.mark.quick
def test_two_branches_are_ranked_each_on_its_own_noise() -> None:
    """The noise a layer adds is measured against the layers it computes from, not the one run before it: a branch
    that lost its signal neither hides nor blames the other branch; where they meet, the lost signal is lost."""

    def layer(name: str, relative_noise: float) -> Any:
        from edgeline.export.layers import _Layer

        made = _Layer(name, "Conv2d", (1, 1), (1, 1), (0, 1))
        made.sums.add(np.array([[1.0]]), np.array([[1.0 + math.sqrt(relative_noise)]]))
        return made

    layers = {"side": layer("side", 0.9), "side_out": layer("side_out", 0.95), "main": layer("main", 0.1),
              "main_out": layer("main_out", 0.11), "both": layer("both", 0.96)}  # fmt: skip
    order = ["side", "side_out", "main", "main_out", "both"]
    sources = {"side": ("input x",), "side_out": ("side",), "main": ("input x",), "hidden": ("main",),
               "main_out": ("hidden",), "both": ("main_out", "side_out")}  # fmt: skip
    ranked = {entry.module: entry.added_sqnr_db for entry in _ranked(layers, order, sources)}
    assert ranked["side"] == pytest.approx(-10 * math.log10(0.9), abs=0.01)
    assert ranked["side_out"] is None  # it computes from a lost signal
    assert ranked["main"] == pytest.approx(10.0, abs=0.01)  # against the input, not the lost side branch
    assert ranked["main_out"] == pytest.approx(20.0, abs=0.01)  # through the layer not listed ("hidden")
    assert ranked["both"] is None
    # in execution order alone, the main branch is hidden behind the lost side branch
    alone = {entry.module: entry.added_sqnr_db for entry in _ranked(layers, order)}
    assert alone["main"] is None and alone["main_out"] is None


@pytest.mark.quick
def test_a_layer_fused_into_another_is_kept_with_it() -> None:
    readers = {"conv1": ("act1",), "act1": ("mix",), "mix": ("act2",), "shared": ("act1", "other")}
    assert fused_into("act1", readers, measured={"act1", "act2"}) == ("conv1",)
    assert fused_into("act2", readers, measured={"act1", "act2"}) == ("mix",)
    assert fused_into("act1", readers, measured={"act1", "conv1"}) == ()  # conv1 has a tensor of its own


@pytest.mark.export
def test_a_runtime_without_intermediate_tensors_and_a_model_without_layers_say_why() -> None:
    samples = SampleSet([np.zeros((2, 1, 6, 6), np.float32)], None, "zeros")
    report = measure_layers(_network(), samples, "coreml", "coreml", None, ("x",))  # type: ignore[arg-type]
    assert report.layers == () and report.unknown is not None and "coreml" in report.unknown
    import torch

    flat = torch.nn.Sequential()
    report = measure_layers(flat, samples, "litert", "litert", None, ("x",))  # type: ignore[arg-type]
    assert report.layers == () and report.unknown is not None and "submodules" in report.unknown
    fields = report.fields()
    assert fields["layers"] == () and fields["layers_unknown"] == report.unknown


@pytest.mark.export
def test_each_module_s_multiply_accumulates_are_counted_as_by_hand() -> None:
    """A 3x3 convolution of 4 channels into 4 on 6x6 (padding 1): 4*6*6 outputs of 4*3*3 each; the linear head 3
    outputs of 144 each; a block holds its convolution's and its ReLU's (one per element)."""
    per_module, total = module_macs(export_program(_network(), [np.zeros((1, 1, 6, 6), np.float32)]))
    assert per_module["blocks.0.my_conv"] == 4 * 6 * 6 * 4 * 3 * 3
    assert per_module["stem"] == 4 * 6 * 6 * 1 * 3 * 3
    assert per_module["head"] == 3 * 144
    assert per_module["blocks.0"] == per_module["blocks.0.my_conv"] + 4 * 6 * 6
    assert per_module["blocks"] == 2 * per_module["blocks.0"]
    assert total >= per_module["stem"] + per_module["blocks"] + per_module["head"]


@pytest.mark.quick
def test_a_kept_layer_s_share_off_the_accelerator_is_said_only_when_it_left() -> None:
    from edgeline.export.pipeline import _off_accelerator
    from edgeline.manifest import KeptFloat, Placement

    kept = (KeptFloat(module="stem", operator="Conv2d", added_bytes=120, reason="ranked 1"),)
    macs = ({"stem": 25}, 1000)
    npu = Placement(accelerator="ethos-u", ops=4, accelerator_ops=4, macs=1000, accelerator_macs=1000)
    left = npu.model_copy(update={"accelerator_ops": 3, "accelerator_macs": 975})
    (moved,) = _off_accelerator(kept, npu, left, macs)
    assert moved.accelerator_macs_share == pytest.approx(0.025)
    (stayed,) = _off_accelerator(kept, npu, npu, macs)  # a GPU computes float as well: nothing left it
    assert stayed.accelerator_macs_share == 0.0
    cpu = Placement(accelerator=None, ops=4, macs=1000)
    assert _off_accelerator(kept, cpu, cpu, macs)[0].accelerator_macs_share is None


@pytest.mark.export
def test_a_batch_norm_folded_into_the_layer_before_it_owns_that_layer_s_tensor() -> None:
    """A converter folds a BatchNorm into the convolution before it: the tensor named after the convolution holds
    the normalisation's output, so it is compared with that (unless the normalisation has a tensor of its own)."""
    import torch
    from torch import nn

    from edgeline.export.layers import _folded_norms, _leaves

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(1, 4, 3, padding=1)
            self.bn = nn.BatchNorm2d(4)
            self.act = nn.ReLU()
            self.shared = nn.Conv2d(4, 4, 1)
            self.bn2 = nn.BatchNorm2d(4)

        def forward(self, x: Any) -> Any:
            y = self.shared(self.act(self.bn(self.conv(x))))
            return self.bn2(y) + y  # shared's output is read twice: nothing folds it away

    torch.manual_seed(0)
    net = Net().eval()
    arrays = [np.zeros((1, 1, 6, 6), np.float32)]
    leaves = _leaves(net)
    program = export_program(net, arrays)
    assert _folded_norms(program, leaves, {"conv", "act", "shared"}) == {"conv": "bn"}
    assert _folded_norms(program, leaves, {"conv", "bn", "act"}) == {}  # bn has a tensor of its own


@pytest.mark.export
def test_an_input_is_kept_float_through_the_layers_that_read_it_directly() -> None:
    """Keeping a model input float means keeping its readers float; an operator outside every module that reads it
    first (a division in forward) would quantize it anyway, so then there are none."""
    import torch
    from torch import nn

    from edgeline.export.layers import input_readers

    arrays = [np.zeros((1, 1, 6, 6), np.float32)]
    network = _network()
    assert input_readers(network, export_program(network, arrays), ("x",)) == {"input x": ("stem",)}

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(1, 2, 3)

        def forward(self, x: Any) -> Any:
            return self.conv(x / 16.0)

    torch.manual_seed(0)
    scaled = Scaled().eval()
    assert input_readers(scaled, export_program(scaled, arrays), ("image",)) == {"input image": ()}


@pytest.mark.export
def test_each_layer_s_sources_are_read_from_the_graph_through_operators_outside_modules() -> None:
    import torch
    from torch import nn

    class TwoBranches(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.probe = nn.Conv2d(1, 2, 3, padding=1)
            self.act_probe = nn.ReLU()
            self.conv = nn.Conv2d(1, 2, 3, padding=1)
            self.act = nn.ReLU()
            self.head = nn.Linear(2 * 6 * 6, 3)

        def forward(self, x: Any) -> Any:
            x = x / 16.0
            side = self.act_probe(self.probe(x))
            main = self.act(self.conv(x))
            return self.head(torch.flatten(main + side * 1e-5, 1))

    torch.manual_seed(0)
    network = TwoBranches().eval()
    program = export_program(network, [np.zeros((1, 1, 6, 6), np.float32)])
    leaves = {"probe", "act_probe", "conv", "act", "head"}
    assert layer_sources(program, leaves, ("image",)) == {
        "probe": ("input image",),
        "act_probe": ("probe",),
        "conv": ("input image",),
        "act": ("conv",),
        "head": ("act", "act_probe"),
    }


# --- an export target is one class: what the layer report and the pipeline ask it ----------------------------------


def _register(monkeypatch: pytest.MonkeyPatch, name: str, target: type) -> None:
    """Registers ``target`` as the export target ``name`` the way every target is: one entry "module:Class" in
    ``EXPORT_BACKENDS`` (the class lives in this test module for the test's time)."""
    import sys

    from edgeline.export.backends import EXPORT_BACKENDS

    monkeypatch.setattr(sys.modules[__name__], target.__name__, target, raising=False)
    monkeypatch.setitem(EXPORT_BACKENDS, name, f"{__name__}:{target.__name__}")


@pytest.mark.export
def test_the_layer_report_reads_a_model_through_its_target_s_own_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    """A target registered in one place, whose class brings its reader, is measured: nothing else names it. Its
    toy deployed model is the float model with every layer's output 1% too large: 40 dB SQNR, cosine 1."""
    from edgeline.export.backends import ExportTarget
    from edgeline.export.layer_probes import LayerProbe, LayerReading
    from edgeline.export.layers import float_layers

    class OnePercentOff(LayerProbe):
        def __init__(self, reading: LayerReading) -> None:
            self.module = reading.module
            self.measured_with = "the float model, every layer 1% off"
            self.inputs_quantized = [None]
            self.order = reading.float_run.order

        def shapes(self) -> dict[str, tuple[int, ...]]:
            return self._shapes

        def run(self, arrays: Any) -> dict[str, np.ndarray]:
            outputs = float_layers(self.module, arrays).outputs
            self._shapes = {name: value.shape for name, value in outputs.items()}
            return {name: value * 1.01 for name, value in outputs.items()}

    class ToyTarget(ExportTarget):
        name = "toy"
        runtime_backend = "litert"

        def layer_probe(self, reading: LayerReading) -> LayerProbe | None:
            return OnePercentOff(reading)

    _register(monkeypatch, "toy", ToyTarget)
    samples = SampleSet([np.random.default_rng(0).standard_normal((3, 1, 6, 6)).astype(np.float32)], None, "noise")
    report = measure_layers(_network(), samples, "toy", "litert", None, ("x",))  # type: ignore[arg-type]
    assert report.unknown is None and report.samples == 3
    assert report.measured_with is not None and report.measured_with.startswith("the float model, every layer 1% off")
    assert [layer.module for layer in report.layers] == [
        "stem",
        "blocks.0.my_conv",
        "blocks.0.act",
        "blocks.1.my_conv",
        "blocks.1.act",
        "head",
    ]
    assert all(layer.sqnr_db == pytest.approx(40.0, abs=0.01) for layer in report.layers)
    assert all(layer.cosine == pytest.approx(1.0) for layer in report.layers)


@pytest.mark.quick
def test_what_a_target_can_do_is_read_from_its_class(monkeypatch: pytest.MonkeyPatch) -> None:
    """The capability name sets of ``edgeline.export.backends`` and the micro-kernel question are the classes'
    answers: a new target declaring them is in the sets, with nothing else edited; the built-in targets' are as
    they always were."""
    from edgeline.device_profiles import Precision, Target
    from edgeline.export import backends
    from edgeline.export.backends.litert import LiteRTExporter
    from edgeline.export.conversion import on_micro_kernels

    class ToyMicroTarget(LiteRTExporter):
        name = "toy-micro"
        full_integer = True

        def on_micro_kernels(self, profile: Any) -> bool:
            return True

    _register(monkeypatch, "toy-micro", ToyMicroTarget)
    edges, keeps, control = backends.INT8_EDGES, backends.KEEPS_FLOAT, backends.ACCURACY_CONTROL
    assert edges == {"tflite-micro", "ethos-u", "toy-micro"}
    assert keeps == {"litert", "onnxruntime", "executorch-xnnpack", "tflite-micro", "ethos-u", "qnn-htp", "toy-micro"}
    assert control == {"openvino", "openvino-gpu", "openvino-npu"}
    int8 = Precision.INT8_STATIC
    assert on_micro_kernels(Target(backend="toy-micro", precision=int8, threads=1), None)
    assert not on_micro_kernels(Target(backend="litert", precision=int8, threads=1), None)


@pytest.mark.quick
def test_the_export_package_imports_in_no_circle() -> None:
    """Every import inside ``edgeline.export`` (module level, in a function, or for type checking only), drawn from
    the sources: no module reaches itself. The layer report, conversion and the XNNPACK target once did."""
    import ast
    from pathlib import Path

    import edgeline.export

    root = Path(edgeline.export.__file__).resolve().parent
    names = {
        ".".join(("edgeline.export", *path.relative_to(root).with_suffix("").parts)).removesuffix(".__init__"): path
        for path in root.rglob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        graph[name] = {other for other in found if other in names and other != name}
    circles = []
    for start in sorted(graph):  # a path back to ``start``, by a bounded walk over at most every module once
        seen, pending = set(), [(start, (start,))]
        while pending:
            current, trail = pending.pop()
            for other in sorted(graph[current]):
                if other == start:
                    circles.append(" -> ".join((*trail, start)))
                elif other not in seen:
                    seen.add(other)
                    pending.append((other, (*trail, other)))
    assert circles == []
