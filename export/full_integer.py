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
- DIV of two activations (int8 in LiteRT and TFLite Micro; vela leaves it to the CPU); EXP and LOG (lookup
  tables) where the target has them, and RSQRT; PRELU (its alpha quantized per tensor) and ELU: see
  ``edgeline.export.tflite_operators``, which makes the converter emit them.
- The activations whose int8 form differs between targets (``Int8Kernels``): ELU that is not TFLite's (SELU,
  CELU, an alpha), and ELU where the target has no ELU (the Ethos-U), as RELU, SUB, ELU or EXP, MUL and ADD;
  Softplus as ``relu(x) + log(1 + exp(-|x|))``; Mish as ``x tanh(softplus(x))``, or without int8 EXP and LOG
  (TFLite Micro) from LOGISTIC, MUL, ADD and DIV; LayerNorm as its MEAN (a linear layer of weights 1/C), SUB, MUL,
  ADD, RSQRT and MUL. Each is the same function, and each piece gets its own quantization (ELU's exponential sees
  only the negative inputs, where the converter's form clipped them at ELU's output range).
- GELU, for targets whose kernels lack it (TFLite Micro): the tanh approximation, from MUL, ADD and TANH. It is not
  the same function as the exact GELU (0.0005 apart at most, in float); ``rewrites`` says so, for the manifest and
  the report, and the fidelity check judges it like any other change.

This keeps the model's own arithmetic, so nothing but quantization separates it from the float model; folding the
normalisation into the first layer instead would be exact only without padding, and only before a convolution or
linear layer. Whatever still computes in float at an edge (an operator without an int8 kernel on the target, such
as LOG on TFLite Micro) is found in the quantized graph with the model's line (``float_edges``), and named
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
from edgeline.export.tflite_operators import (
    ETHOS_U_KERNELS,
    LITERT_KERNELS,
    TFLITE_MICRO_KERNELS,
    Int8Kernels,
)
from edgeline.manifest import Rewrite

__all__ = [
    "ETHOS_U_KERNELS",
    "LITERT_KERNELS",
    "TFLITE_MICRO_KERNELS",
    "FullIntegerQuantizer",
    "Int8Kernels",
    "check_full_integer",
    "float_edges",
]

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
# Operators whose int8 kernels are lookup tables built from their input's and output's quantization (RSQRT is
# computed, not a table, in TFLite Micro): any two quantizations go. ELU is here for the targets that keep it
# (``_rewrite_for_int8`` decomposes it for the others).
_ONE_INPUT |= {_aten.rsqrt.default, _aten.elu.default}
_LOOKUP_TABLES = frozenset({_aten.exp.default, _aten.log.default})
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
    """A new constant (a buffer read by ``get_attr``) in the dtype of ``before``'s output, inserted before it. A
    single number takes the rank of that output (all ones): litert-torch's layout pass keeps an operator with a
    0-d operand in NCHW, and the TRANSPOSEs it then adds cut the NPU graph (and left a global MEAN reducing the
    channels, which vela refuses)."""
    result = before.meta["val"]
    index = 0
    while hasattr(model, f"_full_integer_constant_{index}"):
        index += 1
    name = f"_full_integer_constant_{index}"
    constant = torch.as_tensor(value, dtype=result.dtype)
    if constant.dim() == 0 and result.dim() > 0:
        constant = constant.reshape([1] * result.dim())
    model.register_buffer(name, constant)
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


