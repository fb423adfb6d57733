"""Export backends: one module each, found by name, imported on first use.

An exporter takes a float torch module, batch-1 example inputs, a precision and calibration samples,
and writes model file(s) into a directory. Everything else (bundle, fidelity, budgets) is shared.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from edgeline.export.errors import ExportError
from edgeline.registry import resolve

if TYPE_CHECKING:  # the registry is read by `edgeline export --help` (choices of --backend): nothing heavy for that
    import numpy as np

    from edgeline.device_profiles import Precision, Profile
    from edgeline.manifest import Estimates, KeptFloat, Placement, Rewrite, RuntimeRequirement, TensorSpec

__all__ = [
    "ACCURACY_CONTROL",
    "EXPORT_BACKENDS",
    "INT8_EDGES",
    "KEEPS_FLOAT",
    "AccuracyControl",
    "ExportRequest",
    "ExportedModel",
    "Exporter",
    "Verification",
    "get_exporter",
    "operators_named_in",
]

EXPORT_BACKENDS: dict[str, str] = {
    "executorch-xnnpack": "edgeline.export.backends.executorch_xnnpack:XnnpackExporter",
    "litert": "edgeline.export.backends.litert:LiteRTExporter",
    "onnxruntime": "edgeline.export.backends.onnxruntime:OnnxRuntimeExporter",
    "qnn-htp": "edgeline.export.backends.qnn:QnnHtpExporter",
    "ethos-u": "edgeline.export.backends.ethos_u:EthosUExporter",
    "tflite-micro": "edgeline.export.backends.tflite_micro:TFLiteMicroExporter",
    "coreml": "edgeline.export.backends.coreml:CoreMLExporter",
    "executorch-coreml": "edgeline.export.backends.executorch_coreml:ExecuTorchCoreMLExporter",
    "openvino": "edgeline.export.backends.openvino:OpenVINOExporter",
    "openvino-gpu": "edgeline.export.backends.openvino:OpenVINOGpuExporter",
    "openvino-npu": "edgeline.export.backends.openvino:OpenVINONpuExporter",
}


INT8_EDGES = frozenset({"tflite-micro", "ethos-u"})
"""The exporters whose int8-static model takes and gives int8 whatever is kept float (full-integer: what TFLite
Micro's firmware and vela take)."""

KEEPS_FLOAT = frozenset({"litert", "onnxruntime", "executorch-xnnpack", "tflite-micro", "ethos-u", "qnn-htp"})
ACCURACY_CONTROL = frozenset({"openvino", "openvino-gpu", "openvino-npu"})
"""The exporters whose int8-static model, when it misses the accuracy budget, is made again by their quantizer's own
accuracy control (NNCF's ``quantize_with_accuracy_control``, ``ExportRequest.accuracy_control``) rather than by
edgeline's mixed precision; what it reverted to float comes back as ``ExportedModel.kept_float``."""
"""The exporters that honour ``ExportRequest.keep_float`` in int8-static, through their quantizer's public means:
the LiteRT quantizer's per-operator annotation (also for the int8 models of TFLite Micro, whose float kernels run
the kept layers, and of the Ethos-U, whose CPU runs them), ONNX Runtime's ``nodes_to_exclude`` (also QNN's QDQ
configuration: the HTP computes float operators in fp16, so its kept layers are float16, not float32; its CPU
fallback stays off), the XNNPACK quantizer's filter function. Not Core ML (not measured off macOS, so no fidelity
to hold to a budget)."""


@dataclass(frozen=True)
class AccuracyControl:
    """What an exporter's own accuracy control needs from the pipeline (``ACCURACY_CONTROL``): the validation samples,
    a score of a model's outputs on some of them (higher better; the float model's is the reference), and the
    largest drop of that score allowed."""

    samples: Sequence[tuple[np.ndarray, ...]]
    score: Callable[[Sequence[int], Sequence[tuple[np.ndarray, ...]]], float]
    """(sample indices, each one's outputs) -> the score edgeline's budget judges on those samples."""
    max_drop: float
    measure: str  # what ``score`` is, for the manifest: "accuracy", "top-1 agreement", ...


@dataclass(frozen=True)
class ExportRequest:
    module: Any  # torch.nn.Module in eval mode
    example_inputs: tuple[Any, ...]  # torch tensors, batch 1
    calibration: Sequence[tuple[Any, ...]]  # batch-1 samples, used by static quantization
    precision: Precision
    out_dir: Path
    input_names: tuple[str, ...]
    profile: Profile | None = None  # the device's profile: its accelerator section (coreml, qnn, ethos_u, ...)
    keep_float: tuple[str, ...] = ()
    """Module paths (``features.2``) to leave in float in an int8-static model: mixed precision, for the exporters
    in ``KEEPS_FLOAT``."""
    accuracy_control: AccuracyControl | None = None
    """For the exporters in ``ACCURACY_CONTROL``: make int8-static with their quantizer's accuracy control."""

    def profile_section(self, name: str, backend: str, needs: str) -> Any:
        """The profile's ``[name]`` section, which ``backend`` cannot export without (``needs`` says what it takes
        from it); an ``ExportError`` naming the profile when it has none."""
        section = getattr(self.profile, name, None) if self.profile is not None else None
        if section is None:
            where = f"profile {self.profile.id}" if self.profile is not None else "this export (no profile)"
            raise ExportError(f"{backend}: {where} has no [{name}] section; it needs {needs}")
        return section


@dataclass(frozen=True)
class Verification:
    """How the export checks fidelity when not by running the bundle's model file with its own runtime backend.

    ``backend`` None means nothing on this machine can run the model: the manifest's fidelity is "not measured"
    with ``reason`` (e.g. "Core ML runs on macOS only"), never a number. Otherwise ``backend`` runs
    ``model_file`` (a file of the bundle; default the bundle's model) and ``measured_with`` says on what (e.g.
    the HTP emulator, or TFLite Micro's reference kernels on the int8 model vela compiled).
    """

    backend: str | None = None
    model_file: str | None = None
    measured_with: str | None = None
    reason: str | None = None


@dataclass(frozen=True)
class ExportedModel:
    model_file: str  # relative to out_dir
    runtime_backend: str  # edgeline registry name
    runtime: RuntimeRequirement
    input_names: tuple[str, ...]  # the model file's tensor names, in forward()'s order
    extra_files: tuple[str, ...] = ()  # e.g. a compiled context binary
    flash_files: tuple[str, ...] | None = None
    """The files the device stores to run it, which ``max_model_bytes`` judges; None: every file but golden.npz.
    An Ethos-U bundle's is the vela model alone (its int8 copy serves a device without the NPU)."""
    placement: Placement | None = None
    tool_versions: dict[str, str] = field(default_factory=dict)
    verification: Verification | None = None  # None: the bundle's model on its runtime backend, here
    # The model file's inputs and outputs, when no runtime here can open it to read them (Core ML on Linux).
    inputs: tuple[TensorSpec, ...] | None = None
    outputs: tuple[TensorSpec, ...] | None = None
    estimates: Estimates | None = None
    # Per output: the step of an integer tensor dequantized to the float output inside the model (QDQ). Another
    # runtime or CPU may land one step apart: golden.npz's tolerance allows two (see export/staging.py).
    output_steps: tuple[float, ...] = ()
    kept_float: tuple[KeptFloat, ...] = ()
    """The layers the exporter's own accuracy control left in float (``ExportRequest.accuracy_control``)."""
    rewrites: tuple[Rewrite, ...] = ()
    """What the export changed of the function the model computes, so that the target runs it (the manifest's
    ``quantization.rewrites``)."""
    activation_ranges: str | None = None
    """How the int8 activation ranges were chosen, when the exporter chose (the manifest's
    ``quantization.activation_ranges``)."""


class Exporter(Protocol):
    name: str
    runtime_backend: str  # the runtime registry name of what it writes (edgeline.backends.RUNTIME_BACKENDS)
    precisions: tuple[Precision, ...]

    def export(self, request: ExportRequest) -> ExportedModel: ...


def get_exporter(name: str) -> Exporter:
    exporter: Exporter = resolve(EXPORT_BACKENDS, name, "export backend", ExportError)()
    return exporter


_OPERATOR = re.compile(r"\b(aten(?:::|\.)[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)?|tfl\.[a-z0-9_]+)")


def operators_named_in(text: str) -> tuple[str, ...]:
    """Operator names (aten.*, tfl.*) mentioned in a converter's error text, in order, without repeats."""
    return tuple(dict.fromkeys(match.group(1).replace("::", ".") for match in _OPERATOR.finditer(text)))
