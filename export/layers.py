"""Which layer lost accuracy: per torch layer, how far the deployed model's intermediate output is from the float
model's, on the validation samples.

The float side is the torch model itself, a forward hook on every leaf module (``features.2``, a ``Conv2d``). The
deployed side is read with the runtime's own means of keeping intermediate tensors, and each tensor is tied back to
the module that made it from what the converter wrote into the model: the export target's class picks the reader
(``ExportTarget.layer_probe``; the readers, one per runtime's means, are in ``edgeline.export.layer_probes``). A
target without one (Core ML) says its layers were not measured, and why.

A layer whose output no tensor of the deployed model holds (a convolution fused with its ReLU holds only the
ReLU's) is not listed. The figures are accumulated: each layer computes from the deployed model's own inputs, so a
layer's figure includes what every layer before it lost. ``added_sqnr_db``, the SQNR of the noise the layer adds (its
accumulated noise less that of the layers it computes from: two branches of a model are each ranked on their own),
points at the layer that loses.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import permutations
from pathlib import Path
from typing import Any

import numpy as np

from edgeline.errors import EdgelineError
from edgeline.export.backends import get_exporter
from edgeline.export.graph import export_program, last_nodes, module_of_location, module_path
from edgeline.export.layer_probes import FloatRun, LayerProbe, LayerReading, NotMeasured
from edgeline.manifest import LayerFidelity
from edgeline.quantization import dequantize, quantize
from edgeline.samples import SampleSet

__all__ = [
    "INPUT",
    "LAYER_SAMPLES",
    "LayerReport",
    "export_program",
    "fused_into",
    "input_layer",
    "input_readers",
    "measure_layers",
    "module_macs",
    "module_of_location",
    "not_measured_layers",
    "output_readers",
]

logger = logging.getLogger(__name__)

LAYER_SAMPLES = 64
"""At most this many validation samples: enough for a stable ranking; every figure is a running sum."""

_SKIPPED = frozenset(
    {"Identity", "Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout", "Flatten", "Unflatten"}
)
"""Leaf modules that compute nothing: the deployed model has no tensor of their own."""


@dataclass(frozen=True)
class LayerReport:
    """What ``measure_layers`` found: the manifest's ``quantization.layers`` and what they rest on, or why none."""

    layers: tuple[LayerFidelity, ...] = ()
    samples: int = 0
    measured_with: str | None = None
    unknown: str | None = None

    def fields(self) -> dict[str, Any]:
        """As the manifest's ``QuantizationSummary`` fields."""
        return {
            "layers": self.layers,
            "layers_samples": self.samples,
            "layers_measured_with": self.measured_with,
            "layers_unknown": self.unknown,
        }


DEAD = 1e-4
"""A channel whose float signal (its sum of squares) is under this share of the median channel's is dead."""


@dataclass
class _Sums:
    """Running sums over samples, of the whole tensor and per channel (axis 1 of the torch layout)."""

    signal: float = 0.0  # sum of float^2
    noise: float = 0.0  # sum of (float - deployed)^2
    dot: float = 0.0
    deployed: float = 0.0  # sum of deployed^2
    channel_signal: np.ndarray | None = None
    channel_noise: np.ndarray | None = None

    def add(self, reference: np.ndarray, got: np.ndarray) -> None:
        """``reference`` and ``got`` in the torch layout."""
        reference = reference.astype(np.float64)
        got = got.astype(np.float64)
        difference = reference - got
        self.signal += float(np.vdot(reference, reference))
        self.noise += float(np.vdot(difference, difference))
        self.dot += float(np.vdot(reference, got))
        self.deployed += float(np.vdot(got, got))
        if reference.ndim >= 2 and reference.shape[1] > 1:
            channels = reference.shape[1]
            signal = np.square(np.moveaxis(reference, 1, 0).reshape(channels, -1)).sum(axis=1)
            noise = np.square(np.moveaxis(difference, 1, 0).reshape(channels, -1)).sum(axis=1)
            self.channel_signal = signal if self.channel_signal is None else self.channel_signal + signal
            self.channel_noise = noise if self.channel_noise is None else self.channel_noise + noise

    def sqnr_db(self) -> float | None:
        """None: no difference at all (an infinite SQNR)."""
        return _db(self.signal, self.noise)

    def relative_noise(self) -> float:
        """Noise over signal of the worst channel (of the whole tensor, without channels). A channel whose float
        values are near zero (a dead ReLU's) is left out: any noise on it is infinitely relative. Near zero is
        against the median channel's signal, not the mean: an outlier channel makes the mean thousands of times the
        others, which would leave out the very channels it crushes."""
        if self.channel_signal is None or self.channel_noise is None:
            return self.noise / self.signal if self.signal else (0.0 if self.noise == 0.0 else math.inf)
        live = self.channel_signal[self.channel_signal > 0.0]
        alive = self.channel_signal >= DEAD * float(np.median(live)) if live.size else self.channel_signal > 0.0
        if not alive.any():
            return 0.0 if self.noise == 0.0 else math.inf
        return float((self.channel_noise[alive] / self.channel_signal[alive]).max())

    def channel_sqnr_db(self) -> float | None:
        relative = self.relative_noise()
        return None if relative == 0.0 else (-999.0 if math.isinf(relative) else -10.0 * math.log10(relative))

    def cosine(self) -> float:
        if self.signal == 0.0 or self.deployed == 0.0:
            return 1.0 if self.signal == self.deployed else 0.0
        return max(-1.0, min(1.0, self.dot / math.sqrt(self.signal * self.deployed)))