def _rewrite_for_int8(model: GraphModule, *, kernels: Int8Kernels = LITERT_KERNELS) -> list[Rewrite]:
    """Divisions by a constant into multiplications by its reciprocal; ``c - x`` into ``sub(c, x)``; numbers in
    ADD/SUB/MUL into float constants (litert-torch's quantizer makes ``x + 1`` an int64 constant its observer
    rejects); activations without an annotation into the operators that have one (see the module), in the form the
    target's ``kernels`` run in int8. The rewrites that change what the model computes, with their counts."""
    approximated = 0
    for node in list(model.graph.nodes):
        if node.op != "call_function" or not _floating(node):
            continue
        if node.target is _aten.gelu.default and not kernels.gelu and isinstance(node.args[0], Node):
            exact = (node.kwargs.get("approximate") or (node.args[1] if len(node.args) > 1 else "none")) == "tanh"
            _decompose_gelu(model, node)
            approximated += not exact
            continue
        if node.target in _ELU_FAMILY and isinstance(node.args[0], Node):
            alpha, scale, input_scale = _elu_constants(node)
            if not (kernels.elu and (alpha, scale, input_scale) == (1.0, 1.0, 1.0)):
                _decompose_elu(model, node, alpha, scale, input_scale, native=kernels.elu)
            elif node.target is not _aten.elu.default:  # CELU(1), the same function as ELU
                node.target, node.args, node.kwargs = _aten.elu.default, (node.args[0],), {}
            continue
        if node.target is _aten.softplus.default and kernels.exp_log and isinstance(node.args[0], Node):
            # (without int8 EXP and LOG, softplus stays float, in the converter's form: SELECT becomes SELECT_V2)
            _decompose_softplus(model, node)
            continue
        if node.target is _aten.mish.default and isinstance(node.args[0], Node):
            _decompose_mish(model, node, kernels)
            continue
        if node.target is _aten.layer_norm.default and isinstance(node.args[0], Node):
            _decompose_layer_norm(model, node)
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


_SELU = (1.6732632423543772848170429916717, 1.0507009873554804934193349852946)
_ELU_FAMILY = frozenset({_aten.elu.default, _aten.selu.default, _aten.celu.default})


def _argument(node: Node, position: int, name: str, default: float) -> float:
    value: Any = node.args[position] if len(node.args) > position else node.kwargs.get(name, default)
    return float(value)


def _elu_constants(node: Node) -> tuple[float, float, float]:
    """ELU, SELU and CELU as one function, ``scale * (x if x > 0 else alpha * (exp(input_scale * x) - 1))``:
    its (alpha, scale, input_scale)."""
    if node.target is _aten.selu.default:
        return (*_SELU, 1.0)
    if node.target is _aten.celu.default:
        alpha = _argument(node, 1, "alpha", 1.0)
        return alpha, 1.0, 1.0 / alpha
    return (
        _argument(node, 1, "alpha", 1.0),
        _argument(node, 2, "scale", 1.0),
        _argument(node, 3, "input_scale", 1.0),
    )


def _decompose_elu(
    model: GraphModule, node: Node, alpha: float, scale: float, input_scale: float, *, native: bool
) -> None:
    """ELU that is not TFLite's ELU (alpha 1), or a target without an int8 ELU kernel (the Ethos-U NPU):
    ``r + alpha (exp(s (x - r)) - 1)``, ``r = relu(x)``, times ``scale``: the same function, from RELU, SUB, MUL,
    EXP (``native``: ELU, which is ``exp - 1`` where ``x - r`` lives, at or below 0) and ADD, which have int8
    kernels, and no SELECT (TFLite Micro has none). EXP sees only ``min(x, 0)``, in its own quantization: the
    lowering the converter makes requantized ELU's input to its output's range, clipping it at about -1."""
    mul, add, sub = _aten.mul.Tensor, _aten.add.Tensor, _aten.sub.Tensor
    steps: list[tuple[Any, tuple[Any, ...]]] = [(_aten.relu.default, (0,)), (sub, (0, 1))]  # 1: r, 2: min(x, 0)
    if input_scale != 1.0:
        steps.append((mul, (len(steps), input_scale)))
    if native:
        steps.append((_aten.elu.default, (len(steps),)))  # exp(m) - 1
    else:
        steps += [(_aten.exp.default, (len(steps),)), (add, (len(steps) + 1, -1.0))]
    if alpha != 1.0:
        steps.append((mul, (len(steps), alpha)))
    steps.append((add, (1, len(steps))))
    if scale != 1.0:
        steps.append((mul, (len(steps), scale)))
    _replace(model, node, steps)


