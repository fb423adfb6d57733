"""Graph rewrites before ExecuTorch's XNNPACK quantizer and partitioner, each computing the same function in a
form XNNPACK takes: the 1-D pools it has no kernel for as the 2-D ones it has (``xnnpack_pools``), and for int8 the
activations and LayerNorm its quantizer does not annotate in forms it annotates (``xnnpack_int8_forms``). Each new
node keeps the module and source line of the one it replaces.
Used by ``edgeline.export.backends.executorch_xnnpack``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

__all__ = ["xnnpack_int8_forms", "xnnpack_pools"]


def xnnpack_pools(graph: Any) -> int:
    """Rewrites, in place, the 1-D pools of a torch.export graph (``program.module()``) that XNNPACK has no kernel
    for as the 2-D ones it has, on an axis of one: ``max_pool1d`` as ``max_pool2d`` with a 1 x k window, a global
    average pool (``adaptive_avg_pool1d`` to one, a ``mean`` over the last axis) as ``mean`` over the last two axes
    (XNNPACK's global average pool), each between two reshapes. The same values, computed by XNNPACK in fp32 and
    int8 (its quantizer shares the pools' scale with their input) instead of by ExecuTorch's portable kernels; each
    new node keeps the metadata of the node it replaces (its module, source line and origin, which the layer report
    and the placement read). Only 3-D inputs of static shape. Returns how many it rewrote."""
    import torch

    aten = torch.ops.aten

    def as_2d(node: Any) -> Any:
        source = node.args[0]
        value = source.meta.get("val")
        shape = tuple(getattr(value, "shape", ()))
        if len(shape) != 3 or not all(isinstance(d, int) for d in shape):
            return None
        batch, channels, length = shape
        pool: tuple[Any, tuple[Any, ...]]
        if node.target == aten.max_pool1d.default and 2 <= len(node.args) <= 6 and not node.kwargs:
            given = list(node.args[1:])
            kernel, stride, padding, dilation, ceil = given + [[], [0], [1], False][len(given) - 1 :]
            stride = stride or kernel
            pool = aten.max_pool2d.default, ([1, *kernel], [1, *stride], [0, *padding], [1, *dilation], ceil)
        elif _global_average(node, aten):
            pool = aten.mean.dim, ([2, 3], True)
        else:
            return None
        out = node.meta.get("val")
        if out is None:
            return None
        current = _like(graph, node, aten.reshape.default, (source, [batch, channels, 1, length]))
        current = _like(graph, node, pool[0], (current, *pool[1]))
        return _like(graph, node, aten.reshape.default, (current, list(out.shape)))

    return _rewrite(graph, as_2d)


def _rewrite(graph: Any, replacement: Callable[[Any], Any]) -> int:
    """Each operator of ``graph`` whose first argument is a node, replaced by what ``replacement`` builds for it
    (inserted before it; None: left as it is); the graph checked and recompiled. How many were replaced."""
    import torch

    rewritten = 0
    for node in list(graph.graph.nodes):
        if node.op != "call_function" or not node.args or not isinstance(node.args[0], torch.fx.Node):
            continue
        with graph.graph.inserting_before(node):
            made = replacement(node)
        if made is None:
            continue
        node.replace_all_uses_with(made)
        graph.graph.erase_node(node)
        rewritten += 1
    if rewritten:
        graph.graph.lint()
        graph.recompile()
    return rewritten


def _global_average(node: Any, aten: Any) -> bool:
    """``adaptive_avg_pool1d`` to one, or ``mean`` over the last axis of a 3-D tensor (without a dtype)."""
    if node.target == aten.adaptive_avg_pool1d.default:
        return list(node.args[1]) == [1]
    axes = node.args[1] if len(node.args) > 1 else None
    return bool(
        node.target == aten.mean.dim
        and not node.kwargs.get("dtype")
        and isinstance(axes, list | tuple)
        and [int(axis) % 3 for axis in axes] == [2]
    )


def _like(graph: Any, original: Any, target: Any, arguments: tuple[Any, ...]) -> Any:
    """A new node computing ``target`` on ``arguments`` with ``original``'s metadata, its value's shape worked out on
    the graph's fake tensors."""
    import torch

    node = graph.graph.call_function(target, arguments)
    node.meta.update({key: value for key, value in original.meta.items() if key not in ("val", "tensor_meta")})
    values = tuple(a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in arguments)
    mode = getattr(values[0], "fake_mode", None)  # torch.export's values are fake tensors of one mode
    with mode if mode is not None else contextlib.nullcontext():
        node.meta["val"] = target(*values)
    return node


# -- int8 forms: what XNNPACK's quantizer annotates and its partitioner takes in int8 ---------------------------------

_SELU = (1.6732632423543772848170429916717, 1.0507009873554804934193349852946)


def xnnpack_int8_forms(graph: Any, *, elu: bool = True) -> int:
    """Rewrites, in place, the operators of a torch.export graph (``program.module()``) that XNNPACK's quantizer does
    not annotate, or its partitioner does not take, into the same function from operators it annotates (ADD, MUL,
    linear) or that read and write the int8 tensors their neighbours' annotations make (RELU, SUB, ELU):

    - PReLU as ``r + alpha (x - r)``, ``r = relu(x)``, alpha broadcast per channel (the partitioner's PReLU is fp32
      only, and its channels-last pass failed on the prelu of an int8 graph);
    - ELU, SELU and CELU as XNNPACK's ELU of an explicit alpha (its node ignores ``scale`` and ``input_scale``) between
      multiplications: ``scale / s * elu(s x, alpha s)``, ``s = input_scale`` (only where the ELU config is there:
      ``partitioner_configs``);
    - Softplus as ``r + log(1 + exp(x - 2r))`` (``x - 2r = -|x|``: EXP sees 0 to 1), divided by ``beta`` on ``beta x``;
      Mish as ``x tanh(softplus(x))``. No SELECT (torch's own decomposition, which XNNPACK does not take); EXP, LOG and
      TANH run in fp32 inside XNNPACK, between conversions, the rest in int8;
    - LayerNorm over the last axis: its means as a linear layer of weights -1/C and 1/C (int8 per channel, exact),
      ``d = x + mean'``, ``d * rsqrt(mean(d * d) + eps)`` (eps the linear layer's bias), then its weight and bias;
    - SiLU as ``x * sigmoid(x)`` (ExecuTorch decomposes it so after quantization: its MUL stayed float);
    - a division by a number as a multiplication by its reciprocal (XNNPACK's DIV is fp32 only), a subtraction of a
      number as the addition of its opposite (the quantizer annotates ADD, not SUB: ``(x - mean) / std`` in a
      forward() stayed float).

    Each new node keeps the metadata of the node it replaces (its module, source line and origin). Returns how many
    operators it rewrote."""
    return _rewrite(graph, lambda node: _int8_form(graph, node, elu) if _floating(node) else None)


def _int8_form(graph: Any, node: Any, elu: bool) -> Any:
    """The last node of ``node``'s form (inserted before it), or None where it keeps its own."""
    import torch

    aten = torch.ops.aten
    if node.target == aten.prelu.default:
        made = _prelu(graph, node)
    elif node.target in (aten.elu.default, aten.selu.default, aten.celu.default) and elu:
        made = _elu(graph, node)
    elif node.target == aten.softplus.default:
        made = _softplus(graph, node, node.args[0])
    elif node.target == aten.mish.default:
        tanh = _like(graph, node, aten.tanh.default, (_softplus(graph, node, node.args[0]),))
        made = _like(graph, node, aten.mul.Tensor, (node.args[0], tanh))
    elif node.target == aten.layer_norm.default:
        made = _layer_norm(graph, node)
    elif node.target == aten.silu.default and len(node.args) == 1 and not node.kwargs:
        made = _like(graph, node, aten.mul.Tensor, (node.args[0], _like(graph, node, aten.sigmoid.default, node.args)))
    elif node.target == aten.div.Tensor and len(node.args) == 2 and not node.kwargs and _number(node.args[1]):
        made = None if node.args[1] == 0 else _like(graph, node, aten.mul.Tensor, (node.args[0], 1 / node.args[1]))
    elif node.target == aten.sub.Tensor and len(node.args) == 2 and not node.kwargs and _number(node.args[1]):
        made = _like(graph, node, aten.add.Tensor, (node.args[0], -node.args[1]))
    else:
        made = None
    return made


def _floating(node: Any) -> bool:
    value = node.meta.get("val")
    return value is not None and getattr(value, "dtype", None) is not None and value.dtype.is_floating_point


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _argument(node: Any, position: int, name: str, default: float) -> float:
    value = node.args[position] if len(node.args) > position else node.kwargs.get(name, default)
    return float(value)


def _prelu(graph: Any, node: Any) -> Any:
    """``r + alpha (x - r)``, ``r = relu(x)``: alpha a constant of the input's rank, its channels on axis 1."""
    import torch

    aten = torch.ops.aten
    source, weight = node.args[0], node.args[1]
    alpha = _attribute(graph, weight)
    shape = tuple(node.meta["val"].shape)
    if alpha is None or len(shape) < 1:
        return None
    axes = [1] * len(shape)
    if alpha.numel() > 1:
        if len(shape) < 2 or shape[1] != alpha.numel():
            return None
        axes[1] = alpha.numel()
    constant = _constant(graph, node, alpha.detach().reshape(axes))
    relu = _like(graph, node, aten.relu.default, (source,))
    negative = _like(graph, node, aten.sub.Tensor, (source, relu))
    return _like(graph, node, aten.add.Tensor, (relu, _like(graph, node, aten.mul.Tensor, (negative, constant))))


def _elu(graph: Any, node: Any) -> Any:
    """``scale * (x if x > 0 else alpha (exp(s x) - 1))`` (SELU's and CELU's constants too) as
    ``scale / s * elu(s x, alpha s)``; None for an ELU XNNPACK's node already computes (an explicit alpha)."""
    import torch

    aten = torch.ops.aten
    if node.target == aten.selu.default:
        alpha, scale, input_scale = (*_SELU, 1.0)
    elif node.target == aten.celu.default:
        alpha = _argument(node, 1, "alpha", 1.0)
        alpha, scale, input_scale = alpha, 1.0, 1.0 / alpha
    else:
        alpha = _argument(node, 1, "alpha", 1.0)
        scale, input_scale = _argument(node, 2, "scale", 1.0), _argument(node, 3, "input_scale", 1.0)
        if len(node.args) == 2 and not node.kwargs:
            return None
    current = node.args[0]
    if input_scale != 1.0:
        current = _like(graph, node, aten.mul.Tensor, (current, input_scale))
    current = _like(graph, node, aten.elu.default, (current, alpha * input_scale))
    if scale / input_scale != 1.0:
        current = _like(graph, node, aten.mul.Tensor, (current, scale / input_scale))
    return current


def _softplus(graph: Any, node: Any, source: Any) -> Any:
    """``r + log(1 + exp(x - 2r))``, ``r = relu(x)``, on ``beta x`` and divided by ``beta`` (torch's ``threshold``
    returns ``x`` where the two differ by under 2e-9): ``x - 2r`` as ``x + (-2) r``, ADD and MUL being what the
    quantizer annotates (a SUB into EXP would stay float)."""
    import torch

    aten = torch.ops.aten
    beta = _argument(node, 1, "beta", 1.0) if node.target == aten.softplus.default else 1.0
    x = source if beta == 1.0 else _like(graph, node, aten.mul.Tensor, (source, beta))
    relu = _like(graph, node, aten.relu.default, (x,))
    negative = _like(graph, node, aten.add.Tensor, (x, _like(graph, node, aten.mul.Tensor, (relu, -2.0))))
    exp = _like(graph, node, aten.exp.default, (negative,))
    log = _like(graph, node, aten.log.default, (_like(graph, node, aten.add.Tensor, (exp, 1.0)),))
    result = _like(graph, node, aten.add.Tensor, (relu, log))
    return result if beta == 1.0 else _like(graph, node, aten.mul.Tensor, (result, 1.0 / beta))


def _layer_norm(graph: Any, node: Any) -> Any:
    """LayerNorm over the last axis (None over more): see ``xnnpack_int8_forms``."""
    import torch

    aten = torch.ops.aten
    source = node.args[0]
    normalized = node.args[1] if len(node.args) > 1 else node.kwargs.get("normalized_shape")
    weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
    bias = node.args[3] if len(node.args) > 3 else node.kwargs.get("bias")
    eps = _argument(node, 4, "eps", 1e-5)
    shape = tuple(node.meta["val"].shape)
    if normalized is None or len(list(normalized)) != 1 or not shape or not isinstance(shape[-1], int):
        return None
    channels = shape[-1]
    dtype = node.meta["val"].dtype
    negative_mean = _constant(graph, node, torch.full((1, channels), -1.0 / channels, dtype=dtype))
    average = _constant(graph, node, torch.full((1, channels), 1.0 / channels, dtype=dtype))
    epsilon = _constant(graph, node, torch.full((1,), eps, dtype=dtype))
    centred = _like(
        graph, node, aten.add.Tensor, (source, _like(graph, node, aten.linear.default, (source, negative_mean)))
    )
    squared = _like(graph, node, aten.mul.Tensor, (centred, centred))
    variance = _like(graph, node, aten.linear.default, (squared, average, epsilon))
    result = _like(graph, node, aten.mul.Tensor, (centred, _like(graph, node, aten.rsqrt.default, (variance,))))
    if isinstance(weight, torch.fx.Node):
        result = _like(graph, node, aten.mul.Tensor, (result, weight))
    if isinstance(bias, torch.fx.Node):
        result = _like(graph, node, aten.add.Tensor, (result, bias))
    return result


def _attribute(graph: Any, node: Any) -> Any:
    """The tensor a ``get_attr`` node reads (None for any other node)."""
    import torch

    if not isinstance(node, torch.fx.Node) or node.op != "get_attr":
        return None
    value: Any = graph
    for part in str(node.target).split("."):
        value = getattr(value, part, None)
    return value if isinstance(value, torch.Tensor) else None


def _constant(graph: Any, original: Any, value: Any) -> Any:
    """A new constant (a buffer read by ``get_attr``) inserted before ``original``, its fake value in the graph's
    fake mode."""
    index = 0
    while hasattr(graph, f"_xnnpack_constant_{index}"):
        index += 1
    name = f"_xnnpack_constant_{index}"
    graph.register_buffer(name, value)
    with graph.graph.inserting_before(original):
        node = graph.graph.get_attr(name)
    mode = getattr(original.meta.get("val"), "fake_mode", None)
    node.meta["val"] = mode.from_tensor(value, static_shapes=True) if mode is not None else value
    return node