def _db(signal: float, noise: float) -> float | None:
    if noise == 0.0:
        return None
    if signal == 0.0:
        return -999.0
    return 10.0 * math.log10(signal / noise)


@dataclass
class _Layer:
    module: str
    operator: str
    shape: tuple[int, ...]  # the float output's
    deployed_shape: tuple[int, ...]
    layout: tuple[int, ...]  # the permutation of the float output's axes that gives the deployed tensor
    sums: _Sums = field(default_factory=_Sums)
    isolated: _Sums = field(default_factory=_Sums)  # from the float model's inputs to the layer

    def add(self, reference: np.ndarray, got: np.ndarray, *, isolated: bool = False) -> None:
        sums = self.isolated if isolated else self.sums
        if len(self.deployed_shape) != reference.ndim:  # the same values, reshaped
            sums.add(reference, got.reshape(reference.shape))
        else:
            sums.add(reference, np.transpose(got.reshape(self.deployed_shape), np.argsort(self.layout)))


# --- the float side -----------------------------------------------------------------------------------------------


def _leaves(module: Any) -> dict[str, Any]:
    return {
        name: child
        for name, child in module.named_modules()
        if name and next(iter(child.children()), None) is None and type(child).__name__ not in _SKIPPED
    }


def float_layers(module: Any, arrays: Sequence[np.ndarray]) -> FloatRun:
    """The float model on one sample, its leaf modules hooked."""
    import torch

    order: list[str] = []
    outputs: dict[str, np.ndarray] = {}
    tensors: dict[str, Any] = {}
    calls: Counter[str] = Counter()

    def hook(name: str) -> Any:
        def record(_module: Any, _inputs: Any, output: Any) -> None:
            calls[name] += 1
            if calls[name] == 1:
                order.append(name)
            if isinstance(output, torch.Tensor) and output.is_floating_point():
                outputs[name] = output.detach().float().numpy().copy()
                tensors[name] = output

        return record

    handles = [child.register_forward_hook(hook(name)) for name, child in _leaves(module).items()]
    try:
        with torch.no_grad():
            result = module(*(torch.from_numpy(a) for a in arrays))
    finally:
        for handle in handles:
            handle.remove()
    once = [name for name in order if calls[name] == 1 and name in outputs]
    returned = result if isinstance(result, tuple | list) else (result,)
    by_tensor = {id(tensors[name]): name for name in once}
    return FloatRun(
        order=order,
        outputs={name: outputs[name] for name in once},
        returned={i: by_tensor[id(t)] for i, t in enumerate(returned) if id(t) in by_tensor},
    )


_PASSING = frozenset(
    {"view", "reshape", "flatten", "permute", "transpose", "squeeze", "unsqueeze", "contiguous", "clone", "t"}
    | {"expand", "alias", "detach", "_assert_tensor_metadata", "getitem", "dropout"}
)
"""Operators that pass values on unchanged: a quantized tensor crosses them with its quantization."""


def _readers(node: Any, leaves: set[str], skip: str | None = None) -> tuple[tuple[str, ...], bool]:
    """The leaf modules that read ``node``'s value, through operators that pass it on unchanged (``skip``: the
    module it belongs to), and whether an operator outside every leaf module reads it too."""
    found: set[str] = set()
    pending, seen, outside = list(node.users), set(), False
    while pending:
        user = pending.pop()
        if user in seen:
            continue
        seen.add(user)
        path = module_path(user) if user.op == "call_function" else None
        if path in leaves and path != skip:
            found.add(path)
        elif str(getattr(user.target, "__name__", user.target)).split(".")[0] in _PASSING:
            pending.extend(user.users)
        elif path != skip:
            outside = True
    return tuple(sorted(found)), outside


