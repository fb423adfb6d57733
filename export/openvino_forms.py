"""Rewrites of the OpenVINO IR the PyTorch frontend makes, before NNCF quantizes it, each computing the same function
in a form the CPU plugin computes in int8: PReLU as OpenVINO's PRelu, a post-op of the int8 layer before it
(``restore_prelu``), and a LayerNorm as an MVN the plugin runs in int8 with its weight, bias, activation and
requantization fused (``row_layer_norms``). Each keeps the names the placement and the layer report tie to modules.
Used by ``edgeline.export.backends.openvino``."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["restore_prelu", "row_layer_norms"]


def restore_prelu(model: Any) -> int:
    """Each PReLU as torch.export decomposes it (``where(x > 0, x, weight * x)``: Greater, Multiply, Select) made
    OpenVINO's PRelu again, in place; how many. OpenVINO's PyTorch frontend decomposes the program with torch's
    default table (and has no translator for ``aten.prelu`` on an FX graph), so a program that kept ``aten.prelu``
    would reach the IR decomposed all the same; the CPU plugin runs the Select form as a float Snippets kernel
    between int8 layers, and PRelu as a post-op of the int8 convolution or fully connected layer before it. Only the
    exact form is taken: the comparison with a constant 0, the same tensor selected and scaled, a constant slope per
    channel (axis 1) or one for all; the PRelu keeps the Select's name, the torch.export node's, with its type."""
    import openvino.opset13 as ops

    found = 0
    for op in model.get_ordered_ops():
        if op.get_type_name() != "Select":
            continue
        slope = _prelu_slope(op)
        if slope is None:
            continue
        prelu = ops.prelu(op.input(1).get_source_output(), ops.constant(slope))
        prelu.set_friendly_name(op.get_friendly_name().rpartition("/")[0] + "/PRelu")
        op.output(0).replace(prelu.output(0))
        found += 1
    if found:
        model.validate_nodes_and_infer_types()
    return found


_POST_OP_ACTIVATIONS = frozenset(
    {"Relu", "Clamp", "Gelu", "Elu", "Sigmoid", "Tanh", "Swish", "HSwish", "HSigmoid", "Mish", "SoftPlus", "Abs"}
)
"""One-input activations the CPU plugin's MVN computes as a post-op (its ``isUnaryEltwise``)."""
_MOVING = frozenset({"Reshape", "Transpose", "Squeeze", "Unsqueeze"})
"""IR operators that only move values: an element-wise activation after them computes the same before them."""


def row_layer_norms(model: Any) -> int:
    """Each layer norm the CPU plugin would not run as an int8 MVN with its requantization made one it runs so, in
    place; how many.
    torch's LayerNorm is an MVN over the array's last axes (OpenVINO's frontend makes ``aten.native_layer_norm`` an
    MVN, its weight's Multiply and its bias's Add). The plugin's MVN takes the axes of a 4-D array only as [2, 3] or
    [1, 2, 3] (``MVN::isSupportedOperation``): over the last axis of the NHWC array of a permuted LayerNorm (ConvNeXt's
    channel norm) it decomposes it (``MVN6Decomposition``) into a ReduceMean and Subtract it computes in int8 and an
    RMS and Add it computes in float; over the features of a 2-D array it runs the MVN in int8 but fuses no
    requantization into it (``MVN::canFuse``), which it then computes alone in float; over the last axis of a 3-D
    array (a transformer's [batch, tokens, features]) it runs the MVN in int8, but its post-ops are per channel (axis
    1, the tokens), so the weight and bias along the features run apart, a float Multiply and Add (a two-block
    ViT-like digits model: 49 of 59 operators int8 before, 55 of 60 after). As a [rows, features, 1] array
    normalised over axes [1, 2] (every row over its features: the same numbers) the plugin computes the MVN in int8
    with the weight and bias as its per-channel post-ops, and the requantization NNCF puts after the activation that
    follows, once that activation is moved next to it, before the reshape back and the permute (an element-wise
    function computes the same before or after operators that only move values). The reshape back is named after
    the value it gives back (the activation's or the layer norm's), which the layer report reads in the model's
    layout. Only the exact form is taken: an MVN over an array's last axes, static shapes, a weight and bias
    constant along the axes it does not normalise; every other MVN (instance and group norms over [2, 3], whose
    weights are per channel) is left as it is, as is one the plugin already runs with its weight and bias fused."""
    import openvino.opset13 as ops

    found = 0
    for mvn in model.get_ordered_ops():
        if mvn.get_type_name() != "MVN" or mvn.get_input_size() != 2:
            continue
        shape, first = _last_axes(mvn)
        if shape is None:
            continue
        affine = _layer_norm_affine(mvn, shape, first)
        if _mvn_runs_as_is(len(shape), first) and all(_per_channel(values, shape, first) for _, _, values in affine):
            continue
        rows, features = int(np.prod(shape[:first], dtype=np.int64)), int(np.prod(shape[first:], dtype=np.int64))
        prefix = mvn.get_friendly_name().rpartition("/")[0]
        tail = affine[-1][0] if affine else mvn
        moved, activation = _activation_after(tail)
        readers = list((activation if activation is not None else tail).output(0).get_target_inputs())
        as_rows = ops.constant(np.array([rows, features, 1], np.int64))
        rows_in = ops.reshape(mvn.input(0).get_source_output(), as_rows, False)
        rows_in.set_friendly_name(f"{prefix}/Reshape")
        mvn.input(0).replace_source_output(rows_in.output(0))
        mvn.input(1).replace_source_output(ops.constant(np.array([1, 2], np.int64)).output(0))
        for op, index, values in affine:
            op.input(index).replace_source_output(ops.constant(values.reshape(1, features, 1)).output(0))
        if activation is not None:
            activation.input(0).replace_source_output(tail.output(0))
            tail, prefix = activation, activation.get_friendly_name().rpartition("/")[0]
        back = ops.reshape(tail.output(0), ops.constant(np.array(shape, np.int64)), False)
        back.set_friendly_name(f"{prefix}/Reshape_back")
        if activation is not None and moved:
            moved[0].input(0).replace_source_output(back.output(0))
            back = moved[-1]
        for reader in readers:
            reader.replace_source_output(back.output(0))
        found += 1
    if found:
        model.validate_nodes_and_infer_types()
    return found


