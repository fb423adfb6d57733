"""The toy export target: what ``export/backends/<name>.py`` holds for a real one. It saves the float module as a
``torch.export`` program (``.pt2``) that the toy runtime backend runs: no quantization, no accelerator."""

from __future__ import annotations

import json
from importlib.metadata import version

from edgeline.device_profiles import Precision
from edgeline.export.backends import ExportedModel, ExportRequest, ExportTarget
from edgeline.export.errors import ExportError
from edgeline.manifest import RuntimeRequirement

MODEL_FILE = "model.pt2"
SPECS = "edgeline_specs.json"
"""Beside the program in the .pt2 archive: its inputs and outputs (name, dtype, shape), which the runtime reads."""


class ToyTarget(ExportTarget):
    name = "toy"
    runtime_backend = "toy"
    precisions = (Precision.FP32,)

    def export(self, request: ExportRequest) -> ExportedModel:
        import torch

        if request.precision not in self.precisions:
            raise ExportError(f"toy exports fp32 only, not {request.precision.value}")
        program = torch.export.export(request.module, tuple(request.example_inputs))
        outputs = request.module(*request.example_inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)

        def spec(name: str, tensor: torch.Tensor) -> dict[str, object]:
            return {"name": name, "dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape)}

        specs = {
            "inputs": [spec(n, t) for n, t in zip(request.input_names, request.example_inputs, strict=True)],
            "outputs": [spec(f"output_{i}", t) for i, t in enumerate(outputs)],
        }
        torch.export.save(program, request.out_dir / MODEL_FILE, extra_files={SPECS: json.dumps(specs)})
        return ExportedModel(
            model_file=MODEL_FILE,
            runtime_backend=self.runtime_backend,
            runtime=RuntimeRequirement(package="torch", min_version=version("torch")),
            input_names=request.input_names,
        )
