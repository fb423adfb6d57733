"""``Model``: a verified bundle opened on a runtime backend. Floats in, floats out."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from edge_runtime.backends import Session, open_session
from edge_runtime.bundle import Bundle, read_bundle
from edge_runtime.errors import BundleError, PayloadError
from edge_runtime.manifest import Manifest, TensorSpec
from edge_runtime.postprocess import Interpretation, interpret
from edge_runtime.quantization import dequantize, quantize

__all__ = ["Model", "load"]

Converter = Callable[[np.ndarray], np.ndarray]


def _input_converter(spec: TensorSpec, manifest: Manifest) -> Converter:
    """Float array (already shaped) -> what the model's input tensor holds."""
    pre = manifest.preprocess
    dtype = np.dtype(spec.dtype)
    params = spec.quantization
    if params is not None and np.issubdtype(dtype, np.integer):
        if pre is not None:
            return lambda x: quantize(x * pre.scale + pre.offset, params, dtype)
        return lambda x: quantize(x, params, dtype)
    if pre is not None:
        return lambda x: (x * pre.scale + pre.offset).astype(dtype, copy=False)
    return lambda x: x.astype(dtype, copy=False)


def _output_converter(spec: TensorSpec) -> Converter | None:
    params = spec.quantization
    if params is not None and np.issubdtype(np.dtype(spec.dtype), np.integer):
        return lambda y: dequantize(y, params)
    if spec.dtype != "float32":
        return lambda y: y.astype(np.float32)
    return None


class Model:
    """A bundle ready to run: ``predict(*arrays)`` takes one float array per input (batch 1)."""

    def __init__(self, bundle: Bundle, session: Session, backend: str):
        self.bundle = bundle
        self.manifest = bundle.manifest
        self.backend = backend
        self._session = session
        self.inputs = self.manifest.inputs
        self.outputs = self.manifest.outputs
        self._shapes = [spec.shape for spec in self.inputs]
        self._sample_shapes = [spec.shape[1:] if spec.shape[0] == 1 else None for spec in self.inputs]
        self._to_model = [_input_converter(spec, self.manifest) for spec in self.inputs]
        self._from_model = [_output_converter(spec) for spec in self.outputs]
        self._run = session.run

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def version(self) -> int:
        return self.manifest.version

    def _check(self, index: int, array: np.ndarray) -> np.ndarray:
        spec = self.inputs[index]
        if not isinstance(array, np.ndarray):
            array = np.asarray(array)
        if array.shape != spec.shape:
            if array.shape == self._sample_shapes[index]:
                array = array.reshape(spec.shape)
            else:
                raise PayloadError(
                    f"input {index} ({spec.name}): shape {list(array.shape)}, expected {list(spec.shape)}"
                )
        if array.dtype != np.float32:
            if not (np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)):
                raise PayloadError(f"input {index} ({spec.name}): dtype {array.dtype}, expected float32")
            array = array.astype(np.float32)
        # One reduction is the cheapest full scan: NaN or Inf anywhere makes the sum non-finite.
        if not np.isfinite(np.add.reduce(array, axis=None)) and not np.isfinite(array).all():
            raise PayloadError(f"input {index} ({spec.name}): contains NaN or Inf")
        return array

    def predict(self, *arrays: np.ndarray) -> list[np.ndarray]:
        """Run one sample: each array has the input's shape, with or without its batch dimension of 1."""
        if len(arrays) != len(self.inputs):
            raise PayloadError(f"{self.name} takes {len(self.inputs)} input(s), got {len(arrays)}")
        native = [convert(self._check(i, a)) for i, (convert, a) in enumerate(zip(self._to_model, arrays, strict=True))]
        raw = self._run(native)
        return [y if convert is None else convert(y) for convert, y in zip(self._from_model, raw, strict=True)]

    def interpret(
        self, inputs: Sequence[np.ndarray], outputs: Sequence[np.ndarray], *, top_k: int = 1
    ) -> Interpretation:
        """Labels and scores (classifiers) or anomaly score and flag, from one sample's float outputs."""
        return interpret(self.manifest.postprocess, inputs, outputs, top_k=top_k)


def load(path: str | os.PathLike[str], *, backend: str | None = None, threads: int | None = None) -> Model:
    """Verify the bundle at ``path`` and open it; ``backend`` overrides the manifest's runtime backend."""
    bundle = read_bundle(Path(path))
    manifest = bundle.manifest
    name = backend or manifest.backend
    session = open_session(
        name,
        bundle.model_path,
        threads=threads or manifest.threads,
        input_names=[spec.name for spec in manifest.inputs],
    )
    found = session.input_specs()
    for declared, actual in zip(manifest.inputs, found, strict=True):
        if declared.shape != actual.shape or declared.dtype != actual.dtype:
            raise BundleError(
                f"{bundle.path}: model input {actual.name} is {actual.dtype}{list(actual.shape)}, "
                f"the manifest says {declared.dtype}{list(declared.shape)}"
            )
    return Model(bundle, session, name)
