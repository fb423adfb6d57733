"""Full-integer int8 static quantization: every operator int8, from the model's input to its output.

litert-torch's PT2E quantizer annotates convolutions, linear layers, pooling, ``add``/``mul``/``cat`` and a few
activations; any other operator stays float between a dequantize and a quantize. At the model's edges that leaves a
float input or output, which vela and TFLite Micro refuse: the normalisation a ``forward`` starts with
(``(x - mean) / std``), the ``log_softmax`` it ends with. ``FullIntegerQuantizer`` quantizes those too, as operators
TFLite has int8 kernels for, that TFLite Micro runs and vela (except LOG_SOFTMAX) maps to the Ethos-U NPU:

- SUB, ADD and MUL, of activations or constants (a constant operand is quantized like an activation). A division by
  a constant becomes a multiplication by its reciprocal: vela has no DIV, and the int8 MUL rounds once. Arithmetic
  on constants alone (``std + eps``, a tensor built in ``forward``) is folded into one constant first.
- SOFTMAX and LOG_SOFTMAX, with the fixed output quantization their int8 kernels require. vela leaves LOG_SOFTMAX to
  the CPU (TFLite Micro's int8 kernel there); it has no NPU form, and TFLite Micro has no int8 EXP or LOG to build one.
- The activations with int8 kernels: LOGISTIC and TANH (fixed output quantization), HARD_SWISH, RELU6, and the
  pieces of those that have none. ``torch.export`` keeps ``nn.SiLU`` as one operator, ``aten.silu``, which no
  annotator of litert-torch's quantizer knows: it stayed float, and the converter lowered it to LOGISTIC and MUL
  between a DEQUANTIZE and a QUANTIZE (an EfficientNet's every block). It is written ``x * sigmoid(x)`` here, which
  is the same function. An operator that consumes a fixed output quantization (TANH's, LOGISTIC's) takes it as it
  is: a second observer there would requantize for nothing, and the converter refused the TRANSPOSE that carried
  the requantization after a TANH ("quantization parameters violate the same scale constraint").
- GELU, for targets whose kernels lack it (TFLite Micro: ``gelu_kernel=False``): the tanh approximation, from MUL,
  ADD and TANH. It is not the same function as the exact GELU (0.0005 apart at most, in float); ``rewrites`` says
  so, for the manifest and the report, and the fidelity check judges it like any other change.

This keeps the model's own arithmetic, so nothing but quantization separates it from the float model; folding the
normalisation into the first layer instead would be exact only without padding, and only before a convolution or
linear layer. Whatever still computes in float at an edge (a division by a value the model computes, an operator
without an int8 kernel) is found in the quantized graph with the model's line (``float_edges``), and named
when a full-integer target refuses the file it went into (``write_tflite(..., full_integer_for=...)``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from litert_torch.quantize.pt2e_quantizer import PT2EQuantizer, get_symmetric_quantization_config
from litert_torch.quantize.pt2e_quantizer_utils import propagate_annotation
from torch.fx import GraphModule, Node
from torchao.quantization.pt2e.constant_fold import constant_fold
from torchao.quantization.pt2e.quantizer import (
    FixedQParamsQuantizationSpec,
    QuantizationAnnotation,
    SharedQuantizationSpec,
)

from edgeline.export.conversion import Culprit, describe_culprit, module_path, node_culprit
from edgeline.export.errors import LoweringError
from edgeline.manifest import Rewrite

__all__ = ["FullIntegerQuantizer", "check_full_integer", "float_edges"]

_aten = torch.ops.aten
_ELEMENTWISE = frozenset({_aten.add.Tensor, _aten.sub.Tensor, _aten.mul.Tensor})
_DIVISIONS = frozenset({_aten.div.Tensor, _aten.div.Scalar})


def _fixed(scale: float, zero_point: int) -> FixedQParamsQuantizationSpec:
    return FixedQParamsQuantizationSpec(
        dtype=torch.int8,
        scale=scale,
        zero_point=zero_point,
        quant_min=-128,
        quant_max=127,
        qscheme=torch.per_tensor_affine,
    )


# The output quantization TFLite's int8 kernels require (and check when the model is prepared).
_FIXED_OUTPUT = {
    _aten.softmax.int: _fixed(1 / 256, -128),
    _aten._softmax.default: _fixed(1 / 256, -128),
    _aten.log_softmax.int: _fixed(16 / 256, 127),
    _aten._log_softmax.default: _fixed(16 / 256, 127),
}

# Operators of one activation input that TFLite runs in int8 with the input's own kind of quantization (vela maps
# them to the NPU): the squeeze-excite pool and gates of a MobileNetV3 among them.
_ONE_INPUT = frozenset(
    {
        _aten.mean.dim,
        _aten.adaptive_avg_pool2d.default,
        _aten.hardswish.default,
        _aten.hardsigmoid.default,
        _aten.hardtanh.default,
        _aten.clamp.default,
        _aten.relu.default,
    }
)
_FIXED_OUTPUT |= {_aten.sigmoid.default: _fixed(1 / 256, -128), _aten.tanh.default: _fixed(1 / 128, 0)}

# Arithmetic on constants that is folded into one constant before annotation (aliases included: a tensor built in
# forward() comes as lift_fresh_copy, then detach_).
_FOLDED = frozenset(
    {"add", "sub", "rsub", "mul", "div", "neg", "reciprocal", "sqrt", "rsqrt", "pow", "square", "abs"}
    | {"lift_fresh_copy", "detach", "detach_", "clone", "alias", "_to_copy", "to"}
)


def _op_name(node: Node) -> str:
    return str(getattr(node.target, "__name__", node.target)).split(".")[0]


def _floating(node: Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.dtype.is_floating_point


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _constant(model: GraphModule, before: Node, value: Any) -> Node:
    """A new constant (a buffer read by ``get_attr``) in the dtype of ``before``'s output, inserted before it."""
    dtype = before.meta["val"].dtype
    index = 0
    while hasattr(model, f"_full_integer_constant_{index}"):
        index += 1
    name = f"_full_integer_constant_{index}"
    model.register_buffer(name, torch.as_tensor(value, dtype=dtype))
    with model.graph.inserting_before(before):
        return model.graph.get_attr(name)


