"""ExecuTorch's Python runtime. It needs torch: fine on a workstation, heavy on a device."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from edgeline.errors import BackendUnavailableError, BundleError
from edgeline.manifest import TensorSpec

__all__ = ["ExecuTorchSession"]

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
        try:
            program = Runtime.get().load_program(model_path)
            method = program.load_method("forward")
        except (RuntimeError, ValueError) as exc:
            raise BundleError(f"{model_path}: ExecuTorch could not load the program: {exc}") from exc
        if method is None:
            raise BundleError(f"{model_path}: the program has no 'forward' method")
        meta = method.metadata
        names = list(input_names) if input_names else [f"input_{i}" for i in range(meta.num_inputs())]
        if len(names) != meta.num_inputs():
            raise BundleError(f"{model_path}: program takes {meta.num_inputs()} inputs, manifest lists {len(names)}")
        self._inputs = [self._spec(meta.input_tensor_meta(i), names[i]) for i in range(meta.num_inputs())]
        self._outputs = [self._spec(meta.output_tensor_meta(i), f"output_{i}") for i in range(meta.num_outputs())]
        self._execute = method.execute
        self._from_numpy = torch.from_numpy

    @staticmethod
    def _spec(info: Any, name: str) -> TensorSpec:
        dtype = _SCALAR_TYPES.get(info.dtype())
        if dtype is None:
            raise BundleError(f"tensor {name}: unsupported ExecuTorch dtype code {info.dtype()}")
        return TensorSpec(name=name, dtype=dtype, shape=tuple(info.sizes()))

    def input_specs(self) -> list[TensorSpec]:
        return list(self._inputs)

    def output_specs(self) -> list[TensorSpec]:
        return list(self._outputs)

    def run(self, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
        outputs = self._execute([self._from_numpy(array) for array in inputs])
        return [output.numpy() for output in outputs]
