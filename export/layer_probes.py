"""Reading a deployed model's intermediate tensors, layer by layer: the readers an export target's class picks
(``ExportTarget.layer_probe``) for ``edgeline.export.layers``, one per way a runtime keeps them:

- LiteRT (and the int8 model a TFLite Micro or Ethos-U bundle carries): the interpreter's
  ``experimental_preserve_all_tensors``, without delegates; litert-torch names every tensor after the location of
  the torch code that made it, and a fused operator's output after every location it fused.
- ONNX Runtime (and a QNN HTP bundle's QDQ model): the values added as graph outputs; the dynamo exporter names each
  value after the torch.export node that made it, and torch.export's own graph says which module made which node.
- OpenVINO: the IR with each layer's output added to the model's outputs, on the CPU plugin in f32.
- ExecuTorch: the PT2E graph the ``.pte`` was lowered from, with torchao's numeric debugger.

Nothing here knows a target by name: a target's class builds the reader that fits its model from a ``LayerReading``.
"""

from __future__ import annotations

import logging
import platform
import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np

from edgeline.backends import goes_into_firmware
from edgeline.export.graph import export_node_modules, export_program, last_nodes, module_of_location
from edgeline.manifest import Quantization
from edgeline.quantization import dequantize, quantize
from edgeline.samples import SampleSet

__all__ = [
    "FloatRun",
    "LayerProbe",
    "LayerReading",
    "LiteRTProbe",
    "NotMeasured",
    "OnnxProbe",
    "OpenVINOProbe",
    "PT2EProbe",
    "litert_layers",
    "onnx_layers",
    "openvino_layers",
    "pt2e_layers",
]

logger = logging.getLogger(__name__)


class NotMeasured(Exception):
    """A reader that cannot read this model: the layer report says why, in the manifest."""


@dataclass(frozen=True)
class FloatRun:
    """The float model on one sample, its leaf modules hooked (``edgeline.export.layers.float_layers``)."""

    order: list[str]  # the leaf modules in the order they first ran
    outputs: dict[str, np.ndarray]  # of each that ran once and returned one floating tensor
    returned: dict[int, str]  # the model's output index -> the module whose output it is, unchanged


@dataclass(frozen=True)
class LayerReading:
    """What an export target reads its deployed model's layers from (``ExportTarget.layer_probe``)."""

    module: Any  # the float torch module
    model_path: Path  # the model file the runtime backend runs (the verification's, else the bundle's)
    runtime_backend: str  # the runtime backend that runs it (edgeline.backends.RUNTIME_BACKENDS)
    input_names: Sequence[str]  # the model file's input names, in forward()'s order
    first_sample: Sequence[np.ndarray]
    float_run: FloatRun  # the float model on ``first_sample``
    program: Any  # torch.export's program of ``module`` on ``first_sample``
    calibration: SampleSet | None = None
    dynamic: bool = False  # int8-dynamic
    keep_float: tuple[str, ...] = ()  # the modules mixed precision kept float
    quantized_graph: Any = None  # the quantized graph the export lowered (ExportedModel.quantized_graph), if any


