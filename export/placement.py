"""Counting where a converted model's operators run and in what precision (the manifest's ``placement``).

Every count is read from the converted model itself, never from what the converter was asked to do: a declared
"int8" model that computes mostly in float, or an accelerator that took a few operators, is a figure the user sees.

The rules, the same for every format:
- ``ops`` leaves out the precision conversions (quantize, dequantize, choose-qparams): they exist because of
  quantization and are not the model's work.
- int8-static: an operator computes in the integer precision when none of its activations (non-constant inputs
  and outputs) is a float tensor, or when it takes integer weights. Otherwise it computes in float.
- Weight precisions (int8-dynamic, int8-weights) declare the weights' precision only: activations stay float by
  design. An operator with weights counts as quantized when they are integer, as float when they are float (the
  convolutions int8-dynamic leaves alone); one without weights (activation, pooling, reshape) has nothing to
  quantize and is not held against the share.
- ``fallback`` counts, per operator, those left off the accelerator (when there is one) or in float (when the
  precision is an integer one); an operator both off the accelerator and in float counts once.
- A delegate may compute an operator in float between a dequantize and a quantize of its own (XNNPACK's EXP, LOG,
  TANH...: conversions, then its fp32 kernel). Where the exporter says which delegated operators its delegate
  computes on integers (``executorch_placement``'s ``integer_kernel``), the others count as float, on the accelerator.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from edgeline.device_profiles import Precision
from edgeline.export.graph import module_path
from edgeline.manifest import Placement

__all__ = [
    "GraphOperator",
    "ModelSources",
    "OpRecord",
    "code_source",
    "executorch_placement",
    "fx_macs",
    "node_source",
    "placement_of",
    "tflite_macs",
    "tflite_placement",
]

TFLITE_CONVERSIONS = frozenset({"QUANTIZE", "DEQUANTIZE"})
_FLOAT = frozenset({np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.float64)})
_INTEGER_WEIGHTS = frozenset({np.dtype(np.int8), np.dtype(np.uint8), np.dtype(np.int16)})


@dataclass(frozen=True)
class OpRecord:
    """One operator of a converted model: its name, whether an accelerator runs it, whether it is quantized, and
    its work in multiply-accumulates (``macs``; None when the graph does not give the shapes to count it)."""

    name: str
    on_accelerator: bool
    quantized: bool
    macs: int | None = None
    output: str = ""  # the name of its first output tensor, where the format names tensors
    source: str = ""  # the model's code that made it, "pool1 (model.py:14)", where the format keeps it


def placement_of(
    records: Iterable[OpRecord], precision: Precision, accelerator: str | None, macs_unknown: str | None = None
) -> Placement:
    """The manifest's placement from per-operator records (conversions already left out). The work figures are
    recorded when every operator's is known; otherwise ``unknown`` says why (``macs_unknown``, or the operators
    whose work could not be counted)."""
    records = list(records)
    fallback: Counter[str] = Counter()
    sources: dict[str, list[str]] = {}
    for record in records:
        off = accelerator is not None and not record.on_accelerator
        in_float = precision.integer and not record.quantized
        if off or in_float:
            fallback[record.name] += 1
            if record.source and record.source not in sources.setdefault(record.name, []):
                sources[record.name].append(record.source)
    uncounted = sorted({r.name for r in records if r.macs is None})
    unknown: dict[str, str] = {}
    if macs_unknown is None and uncounted:
        macs_unknown = f"the converted graph does not give the shapes of {', '.join(uncounted[:5])}"
    if macs_unknown is not None:
        unknown = {"macs": macs_unknown}
    counted = macs_unknown is None
    return Placement(
        accelerator=accelerator,
        ops=len(records),
        accelerator_ops=sum(r.on_accelerator for r in records) if accelerator is not None else None,
        quantized_ops=sum(r.quantized for r in records) if precision.integer else None,
        macs=sum(r.macs or 0 for r in records) if counted else None,
        accelerator_macs=sum(r.macs or 0 for r in records if r.on_accelerator)
        if counted and accelerator is not None
        else None,
        quantized_macs=sum(r.macs or 0 for r in records if r.quantized) if counted and precision.integer else None,
        fallback=dict(sorted(fallback.items())),
        fallback_sources={name: found for name, found in sorted(sources.items()) if found},
        unknown=unknown,
    )


# Operators whose work is multiply-accumulates over a reduction axis; every other operator counts one per output
# element (an element-wise operation, an activation, a pooling or a copy).
def tflite_macs(name: str, inputs: list[tuple[int, ...] | None], outputs: list[tuple[int, ...] | None]) -> int | None:
    """The multiply-accumulates of one LiteRT operator from its tensors' shapes (inputs in the operator's order,
    -1 indices left out as None); None when a shape it needs is missing."""
    out = outputs[0] if outputs else None
    if out is None:
        return None
    elements = int(np.prod(out, dtype=np.int64))
    weight = inputs[1] if len(inputs) > 1 else None
    if name in ("CONV_2D", "CONV_3D"):  # weights [out, (d,) h, w, in / groups]
        return None if weight is None else elements * int(np.prod(weight[1:], dtype=np.int64))
    if name == "DEPTHWISE_CONV_2D":  # weights [1, h, w, out]: one multiply-accumulate per tap
        return None if weight is None else elements * int(weight[1]) * int(weight[2])
    if name == "FULLY_CONNECTED":  # weights [out, in]
        return None if weight is None else elements * int(weight[-1])
    if name == "TRANSPOSE_CONV":  # inputs: output shape, weights [out, h, w, in], activations
        source = inputs[2] if len(inputs) > 2 else None
        if weight is None or source is None:
            return None
        return int(np.prod(source, dtype=np.int64)) * int(np.prod(weight[:3], dtype=np.int64))
    if name == "BATCH_MATMUL":  # [..., m, k] x [..., k, n] -> [..., m, n] (either side may be adjoint)
        left = inputs[0] if inputs else None
        if left is None or weight is None or min(len(left), len(weight), len(out)) < 2:
            return None
        return elements * _reduced_length(left[-2] * left[-1], weight[-2] * weight[-1], out[-2] * out[-1])
    return elements


def _reduced_length(left: int, right: int, out: int) -> int:
    """k of a matrix product from the sizes of its matrices (m*k, k*n, m*n), whichever side is transposed."""
    return math.isqrt(left * right // out) if out else 0


WEIGHT_PRECISIONS = frozenset({Precision.INT8_DYNAMIC, Precision.INT8_WEIGHTS})


def tflite_placement(path: Path, precision: Precision, sources: ModelSources | None = None) -> Placement:
    """A LiteRT model run by the CPU (LiteRT's kernels or XNNPACK, chosen when it loads): operators and precision;
    with ``sources`` (of the graph it was converted from), the model's code that made those it leaves float."""
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_path=str(path))
    records = tflite_records(interpreter, precision)
    return placement_of(sources.name(records) if sources else records, precision, accelerator=None)