def output_readers(module: Any, program: Any) -> dict[str, tuple[str, ...]]:
    """Per leaf module, the other leaf modules that read its output (through reshapes): the layers that share the
    quantization of that tensor. Keeping the tensor float takes the module and all its readers in float, the group
    NNCF's accuracy control reverts together."""
    leaves = set(_leaves(module))
    return {path: _readers(node, leaves, skip=path)[0] for path, node in last_nodes(program).items() if path in leaves}


def module_macs(program: Any) -> tuple[dict[str, int], int]:
    """The multiply-accumulates of each module path's operators (``fx_macs``, as the placements count them), and of
    the whole model: what keeping a module in float moves to whatever computes float."""
    from edgeline.export.placement import fx_macs

    per_module: dict[str, int] = {}
    total = 0
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        macs = fx_macs(node, str(node.target)) or 0
        total += macs
        path = module_path(node)
        while path:  # the module and each module holding it
            per_module[path] = per_module.get(path, 0) + macs
            path = path.rpartition(".")[0]
    return per_module, total


def _folded_norms(program: Any, leaves: dict[str, Any], read: set[str]) -> dict[str, str]:
    """Layer -> the batch normalisation its tensor holds the output of: a converter folds a BatchNorm into the
    convolution or linear layer before it (its scale and shift into their weights), so the one tensor left, named
    after the convolution, is the normalisation's output; compared with the convolution's own float output, every
    such layer looked 20 dB lost (an EfficientNet-like stack, seen). Only where the normalisation is the only
    reader of the layer's output and has no tensor of its own."""
    import torch

    norms = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d)
    folded = {}
    for name, node in last_nodes(program).items():
        users = list(node.users)
        reader = module_path(users[0]) if len(users) == 1 and users[0].op == "call_function" else None
        if name in read and reader is not None and isinstance(leaves.get(reader), norms) and reader not in read:
            folded[name] = reader
    return folded


INPUT = "input "
"""How ``quantization.layers`` names a model input: ``input x``, before every layer (no module path has a space)."""


def input_layer(name: str) -> str:
    return f"{INPUT}{name}"


