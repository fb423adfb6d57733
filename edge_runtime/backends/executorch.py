"""ExecuTorch's Python runtime. It needs torch: fine on a workstation, heavy on a device."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from edgeline.errors import BackendUnavailableError, BundleError
from edgeline.manifest import TensorSpec

__all__ = ["DELEGATE_BACKENDS", "ExecuTorchSession", "program_specs"]

# c10::ScalarType codes as reported by TensorInfo.dtype().
_SCALAR_TYPES = {
    0: "uint8",
    1: "int8",
    2: "int16",
    3: "int32",
    4: "int64",
    5: "float16",
    6: "float32",
    11: "bool",
}

DELEGATE_BACKENDS = {"xnnpack": "XnnpackBackend", "coreml": "CoreMLBackend"}
"""A bundle's placement.accelerator -> the ExecuTorch backend its delegated parts need at run time."""
_WHY_MISSING = {"coreml": "the Core ML delegate runs on Apple devices only (ExecuTorch built for iOS or macOS)"}


def _spec(info: Any, name: str) -> TensorSpec:
    dtype = _SCALAR_TYPES.get(info.dtype())
    if dtype is None:
        raise BundleError(f"tensor {name}: unsupported ExecuTorch dtype code {info.dtype()}")
    return TensorSpec(name=name, dtype=dtype, shape=tuple(info.sizes()))


def _specs(meta: Any, model_path: Path, input_names: Sequence[str] | None) -> tuple[list[TensorSpec], list[TensorSpec]]:
    names = list(input_names) if input_names else [f"input_{i}" for i in range(meta.num_inputs())]
    if len(names) != meta.num_inputs():
        raise BundleError(f"{model_path}: program takes {meta.num_inputs()} inputs, manifest lists {len(names)}")
    inputs = [_spec(meta.input_tensor_meta(i), names[i]) for i in range(meta.num_inputs())]
    return inputs, [_spec(meta.output_tensor_meta(i), f"output_{i}") for i in range(meta.num_outputs())]


def program_specs(model_path: Path, input_names: Sequence[str] | None) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The forward method's inputs and outputs, read from the program without loading the method: this works for
    a program delegated to a backend this runtime lacks."""
    from executorch.runtime import Runtime

    try:
        meta = Runtime.get().load_program(model_path).metadata("forward")
    except (RuntimeError, ValueError) as exc:
        raise BundleError(f"{model_path}: ExecuTorch could not read the program: {exc}") from exc
    return _specs(meta, model_path, input_names)


class ExecuTorchSession:
    file_suffixes: ClassVar[tuple[str, ...]] = (".pte",)

    def __init__(
        self,
        model_path: Path,
        *,
        threads: int = 1,
        input_names: Sequence[str] | None = None,
        accelerator: str | None = None,
    ):
        # Delegated parts are compiled into the program: they run on what they were lowered for, or not at all.
        self.accelerator = accelerator
        try:
            import torch
            from executorch.extension.pybindings import portable_lib
            from executorch.runtime import Runtime
        except ImportError as exc:
            raise BackendUnavailableError(
                "this bundle needs the ExecuTorch Python runtime, which needs torch: pip install 'edgeline[executorch]'"
            ) from exc
        self._torch: Any = torch
        if portable_lib._threadpool_get_thread_count() != threads:
            portable_lib._unsafe_reset_threadpool(threads)
        runtime = Runtime.get()
        needed = DELEGATE_BACKENDS.get(accelerator or "")
        if needed is not None and not runtime.backend_registry.is_available(needed):
            registered = ", ".join(runtime.backend_registry.registered_backend_names) or "none"
            why = _WHY_MISSING.get(accelerator or "", "install an ExecuTorch build that has it")
            raise BackendUnavailableError(
                f"{model_path}: the program is delegated to {needed}, which this ExecuTorch runtime lacks "
                f"(it has: {registered}); {why}"
            )
        try:
            program = runtime.load_program(model_path)
            method = program.load_method("forward")
        except (RuntimeError, ValueError) as exc:
            raise BundleError(f"{model_path}: ExecuTorch could not load the program: {exc}") from exc
        if method is None:
            raise BundleError(f"{model_path}: the program has no 'forward' method")
        self._inputs, self._outputs = _specs(method.metadata, model_path, input_names)
        self._execute = method.execute
        self._from_numpy = torch.from_numpy

    def input_specs(self) -> list[TensorSpec]:
        return list(self._inputs)

    def output_specs(self) -> list[TensorSpec]:
        return list(self._outputs)

    def run(self, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
        outputs = self._execute([self._from_numpy(array) for array in inputs])
        return [output.numpy() for output in outputs]