def tflite_records(interpreter: Any, precision: Precision, on_accelerator: Iterable[int] = ()) -> list[OpRecord]:
    """Per-operator records of a LiteRT interpreter's model; ``on_accelerator``: indices of delegated operators."""
    ops = interpreter._get_ops_details()  # the only listing of a model's operators in ai-edge-litert's Python API
    details = {detail["index"]: detail for detail in interpreter.get_tensor_details()}
    dtypes = {index: np.dtype(detail["dtype"]) for index, detail in details.items()}
    produced = {index for op in ops for index in op["outputs"]}
    graph_inputs = {detail["index"] for detail in interpreter.get_input_details()}
    delegated = set(on_accelerator)
    records = []
    for position, op in enumerate(ops):
        if op["op_name"] in TFLITE_CONVERSIONS:
            continue
        inputs = [index for index in op["inputs"] if index >= 0]
        constants = [i for i in inputs if i not in produced and i not in graph_inputs]
        activations = [i for i in inputs if i not in constants] + [i for i in op["outputs"] if i >= 0]
        integer_weights = any(dtypes.get(i) in _INTEGER_WEIGHTS for i in constants)
        if precision in WEIGHT_PRECISIONS:
            float_weights = any(dtypes.get(i) in _FLOAT and len(details[i]["shape"]) >= 2 for i in constants)
            quantized = integer_weights or not float_weights
        else:
            quantized = integer_weights or not any(dtypes.get(i) in _FLOAT for i in activations)
        shapes = [tuple(int(d) for d in details[i]["shape"]) if i >= 0 else None for i in op["inputs"]]
        out_shapes = [tuple(int(d) for d in details[i]["shape"]) if i >= 0 else None for i in op["outputs"]]
        macs = tflite_macs(op["op_name"], shapes, out_shapes)
        first = next((details[i]["name"] for i in op["outputs"] if i >= 0), "")
        records.append(OpRecord(op["op_name"], op.get("index", position) in delegated, quantized, macs, first))
    return records


