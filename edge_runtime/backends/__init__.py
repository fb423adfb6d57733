"""Runtime backends: one module each, found by name, imported on first use.

A backend opens a model file and runs model-native numpy arrays (already quantized where the model
wants integers) in the order of the manifest's inputs, returning the outputs in manifest order.
Quantization, validation and post-processing are the ``Model``'s job, shared by every backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from edgeline.errors import BundleError
from edgeline.registry import resolve

if TYPE_CHECKING:  # the registry is read by `--help` (choices of --backend): no numpy or pydantic for that
    import numpy as np

    from edgeline.manifest import TensorSpec

__all__ = ["BASE_INSTALL_BACKENDS", "RUNTIME_BACKENDS", "Session", "SessionFactory", "open_session"]

RUNTIME_BACKENDS: dict[str, str] = {
    "litert": "edgeline.backends.litert:LiteRTSession",
    "tflite-runtime": "edgeline.backends.litert:TFLiteRuntimeSession",
    "executorch": "edgeline.backends.executorch:ExecuTorchSession",
    "tflite-micro": "edgeline.backends.tflite_micro:TFLiteMicroSession",
    "coreml": "edgeline.backends.coreml:CoreMLSession",
    "onnxruntime": "edgeline.backends.onnxruntime:OnnxRuntimeSession",
    "openvino": "edgeline.backends.openvino:OpenVINOSession",
}
BASE_INSTALL_BACKENDS: frozenset[str] = frozenset({"litert"})
"""The runtime backends that ``pip install edgeline`` (no extras, what a device runs) can run: their runtime is a
dependency of the base install and needs no torch. ``executorch`` needs its C++ runtime installed
(``edgeline doctor --install executorch``, no torch) or the ``executorch`` extra (torch), ``tflite-runtime`` a package
of its own, ``onnxruntime`` the ``onnx`` extra and ``openvino`` the ``openvino`` extra (both torch-free). A device
profile's first target must export for one of these, unless the profile is for an accelerator whose extra it names."""


class Session(Protocol):
    """An opened model, ready to run."""

    accelerator: str | None
    """What really runs the model here: the accelerator asked for, or None when the CPU runs it (a fallback when
    an accelerator was asked for: the model says so loudly)."""

    def input_specs(self) -> list[TensorSpec]: ...

    def output_specs(self) -> list[TensorSpec]: ...

    def run(self, inputs: Sequence[np.ndarray]) -> list[np.ndarray]: ...


class SessionFactory(Protocol):
    file_suffixes: tuple[str, ...]

    def __call__(
        self, model_path: Path, *, threads: int, input_names: Sequence[str] | None, accelerator: str | None = None
    ) -> Session: ...


def open_session(
    name: str,
    model_path: Path,
    *,
    threads: int = 1,
    input_names: Sequence[str] | None = None,
    accelerator: str | None = None,
) -> Session:
    """Open ``model_path`` with the runtime backend called ``name``, on ``accelerator`` where it can."""
    factory: SessionFactory = resolve(RUNTIME_BACKENDS, name, "runtime backend", BundleError)
    if model_path.suffix not in factory.file_suffixes:
        raise BundleError(
            f"runtime backend {name!r} runs {', '.join(factory.file_suffixes)} models, not {model_path.name}"
        )
    return factory(model_path, threads=threads, input_names=input_names, accelerator=accelerator)
