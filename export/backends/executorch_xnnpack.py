"""ExecuTorch programs (.pte) delegated to XNNPACK; int8 through PT2E with the XNNPACK quantizer. The 1-D pools
XNNPACK has no kernel for are expressed as the 2-D ones it has first (``xnnpack_pools``), so they run on it too."""

from __future__ import annotations

import contextlib
from importlib.metadata import version
from typing import Any

from edgeline.device_profiles import Precision
from edgeline.export.backends import ExportedModel, ExportRequest, ExportTarget
from edgeline.export.errors import ExportError
from edgeline.export.graph import module_path
from edgeline.export.layer_probes import LayerProbe, LayerReading, pt2e_layers
from edgeline.export.placement import executorch_placement
from edgeline.manifest import RuntimeRequirement

__all__ = ["XnnpackExporter", "quantized_module", "xnnpack_pools"]

MODEL_FILE = "model.pte"


def _quantized(request: ExportRequest, *, dynamic: bool) -> Any:
    return quantized_module(
        request.module, request.example_inputs, request.calibration, dynamic=dynamic, keep_float=request.keep_float
    )


def quantized_module(
    module: Any, example_inputs: tuple[Any, ...], calibration: Any, *, dynamic: bool, keep_float: tuple[str, ...] = ()
) -> Any:
    """The PT2E-quantized graph (XNNPACK's quantizer, per-channel symmetric weights) this exporter lowers: also what
    ``edgeline.export.layers`` compares layer by layer. ``keep_float``: module paths left in float, through the
    quantizer's public filter (its ``set_module_name`` refuses a None config)."""
    import torch
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    quantizer = XNNPACKQuantizer().set_global(
        get_symmetric_quantization_config(is_per_channel=True, is_dynamic=dynamic)
    )
    if keep_float:

        def quantized(node: Any) -> bool:
            path = module_path(node)
            return path is None or not any(path == kept or path.startswith(kept + ".") for kept in keep_float)

        quantizer.set_filter_function(quantized)
    graph = torch.export.export(module, example_inputs).module()
    xnnpack_pools(graph)
    prepared = prepare_pt2e(graph, quantizer)
    with torch.no_grad():
        for sample in calibration if not dynamic else calibration[:1]:
            prepared(*sample)
    return convert_pt2e(prepared)


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
    rewritten = 0
    for node in list(graph.graph.nodes):
        if node.op != "call_function" or not node.args or not isinstance(node.args[0], torch.fx.Node):
            continue
        source = node.args[0]
        value = source.meta.get("val")
        shape = tuple(getattr(value, "shape", ()))
        if len(shape) != 3 or not all(isinstance(d, int) for d in shape):
            continue
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
            continue
        out = node.meta.get("val")
        if out is None:
            continue
        with graph.graph.inserting_before(node):
            current = _like(graph, node, aten.reshape.default, (source, [batch, channels, 1, length]))
            current = _like(graph, node, pool[0], (current, *pool[1]))
            current = _like(graph, node, aten.reshape.default, (current, list(out.shape)))
        node.replace_all_uses_with(current)
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


class XnnpackExporter(ExportTarget):
    name = "executorch-xnnpack"
    runtime_backend = "executorch"
    accelerator = "xnnpack"  # the ExecuTorch delegate its program is lowered to
    precisions = (Precision.FP32, Precision.INT8_DYNAMIC, Precision.INT8_STATIC)
    keeps_float = True  # the XNNPACK quantizer's filter function

    def layer_probe(self, reading: LayerReading) -> LayerProbe | None:
        """The PT2E graph the ``.pte`` was lowered from, read with torchao's numeric debugger: the export's own
        (``reading.quantized_graph``), else quantized again on the calibration samples (the same graph: the quantizer
        is deterministic); none without either."""
        if reading.quantized_graph is not None:
            return pt2e_layers(reading, reading.quantized_graph)
        if reading.calibration is None:
            return None
        import torch

        calibration = reading.calibration
        tensors = [tuple(torch.from_numpy(a) for a in calibration.sample(i)) for i in range(len(calibration))]
        converted = quantized_module(
            reading.module, tensors[0], tensors, dynamic=reading.dynamic, keep_float=reading.keep_float
        )
        return pt2e_layers(reading, converted)

    def export(self, request: ExportRequest) -> ExportedModel:
        import torch
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
        from executorch.exir import to_edge_transform_and_lower

        if request.precision not in self.precisions:
            valid = ", ".join(p.value for p in self.precisions)
            raise ExportError(f"executorch-xnnpack cannot export {request.precision.value}; valid: {valid}")
        quantized = None
        if request.precision is not Precision.FP32:
            quantized = _quantized(request, dynamic=request.precision is Precision.INT8_DYNAMIC)
        if quantized is None:
            program = torch.export.export(request.module, request.example_inputs)
            graph = program.module()
            if xnnpack_pools(graph):  # the 1-D pools as 2-D ones: traced again from the rewritten graph
                program = torch.export.export(graph, request.example_inputs)
        else:
            program = torch.export.export(quantized, request.example_inputs)
        edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])
        placement = executorch_placement(edge.exported_program().graph_module, request.precision, self.accelerator)
        executorch_program = edge.to_executorch()
        (request.out_dir / MODEL_FILE).write_bytes(executorch_program.buffer)
        return ExportedModel(
            model_file=MODEL_FILE,
            runtime_backend=self.runtime_backend,
            runtime=RuntimeRequirement(package="executorch", min_version=version("executorch")),
            input_names=request.input_names,
            placement=placement,
            tool_versions={"executorch": version("executorch"), "torch": version("torch")},
            quantized_graph=quantized,  # what the layer probe reads: the export's, not quantized a second time
        )