# TFLite operators whose torch operator has another name; the others are named alike (CUMSUM: aten.cumsum).
_TFLITE_KINDS: dict[str, frozenset[str]] = {
    "FULLY_CONNECTED": frozenset({"linear", "addmm", "mm", "matmul"}),
    "CONV_2D": frozenset({"convolution", "conv2d", "conv1d"}),
    "DEPTHWISE_CONV_2D": frozenset({"convolution", "conv2d", "conv1d"}),
    "TRANSPOSE_CONV": frozenset({"convolution", "convtranspose2d", "convtranspose1d"}),
    "BATCH_MATMUL": frozenset({"bmm", "matmul", "baddbmm"}),
    "LOGISTIC": frozenset({"sigmoid"}),
    "PRELU": frozenset({"prelukernel", "prelu"}),
    "REDUCE_MAX": frozenset({"amax", "max"}),
    "REDUCE_MIN": frozenset({"amin", "min"}),
    "REDUCE_PROD": frozenset({"prod"}),
    "SUM": frozenset({"sum"}),
    "MEAN": frozenset({"mean", "adaptiveavgpool2d", "adaptiveavgpool1d"}),
    "AVERAGE_POOL_2D": frozenset({"avgpool2d", "avgpool1d", "adaptiveavgpool2d"}),
    "MAX_POOL_2D": frozenset({"maxpool2d", "maxpool2dwithindices", "maxpool1d"}),
    "RESHAPE": frozenset({"view", "reshape", "flatten", "unsqueeze", "squeeze"}),
    "TRANSPOSE": frozenset({"permute", "transpose", "t"}),
    "CONCATENATION": frozenset({"cat", "concat"}),
    "SQUARED_DIFFERENCE": frozenset({"sub", "pow"}),
    "HARD_SWISH": frozenset({"hardswish"}),
    "LOG_SOFTMAX": frozenset({"logsoftmax"}),
    "SELECT": frozenset({"where"}),
    "SELECT_V2": frozenset({"where"}),
    "ATAN2": frozenset({"atan", "atan2"}),
    "GREATER_EQUAL": frozenset({"ge"}),
    "GREATER": frozenset({"gt"}),
    "LESS": frozenset({"lt"}),
    "LESS_EQUAL": frozenset({"le"}),
    "MAXIMUM": frozenset({"maximum", "clamp", "clampmin"}),
    "MINIMUM": frozenset({"minimum", "clamp", "clampmax"}),
    "RELU6": frozenset({"hardtanh", "relu6"}),
    "LEAKY_RELU": frozenset({"leakyrelu"}),
}


def _plain(name: str) -> str:
    """``aten._prelu_kernel.default`` and ``PRELU`` -> ``prelukernel`` and ``prelu``: an operator's bare kind."""
    return name.split(".")[-2 if name.count(".") >= 2 else 0].replace("_", "").lower()


@dataclass(frozen=True)
class GraphOperator:
    """An operator of the torch graph a model file was converted from: its kind (``cumsum``), the module whose code
    made it (``spread``; "" outside every module) and where (``spread (model.py:7)``, see ``node_source``)."""

    kind: str
    module: str
    source: str