def _constant_value(model: GraphModule, arg: Any) -> torch.Tensor | None:
    if _is_number(arg):
        return torch.tensor(float(arg))
    if isinstance(arg, Node) and arg.op == "get_attr":
        value = _attribute(model, str(arg.target))
        return value if isinstance(value, torch.Tensor) else None
    return None


def _attribute(model: GraphModule, target: str) -> Any:
    value: Any = model
    for part in target.split("."):
        value = getattr(value, part)
    return value


GELU_AS_TANH = Rewrite(
    operator="aten.gelu",
    replacement="the tanh approximation, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), from MUL, ADD and TANH",
    reason="the target's kernels have no GELU (TFLite Micro)",
)


def _rewrite_for_int8(model: GraphModule, *, gelu_kernel: bool = True) -> list[Rewrite]:
    """Divisions by a constant into multiplications by its reciprocal; ``c - x`` into ``sub(c, x)``; numbers in
    ADD/SUB/MUL into float constants (litert-torch's quantizer makes ``x + 1`` an int64 constant its observer
    rejects); activations without an annotation into the operators that have one (see the module). The rewrites
    that change what the model computes, with their counts."""
    approximated = 0
    for node in list(model.graph.nodes):
        if node.op != "call_function" or not _floating(node):
            continue
        if node.target is _aten.gelu.default and not gelu_kernel and isinstance(node.args[0], Node):
            exact = (node.kwargs.get("approximate") or (node.args[1] if len(node.args) > 1 else "none")) == "tanh"
            _decompose_gelu(model, node)
            approximated += not exact
            continue
        if node.kwargs:
            continue
        if node.target is _aten.hardsigmoid.default and isinstance(node.args[0], Node):
            _decompose_hardsigmoid(model, node)
            continue
        if node.target is _aten.silu.default and isinstance(node.args[0], Node):
            _decompose_silu(model, node)
            continue
        if node.target in _DIVISIONS and isinstance(node.args[0], Node):
            divisor = _constant_value(model, node.args[1])
            if divisor is not None and bool(torch.all(divisor != 0)):
                node.target = _aten.mul.Tensor
                node.args = (node.args[0], _constant(model, node, 1 / divisor.to(node.meta["val"].dtype)))
        elif node.target is _aten.rsub.Scalar and len(node.args) == 2 and _is_number(node.args[1]):
            node.target = _aten.sub.Tensor
            node.args = (_constant(model, node, node.args[1]), node.args[0])
        if node.target in _ELEMENTWISE:
            node.args = tuple(_constant(model, node, a) if _is_number(a) else a for a in node.args)
    model.graph.eliminate_dead_code()
    model.recompile()
    return [GELU_AS_TANH.model_copy(update={"count": approximated})] if approximated else []


