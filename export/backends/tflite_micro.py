"""TensorFlow Lite Micro: the full-integer int8 LiteRT model a Cortex-M's firmware runs, without an NPU.

The same model file LiteRT's int8-static writes, checked to be full-integer (int8 inputs and outputs, as TFLite Micro
kernels and firmware expect), and measured here with TFLite Micro's reference kernels: a microcontroller's optimized
kernels (CMSIS-NN) are not here, so no latency is measured on this host.
"""

from __future__ import annotations

from importlib.metadata import version

from edgeline.device_profiles import Precision, Profile
from edgeline.export.backends import ExportedModel, ExportRequest, ExportTarget, Verification
from edgeline.export.backends.litert import MODEL_FILE, tool_versions, write_tflite
from edgeline.export.errors import ExportError
from edgeline.export.layer_probes import LayerProbe, LayerReading, litert_layers
from edgeline.export.placement import tflite_placement
from edgeline.export.tflite_operators import TFLITE_MICRO_KERNELS
from edgeline.manifest import RuntimeRequirement

__all__ = ["TFLiteMicroExporter"]


class TFLiteMicroExporter(ExportTarget):
    name = "tflite-micro"
    runtime_backend = "tflite-micro"
    precisions = (Precision.INT8_STATIC,)
    keeps_float = True  # the LiteRT quantizer's annotation: TFLite Micro's float kernels run the kept layers
    full_integer = True

    def layer_probe(self, reading: LayerReading) -> LayerProbe | None:
        """Its int8 model on LiteRT's interpreter: the microcontroller's TFLite Micro kernels compute the same."""
        return litert_layers(reading)

    def on_micro_kernels(self, profile: Profile | None) -> bool:
        return True

    def export(self, request: ExportRequest) -> ExportedModel:
        if request.precision not in self.precisions:
            raise ExportError(f"tflite-micro exports int8-static only, not {request.precision.value}")
        path = request.out_dir / MODEL_FILE
        written = write_tflite(request, path, full_integer_for=self.name, kernels=TFLITE_MICRO_KERNELS)
        tflm = version("tflite-micro")
        return ExportedModel(
            model_file=MODEL_FILE,
            runtime_backend=self.runtime_backend,
            runtime=RuntimeRequirement(package="tflite-micro", min_version=tflm),
            input_names=written.input_names,
            rewrites=written.rewrites,
            placement=tflite_placement(path, request.precision, written.sources),
            tool_versions={**tool_versions(), "tflite-micro": tflm},
            flash_files=(MODEL_FILE,),  # what the firmware stores is the model array; its C sources are text
            verification=Verification(
                backend=self.runtime_backend,
                measured_with=f"TFLite Micro {tflm} reference kernels on this host (not the device's kernels)",
            ),
        )
