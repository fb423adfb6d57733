"""ExecuTorch programs (.pte) delegated to XNNPACK; int8 through PT2E with the XNNPACK quantizer."""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

from edgeline.device_profiles import Precision
from edgeline.export.backends import ExportedModel, ExportRequest, ExportTarget
from edgeline.export.errors import ExportError
from edgeline.export.graph import module_path
from edgeline.export.layer_probes import LayerProbe, LayerReading, pt2e_layers
from edgeline.export.placement import executorch_placement
from edgeline.manifest import RuntimeRequirement

__all__ = ["XnnpackExporter", "quantized_module"]

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
    prepared = prepare_pt2e(graph, quantizer)
    with torch.no_grad():
        for sample in calibration if not dynamic else calibration[:1]:
            prepared(*sample)
    return convert_pt2e(prepared)


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
        program = torch.export.export(request.module if quantized is None else quantized, request.example_inputs)
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