def _replace(model: GraphModule, node: Node, steps: list[tuple[Any, tuple[Any, ...]]]) -> None:
    """``node`` replaced by ``steps``, operators applied in order on the same shape: (target, args), where an arg
    that is an int names the result of an earlier step (0: ``node``'s input, 1: the first step's result...), a float
    is a constant. The last step's result takes ``node``'s uses."""
    graph = model.graph
    source = node.args[0]
    assert isinstance(source, Node)
    results: list[Node] = [source]
    with graph.inserting_before(node):
        for target, args in steps:
            made = graph.call_function(
                target, tuple(results[a] if isinstance(a, int) else _constant(model, node, a) for a in args)
            )
            made.meta = {**node.meta, "val": node.meta["val"]}
            results.append(made)
    node.replace_all_uses_with(results[-1])
    graph.erase_node(node)


def _decompose_silu(model: GraphModule, node: Node) -> None:
    """``silu(x)`` as ``x * sigmoid(x)``: the same function, from LOGISTIC and MUL, which have int8 kernels."""
    _replace(model, node, [(_aten.sigmoid.default, (0,)), (_aten.mul.Tensor, (0, 1))])


def _decompose_gelu(model: GraphModule, node: Node) -> None:
    """``gelu(x)`` as its tanh approximation, arranged so that every intermediate has a range int8 holds well:
    ``s = x * (c + c k x^2)`` (``c = sqrt(2/pi)``, ``k = 0.044715``), then ``x * (0.5 + 0.5 tanh(s))``."""
    c, k = math.sqrt(2 / math.pi), 0.044715
    mul, add = _aten.mul.Tensor, _aten.add.Tensor
    _replace(
        model, node,
        [
            (mul, (0, 0)),  # 1: x^2
            (mul, (1, c * k)),  # 2: c k x^2
            (add, (2, c)),  # 3: c + c k x^2
            (mul, (0, 3)),  # 4: s
            (_aten.tanh.default, (4,)),  # 5
            (mul, (5, 0.5)),  # 6
            (add, (6, 0.5)),  # 7
            (mul, (0, 7)),  # 8: gelu(x)
        ],
    )  # fmt: skip


def _decompose_hardsigmoid(model: GraphModule, node: Node) -> None:
    """``hardsigmoid(x)`` as ``relu6(x + 3) * (1/6)``: three operators with int8 kernels (and NPU forms). The converter
    lowers hardsigmoid itself to the same ADD and MUL, but in float (MobileNetV3's squeeze-excite gates)."""
    (source,) = node.args
    graph = model.graph
    with graph.inserting_before(node):
        shifted = graph.call_function(_aten.add.Tensor, (source, _constant(model, node, 3.0)))
        clamped = graph.call_function(_aten.hardtanh.default, (shifted, 0.0, 6.0))
        scaled = graph.call_function(_aten.mul.Tensor, (clamped, _constant(model, node, 1 / 6)))
    for made in (shifted, clamped, scaled):
        made.meta = {**node.meta, "val": node.meta["val"]}
    node.replace_all_uses_with(scaled)
    graph.erase_node(node)


def _share_fixed_outputs(model: GraphModule) -> None:
    """An input edge from an operator with a fixed output quantization (TANH, LOGISTIC, SOFTMAX) shares it, rather
    than observing its own: see the module."""
    for node in model.graph.nodes:
        annotation = node.meta.get("quantization_annotation")
        if annotation is None:
            continue
        for source, spec in list(annotation.input_qspec_map.items()):
            made = source.meta.get("quantization_annotation")
            fixed = made is not None and isinstance(made.output_qspec, FixedQParamsQuantizationSpec)
            if fixed and not isinstance(spec, SharedQuantizationSpec | FixedQParamsQuantizationSpec):
                annotation.input_qspec_map[source] = SharedQuantizationSpec(source)


def _reaches_output(node: Node) -> bool:
    """Whether ``node``'s value is one of the model's outputs, as it is or through reshapes."""
    pending, seen = list(node.users), set()
    while pending:
        user = pending.pop()
        if user.op == "output":
            return True
        if user not in seen and user.op == "call_function" and _op_name(user) in _SHAPE_ONLY:
            seen.add(user)
            pending.extend(user.users)
    return False