def _decompose_softplus(model: GraphModule, node: Node) -> None:
    """``softplus(x) = r + log(1 + exp(x - 2r))``, ``r = relu(x)`` (``x - 2r = -|x|``), divided by ``beta`` on
    ``beta x``: the same function (torch's ``threshold`` returns ``x`` where the two differ by under 2e-9), and EXP
    sees ``-|x|``, whose ``exp`` int8 holds well (0 to 1), where the converter's form quantized ``exp(x)``."""
    beta = _argument(node, 1, "beta", 1.0)
    mul, add, sub = _aten.mul.Tensor, _aten.add.Tensor, _aten.sub.Tensor
    steps: list[tuple[Any, tuple[Any, ...]]] = [(mul, (0, beta))] if beta != 1.0 else []
    x = len(steps)
    steps += [(_aten.relu.default, (x,))]
    r = len(steps)
    steps += [(mul, (r, 2.0)), (sub, (x, r + 1)), (_aten.exp.default, (r + 2,)), (add, (r + 3, 1.0))]
    steps += [(_aten.log.default, (r + 4,)), (add, (r, r + 5))]
    if beta != 1.0:
        steps.append((mul, (len(steps), 1.0 / beta)))
    _replace(model, node, steps)


def _decompose_mish(model: GraphModule, node: Node, kernels: Int8Kernels) -> None:
    """``mish(x) = x tanh(softplus(x))``. With int8 EXP and LOG: softplus as ``_decompose_softplus``, then TANH
    and MUL. Without (TFLite Micro): ``tanh(softplus(x)) = s (2 - s) / (2 - 2s + s^2)``, ``s = sigmoid(x)`` (from
    ``1 + e^x = 1 / (1 - s)``), from LOGISTIC, MUL, SUB, ADD and DIV: the same function, every piece int8."""
    mul, add, sub = _aten.mul.Tensor, _aten.add.Tensor, _aten.sub.Tensor
    if kernels.exp_log:
        steps: list[tuple[Any, tuple[Any, ...]]] = [
            (_aten.relu.default, (0,)), (mul, (1, 2.0)), (sub, (0, 2)), (_aten.exp.default, (3,)),
            (add, (4, 1.0)), (_aten.log.default, (5,)), (add, (1, 6)),  # 7: softplus(x)
            (_aten.tanh.default, (7,)), (mul, (0, 8)),
        ]  # fmt: skip
    else:
        steps = [
            (_aten.sigmoid.default, (0,)), (sub, (2.0, 1)), (mul, (1, 2)),  # 3: s (2 - s)
            (mul, (1, 1)), (mul, (1, 2.0)), (sub, (4, 5)), (add, (6, 2.0)),  # 7: 2 - 2s + s^2
            (_aten.div.Tensor, (3, 7)), (mul, (0, 8)),
        ]  # fmt: skip
    _replace(model, node, steps)


def _decompose_layer_norm(model: GraphModule, node: Node) -> None:
    """``layer_norm`` as MEAN, SUB, MUL, MEAN, ADD, RSQRT, MUL (and MUL, ADD for its weight and bias), a mean over
    the last axis as a linear layer: every piece has an int8 kernel in LiteRT and TFLite Micro and an NPU form in
    vela; as one operator the converter left all of it float (42 of 60 operators of a small transformer, the NPU
    graph cut into 4)."""
    source = node.args[0]
    normalized: Any = node.args[1] if len(node.args) > 1 else node.kwargs["normalized_shape"]
    weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
    bias = node.args[3] if len(node.args) > 3 else node.kwargs.get("bias")
    eps = _argument(node, 4, "eps", 1e-5)
    dims = [-(i + 1) for i in range(len(list(normalized)))][::-1]
    graph = model.graph
    made: list[Node] = []

    def call(target: Any, *args: Any) -> Node:
        with graph.inserting_before(node):
            result = graph.call_function(target, args)
        made.append(result)
        return result

    channels = int(node.meta["val"].shape[-1])
    if len(dims) == 1:
        # the mean over the last axis as a linear layer of weights 1/C (exact in int8 per channel): vela maps a
        # FULLY_CONNECTED to the NPU, but not a MEAN over the channels of a 4-D tensor
        average = _constant(model, node, torch.full((1, channels), 1.0 / channels))
        mean = call(_aten.linear.default, source, average)
        centred = call(_aten.sub.Tensor, source, mean)
        squared = call(_aten.mul.Tensor, centred, centred)
        variance = call(_aten.linear.default, squared, average)
    else:
        mean = call(_aten.mean.dim, source, dims, True)
        centred = call(_aten.sub.Tensor, source, mean)
        squared = call(_aten.mul.Tensor, centred, centred)
        variance = call(_aten.mean.dim, squared, dims, True)
    shifted = call(_aten.add.Tensor, variance, _constant(model, node, eps))
    inverse = call(_aten.rsqrt.default, shifted)
    result = call(_aten.mul.Tensor, centred, inverse)
    if isinstance(weight, Node):
        result = call(_aten.mul.Tensor, result, weight)
    if isinstance(bias, Node):
        result = call(_aten.add.Tensor, result, bias)
    value = node.meta["val"]
    reduced = value.mean(dim=dims, keepdim=True)
    for item in made:
        shape = reduced if item in (mean, variance, shifted, inverse) else value
        item.meta = {**node.meta, "val": shape}
    node.replace_all_uses_with(result)
    graph.erase_node(node)


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


