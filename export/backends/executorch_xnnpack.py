"""ExecuTorch programs (.pte) delegated to XNNPACK; int8 through PT2E with the XNNPACK quantizer."""

from __future__ import annotations

from collections import Counter
from importlib.metadata import version
from typing import Any

from edgeline.device_profiles import Precision
from edgeline.export.backends import ExportedModel, ExportRequest
from edgeline.export.errors import ExportError
from edgeline.manifest import Placement, RuntimeRequirement

__all__ = ["XnnpackExporter"]

MODEL_FILE = "model.pte"


def _quantized(request: ExportRequest, *, dynamic: bool) -> Any:
    import torch
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    quantizer = XNNPACKQuantizer().set_global(
        get_symmetric_quantization_config(is_per_channel=True, is_dynamic=dynamic)
    )
    graph = torch.export.export(request.module, request.example_inputs).module()
    prepared = prepare_pt2e(graph, quantizer)
    with torch.no_grad():
        for sample in request.calibration if not dynamic else request.calibration[:1]:
            prepared(*sample)
    return convert_pt2e(prepared)


def _placement(graph_module: Any) -> Placement:
    from executorch.devtools.backend_debug import get_delegation_info

    info = get_delegation_info(graph_module)
    delegated: Counter[str] = Counter()
    other: Counter[str] = Counter()
    for op, breakdown in info.delegation_by_operator.items():
        if breakdown.delegated:
            delegated[op] += breakdown.delegated
        if breakdown.non_delegated:
            other[op] += breakdown.non_delegated
    return Placement(delegate="xnnpack", delegated=dict(delegated), not_delegated=dict(other))


class XnnpackExporter:
    name = "executorch-xnnpack"
    runtime_backend = "executorch"
    precisions = (Precision.FP32, Precision.INT8_DYNAMIC, Precision.INT8_STATIC)

    def export(self, request: ExportRequest) -> ExportedModel:
        import torch
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
        from executorch.exir import to_edge_transform_and_lower

        if request.precision not in self.precisions:
            valid = ", ".join(p.value for p in self.precisions)
            raise ExportError(f"executorch-xnnpack cannot export {request.precision.value}; valid: {valid}")
        module = request.module
        if request.precision is not Precision.FP32:
            module = _quantized(request, dynamic=request.precision is Precision.INT8_DYNAMIC)
        program = torch.export.export(module, request.example_inputs)
        edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])
        placement = _placement(edge.exported_program().graph_module)
        executorch_program = edge.to_executorch()
        (request.out_dir / MODEL_FILE).write_bytes(executorch_program.buffer)
        return ExportedModel(
            model_file=MODEL_FILE,
            runtime_backend=self.runtime_backend,
            runtime=RuntimeRequirement(package="executorch", min_version=version("executorch")),
            input_names=request.input_names,
            placement=placement,
            tool_versions={"executorch": version("executorch"), "torch": version("torch")},
        )
