"""Which layer lost accuracy: per torch layer, how far the deployed model's intermediate output is from the float
model's, on the validation samples.

The float side is the torch model itself, a forward hook on every leaf module (``features.2``, a ``Conv2d``). The
deployed side is read with the runtime's own means of keeping intermediate tensors, and each tensor is tied back to
the module that made it from what the converter wrote into the model:

- LiteRT (and the int8 model a TFLite Micro or Ethos-U bundle carries): the interpreter's
  ``experimental_preserve_all_tensors``, without delegates; litert-torch names every tensor after the location of
  the torch code that made it (``__main__.Net/torch.nn.modules.linear.Linear_head``: attribute ``head`` of the root),
  and a fused operator's output after every location it fused.
- ONNX Runtime: the values added as graph outputs; the dynamo exporter names each value after the torch.export node
  that made it (``conv2d_1``), the quantizer keeps those names, and torch.export's own graph says which module made
  which node. A QNN HTP bundle's context binary runs as one node, so its QDQ model (the graph the binary was
  compiled from, in the bundle beside it) is read this way instead, on the CPU provider: said in the manifest.
- ExecuTorch: the PT2E graph the ``.pte`` was lowered from, with torchao's numeric debugger.

A layer whose output no tensor of the deployed model holds (a convolution fused with its ReLU holds only the
ReLU's) is not listed. The figures are accumulated: each layer computes from the deployed model's own inputs, so a
layer's figure includes what every layer before it lost. ``added_sqnr_db``, the SQNR of the noise the layer adds (its
accumulated noise less that of the layer before it in execution order), points at the layer that loses.
"""

from __future__ import annotations

