"""Core ML (``.mlpackage``) through coremltools: Apple's OSes only, where Core ML itself runs the model.

Core ML places each operation on the Neural Engine, the GPU or the CPU when the model loads, within the compute units
it is loaded with. Those are not part of the package format: edgeline's exporter records the profile's choice in the
package's user-defined metadata (``edgeline.compute_units``), and the session loads the package with it.
"""

from __future__ import annotations

import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edgeline.backends.base import Asked, RuntimeBackend, Verdict
from edgeline.errors import BackendUnavailableError, BundleError
from edgeline.manifest import Dtype, TensorSpec

if TYPE_CHECKING:
    from edgeline.backends.base import Facts

__all__ = [
    "ACCELERATORS",
    "COMPUTE_UNITS_KEY",
    "CoreMLBackend",
    "CoreMLSession",
    "accelerator_for",
    "unavailable_reason",
]

COMPUTE_UNITS_KEY = "edgeline.compute_units"
_COMPUTE_UNITS = ("ALL", "CPU_AND_NE", "CPU_AND_GPU", "CPU_ONLY")
_ACCELERATORS = {"ALL": "neural-engine", "CPU_AND_NE": "neural-engine", "CPU_AND_GPU": "gpu"}
ACCELERATORS = frozenset({"neural-engine", "gpu", "coreml"})
"""What a bundle built for Core ML names as its accelerator (``coreml``: Core ML's own delegate in ExecuTorch)."""
_DTYPES: dict[int, Dtype] = {65568: "float32", 65552: "float16", 131104: "int32"}  # ArrayFeatureType.ArrayDataType


def accelerator_for(compute_units: str) -> str | None:
    """The accelerator a package loaded with ``compute_units`` may use (Core ML picks per operation at load time)."""
    return _ACCELERATORS.get(compute_units)


def unavailable_reason() -> str | None:
    """Why Core ML cannot run here, or None on macOS (where it can)."""
    if sys.platform == "darwin":
        return None
    return f"Core ML runs on macOS only (this is {platform.system() or sys.platform})"


def _specs(features: Any, model_path: Path) -> list[TensorSpec]:
    specs = []
    for feature in features:
        array = feature.type.multiArrayType
        dtype = _DTYPES.get(array.dataType)
        if feature.type.WhichOneof("Type") != "multiArrayType" or dtype is None:
            raise BundleError(f"{model_path}: Core ML feature {feature.name!r} is not a float32/float16/int32 tensor")
        specs.append(TensorSpec(name=feature.name, dtype=dtype, shape=tuple(int(d) for d in array.shape)))
    return specs


class CoreMLSession:
    def __init__(
        self,
        model_path: Path,
        *,
        threads: int = 1,
        input_names: Sequence[str] | None = None,
        accelerator: str | None = None,
    ):
        reason = unavailable_reason()
        if reason is not None:
            raise BackendUnavailableError(f"{model_path}: {reason}")
        try:
            import coremltools as ct
        except ImportError as exc:
            raise BackendUnavailableError(
                "this bundle needs coremltools, which is not installed: pip install 'edgeline[coreml]'"
            ) from exc
        try:
            spec = ct.models.MLModel(str(model_path), skip_model_load=True).get_spec()
        except Exception as exc:  # coremltools raises bare Exceptions for a malformed package
            raise BundleError(f"{model_path}: coremltools could not read the package: {exc}") from exc
        units = spec.description.metadata.userDefined.get(COMPUTE_UNITS_KEY, "ALL")
        if units not in _COMPUTE_UNITS:
            raise BundleError(
                f"{model_path}: metadata {COMPUTE_UNITS_KEY} is {units!r}; valid: {', '.join(_COMPUTE_UNITS)}"
            )
        self.accelerator: str | None = accelerator_for(units)
        self._inputs = _specs(spec.description.input, model_path)
        self._outputs = _specs(spec.description.output, model_path)
        if input_names is not None:
            by_name = {s.name: s for s in self._inputs}
            if sorted(by_name) != sorted(input_names):
                raise BundleError(
                    f"{model_path}: inputs {sorted(by_name)} differ from the manifest's {list(input_names)}"
                )
            self._inputs = [by_name[name] for name in input_names]
        try:
            self._model = ct.models.MLModel(str(model_path), compute_units=ct.ComputeUnit[units])
        except Exception as exc:  # Core ML's compile or load failure, e.g. an OS older than the deployment target
            raise BundleError(f"{model_path}: Core ML could not load the package: {exc}") from exc

    def input_specs(self) -> list[TensorSpec]:
        return list(self._inputs)

    def output_specs(self) -> list[TensorSpec]:
        return list(self._outputs)

    def run(self, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
        answer = self._model.predict({spec.name: array for spec, array in zip(self._inputs, inputs, strict=True)})
        return [np.asarray(answer[spec.name], dtype=spec.dtype).reshape(spec.shape) for spec in self._outputs]


class CoreMLBackend(RuntimeBackend):
    """Core ML, on Apple's OSes only: a bundle for it cannot run anywhere else, whatever is installed."""

    name = "coreml"
    package = "coremltools"
    module = "coremltools"
    install = "macOS with pip install 'edgeline[coreml]'"
    file_suffixes = (".mlpackage",)
    runs_on = "on macOS"

    def refusal(self, accelerator: str | None, facts: Facts) -> str | None:
        return None if facts.system == "Darwin" else f"Core ML runs on macOS only (this is {facts.system})"

    def verdict(self, asked: Asked) -> Verdict | None:
        version = asked.runtime.version
        installed = f"{self.package} {version}" if version else self.package
        return asked.runs(self.name, asked.model, asked.accelerator, None, f"{installed} runs it {self.runs_on}")

    def accelerators(self, facts: Facts) -> dict[str, dict[str, Any]]:
        on_macos = facts.system == "Darwin"
        detail = "macOS" if on_macos else f"Core ML runs on macOS only (this is {facts.system})"
        return {"coreml": {"present": on_macos, "detail": detail}}

    def open(
        self, model_path: Path, *, threads: int, input_names: Sequence[str] | None, accelerator: str | None
    ) -> CoreMLSession:
        return CoreMLSession(model_path, threads=threads, input_names=input_names, accelerator=accelerator)