def _keep_float(model: GraphModule, modules: tuple[str, ...], activation: Any, int8_edges: bool) -> None:
    """Takes back the annotations of the operators inside ``modules`` (and their submodules), and every input edge
    of another operator that shares a quantization with one of them. ``int8_edges``: the model's edges stay int8
    (full-integer, as TFLite Micro and vela take it): a kept operator that reads a model input still has it
    quantized (the model takes int8 and dequantizes it), and one whose value is a model output quantizes it.
    Otherwise (LiteRT on a CPU) a kept first layer takes the input in float: an input whose features span very
    different ranges is what int8 loses there."""
    if not modules:
        return
    kept = set()
    for node in model.graph.nodes:
        path = module_path(node)
        inside = path is not None and any(path == m or path.startswith(m + ".") for m in modules)
        annotation = node.meta.pop("quantization_annotation", None) if inside else None
        if annotation is None:
            continue
        kept.add(node)
        if not int8_edges:
            continue
        edges = {arg: spec for arg, spec in annotation.input_qspec_map.items() if arg.op == "placeholder"}
        output = annotation.output_qspec if _reaches_output(node) else None
        if edges or output is not None:
            node.meta["quantization_annotation"] = QuantizationAnnotation(
                input_qspec_map=edges, output_qspec=output, _annotated=True
            )
    for node in model.graph.nodes:
        annotation = node.meta.get("quantization_annotation")
        if annotation is None:
            continue
        for source, spec in list(annotation.input_qspec_map.items()):
            if not isinstance(spec, SharedQuantizationSpec):
                continue
            shared = spec.edge_or_node[0] if isinstance(spec.edge_or_node, tuple) else spec.edge_or_node
            if shared in kept:
                annotation.input_qspec_map[source] = activation


def _annotated(node: Node) -> bool:
    annotation = node.meta.get("quantization_annotation")
    return annotation is not None and bool(annotation._annotated)


class FullIntegerQuantizer(PT2EQuantizer):  # type: ignore[misc]  # litert-torch ships no type information
    """litert-torch's PT2E quantizer (symmetric per-channel weights, int8 activations) that also quantizes the
    element-wise arithmetic, SOFTMAX and LOG_SOFTMAX: see the module's docstring."""

    def __init__(self, *, gelu_kernel: bool = True, keep_float: tuple[str, ...] = (), int8_edges: bool = True) -> None:
        super().__init__()
        self.set_global(get_symmetric_quantization_config(is_per_channel=True, is_dynamic=False))
        self.gelu_kernel = gelu_kernel
        """False: the target has no GELU kernel (TFLite Micro): GELU becomes its tanh approximation."""
        self.keep_float = keep_float
        """Module paths whose operators stay float (mixed precision): their annotations are taken back, so a
        dequantize comes before them and a quantize after."""
        self.int8_edges = int8_edges
        """Whether the model's inputs and outputs stay int8 when a layer at an edge is kept float (see
        ``_keep_float``)."""
        self.rewrites: list[Rewrite] = []
        """What the rewrites changed of the function the model computes (the manifest's ``quantization.rewrites``)."""

    def transform_for_annotation(self, model: GraphModule) -> GraphModule:
        constant_fold(model, constraint_fn=lambda node: _op_name(node) in _FOLDED)
        self.rewrites = _rewrite_for_int8(model, gelu_kernel=self.gelu_kernel)
        return super().transform_for_annotation(model)

    def annotate(self, model: GraphModule) -> GraphModule:
        super().annotate(model)  # litert-torch's patterns first: they fuse a convolution with its ReLU, ...
        activation = self.global_config.input_activation
        for node in model.graph.nodes:
            if node.op != "call_function" or _annotated(node) or not _floating(node):
                continue
            if node.target in _ELEMENTWISE:
                inputs = {arg: activation for arg in node.args[:2] if isinstance(arg, Node)}
                output = self.global_config.output_activation
            elif node.target in _FIXED_OUTPUT and isinstance(node.args[0], Node):
                inputs, output = {node.args[0]: activation}, _FIXED_OUTPUT[node.target]
            elif node.target in _ONE_INPUT and isinstance(node.args[0], Node):
                inputs, output = {node.args[0]: activation}, self.global_config.output_activation
            else:
                continue
            node.meta["quantization_annotation"] = QuantizationAnnotation(
                input_qspec_map=inputs, output_qspec=output, _annotated=True
            )
        _keep_float(model, self.keep_float, activation, self.int8_edges)
        propagate_annotation(model)  # reshapes after the operators annotated here share their quantization
        _share_fixed_outputs(model)
        return model


_CONVERSIONS = ("quantize_per_", "dequantize_per_", "choose_qparams")
_SHAPE_ONLY = frozenset(
    {"view", "reshape", "flatten", "permute", "transpose", "squeeze", "unsqueeze", "contiguous", "clone", "t"}
    | {"expand", "alias", "detach", "detach_", "_assert_tensor_metadata", "getitem"}
)