def _quantize_shared_fused_outputs(model: GraphModule, output: Any) -> None:
    """litert-torch's patterns fuse a convolution or linear layer with the ReLU after it: the layer's output is not
    quantized, the ReLU's is. When another operator also reads the layer's output (``relu(x)`` and ``x - relu(x)``
    in the forms above, a residual branch), that output must be quantized too, or the layer runs in float: it gets
    its own quantization, and the ReLU reads it like any other int8 input."""
    for node in model.graph.nodes:
        annotation = node.meta.get("quantization_annotation")
        if annotation is None or annotation.output_qspec is not None or not _floating(node) or len(node.users) < 2:
            continue
        if any(_op_name(user) in ("relu", "relu_", "hardtanh", "hardtanh_") for user in node.users):
            annotation.output_qspec = output


def _annotated(node: Node) -> bool:
    annotation = node.meta.get("quantization_annotation")
    return annotation is not None and bool(annotation._annotated)


class FullIntegerQuantizer(PT2EQuantizer):  # type: ignore[misc]  # litert-torch ships no type information
    """litert-torch's PT2E quantizer (symmetric per-channel weights, int8 activations) that also quantizes the
    element-wise arithmetic, SOFTMAX and LOG_SOFTMAX: see the module's docstring."""

    def __init__(
        self, *, kernels: Int8Kernels = LITERT_KERNELS, keep_float: tuple[str, ...] = (), int8_edges: bool = True
    ) -> None:
        super().__init__()
        self.set_global(get_symmetric_quantization_config(is_per_channel=True, is_dynamic=False))
        self.kernels = kernels
        """What the target runs in int8 (``Int8Kernels``): the form GELU, ELU and Mish take, and whether EXP and
        LOG are quantized."""
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
        self.rewrites = _rewrite_for_int8(model, kernels=self.kernels)
        return super().transform_for_annotation(model)

    def annotate(self, model: GraphModule) -> GraphModule:
        super().annotate(model)  # litert-torch's patterns first: they fuse a convolution with its ReLU, ...
        activation = self.global_config.input_activation
        _quantize_shared_fused_outputs(model, self.global_config.output_activation)
        one_input = _ONE_INPUT | _LOOKUP_TABLES if self.kernels.exp_log else _ONE_INPUT
        for node in model.graph.nodes:
            if node.op != "call_function" or _annotated(node) or not _floating(node):
                continue
            if node.target in _ELEMENTWISE or node.target is _aten.div.Tensor:  # DIV: int8 everywhere
                inputs = {arg: activation for arg in node.args[:2] if isinstance(arg, Node)}
                output = self.global_config.output_activation
            elif node.target in _FIXED_OUTPUT and isinstance(node.args[0], Node):
                inputs, output = {node.args[0]: activation}, _FIXED_OUTPUT[node.target]
            elif node.target in one_input and isinstance(node.args[0], Node):
                inputs, output = {node.args[0]: activation}, self.global_config.output_activation
            elif node.target is _aten.prelu.default and all(isinstance(arg, Node) for arg in node.args[:2]):
                # PRELU's int8 kernel takes its alpha in int8, quantized per tensor like an activation
                inputs = {node.args[0]: activation, node.args[1]: activation}
                output = self.global_config.output_activation
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
