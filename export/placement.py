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
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgeline.device_profiles import Precision
from edgeline.manifest import Placement

__all__ = ["OpRecord", "executorch_placement", "fx_macs", "placement_of", "tflite_macs", "tflite_placement"]

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


def placement_of(
    records: Iterable[OpRecord], precision: Precision, accelerator: str | None, macs_unknown: str | None = None
) -> Placement:
    """The manifest's placement from per-operator records (conversions already left out). The work figures are
    recorded when every operator's is known; otherwise ``unknown`` says why (``macs_unknown``, or the operators
    whose work could not be counted)."""
    records = list(records)
    fallback: Counter[str] = Counter()
    for record in records:
        off = accelerator is not None and not record.on_accelerator
        in_float = precision.integer and not record.quantized
        if off or in_float:
            fallback[record.name] += 1
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


def tflite_placement(path: Path, precision: Precision) -> Placement:
    """A LiteRT model run by the CPU (LiteRT's kernels or XNNPACK, chosen when it loads): operators and precision."""
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_path=str(path))
    return placement_of(tflite_records(interpreter, precision), precision, accelerator=None)


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


_CONVERSION_MARKERS = ("quantize_per_", "dequantize_per_", "choose_qparams")
_SKIPPED = frozenset({"getitem", "executorch_call_delegate"})


def _op_name(node: Any) -> str:
    return str(getattr(node.target, "__name__", node.target))


def _is_conversion(name: str) -> bool:
    return any(marker in name for marker in _CONVERSION_MARKERS)


def _is_parameter(node: Any) -> bool:
    """A graph input holding a weight: torch.export names parameters p_*, buffers b_* (constants _frozen*)."""
    return bool(node.op == "get_attr" or (node.op == "placeholder" and re.match(r"^(p_|b_|_frozen)", node.name)))


def _fx_records(graph: Any, on_accelerator: bool, precision: Precision) -> list[OpRecord]:
    """A PT2E graph's operators: quantized when an input comes through a dequantize (static or dynamic), or when
    its output is quantized and every operator feeding it is quantized (an activation fused after a quantized
    convolution). A float operator whose output is quantized on the fly (dynamic quantization) stays float.
    For weight precisions, an operator without weights is not held against the share (see the module's rules)."""
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
        if from_dequantize or fused or weightless:
            quantized.add(node)
        records.append(OpRecord(name, on_accelerator, node in quantized, fx_macs(node, name), node.name))
    return records


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


def executorch_placement(graph_module: Any, precision: Precision, accelerator: str) -> Placement:
    """An ExecuTorch edge program after lowering: the delegates' operators (from each lowered module's original
    graph) count as on the accelerator, the rest as left to ExecuTorch's CPU kernels."""
    records = _fx_records(graph_module.graph, False, precision)
    for node in graph_module.graph.nodes:
        if node.op == "get_attr":
            lowered = getattr(graph_module, str(node.target))
            original = getattr(lowered, "original_module", None)
            if original is not None:
                records.extend(_fx_records(original.graph_module.graph, True, precision))
    return placement_of(records, precision, accelerator)