import logging
import math
import platform
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib.metadata import version
from itertools import permutations
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from edgeline.export.conversion import module_path
from edgeline.manifest import LayerFidelity, Quantization
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
        values are near zero (a dead ReLU's) is left out: any noise on it is infinitely relative."""
        if self.channel_signal is None or self.channel_noise is None:
            return self.noise / self.signal if self.signal else (0.0 if self.noise == 0.0 else math.inf)
        alive = self.channel_signal >= 1e-4 * float(self.channel_signal.mean())
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


@dataclass(frozen=True)
class _FloatRun:
    order: list[str]  # the leaf modules in the order they first ran
    outputs: dict[str, np.ndarray]  # of each that ran once and returned one floating tensor
    returned: dict[int, str]  # the model's output index -> the module whose output it is, unchanged


def float_layers(module: Any, arrays: Sequence[np.ndarray]) -> _FloatRun:
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
    return _FloatRun(
        order=order,
        outputs={name: outputs[name] for name in once},
        returned={i: by_tensor[id(t)] for i, t in enumerate(returned) if id(t) in by_tensor},
    )


# --- the deployed side --------------------------------------------------------------------------------------------


class _Probe(Protocol):
    measured_with: str
    inputs_quantized: list[tuple[Quantization, np.dtype] | None]
    """Per model input, in forward()'s order, how the deployed model quantizes it (None: it takes it float)."""

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Per module path, the shape of the deployed tensor that holds its output."""
        ...

    def run(self, arrays: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
        """The deployed model on one sample: per module path, that tensor's values as floats."""
        ...


def _segment(child: Any, attribute: str) -> str:
    kind = type(child)
    return f"{kind.__module__}.{kind.__qualname__}_{attribute}"


def module_of_location(location: str, root: Any) -> str | None:
    """``__main__.Net/torch.nn.modules.container.Sequential_features/torch.nn.modules.conv.Conv2d_2`` -> ``features.2``:
    each segment after the root's is a child's class and its attribute name; the root's alone is ``""``."""
    segments = location.split("/")
    kind = type(root)
    if segments[0] != f"{kind.__module__}.{kind.__qualname__}":
        return None
    module, path = root, []
    for segment in segments[1:]:
        children = dict(module.named_children())
        found = next((name for name, child in children.items() if _segment(child, name) == segment), None)
        if found is None:
            return None
        module = children[found]
        path.append(found)
    return ".".join(path)


class _LiteRTProbe:
    def __init__(self, path: Path, root: Any, run: _FloatRun, input_names: Sequence[str], microcontroller: bool):
        from ai_edge_litert.interpreter import Interpreter, OpResolverType

        self.interpreter = Interpreter(
            model_path=str(path),
            experimental_preserve_all_tensors=True,
            experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES,
        )
        self.interpreter.allocate_tensors()
        device = " (the microcontroller's TFLite Micro kernels compute the same int8 model)" if microcontroller else ""
        self.measured_with = (
            f"ai-edge-litert {version('ai-edge-litert')} on this {platform.machine()} machine{device}, its built-in "
            "kernels with every intermediate tensor kept (experimental_preserve_all_tensors)"
        )
        details = {detail["index"]: detail for detail in self.interpreter.get_tensor_details()}
        listed = self.interpreter.get_input_details()
        by_name = {detail["name"]: detail for detail in listed}
        named = all(name in by_name for name in input_names) and len(input_names) == len(listed)
        self.inputs = [by_name[name] for name in input_names] if named else listed
        self.inputs_quantized = [
            (params, np.dtype(detail["dtype"])) if (params := _params(detail)) is not None else None
            for detail in self.inputs
        ]
        ops = getattr(self.interpreter, "_get_ops_details", None)  # the only listing of operators in its Python API
        if ops is None:
            raise _NotMeasured("ai-edge-litert no longer lists a model's operators (_get_ops_details)")
        rank = {name: position for position, name in enumerate(run.order)}
        self.tensors: dict[str, dict[str, Any]] = {}
        for op in ops():  # in execution order: a module's last tensor is its output
            for index in op["outputs"]:
                if index < 0:
                    continue
                detail = details[index]
                modules = {
                    module
                    for location in str(detail["name"]).split(";")
                    if (module := module_of_location(location, root)) in rank
                }
                if modules:  # a fused operator's output belongs to the last module it computes
                    self.tensors[max(modules, key=rank.__getitem__)] = detail
        # The model's outputs are named after the signature, not the code: the module that returned each
        for index, detail in enumerate(self.interpreter.get_output_details()):
            found = re.search(r"output_(\d+)", str(detail["name"]))
            module = run.returned.get(int(found.group(1)) if found else index)
            if module is not None and module not in self.tensors:
                self.tensors[module] = detail

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {module: tuple(int(d) for d in detail["shape"]) for module, detail in self.tensors.items()}

    def run(self, arrays: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
        for detail, array in zip(self.inputs, arrays, strict=True):
            self.interpreter.set_tensor(detail["index"], _quantize(array, detail))
        self.interpreter.invoke()
        return {
            module: _dequantize(self.interpreter.get_tensor(detail["index"]), detail)
            for module, detail in self.tensors.items()
        }


def _params(detail: dict[str, Any]) -> Quantization | None:
    """A tensor's per-tensor quantization as the runtime's (de)quantizers take it; None: a float tensor."""
    scale, zero_point = detail["quantization"]
    return Quantization(scale=float(scale), zero_point=int(zero_point)) if scale else None


def _quantize(array: np.ndarray, detail: dict[str, Any]) -> np.ndarray:
    params, dtype = _params(detail), np.dtype(detail["dtype"])
    return quantize(array, params, dtype) if params is not None and dtype.kind in "iu" else array.astype(dtype)


def _dequantize(array: np.ndarray, detail: dict[str, Any]) -> np.ndarray:
    params = _params(detail)
    return dequantize(array, params) if params is not None and array.dtype.kind in "iu" else array.astype(np.float32)


def export_program(module: Any, arrays: Sequence[np.ndarray]) -> Any:
    """torch.export's program of ``module`` on one sample: the graph the layer report reads its modules from (export
    once, pass it to each reader)."""
    import torch

    return torch.export.export(module, tuple(torch.from_numpy(a) for a in arrays))


def _last_nodes(program: Any) -> dict[str, Any]:
    """Module path -> its last operator in the graph: the node whose value is the module's output."""
    last: dict[str, Any] = {}
    for node in program.graph.nodes:
        path = module_path(node) if node.op == "call_function" else None
        if path is not None:
            last[path] = node
    return last


def _export_node_modules(program: Any) -> dict[str, str]:
    """torch.export node name -> the module path whose output it is (the module's last node)."""
    return {node.name: path for path, node in _last_nodes(program).items()}


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
    return {path: _readers(node, leaves, skip=path)[0] for path, node in _last_nodes(program).items() if path in leaves}


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
    for name, node in _last_nodes(program).items():
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


def fused_into(layer: str, readers: dict[str, tuple[str, ...]], measured: set[str]) -> tuple[str, ...]:
    """The layers whose output only ``layer`` reads and that have no tensor of their own in the deployed model (a
    convolution fused with the ReLU after it): they compute in the same kernel as ``layer``."""
    return tuple(sorted(source for source, read in readers.items() if read == (layer,) and source not in measured))


def _pt2e_input_quantization(converted: Any) -> list[tuple[Quantization, np.dtype] | None]:
    """Per input of a converted PT2E graph, the per-tensor quantize its value goes through first, if any."""
    import torch

    found: list[tuple[Quantization, np.dtype] | None] = []
    for node in converted.graph.nodes:
        if node.op != "placeholder":
            continue
        quantized = None
        for user in node.users:
            if "quantize_per_tensor" in str(user.target) and "dequantize" not in str(user.target):
                scale, zero, dtype = user.args[1], user.args[2], user.args[-1]
                if isinstance(scale, float | int) and isinstance(zero, int) and dtype in (torch.int8, torch.uint8):
                    quantized = Quantization(scale=float(scale), zero_point=zero), np.dtype(str(dtype).split(".")[-1])
        found.append(quantized)
    return found


@dataclass(frozen=True)
class _Region:
    """The part of a QDQ model that computes one layer's output from the values before it: a session of its own."""

    inputs: tuple[tuple[str, str], ...]  # (the value fed, the model input or module whose float value it takes)
    session: Any


def _regions(model: Any, names: dict[str, str], outputs: dict[str, str], model_inputs: set[str]) -> dict[str, _Region]:
    """Per layer (``outputs``: module -> the value the next operator reads), its region: every node from the values
    the float model also has (the model's inputs, other layers' outputs before their quantization) to its output,
    cut out with ``onnx.utils.Extractor``. A layer whose region reaches a value the float model has no counterpart
    for is not isolated; nor are the layers of a model that cannot be cut (said by their missing figure)."""
    import onnx
    import onnxruntime
    from onnx.utils import Extractor

    graph = model.graph
    producer = {output: node for node in graph.node for output in node.output}
    constants = {tensor.name for tensor in graph.initializer}
    module_of = {value: module for value, module in names.items() if value in producer}
    try:
        extractor = Extractor(onnx.shape_inference.infer_shapes(model))
    except Exception as exc:  # shape inference or the extractor refusing this model: accumulated figures only
        logger.debug("no regions: %s", exc)
        return {}
    regions = {}
    for module, output in outputs.items():
        boundary: dict[str, str] = {}
        pending, seen, whole = [output], set(), True
        while pending and whole:
            node = producer.get(pending.pop())
            if node is None:
                whole = False
                break
            if id(node) in seen:
                continue
            seen.add(id(node))
            for value in node.input:
                if not value or value in constants:
                    continue
                if value in model_inputs or module_of.get(value, module) != module:
                    boundary[value] = value if value in model_inputs else module_of[value]
                elif value in producer:
                    pending.append(value)
                else:
                    whole = False
        if not whole or not boundary:
            continue
        try:
            part = extractor.extract_model(sorted(boundary), [output])
            session = onnxruntime.InferenceSession(part.SerializeToString(), providers=["CPUExecutionProvider"])
        except Exception as exc:  # this layer is not isolated; the others may be
            logger.debug("no region for %s: %s", module, exc)
            continue
        fed = tuple((i.name, boundary[i.name]) for i in session.get_inputs())
        regions[module] = _Region(fed, session)
    return regions


def _onnx_input_quantization(
    graph: Any, consumers: dict[str, list[Any]], name: str
) -> tuple[Quantization, np.dtype] | None:
    """The QuantizeLinear the QDQ model applies to input ``name`` (per tensor): its scale, zero point and type."""
    from onnx import numpy_helper

    constants = {tensor.name: tensor for tensor in graph.initializer}
    for node in consumers.get(name, ()):
        if node.op_type == "QuantizeLinear" and len(node.input) == 3 and node.input[1] in constants:
            scale = numpy_helper.to_array(constants[node.input[1]])
            zero = numpy_helper.to_array(constants[node.input[2]]) if node.input[2] in constants else None
            if scale.size == 1 and zero is not None and zero.size == 1:
                return Quantization(scale=float(scale.reshape(())), zero_point=int(zero.reshape(()))), zero.dtype
    return None


class _OnnxProbe:
    def __init__(
        self, path: Path, names: dict[str, str], run: _FloatRun, input_names: Sequence[str], qnn: bool = False
    ):
        import onnx
        import onnxruntime

        model = onnx.load(str(path))
        graph = model.graph
        consumers: dict[str, list[Any]] = {}
        for node in graph.node:
            for name in node.input:
                consumers.setdefault(name, []).append(node)
        produced = {output for node in graph.node for output in node.output}
        wanted = set(run.order)
        self.values: dict[str, str] = {}  # module -> the value holding its output, as the next operator reads it
        for value, module in names.items():
            if module not in wanted or value not in produced:
                continue
            self.values[module] = _dequantized(value, consumers)
        self._regions = _regions(model, names, self.values, set(input_names))
        existing = {output.name for output in graph.output}
        for value in self.values.values():
            if value not in existing:
                graph.output.append(onnx.helper.make_empty_tensor_value_info(value))
        self.inputs_quantized = [_onnx_input_quantization(graph, consumers, name) for name in input_names]
        self.session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        self.input_names = list(input_names)
        self.output_names = [output.name for output in self.session.get_outputs()]
        self.measured_with = (
            f"onnxruntime {version('onnxruntime')} CPU provider on this {platform.machine()} machine, the layers' "
            "values added to the graph's outputs"
        )
        if qnn:  # the context binary runs as one node: its insides are not readable, here or on a device
            self.measured_with += (
                f", on the QDQ model ({path.name}) the QNN context binary was compiled from: the HTP computes the "
                "same quantized graph in its own kernels, whose intermediate tensors are not read"
            )
        self._shapes: dict[str, tuple[int, ...]] | None = None

    def shapes(self) -> dict[str, tuple[int, ...]]:
        if self._shapes is None:
            raise _NotMeasured("onnxruntime gives a value's shape only once it ran")
        return self._shapes

    def isolated(self, arrays: Sequence[np.ndarray], reference: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Per layer, its deployed output computed from the float model's values at its inputs: the layer's own
        quantization alone (the model's inputs as they are, quantized as the model quantizes them)."""
        feeds = dict(zip(self.input_names, arrays, strict=True))
        found = {}
        for module, region in self._regions.items():
            given = {
                value: feeds[source] if source in feeds else reference.get(source) for value, source in region.inputs
            }
            if any(array is None for array in given.values()):
                continue
            (output,) = region.session.run(None, given)
            found[module] = np.asarray(output, dtype=np.float32)
        return found

    def run(self, arrays: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
        results = dict(zip(self.output_names, self.session.run(None, dict(zip(self.input_names, arrays, strict=True))),
                           strict=True))  # fmt: skip
        values = {module: np.asarray(results[value], dtype=np.float32) for module, value in self.values.items()}
        if self._shapes is None:
            self._shapes = {module: tuple(array.shape) for module, array in values.items()}
        return values


class _OpenVINOProbe:
    """OpenVINO: the bundle's IR with each layer's output added to the model's outputs, on the CPU plugin in f32.
    An IR operator keeps the name of the torch.export node (of the decomposed program it was converted from) it came
    from: a module's output is the last operator made from its last node, its FakeQuantize where int8 quantizes it
    (the value as the next operator reads it)."""

    def __init__(
        self, path: Path, module: Any, arrays: Sequence[np.ndarray], run: _FloatRun, input_names: Sequence[str]
    ):
        import openvino as ov

        program = export_program(module, arrays).run_decompositions()
        wanted = set(run.order)
        prefixes = {f"{node.name}/": name for name, node in _last_nodes(program).items() if name in wanted}
        core = ov.Core()
        model = core.read_model(str(path))
        ops = model.get_ordered_ops()
        last: dict[str, Any] = {}
        for op in ops:
            name = op.get_friendly_name()
            module_name = next((m for prefix, m in prefixes.items() if name.startswith(prefix)), None)
            if module_name is not None and op.get_output_size() == 1 and op.get_type_name() != "Constant":
                last[module_name] = op
        self.modules = list(last)
        # the Result each value goes to (a value that already is a model output keeps its own)
        results = [model.add_outputs([last[name].output(0)])[0].get_node().get_friendly_name() for name in self.modules]
        compiled = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
        self._request = compiled.create_infer_request()
        by_result = {port.get_node().get_friendly_name(): port for port in compiled.outputs}
        self._ports = [by_result[result] for result in results]
        self._inputs = list(compiled.inputs)
        by_name = {port.get_any_name(): port for port in self._inputs}
        self._inputs = [by_name.get(name, port) for name, port in zip(input_names, self._inputs, strict=False)]
        parameters = {op.get_friendly_name(): op for op in model.get_parameters()}
        self.inputs_quantized = [_openvino_input_quantization(parameters.get(name)) for name in input_names]
        self.measured_with = (
            f"openvino {version('openvino')} CPU plugin (f32) on this {platform.machine()} machine, the layers' "
            "values added to the model's outputs"
        )
        self._shapes: dict[str, tuple[int, ...]] | None = None

    def shapes(self) -> dict[str, tuple[int, ...]]:
        if self._shapes is None:
            raise _NotMeasured("the shapes are read once the model ran")
        return self._shapes

    def run(self, arrays: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
        results = self._request.infer(dict(zip(self._inputs, arrays, strict=True)))
        values = {
            name: np.array(results[port], dtype=np.float32)
            for name, port in zip(self.modules, self._ports, strict=True)
        }
        if self._shapes is None:
            self._shapes = {name: tuple(array.shape) for name, array in values.items()}
        return values


def _openvino_input_quantization(parameter: Any) -> tuple[Quantization, np.dtype] | None:
    """The FakeQuantize an OpenVINO model applies to its input ``parameter`` first (per tensor, 256 levels), as a
    uint8 scale and zero point; None where it takes the input float."""
    if parameter is None:
        return None
    for target in parameter.output(0).get_target_inputs():
        node = target.get_node()
        if node.get_type_name() != "FakeQuantize" or node.get_attributes().get("levels") != 256:
            continue
        low, high = (node.input(i).get_source_output().get_node() for i in (3, 4))
        if low.get_type_name() != "Constant" or high.get_type_name() != "Constant":
            return None
        low_value, high_value = low.get_data(), high.get_data()
        if low_value.size != 1 or high_value.size != 1 or float(high_value.reshape(())) <= float(low_value.reshape(())):
            return None
        scale = (float(high_value.reshape(())) - float(low_value.reshape(()))) / 255.0
        zero = round(-float(low_value.reshape(())) / scale)
        if not 0 <= zero <= 255:
            return None
        return Quantization(scale=scale, zero_point=zero), np.dtype(np.uint8)
    return None


class _PT2EProbe:
    """ExecuTorch: the PT2E-quantized graph the ``.pte`` was lowered from, read with torchao's numeric debugger
    (``prepare_for_propagation_comparison``: a logger after every node, keyed by the float graph's node name)."""

    def __init__(
        self,
        module: Any,
        calibration: SampleSet,
        names: dict[str, str],
        run: _FloatRun,
        dynamic: bool,
        keep_float: tuple[str, ...],
    ):
        import torch
        from torchao.quantization.pt2e import prepare_for_propagation_comparison

        from edgeline.export.backends.executorch_xnnpack import quantized_module

        tensors = [tuple(torch.from_numpy(a) for a in calibration.sample(i)) for i in range(len(calibration))]
        converted = quantized_module(module, tensors[0], tensors, dynamic=dynamic, keep_float=keep_float)
        self.inputs_quantized = _pt2e_input_quantization(converted)
        self.model = prepare_for_propagation_comparison(converted)
        self.names = {value: path for value, path in names.items() if path in set(run.order)}
        self.measured_with = (
            f"torchao {version('torchao')}'s PT2E numeric debugger on the quantized graph the .pte was lowered from "
            "(XNNPACK computes it up to rounding; the .pte's own tensors are not read)"
        )
        self._shapes: dict[str, tuple[int, ...]] | None = None

    def shapes(self) -> dict[str, tuple[int, ...]]:
        if self._shapes is None:
            raise _NotMeasured("the numeric debugger gives a value's shape only once it ran")
        return self._shapes

    def run(self, arrays: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
        import torch
        from torchao.quantization.pt2e import extract_results_from_loggers

        with torch.no_grad():
            self.model(*(torch.from_numpy(a) for a in arrays))
        values = {}
        for info, (_, _, stats) in extract_results_from_loggers(self.model).items():
            path = self.names.get(info.name)
            if path is not None and stats and isinstance(stats[-1], torch.Tensor) and stats[-1].is_floating_point():
                values[path] = stats[-1].detach().float().numpy()
                stats.clear()  # one sample at a time: the logger keeps every call's
        if self._shapes is None:
            self._shapes = {path: tuple(value.shape) for path, value in values.items()}
        return values


def _dequantized(value: str, consumers: dict[str, list[Any]]) -> str:
    """The QDQ pair after ``value`` (QuantizeLinear, then DequantizeLinear), if any: its output is what the next
    operator reads, the integer the runtime computes."""
    for q in consumers.get(value, []):
        if q.op_type != "QuantizeLinear":
            continue
        for dq in consumers.get(q.output[0], []):
            if dq.op_type == "DequantizeLinear":
                return str(dq.output[0])
    return value


class _NotMeasured(Exception):
    pass


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
) -> LayerReport:
    """Per layer, SQNR and cosine of the deployed model's intermediate outputs against the float model's, on at
    most ``LAYER_SAMPLES`` samples. ``exporter`` made the bundle and ``backend`` runs its ``model_path``: LiteRT's
    interpreter reads a LiteRT model (litert, and the int8 model of tflite-micro and ethos-u), onnxruntime an
    ``onnxruntime`` one; executorch-xnnpack's is the PT2E graph quantized again on ``calibration`` (``dynamic``:
    int8-dynamic; ``keep_float``: the modules mixed precision kept float); qnn-htp's the QDQ model beside its
    context binary, on onnxruntime's CPU provider (the HTP emulator runs the binary as one node). Others (Core ML)
    say they were not measured, as does a model that gives no layers: why, never a figure. Each input the model
    quantizes comes first (``input x``, named by ``labels``, forward()'s names, else ``input_names``): the data
    as the model reads it."""
    count = min(len(samples), LAYER_SAMPLES)
    if count == 0:
        return not_measured_layers("no validation samples")
    if not _leaves(module):
        return not_measured_layers("the model has no submodules to name its layers by (an exported program)")
    try:
        first = float_layers(module, samples.sample(0))
        program = export_program(module, samples.sample(0))
        probe: _Probe
        if exporter in ("litert", "tflite-micro", "ethos-u"):
            micro = backend == "tflite-micro"
            probe = _LiteRTProbe(model_path, module, first, input_names, microcontroller=micro)
        elif exporter == "onnxruntime":
            probe = _OnnxProbe(model_path, _export_node_modules(program), first, input_names)
        elif exporter == "qnn-htp":
            from edgeline.export.backends.qnn import QDQ_FILE

            names = _export_node_modules(program)
            probe = _OnnxProbe(model_path.with_name(QDQ_FILE), names, first, input_names, qnn=True)
        elif exporter in ("openvino", "openvino-gpu", "openvino-npu"):
            probe = _OpenVINOProbe(model_path, module, samples.sample(0), first, input_names)
        elif exporter == "executorch-xnnpack" and calibration is not None:
            probe = _PT2EProbe(module, calibration, _export_node_modules(program), first, dynamic, keep_float)
        else:
            return not_measured_layers(f"{exporter}: edgeline reads no intermediate tensors of its model here")
        layers: dict[str, _Layer] = {}
        leaves = _leaves(module)
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
            isolated = probe.isolated(arrays, reference) if isinstance(probe, _OnnxProbe) else {}
            for name, values in isolated.items():
                if name in layers and name in reference:
                    layers[name].add(reference[name], values, isolated=True)
    except _NotMeasured as exc:
        return not_measured_layers(str(exc))
    except Exception as exc:  # a diagnosis never fails the export: it says why it is missing, in the manifest
        logger.debug("reading %s's layers failed", exporter, exc_info=exc)
        first_line = (str(exc).strip().splitlines() or [""])[0][:200]
        return not_measured_layers(f"reading the layers failed: {type(exc).__name__}: {first_line}")
    if len(layers) == len(entries):
        return not_measured_layers(f"no tensor of the {exporter} model could be tied to a layer of the torch model")
    return LayerReport(
        layers=_ranked(layers, [*entries, *first.order]),
        samples=count,
        measured_with=f"{probe.measured_with}; accumulated: each layer computes from the deployed model's own inputs",
    )


LOST = 0.5
"""Relative noise (of the worst channel) past which the signal is lost: no later layer is blamed for adding noise."""


def _ranked(layers: dict[str, _Layer], order: list[str]) -> tuple[LayerFidelity, ...]:
    """In execution order, each with the SQNR of the noise it adds: the relative noise of its worst channel less
    that of the listed layer before it (the first adds all of its own; None: it adds none, or the signal was lost
    before it)."""
    result = []
    before, lost = 0.0, False  # no noise at the input
    for name in order:
        layer = layers.get(name)
        if layer is None:
            continue
        relative = layer.sums.relative_noise()
        # Once the noise is half the signal (SQNR under 3 dB), what a later layer adds cannot be told apart
        lost = lost or before >= LOST
        added = 0.0 if lost else relative - before
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
        before = relative
    return tuple(result)


def _rounded(db: float | None) -> float | None:
    return None if db is None else round(db, 2) + 0.0  # + 0.0: never "-0.0 dB"


def not_measured_layers(reason: str) -> LayerReport:
    return LayerReport(unknown=reason)