def _is_conversion(node: Node) -> bool:
    return node.op == "call_function" and any(marker in _op_name(node) for marker in _CONVERSIONS)


def _walk(start: list[Node], step: Any) -> Iterator[Node]:
    """The float operators reached from ``start`` through ``step`` (users or inputs) before a (de)quantize."""
    seen: set[Node] = set()
    pending = list(start)
    while pending:
        for node in step(pending.pop()):
            if node in seen or node.op != "call_function" or _is_conversion(node):
                continue
            seen.add(node)
            pending.append(node)
            yield node


def float_edges(quantized: GraphModule) -> tuple[Culprit, ...]:
    """The operators of a converted PT2E graph that compute in float between the model's inputs and the first
    quantize, or between the last dequantize and its outputs: why its LiteRT model has a float input or output.
    Reshapes are named only when nothing else is there (the converter moves a quantize past them). In graph order,
    each with the model's line."""
    inputs = [node for node in quantized.graph.nodes if node.op == "placeholder"]
    outputs = [arg for node in quantized.graph.nodes if node.op == "output" for arg in node.all_input_nodes]
    found = set(_walk(inputs, lambda node: list(node.users)))
    found |= {node for node in outputs if node.op == "call_function" and not _is_conversion(node)}
    found |= set(_walk(outputs, lambda node: node.all_input_nodes))
    ordered = [node for node in quantized.graph.nodes if node in found]
    computing = [node for node in ordered if _op_name(node) not in _SHAPE_ONLY]
    return tuple(node_culprit(node, operator=str(node.target)) for node in computing or ordered)


def _describe(culprits: tuple[Culprit, ...]) -> str:
    """``aten.amax.default, aten.div.Tensor (model.py:12: x = x / x.amax())``: operators of one line together."""
    lines: dict[tuple[str | None, str | None], list[str]] = {}
    for culprit in culprits:
        lines.setdefault((culprit.module, culprit.source), []).append(culprit.operator)
    return "; ".join(
        describe_culprit(Culprit(", ".join(dict.fromkeys(operators)), module, source))
        for (module, source), operators in lines.items()
    )


def _tflite_float_edges(interpreter: Any) -> list[str]:
    """The float operators of a LiteRT model between its float inputs and a QUANTIZE, or a DEQUANTIZE and its float
    outputs (their TFLite names): what is known of a file ``float_edges`` did not see."""
    ops = interpreter._get_ops_details()  # the only listing of a model's operators in ai-edge-litert's Python API
    dtypes = {detail["index"]: np.dtype(detail["dtype"]) for detail in interpreter.get_tensor_details()}
    floating = {np.dtype(np.float32), np.dtype(np.float16)}
    reached: set[int] = set()
    for tensors, side, other in (
        ({d["index"] for d in interpreter.get_input_details()}, "inputs", "outputs"),
        ({d["index"] for d in interpreter.get_output_details()}, "outputs", "inputs"),
    ):
        tensors = {index for index in tensors if dtypes.get(index) in floating}
        changed = True
        while changed:
            changed = False
            for position, op in enumerate(ops):
                conversion = op["op_name"] in ("QUANTIZE", "DEQUANTIZE")
                if position in reached or conversion or not tensors & set(op[side]):
                    continue
                reached.add(position)
                tensors |= {index for index in op[other] if index >= 0 and dtypes.get(index) in floating}
                changed = True
    return [ops[position]["op_name"] for position in sorted(reached)]


def check_full_integer(path: Path, backend: str, culprits: tuple[Culprit, ...] = ()) -> None:
    """vela and TFLite Micro take full-integer models: every input and output int8. Otherwise a ``LoweringError``
    naming the operators that stayed float at the model's edges: ``culprits`` (``float_edges`` of the graph the file
    was converted from, with the model's lines), else those the file itself shows."""
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_path=str(path))
    for kind, details in (("input", interpreter.get_input_details()), ("output", interpreter.get_output_details())):
        for detail in details:
            dtype = np.dtype(detail["dtype"])
            if dtype == np.int8:
                continue
            if culprits:
                operators = tuple(dict.fromkeys(culprit.operator for culprit in culprits))
                named = _describe(culprits)
            else:
                operators = tuple(dict.fromkeys(_tflite_float_edges(interpreter)))
                named = ", ".join(operators) or "none found"
            raise LoweringError(
                f"{backend}: the int8 model's {kind} {detail['name']!r} is {dtype.name}, not int8: the operators at "
                f"the model's edges that stayed float are {named}. Compute them outside the model (in the data, or "
                "on its outputs), or choose a target that takes float",
                operators=operators,
            )
