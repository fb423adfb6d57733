"""ExecuTorch programs (.pte) whose supported parts are lowered to Core ML by ExecuTorch's CoreMLPartitioner.

The delegated parts are Core ML programs compiled for the profile's compute units and deployment target; the rest
runs on ExecuTorch's portable CPU kernels. Only ExecuTorch built for Apple's OSes has the Core ML delegate, so nothing
here can run the program: the fidelity check is left to a device, and the manifest says so.
"""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

from edgeline.backends.executorch import program_specs
from edgeline.device_profiles import Precision
from edgeline.device_profiles.schema import CoreML
from edgeline.export.backends import ExportedModel, ExportRequest, ExportTarget, Verification
from edgeline.export.errors import ExportError
from edgeline.export.placement import executorch_placement
from edgeline.manifest import RuntimeRequirement

__all__ = ["NOT_HERE", "ExecuTorchCoreMLExporter"]

MODEL_FILE = "model.pte"
NOT_HERE = "the Core ML delegate runs on Apple devices only"


def _compile_specs(settings: CoreML, precision: Precision) -> list[Any]:
    import coremltools as ct
    from executorch.backends.apple.coreml.compiler import CoreMLBackend

    return list(
        CoreMLBackend.generate_compile_specs(
            compute_unit=ct.ComputeUnit[settings.compute_units],
            minimum_deployment_target=ct.target[settings.minimum_deployment_target],
            compute_precision=ct.precision.FLOAT16 if precision is Precision.FP16 else ct.precision.FLOAT32,
        )
    )


class ExecuTorchCoreMLExporter(ExportTarget):
    name = "executorch-coreml"
    runtime_backend = "executorch"
    accelerator = "coreml"  # the ExecuTorch delegate its program is lowered to
    precisions = (Precision.FP16, Precision.FP32)

    def export(self, request: ExportRequest) -> ExportedModel:
        import torch
        from executorch.backends.apple.coreml.partition import CoreMLPartitioner
        from executorch.exir import to_edge_transform_and_lower

        if request.precision not in self.precisions:
            valid = ", ".join(p.value for p in self.precisions)
            raise ExportError(f"executorch-coreml cannot export {request.precision.value}; valid: {valid}")
        settings = request.profile_section("coreml", "executorch-coreml", "compute_units and minimum_deployment_target")
        partitioner = CoreMLPartitioner(compile_specs=_compile_specs(settings, request.precision))
        program = torch.export.export(request.module, request.example_inputs)
        edge = to_edge_transform_and_lower(program, partitioner=[partitioner])
        placement = executorch_placement(edge.exported_program().graph_module, request.precision, self.accelerator)
        (request.out_dir / MODEL_FILE).write_bytes(edge.to_executorch().buffer)
        inputs, outputs = program_specs(request.out_dir / MODEL_FILE, request.input_names)  # read from the file
        return ExportedModel(
            model_file=MODEL_FILE,
            runtime_backend=self.runtime_backend,
            runtime=RuntimeRequirement(package="executorch", min_version=version("executorch")),
            input_names=request.input_names,
            placement=placement,
            tool_versions={
                "executorch": version("executorch"),
                "coremltools": version("coremltools"),
                "torch": version("torch"),
            },
            verification=Verification(backend=None, reason=NOT_HERE),
            inputs=tuple(inputs),
            outputs=tuple(outputs),
        )