@dataclass(frozen=True)
class ModelSources:
    """Names the operators of a LiteRT model by the model's code, from the PT2E-converted graph it was converted from.

    The model file keeps no source lines; each operator's output tensor is named after the modules whose code made
    it (``__main__.Net/__main__.Spread_spread``), and the graph's nodes carry their module and stack trace
    (torch.export's ``nn_module_stack`` and ``stack_trace``). An operator is tied to the graph's operators of that
    module: the one of its own kind (CUMSUM: ``aten.cumsum``), the n-th of a module's operators of one kind to the
    n-th of the graph's; where the module has none of its kind (a torch operator the converter wrote as several,
    PReLU as RELU, MUL and SUB), to the module's first torch operator, whose module and line are named. An operator
    whose tensor names no module (a model output, named after the signature) is tied by its kind alone to the
    graph's first operator of that kind not yet tied; with neither, it is left unnamed (never guessed).

    Which operators compute in float is the model file's to say (``tflite_records``): the graph's quantize and
    dequantize nodes frame every operator the quantizer annotated, including those the converter then leaves in
    float (CUMSUM, DIV of two activations), so the graph only names them."""

    operators: tuple[GraphOperator, ...] = ()
    locations: tuple[tuple[str, str], ...] = ()
    """Each module's location as LiteRT names it, with its path (``("__main__.Net/..._spread", "spread")``)."""

    @classmethod
    def of(cls, converted: Any, root: Any) -> ModelSources:
        """From the PT2E-converted GraphModule ``converted`` of the torch module ``root``."""
        operators = tuple(
            GraphOperator(_plain(_op_name(node)), module_path(node) or "", node_source(node))
            for node in converted.graph.nodes
            if node.op == "call_function" and _op_name(node) not in _SKIPPED and not _is_conversion(_op_name(node))
        )
        return cls(operators, tuple(_locations(root)))

    def modules(self, tensor: str) -> tuple[str, ...]:
        """The modules a LiteRT tensor's name places it in: the innermost ones it names, "" for the model's own
        forward(); () when it names none."""
        by_location = dict(self.locations)
        found = {by_location[part] for part in tensor.split(";") if part in by_location}
        inner = {module for module in found if module}
        return tuple(sorted(inner or found))

    def name(self, records: list[OpRecord]) -> list[OpRecord]:
        """``records`` with their ``source``: see the class."""
        named = list(records)
        tied: set[int] = set()
        seen: Counter[tuple[str, tuple[str, ...]]] = Counter()
        unplaced = []
        for position, record in enumerate(records):
            modules = self.modules(record.output)
            if not modules:
                unplaced.append(position)
                continue
            here = [i for i, op in enumerate(self.operators) if op.module in modules]
            alike = [i for i in here if self._alike(record.name, i)]
            if alike:
                pick = alike[min(seen[record.name, modules], len(alike) - 1)]
                seen[record.name, modules] += 1
            elif here:
                pick = next((i for i in here if i not in tied), here[0])
            else:
                continue
            tied.add(pick)
            named[position] = replace(record, source=self.operators[pick].source)
        for position in unplaced:
            alike = [i for i in range(len(self.operators)) if self._alike(records[position].name, i)]
            free = next((i for i in alike if i not in tied), None)
            if free is not None:
                tied.add(free)
                named[position] = replace(records[position], source=self.operators[free].source)
        return named

    def _alike(self, tflite: str, index: int) -> bool:
        kind = self.operators[index].kind
        return kind in _TFLITE_KINDS.get(tflite, frozenset()) or kind == _plain(tflite)


def _locations(root: Any) -> list[tuple[str, str]]:
    """Every module of ``root`` as LiteRT's tensor names locate it (``edgeline.export.graph.module_of_location``
    reads them back): the root's class, then each child's class and attribute name."""
    kind = type(root)
    pending = [(f"{kind.__module__}.{kind.__qualname__}", "", root)]
    found: list[tuple[str, str]] = []
    while pending and len(found) < 100_000:  # bounded: a model's modules, each visited once
        location, path, module = pending.pop()
        found.append((location, path))
        for attribute, child in module.named_children():
            segment = f"{type(child).__module__}.{type(child).__qualname__}_{attribute}"
            pending.append((f"{location}/{segment}", f"{path}.{attribute}" if path else attribute, child))
    return found


_CONVERSION_MARKERS = ("quantize_per_", "dequantize_per_", "choose_qparams")
_SKIPPED = frozenset({"getitem", "executorch_call_delegate"})


def _op_name(node: Any) -> str:
    return str(getattr(node.target, "__name__", node.target))


def _is_conversion(name: str) -> bool:
    return any(marker in name for marker in _CONVERSION_MARKERS)


def _is_parameter(node: Any) -> bool:
    """A graph input holding a weight: torch.export names parameters p_*, buffers b_* (constants _frozen*)."""
    return bool(node.op == "get_attr" or (node.op == "placeholder" and re.match(r"^(p_|b_|_frozen)", node.name)))


def _fx_records(
    graph: Any, on_accelerator: bool, precision: Precision, integer_kernel: Callable[[Any], bool] | None = None
) -> list[OpRecord]:
    """A PT2E graph's operators: quantized when an input comes through a dequantize (static or dynamic), or when
    its output is quantized and every operator feeding it is quantized (an activation fused after a quantized
    convolution). A float operator whose output is quantized on the fly (dynamic quantization) stays float.
    For weight precisions, an operator without weights is not held against the share (see the module's rules).
    ``integer_kernel`` (int8-static): whether the delegate computes an operator so framed on integers; one it
    computes in float between conversions counts as float, and so does an activation fused after it."""
    records = []
    quantized: set[Any] = set()
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        name = _op_name(node)
        if name in _SKIPPED or _is_conversion(name):
            continue
        feeding = [arg for arg in node.all_input_nodes if arg.op == "call_function"]
        from_dequantize = any("dequantize" in _op_name(arg) for arg in feeding)
        into_quantize = any(
            user.op == "call_function" and "quantize_per_" in _op_name(user) and "dequantize" not in _op_name(user)
            for user in node.users
        )
        fused = into_quantize and feeding and all(arg in quantized for arg in feeding)
        weightless = precision in WEIGHT_PRECISIONS and not any(_is_parameter(a) for a in node.all_input_nodes)
        integer = integer_kernel is None or precision is not Precision.INT8_STATIC or integer_kernel(node)
        if (from_dequantize or fused or weightless) and integer:
            quantized.add(node)
        where = node_source(node)
        records.append(OpRecord(name, on_accelerator, node in quantized, fx_macs(node, name), node.name, where))
    return records