class LayerProbe:
    """A reader of a deployed model's intermediate tensors, tied to the torch modules that made them."""

    measured_with: str
    inputs_quantized: list[tuple[Quantization, np.dtype] | None]
    """Per model input, in forward()'s order, how the deployed model quantizes it (None: it takes it float)."""

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Per module path, the shape of the deployed tensor that holds its output."""
        raise NotImplementedError

    def run(self, arrays: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
        """The deployed model on one sample: per module path, that tensor's values as floats."""
        raise NotImplementedError

    def isolated(self, arrays: Sequence[np.ndarray], reference: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Per layer, its deployed output computed from the float model's values at its inputs; none where the
        reader cannot cut the model into layers."""
        return {}


def litert_layers(reading: LayerReading) -> LayerProbe:
    """A LiteRT model's layers (litert, and the int8 model of tflite-micro and ethos-u)."""
    micro = goes_into_firmware(reading.runtime_backend)
    return LiteRTProbe(
        reading.model_path, reading.module, reading.float_run, reading.input_names, microcontroller=micro
    )


def onnx_layers(reading: LayerReading, model_path: Path | None = None, qnn: bool = False) -> LayerProbe:
    """An ONNX model's layers (``model_path``: the model to read, default the one the runtime runs; ``qnn``: the
    QDQ model a QNN context binary was compiled from)."""
    names = export_node_modules(reading.program)
    return OnnxProbe(model_path or reading.model_path, names, reading.float_run, reading.input_names, qnn=qnn)


def openvino_layers(reading: LayerReading) -> LayerProbe:
    """An OpenVINO IR's layers, on the CPU plugin in f32."""
    return OpenVINOProbe(
        reading.model_path,
        reading.module,
        reading.first_sample,
        reading.float_run,
        reading.input_names,
        program=reading.program,
    )


def pt2e_layers(reading: LayerReading, converted: Any) -> LayerProbe:
    """The layers of ``converted``, the PT2E-quantized graph an ExecuTorch program was lowered from."""
    return PT2EProbe(converted, export_node_modules(reading.program), reading.float_run)


class LiteRTProbe(LayerProbe):
    def __init__(self, path: Path, root: Any, run: FloatRun, input_names: Sequence[str], microcontroller: bool):
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
            raise NotMeasured("ai-edge-litert no longer lists a model's operators (_get_ops_details)")
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
        # The model's outputs are named after the signature, not the code: the module that returned each. Its reading
        # is the tensor the model really outputs, not the one before a last step its location names no module of
        # (a microcontroller's int8 output: QUANTIZE after a layer mixed precision kept float).
        for index, detail in enumerate(self.interpreter.get_output_details()):
            found = re.search(r"output_(\d+)", str(detail["name"]))
            module = run.returned.get(int(found.group(1)) if found else index)
            if module is not None:
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


class OnnxProbe(LayerProbe):
    def __init__(self, path: Path, names: dict[str, str], run: FloatRun, input_names: Sequence[str], qnn: bool = False):
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
            raise NotMeasured("onnxruntime gives a value's shape only once it ran")
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


class OpenVINOProbe(LayerProbe):
    """OpenVINO: the bundle's IR with each layer's output added to the model's outputs, on the CPU plugin in f32.
    An IR operator keeps the name of the torch.export node (of the decomposed program it was converted from) it came
    from: a module's output is the last operator made from its last node, its FakeQuantize where int8 quantizes it
    (the value as the next operator reads it)."""

    def __init__(
        self,
        path: Path,
        module: Any,
        arrays: Sequence[np.ndarray],
        run: FloatRun,
        input_names: Sequence[str],
        program: Any = None,
    ):
        """``program``: torch.export's program of ``module`` on ``arrays`` when the caller has it (the layer report
        traced it already: not traced again), else traced here."""
        import openvino as ov

        if program is None:
            program = export_program(module, arrays)
        program = program.run_decompositions()  # a new program: the caller's is left as it was
        wanted = set(run.order)
        prefixes = {f"{_ir_name(node)}/": name for name, node in last_nodes(program).items() if name in wanted}
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
            raise NotMeasured("the shapes are read once the model ran")
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


def _ir_name(node: Any) -> str:
    """The torch.export node whose name the IR's operators computing ``node``'s value carry: a module whose last node
    takes the first value of a node of several outputs (LayerNorm's ``getitem`` of ``native_layer_norm``, a pool's
    of ``max_pool2d_with_indices``) has no operator of its own; the operators made from that node compute it."""
    import operator

    source = node.args[0] if node.target is operator.getitem and len(node.args) == 2 else None
    if source is not None and node.args[1] == 0 and hasattr(source, "name"):
        return str(source.name)
    return str(node.name)


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


class PT2EProbe(LayerProbe):
    """ExecuTorch: the PT2E-quantized graph the ``.pte`` was lowered from, read with torchao's numeric debugger
    (``prepare_for_propagation_comparison``: a logger after every node, keyed by the float graph's node name)."""

    def __init__(self, converted: Any, names: dict[str, str], run: FloatRun):
        """``converted``: the PT2E-quantized graph (the target's own quantizer's, e.g. XNNPACK's)."""
        from torchao.quantization.pt2e import prepare_for_propagation_comparison

        self.inputs_quantized = _pt2e_input_quantization(converted)
        self.model = prepare_for_propagation_comparison(converted)
        fused = _fused_with_activation(converted)
        self.names = {value: path for value, path in names.items() if path in set(run.order) and value not in fused}
        self.measured_with = (
            f"torchao {version('torchao')}'s PT2E numeric debugger on the quantized graph the .pte was lowered from "
            "(XNNPACK computes it up to rounding; the .pte's own tensors are not read)"
        )
        self._shapes: dict[str, tuple[int, ...]] | None = None

    def shapes(self) -> dict[str, tuple[int, ...]]:
        if self._shapes is None:
            raise NotMeasured("the numeric debugger gives a value's shape only once it ran")
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


_FUSED_ACTIVATIONS = ("relu", "relu_")
"""What XNNPACK's quantizer fuses into the operator before it (its conv, linear, add and mul + ReLU patterns)."""


def _fused_with_activation(converted: Any) -> set[str]:
    """The nodes of a PT2E-quantized graph whose output only an activation reads, unquantized, while the activation's
    output is quantized: the quantizer annotated the pair as one pattern (a convolution or linear layer and its
    ReLU), and XNNPACK computes it in one kernel, so the node has no tensor of its own in the deployed model (as a
    LiteRT operator with a fused activation has none). The layer report leaves them out, and mixed precision keeps
    them with their activation (``edgeline.export.layers.fused_into``): keeping the ReLU alone float would quantize
    the output of the layer before it, the very tensor it was meant to keep."""
    fused = set()
    for node in converted.graph.nodes:
        users = list(node.users)
        if node.op != "call_function" or len(users) != 1 or users[0].op != "call_function":
            continue
        activation = users[0]
        name = str(getattr(activation.target, "__name__", activation.target)).split(".")[0]
        quantized = any(
            "quantize_per_" in str(user.target) and "dequantize" not in str(user.target) for user in activation.users
        )
        if name in _FUSED_ACTIVATIONS and quantized:
            fused.add(node.name)
    return fused


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