def input_readers(module: Any, program: Any, input_names: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """Per model input (``input x``, named by ``input_names`` in forward()'s order), the leaf modules that read it
    (through reshapes): keeping them float keeps the input float. None listed where an operator outside every
    module reads it first (``x / 16`` in forward): that operator would quantize it anyway."""
    leaves = set(_leaves(module))
    user_inputs = program.graph_signature.user_inputs
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder" and n.name in user_inputs]
    found: dict[str, tuple[str, ...]] = {}
    for name, node in zip(input_names, placeholders, strict=False):
        readers, outside = _readers(node, leaves)
        found[input_layer(name)] = () if outside else readers
    return found


def layer_sources(program: Any, leaves: set[str], input_names: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """Per leaf module, the leaf modules and model inputs (``input x``, named by ``input_names`` in forward()'s
    order) whose values it computes from, through every operator outside a leaf module (``x / 16``, an addition in
    forward): the layers whose noise reaches it. Two branches of a model are each other's sources only where they
    meet."""
    user_inputs = program.graph_signature.user_inputs
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder" and n.name in user_inputs]
    inputs = {node: input_layer(name) for name, node in zip(input_names, placeholders, strict=False)}
    found: dict[str, set[str]] = {}
    for node in program.graph.nodes:
        path = module_path(node) if node.op == "call_function" else None
        if path not in leaves:
            continue
        sources = found.setdefault(path, set())
        pending, seen = list(node.all_input_nodes), set()
        while pending:  # each graph node once: bounded by the graph
            source = pending.pop()
            if source in seen:
                continue
            seen.add(source)
            owner = module_path(source) if source.op == "call_function" else None
            if source in inputs:
                sources.add(inputs[source])
            elif owner in leaves:
                if owner != path:  # the module's own operators: walked from themselves
                    sources.add(owner)
            else:
                pending.extend(source.all_input_nodes)
    return {path: tuple(sorted(sources)) for path, sources in found.items()}


def fused_into(layer: str, readers: dict[str, tuple[str, ...]], measured: set[str]) -> tuple[str, ...]:
    """The layers whose output only ``layer`` reads and that have no tensor of their own in the deployed model (a
    convolution fused with the ReLU after it): they compute in the same kernel as ``layer``."""
    return tuple(sorted(source for source, read in readers.items() if read == (layer,) and source not in measured))


# --- comparing ----------------------------------------------------------------------------------------------------


def _layout(reference: np.ndarray, deployed_shape: tuple[int, ...], got: np.ndarray) -> tuple[int, ...] | None:
    """The permutation of the float output's axes that gives the deployed tensor (NCHW -> NHWC in LiteRT); where
    several fit (square shapes), the one that agrees best on this sample."""
    if reference.size != int(np.prod(deployed_shape, dtype=np.int64)):
        return None
    if reference.ndim > 6:
        return tuple(range(reference.ndim)) if reference.shape == deployed_shape else None
    fitting = [p for p in permutations(range(reference.ndim)) if tuple(reference.shape[i] for i in p) == deployed_shape]
    if not fitting:
        return tuple(range(reference.ndim)) if len(deployed_shape) != reference.ndim else None  # same values, reshaped
    if len(fitting) == 1:
        return fitting[0]

    def agreement(order: tuple[int, ...]) -> float:
        sums = _Sums()
        sums.add(np.transpose(reference, order), got)
        return sums.cosine()

    return max(fitting, key=agreement)


def measure_layers(
    module: Any,
    samples: SampleSet,
    exporter: str,
    backend: str,
    model_path: Path,
    input_names: Sequence[str],
    calibration: SampleSet | None = None,
    dynamic: bool = False,
    keep_float: tuple[str, ...] = (),
    labels: Sequence[str] = (),
    quantized_graph: Any = None,
) -> LayerReport:
    """Per layer, SQNR and cosine of the deployed model's intermediate outputs against the float model's, on at
    most ``LAYER_SAMPLES`` samples. ``exporter`` made the bundle and ``backend`` runs its ``model_path``; the
    exporter's class reads it (``ExportTarget.layer_probe``, given ``calibration``, ``dynamic``: int8-dynamic, and
    ``keep_float``: the modules mixed precision kept float; ``quantized_graph``: the graph the export lowered, when it
    kept one, ``ExportedModel.quantized_graph``). One that reads none (Core ML) says it was not
    measured, as does a model that gives no layers: why, never a figure. Each input the model
    quantizes comes first (``input x``, named by ``labels``, forward()'s names, else ``input_names``): the data
    as the model reads it."""
    count = min(len(samples), LAYER_SAMPLES)
    if count == 0:
        return not_measured_layers("no validation samples")
    if not _leaves(module):
        return not_measured_layers("the model has no submodules to name its layers by (an exported program)")
    try:
        target = get_exporter(exporter)
    except EdgelineError:  # not a target of this install: nothing reads its model
        target = None
    try:
        first = float_layers(module, samples.sample(0))
        program = export_program(module, samples.sample(0))
        found = (
            None
            if target is None
            else target.layer_probe(
                LayerReading(
                    module=module,
                    model_path=model_path,
                    runtime_backend=backend,
                    input_names=input_names,
                    first_sample=samples.sample(0),
                    float_run=first,
                    program=program,
                    calibration=calibration,
                    dynamic=dynamic,
                    keep_float=keep_float,
                    quantized_graph=quantized_graph,
                )
            )
        )
        if found is None:
            return not_measured_layers(f"{exporter}: edgeline reads no intermediate tensors of its model here")
        probe: LayerProbe = found
        layers: dict[str, _Layer] = {}
        leaves = _leaves(module)
        sources = layer_sources(program, set(leaves), labels or input_names)
        entries = {  # each quantized input, as the model reads it: what int8 keeps of the data itself
            input_layer(name): (position, quantized)
            for position, (name, quantized) in enumerate(
                zip(labels or input_names, probe.inputs_quantized, strict=False)
            )
            if quantized is not None
        }
        for name, (position, _) in entries.items():
            shape = tuple(samples.sample(0)[position].shape)
            layers[name] = _Layer(name, "input", shape, shape, tuple(range(len(shape))))
        for index in range(count):
            arrays = samples.sample(index)
            for name, (position, (params, dtype)) in entries.items():
                layers[name].add(arrays[position], dequantize(quantize(arrays[position], params, dtype), params))
            reference = (first if index == 0 else float_layers(module, arrays)).outputs
            got = probe.run(arrays)
            if index == 0:
                folded = _folded_norms(program, leaves, set(got))
            got = {folded.get(name, name): value for name, value in got.items()}
            if index == 0:
                shapes = {folded.get(name, name): shape for name, shape in probe.shapes().items()}
                for name in first.order:
                    if name in reference and name in got:
                        layout = _layout(reference[name], shapes[name], got[name])
                        if layout is not None:
                            kind = type(leaves[name]).__name__
                            layers[name] = _Layer(name, kind, reference[name].shape, shapes[name], layout)
            for name, layer in layers.items():
                if name in reference and name in got:
                    layer.add(reference[name], got[name])
            isolated = probe.isolated(arrays, reference)
            for name, values in isolated.items():
                if name in layers and name in reference:
                    layers[name].add(reference[name], values, isolated=True)
    except NotMeasured as exc:
        return not_measured_layers(str(exc))
    except Exception as exc:  # a diagnosis never fails the export: it says why it is missing, in the manifest
        logger.debug("reading %s's layers failed", exporter, exc_info=exc)
        first_line = (str(exc).strip().splitlines() or [""])[0][:200]
        return not_measured_layers(f"reading the layers failed: {type(exc).__name__}: {first_line}")
    if len(layers) == len(entries):
        return not_measured_layers(f"no tensor of the {exporter} model could be tied to a layer of the torch model")
    return LayerReport(
        layers=_ranked(layers, [*entries, *first.order], sources),
        samples=count,
        measured_with=f"{probe.measured_with}; accumulated: each layer computes from the deployed model's own inputs",
    )


LOST = 0.5
"""Relative noise (of the worst channel) past which the signal is lost: no later layer is blamed for adding noise."""


def _ranked(
    layers: dict[str, _Layer], order: list[str], sources: dict[str, tuple[str, ...]] | None = None
) -> tuple[LayerFidelity, ...]:
    """In execution order, each with the SQNR of the noise it adds: the relative noise of its worst channel less
    the largest of the listed layers it computes from (``sources``: ``layer_sources``, through layers not listed;
    without them, or for a layer they do not cover, the listed layer before it). A layer that computes from none adds
    all of its own; None: it adds none, or the signal was lost before it (in a layer it computes from)."""
    result = []
    noise: dict[str, float] = {}  # each listed layer's relative noise
    lost: set[str] = set()  # the listed layers computed from a lost signal, or that lost it
    previous: str | None = None

    def listed(name: str) -> set[str]:  # the listed layers ``name`` computes from, through those not listed
        assert sources is not None
        found: set[str] = set()
        pending, seen = list(sources.get(name, ())), set()
        while pending:
            source = pending.pop()
            if source in seen:
                continue
            seen.add(source)
            if source in noise:
                found.add(source)
            elif source not in layers:
                pending.extend(sources.get(source, ()))
        return found

    for name in order:
        layer = layers.get(name)
        if layer is None:
            continue
        relative = layer.sums.relative_noise()
        if sources is not None and name in sources:
            before_layers = listed(name)
        else:
            before_layers = {previous} if previous is not None else set()
        before = max((noise[source] for source in before_layers), default=0.0)
        # Once the noise is half the signal (SQNR under 3 dB), what a later layer adds cannot be told apart
        if before >= LOST or before_layers & lost:
            lost.add(name)
        added = 0.0 if name in lost else relative - before
        sqnr, channel = layer.sums.sqnr_db(), layer.sums.channel_sqnr_db()
        result.append(
            LayerFidelity(
                module=name,
                operator=layer.operator,
                shape=layer.shape,
                sqnr_db=None if sqnr is None else round(sqnr, 2) + 0.0,  # + 0.0: never "-0.0 dB"
                channel_sqnr_db=None if channel is None else round(channel, 2) + 0.0,
                cosine=round(layer.sums.cosine(), 6),
                added_sqnr_db=(
                    None if added <= 0.0 else -999.0 if math.isinf(added) else round(-10.0 * math.log10(added), 2) + 0.0
                ),
                isolated_sqnr_db=_rounded(layer.isolated.channel_sqnr_db()) if layer.isolated.signal else None,
            )
        )
        noise[name] = relative
        previous = name
    return tuple(result)


def _rounded(db: float | None) -> float | None:
    return None if db is None else round(db, 2) + 0.0  # + 0.0: never "-0.0 dB"


def not_measured_layers(reason: str) -> LayerReport:
    return LayerReport(unknown=reason)