def node_source(node: Any) -> str:
    """``pool1 (model.py:14)``: the module whose code made a torch graph node and the model's own line that called
    it (``code_source``); ``forward()`` for code outside every module; "" when the graph kept neither."""
    meta = getattr(node, "meta", {}) or {}
    return code_source(module_path(node), str(meta.get("stack_trace") or ""))


def code_source(module: str | None, stack_trace: str) -> str:
    """``pool1 (model.py:14)`` from a module path and a torch stack trace: the innermost frame outside torch and the
    installed packages is the model's own line; ``forward()`` without a module; "" without either."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in \S+', stack_trace)
    line = next(
        (
            f"{Path(path).name}:{number}"
            for path, number in reversed(frames)
            if not any(part in path for part in ("site-packages", "dist-packages", "/torch/", "<"))
        ),
        None,
    )
    if not module and line is None:
        return ""
    return f"{module or 'forward()'}" + (f" ({line})" if line else "")


def _shape(node: Any) -> tuple[int, ...] | None:
    value = node.meta.get("val") if hasattr(node, "meta") else None
    shape = getattr(value, "shape", None)
    try:
        return None if shape is None else tuple(int(d) for d in shape)
    except (TypeError, ValueError):  # a symbolic size: not countable
        return None


def fx_macs(node: Any, name: str) -> int | None:
    """The multiply-accumulates of one torch graph operator, from the shapes torch.export recorded (``meta["val"]``):
    convolutions, linear layers and matrix products by their reduction, every other operator one per output element.
    None when the shapes are not recorded."""
    value = node.meta.get("val")
    outputs = value if isinstance(value, (tuple, list)) else (value,)
    if any(getattr(v, "shape", None) is None for v in outputs if v is not None):
        return None
    try:
        elements = sum(int(np.prod(tuple(int(d) for d in v.shape), dtype=np.int64)) for v in outputs if v is not None)
    except (TypeError, ValueError):
        return None
    args = [a for a in node.args if hasattr(a, "meta")]
    short = name.split(".")[-2] if name.count(".") >= 1 else name  # "aten.convolution.default" -> "convolution"
    if short in ("convolution", "conv2d", "conv1d", "_convolution") and len(args) >= 2:
        weight = _shape(args[1])
        if weight is None:
            return None
        transposed = len(node.args) > 6 and node.args[6] is True
        if transposed:
            source = _shape(args[0])
            return None if source is None else int(np.prod(source, dtype=np.int64)) * int(np.prod(weight[1:]))
        return elements * int(np.prod(weight[1:], dtype=np.int64))
    if short == "linear" and len(args) >= 2:
        weight = _shape(args[1])
        return None if weight is None else elements * weight[-1]
    if short in ("addmm", "mm", "bmm", "matmul", "baddbmm") and len(args) >= 2:
        left = _shape(args[-2])
        return None if left is None else elements * left[-1]
    return elements


def _never(node: Any) -> bool:
    return False


def executorch_placement(
    graph_module: Any, precision: Precision, accelerator: str, integer_kernel: Callable[[Any], bool] | None = None
) -> Placement:
    """An ExecuTorch edge program after lowering: the delegates' operators (from each lowered module's original
    graph) count as on the accelerator, the rest as left to ExecuTorch's CPU kernels. ``integer_kernel``: whether
    the delegate computes one of its operators (a node of a lowered module's graph) on integers (see ``_fx_records``);
    with it, an operator left to ExecuTorch's portable kernels counts as float (they compute aten operators on the
    float tensors a dequantize gives them); without it, every operator between a dequantize and a quantize counts as
    integer."""
    portable = None if integer_kernel is None else _never
    records = _fx_records(graph_module.graph, False, precision, portable)
    for node in graph_module.graph.nodes:
        if node.op == "get_attr":
            lowered = getattr(graph_module, str(node.target))
            original = getattr(lowered, "original_module", None)
            if original is not None:
                records.extend(_fx_records(original.graph_module.graph, True, precision, integer_kernel))
    return placement_of(records, precision, accelerator)
