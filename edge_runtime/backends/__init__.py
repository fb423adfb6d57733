"""Runtime backends: one class each (a ``RuntimeBackend``, ``edgeline.backends.base``), registered in
``RUNTIME_BACKENDS``, imported on first use.

A backend's class declares what it runs on and implements its parts: its facts on a machine, whether a bundle runs
there, and the session that opens a model file and runs model-native numpy arrays (already quantized where the model
wants integers) in the order of the manifest's inputs, returning the outputs in manifest order. Quantization,
validation and post-processing are the ``Model``'s job, shared by every backend. Every other module asks the class.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from edgeline.backends.base import RuntimeBackend, Session
from edgeline.errors import BundleError
from edgeline.registry import resolve

__all__ = [
    "BASE_INSTALL_BACKENDS",
    "RUNTIME_BACKENDS",
    "RuntimeBackend",
    "Session",
    "SessionFactory",
    "goes_into_firmware",
    "open_session",
    "runtime_backend",
    "runtime_backends",
]

RUNTIME_BACKENDS: dict[str, str] = {  # the one place a runtime backend is registered: its name -> its class
    "litert": "edgeline.backends.litert:LiteRTBackend",
    "tflite-runtime": "edgeline.backends.litert:TFLiteRuntimeBackend",
    "onnxruntime": "edgeline.backends.onnxruntime:OnnxRuntimeBackend",
    "openvino": "edgeline.backends.openvino:OpenVINOBackend",
    "executorch": "edgeline.backends.executorch:ExecuTorchBackend",
    "tflite-micro": "edgeline.backends.tflite_micro:TFLiteMicroBackend",
    "coreml": "edgeline.backends.coreml:CoreMLBackend",
}
"""In the order ``edgeline doctor`` lists them (and their accelerators)."""


class SessionFactory(Protocol):
    file_suffixes: tuple[str, ...]

    def __call__(
        self, model_path: Path, *, threads: int, input_names: Sequence[str] | None, accelerator: str | None = None
    ) -> Session: ...


def runtime_backend(name: str) -> RuntimeBackend:
    """The backend registered as ``name``; a ``BundleError`` listing the valid names when none is."""
    backend: type[RuntimeBackend] = resolve(RUNTIME_BACKENDS, name, "runtime backend", BundleError)
    return backend()


def goes_into_firmware(name: str | None) -> bool:
    """Whether the bundles of runtime backend ``name`` go into a microcontroller's firmware
    (``RuntimeBackend.firmware``); an unknown name or None: no."""
    return name in RUNTIME_BACKENDS and runtime_backend(name).firmware


def runtime_backends() -> dict[str, RuntimeBackend]:
    """Every registered backend, in the registry's order (each one's module imported)."""
    return {name: runtime_backend(name) for name in RUNTIME_BACKENDS}


def __getattr__(name: str) -> frozenset[str]:
    """``BASE_INSTALL_BACKENDS``: the runtime backends that ``pip install edgeline`` (no extras, what a device runs)
    can run, as this module listed them before the classes declared it (``RuntimeBackend.base_install``). A device
    profile's first target must export for one of these, unless the profile is for an accelerator whose extra it
    names."""
    if name != "BASE_INSTALL_BACKENDS":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return frozenset(found for found, backend in runtime_backends().items() if backend.base_install)


def open_session(
    name: str,
    model_path: Path,
    *,
    threads: int = 1,
    input_names: Sequence[str] | None = None,
    accelerator: str | None = None,
) -> Session:
    """Open ``model_path`` with the runtime backend called ``name``, on ``accelerator`` where it can."""
    backend = runtime_backend(name)
    if model_path.suffix not in backend.file_suffixes:
        raise BundleError(
            f"runtime backend {name!r} runs {', '.join(backend.file_suffixes)} models, not {model_path.name}"
        )
    return backend.open(model_path, threads=threads, input_names=input_names, accelerator=accelerator)
