"""Which nodes of a QDQ ONNX model compute on integers (``edgeline.export.backends.onnxruntime.quantized_nodes``):
a node between a DequantizeLinear and QuantizeLinears is fused into an integer kernel, even when its weights are
float (a layer left out of quantization between quantized neighbours, as mixed precision may leave one): ONNX
Runtime (1.32) quantizes such a convolution's weights itself and runs a QLinearConv. Built by hand, and the counts
checked against what ONNX Runtime itself runs (its optimized graph's node types): this fails when it stops doing so."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.quick


def _model(float_weights: bool) -> Any:
    """x -> Q -> DQ -> Conv(W) -> Q -> DQ -> y, W through a DequantizeLinear or a float initializer."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weights = rng.normal(size=(4, 3, 3, 3)).astype(np.float32)
    scale = numpy_helper.from_array(np.array(0.05, dtype=np.float32), "scale")
    zero = numpy_helper.from_array(np.array(0, dtype=np.int8), "zero")
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "scale", "zero"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "scale", "zero"], ["xd"]),
    ]
    initializers = [scale, zero]
    if float_weights:
        initializers.append(numpy_helper.from_array(weights, "w"))
    else:
        w_scale = float(np.abs(weights).max() / 127)
        initializers += [
            numpy_helper.from_array(np.round(weights / w_scale).astype(np.int8), "wq"),
            numpy_helper.from_array(np.array(w_scale, dtype=np.float32), "w_scale"),
        ]
        nodes.append(helper.make_node("DequantizeLinear", ["wq", "w_scale", "zero"], ["w"]))
    nodes += [
        helper.make_node("Conv", ["xd", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("QuantizeLinear", ["c", "scale", "zero"], ["cq"]),
        helper.make_node("DequantizeLinear", ["cq", "scale", "zero"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "qdq",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        initializers,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _runtime_kinds(model: Any, tmp_path: Path) -> set[str]:
    """The node types ONNX Runtime's CPU provider runs, from its optimized model."""
    import onnx
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return {node.op_type for node in onnx.load(str(tmp_path / "optimized.onnx")).graph.node}


@pytest.mark.parametrize("float_weights", [False, True], ids=["int8 weights", "float weights"])
def test_a_convolution_between_conversions_counts_as_integer_as_the_runtime_runs_it(
    float_weights: bool, tmp_path: Path
) -> None:
    from edgeline.export.backends.onnxruntime import quantized_nodes

    model = _model(float_weights)
    quantized, left_in_float = quantized_nodes(model.graph)
    assert [node.name for node in quantized] == ["conv"], [n.name for n in left_in_float]
    assert "QLinearConv" in _runtime_kinds(model, tmp_path)  # fused, its float weights quantized by the runtime
