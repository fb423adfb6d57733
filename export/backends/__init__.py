"""Export targets: one class each (an ``ExportTarget``), registered in ``EXPORT_BACKENDS``, imported on first use.

A target's class declares what it takes and what it can do (its name, the precisions it exports, the runtime
backend that runs its bundles, whether it can keep layers float, ...) and implements its parts: ``export`` takes a
float torch module, batch-1 example inputs, a precision and calibration samples, and writes model file(s) into a
directory, with the placement read from the converted model; ``layer_probe`` reads the deployed model layer by
layer. Everything else (bundle, fidelity, budgets, mixed precision) is shared and asks the class, never the name.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgeline.export.errors import ExportError
from edgeline.registry import resolve

if TYPE_CHECKING:  # the registry is read by `edgeline export --help` (choices of --backend): nothing heavy for that
    import numpy as np

    from edgeline.device_profiles import Precision, Profile
    from edgeline.export.layer_probes import LayerProbe, LayerReading
    from edgeline.manifest import Estimates, KeptFloat, Placement, Rewrite, RuntimeRequirement, TensorSpec

__all__ = [
    "ACCURACY_CONTROL",
    "EXPORT_BACKENDS",
    "INT8_EDGES",
    "KEEPS_FLOAT",
    "AccuracyControl",
    "ExportRequest",
    "ExportTarget",
    "ExportedModel",
    "Exporter",
    "Verification",
    "export_target",
    "get_exporter",
    "operators_named_in",
]

EXPORT_BACKENDS: dict[str, str] = {  # the one place a target is registered: its name -> its ExportTarget class
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


@dataclass(frozen=True)
class AccuracyControl:
    """What an exporter's own accuracy control needs from the pipeline (``ExportTarget.own_accuracy_control``): the
    validation samples,
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
    """Module paths (``features.2``) to leave in float in an int8-static model: mixed precision, for the targets
    that declare ``keeps_float``."""
    accuracy_control: AccuracyControl | None = None
    """For the targets that declare ``own_accuracy_control``: make int8-static with their quantizer's accuracy
    control."""
    validation_score: AccuracyControl | None = None
    """The labelled validation samples and the score the accuracy budget judges on them (``max_drop``: the budget),
    for an exporter that chooses among ways of quantizing (OpenVINO's activation range estimators); None without
    labels."""

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
    quantized_graph: Any = None
    """The quantized torch graph the model file was lowered from, when the target's layer probe reads that graph
    (ExecuTorch's PT2E): handed to it (``LayerReading.quantized_graph``) so that the layers are read from the very
    graph the export made, not from a second quantization of the same model on the same samples."""


class ExportTarget:
    """One export target: subclass it, declare its capabilities, implement ``export`` (and ``layer_probe`` when
    edgeline can read its model's layers), and register it in ``EXPORT_BACKENDS``. Everything else asks the class.

    The capabilities, read by the pipeline, mixed precision and the per-layer report:
    """

    name: str
    """Its registry name, the profiles' ``backend`` (``litert``)."""
    runtime_backend: str
    """The runtime backend that runs its bundles (``edgeline.backends.RUNTIME_BACKENDS``; ``ExportedModel`` may name
    another for one bundle, e.g. a microcontroller's)."""
    accelerator: str | None = None
    """The accelerator its bundles ask their runtime backend for (their ``placement.accelerator``; None: the CPU).
    ``runs_with`` says it for a profile, without torch: the device side asks it through the registry (``doctor``
    listing which of a profile's targets run here)."""
    precisions: tuple[Precision, ...]
    """The precisions it exports; any other is refused, listing these."""
    keeps_float: bool = False
    """Whether it honours ``ExportRequest.keep_float`` in int8-static, through its quantizer's public means (mixed
    precision by the accuracy budget). Not Core ML (not measured off macOS, so no fidelity to hold to a budget)."""
    kept_float_precision: str = "float32"
    """The precision its kept layers compute in (the manifest's ``kept_float[].precision``)."""
    own_accuracy_control: bool = False
    """Whether its int8-static model, when it misses the accuracy budget, is made again by its quantizer's own
    accuracy control (``ExportRequest.accuracy_control``) rather than by edgeline's mixed precision; what it reverted
    to float comes back as ``ExportedModel.kept_float``."""
    full_integer: bool = False
    """Whether its int8-static model takes and gives int8 whatever is kept float (what TFLite Micro's firmware and
    vela take): an input int8 loses cannot be kept float."""

    def runs_with(self, profile: Profile | None) -> tuple[str, str | None]:
        """The runtime backend and accelerator its bundles for ``profile`` name (None: any profile's)."""
        return self.runtime_backend, self.accelerator

    def export(self, request: ExportRequest) -> ExportedModel:
        """Convert ``request.module`` into ``request.out_dir``: the model file(s), its placement, its runtime."""
        raise NotImplementedError(f"{type(self).__name__} does not implement export()")

    def layer_probe(self, reading: LayerReading) -> LayerProbe | None:
        """The reader of its deployed model's intermediate tensors (``edgeline.export.layer_probes``); None: edgeline
        reads none of them here, and the manifest says so."""
        return None

    def on_micro_kernels(self, profile: Profile | None) -> bool:
        """Whether TFLite Micro's kernels run its model here and on the device of ``profile``: a kernel TFLite Micro
        lacks then fails every such target alike."""
        return False

    def has_every_tflite_kernel(self, profile: Profile | None) -> bool:
        """Whether its model runs on LiteRT, which has every TFLite builtin kernel, on the device of ``profile``: where
        a model needing a kernel TFLite Micro lacks can go."""
        return False


Exporter = ExportTarget
"""The name this class had as a protocol."""


def export_target(name: str) -> type[ExportTarget]:
    """The class registered as ``name``; an ``ExportError`` listing the valid names when none is."""
    target: type[ExportTarget] = resolve(EXPORT_BACKENDS, name, "export backend", ExportError)
    return target


def get_exporter(name: str) -> ExportTarget:
    return export_target(name)()


_CAPABILITY_SETS = {
    "INT8_EDGES": "full_integer",
    "KEEPS_FLOAT": "keeps_float",
    "ACCURACY_CONTROL": "own_accuracy_control",
}


def __getattr__(name: str) -> frozenset[str]:
    """The names of the targets with one capability, as this module listed them before the classes declared them:
    ``INT8_EDGES`` (``full_integer``), ``KEEPS_FLOAT``, ``ACCURACY_CONTROL`` (``own_accuracy_control``)."""
    capability = _CAPABILITY_SETS.get(name)
    if capability is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return frozenset(target for target in EXPORT_BACKENDS if getattr(export_target(target), capability))


_OPERATOR = re.compile(r"\b(aten(?:::|\.)[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)?|tfl\.[a-z0-9_]+)")


def operators_named_in(text: str) -> tuple[str, ...]:
    """Operator names (aten.*, tfl.*) mentioned in a converter's error text, in order, without repeats."""
    return tuple(dict.fromkeys(match.group(1).replace("::", ".") for match in _OPERATOR.finditer(text)))