def _last_axes(mvn: Any) -> tuple[list[int] | None, int]:
    """(the static shape an MVN normalises, the first of its axes) where its axes are the array's last ones; (None,
    0) otherwise."""
    pshape = mvn.input(0).get_partial_shape()
    axes = _constant(mvn.input(1).get_source_output())
    if pshape.is_dynamic or axes is None or axes.size == 0:
        return None, 0
    shape = [int(d) for d in pshape.to_shape()]
    normalised = sorted({int(axis) % len(shape) for axis in axes.reshape(-1)}) if shape else []
    if not normalised or normalised != list(range(normalised[0], len(shape))):
        return None, 0
    return shape, normalised[0]


def _mvn_runs_as_is(rank: int, first: int) -> bool:
    """Whether the CPU plugin runs an MVN over axes ``first``.. of a ``rank``-D array as an MVN with post-ops
    (``MVN::isSupportedOperation``: 1-D over [0]; 3-D to 5-D over all axes but the first one or two; 2-D over [1] is
    supported, but fuses no requantization)."""
    return rank == 1 or (3 <= rank <= 5 and first in (1, 2))


def _per_channel(values: np.ndarray, shape: list[int], first: int) -> bool:
    """Whether a layer norm's weight or bias (over the normalised axes ``first``.., flattened) varies along axis 1 at
    most: what the plugin fuses into an MVN as a per-channel post-op."""
    spread = values.reshape(shape[first:])
    along = tuple(range(max(0, 2 - first), spread.ndim))  # the normalised axes from axis 2 on
    return not along or bool(np.all(np.ptp(spread, axis=along) == 0))


def _layer_norm_affine(mvn: Any, shape: list[int], first: int) -> list[tuple[Any, int, np.ndarray]]:
    """The weight's Multiply and the bias's Add after an MVN, as far as they are the layer norm's: (operator, the
    input its constant is on, the constant over the normalised axes, flattened)."""
    found: list[tuple[Any, int, np.ndarray]] = []
    node = mvn
    dtype = mvn.get_output_element_type(0).to_dtype()
    for kind in ("Multiply", "Add"):
        readers = list(node.output(0).get_target_inputs())
        if len(readers) != 1 or readers[0].get_node().get_type_name() != kind:
            break
        op, index = readers[0].get_node(), 1 - readers[0].get_index()
        values = _constant(op.input(index).get_source_output())
        if values is None or values.dtype != dtype or values.ndim > len(shape):
            break
        aligned = values.reshape((1,) * (len(shape) - values.ndim) + values.shape)
        if aligned.shape[:first] != (1,) * first:
            break
        try:
            spread = np.broadcast_to(aligned, (1,) * first + tuple(shape[first:]))
        except ValueError:
            break
        found.append((op, index, np.ascontiguousarray(spread).reshape(-1)))
        node = op
    return found


def _activation_after(node: Any) -> tuple[list[Any], Any | None]:
    """(the operators that only move values between ``node`` and the activation after them, that activation), each
    the only reader of the one before; ([], None) where no such activation follows."""
    moved: list[Any] = []
    while True:
        readers = list(node.output(0).get_target_inputs())
        if len(readers) != 1:
            return [], None
        reader = readers[0].get_node()
        if reader.get_type_name() in _MOVING and readers[0].get_index() == 0 and reader.get_output_size() == 1:
            moved.append(reader)
            node = reader
            continue
        if reader.get_type_name() in _POST_OP_ACTIVATIONS and reader.get_input_size() == 1:
            return moved, reader
        return [], None


def _constant(output: Any) -> np.ndarray | None:
    node = output.get_node()
    return np.asarray(node.get_data()) if node.get_type_name() == "Constant" else None


def _prelu_slope(select: Any) -> np.ndarray | None:
    """The slope, as PRelu takes it (one value, or one per channel), of a Select computing
    ``where(x > 0, x, slope * x)``; None if it computes anything else."""
    condition, chosen, other = (select.input(i).get_source_output() for i in range(3))
    greater, scaled = condition.get_node(), other.get_node()
    if greater.get_type_name() != "Greater" or scaled.get_type_name() != "Multiply":
        return None
    x = greater.input(0).get_source_output()
    zero = _constant(greater.input(1).get_source_output())
    if chosen != x or zero is None or zero.size != 1 or zero.reshape(-1)[0] != 0:
        return None
    factors = [scaled.input(i).get_source_output() for i in range(2)]
    if x not in factors:
        return None
    slope = _constant(factors[1] if factors[0] == x else factors[0])
    shape = x.get_partial_shape()
    if slope is None or shape.is_dynamic or slope.dtype != x.get_element_type().to_dtype():
        return None
    dims = [int(d) for d in shape.to_shape()]
    if slope.size == 1:
        return slope.reshape(1)
    aligned = (1,) * (len(dims) - slope.ndim) + slope.shape  # numpy's broadcast: trailing axes line up
    if len(dims) < 2 or len(aligned) != len(dims) or aligned[1] != dims[1] or slope.size != dims[1]:
        return None
    return slope.reshape(-1)
