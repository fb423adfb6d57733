"""``Model``: a verified bundle opened on a runtime backend. Floats in, floats out."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from edge_runtime.backends import Session, open_session
from edge_runtime.bundle import Bundle, read_bundle
from edge_runtime.errors import BundleError, PayloadError
from edge_runtime.manifest import Manifest, TensorSpec
from edge_runtime.postprocess import Interpretation, interpret

__all__ = ["Model", "load", "usable_threads"]

Converter = Callable[[np.ndarray], np.ndarray]
_F32 = np.dtype(np.float32)
_vdot = np.vdot


def _input_converter(index: int, spec: TensorSpec, manifest: Manifest) -> Converter:
    """Checks one caller array and turns it into what the model's input tensor holds.

    The hot path: called once per input per inference, so everything that can be is computed here, once.
    """
    shape = spec.shape
    sample_shape = shape[1:] if shape[0] == 1 else None
    where = f"input {index} ({spec.name})"
    pre = manifest.preprocess
    dtype = np.dtype(spec.dtype)
    params = spec.quantization

    def coerce(x: np.ndarray) -> np.ndarray:
        if not isinstance(x, np.ndarray):
            x = np.asarray(x)
        if x.shape != shape:
            if x.shape != sample_shape:
                raise PayloadError(f"{where}: shape {list(x.shape)}, expected {list(shape)}", code="wrong-shape")
            x = x.reshape(shape)
        if x.dtype != _F32:
            if x.dtype.kind not in "fiu":
                raise PayloadError(f"{where}: dtype {x.dtype}, expected float32", code="wrong-dtype")
            with np.errstate(over="ignore"):  # out-of-range values become Inf, refused just below
                x = x.astype(_F32)
        return x

    def check_finite(x: np.ndarray) -> None:
        # The cheapest full scan (a BLAS dot product): NaN or Inf anywhere makes it non-finite. Huge finite
        # values can overflow it too, so only then is every element checked.
        if not math.isfinite(_vdot(x, x)) and not np.isfinite(x).all():
            raise PayloadError(f"{where}: contains NaN or Inf", code="non-finite")

    if params is not None and dtype.kind in "iu":
        scale = np.float32(params.scale)
        zero_point = np.float32(params.zero_point)
        info = np.iinfo(dtype)
        low, high = np.float32(info.min), np.float32(info.max)
        scratch = np.empty(shape, _F32)
        quantized = np.empty(shape, dtype)
        pre_scale = np.float32(pre.scale) if pre else None
        pre_offset = np.float32(pre.offset) if pre else np.float32(0.0)

        def to_quantized(x: np.ndarray) -> np.ndarray:
            x = coerce(x)
            check_finite(x)
            if pre_scale is not None:
                np.multiply(x, pre_scale, out=scratch)
                np.add(scratch, pre_offset, out=scratch)
                np.divide(scratch, scale, out=scratch)
            else:
                np.divide(x, scale, out=scratch)
            np.rint(scratch, out=scratch)
            np.add(scratch, zero_point, out=scratch)
            np.maximum(scratch, low, out=scratch)
            np.minimum(scratch, high, out=scratch)
            np.copyto(quantized, scratch, casting="unsafe")
            return quantized

        return to_quantized

    if pre is not None:

        def to_preprocessed(x: np.ndarray) -> np.ndarray:
            x = coerce(x)
            check_finite(x)
            return (x * pre.scale + pre.offset).astype(dtype, copy=False)

        return to_preprocessed

    def to_float(x: np.ndarray) -> np.ndarray:
        x = coerce(x)
        check_finite(x)
        return x if dtype == _F32 else x.astype(dtype)

    return to_float


def _output_converter(spec: TensorSpec) -> Converter | None:
    params = spec.quantization
    if params is not None and np.dtype(spec.dtype).kind in "iu":
        scale = np.float32(params.scale)
        zero_point = np.float32(params.zero_point)

        def from_quantized(y: np.ndarray) -> np.ndarray:
            out = y.astype(_F32)
            np.subtract(out, zero_point, out=out)
            np.multiply(out, scale, out=out)
            return out

        return from_quantized
    if spec.dtype != "float32":
        return lambda y: y.astype(_F32)
    return None


class Model:
    """A bundle ready to run: ``predict(*arrays)`` takes one float array per input (batch 1).

    A ``Model`` reuses buffers between calls: use one per thread.
    """

    def __init__(self, bundle: Bundle, session: Session, backend: str, threads: int = 1):
        self.bundle = bundle
        self.manifest = bundle.manifest
        self.backend = backend
        self._session = session
        self.inputs = self.manifest.inputs
        self.outputs = self.manifest.outputs
        self._to_model = [_input_converter(i, spec, self.manifest) for i, spec in enumerate(self.inputs)]
        self._from_model = [_output_converter(spec) for spec in self.outputs]
        self._arity = len(self.inputs)
        self._single = len(self.inputs) == 1 and len(self.outputs) == 1
        self._run = session.run
        self.threads = threads

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def version(self) -> int:
        return self.manifest.version

    def predict(self, *arrays: np.ndarray) -> list[np.ndarray]:
        """Run one sample: each array has the input's shape, with or without its batch dimension of 1."""
        if len(arrays) != self._arity:
            names = ", ".join(spec.name for spec in self.inputs)
            raise PayloadError(
                f"{self.name} takes {self._arity} input(s) ({names}), got {len(arrays)}", code="missing-input"
            )
        if self._single:  # the common case, without the generic loops
            (y,) = self._run([self._to_model[0](arrays[0])])
            convert = self._from_model[0]
            return [y if convert is None else convert(y)]
        raw = self._run([convert(array) for convert, array in zip(self._to_model, arrays, strict=True)])
        return [y if convert is None else convert(y) for convert, y in zip(self._from_model, raw, strict=True)]

    def interpret(
        self, inputs: Sequence[np.ndarray], outputs: Sequence[np.ndarray], *, top_k: int = 1
    ) -> Interpretation:
        """Labels and scores (classifiers) or anomaly score and flag, from one sample's float outputs."""
        return interpret(self.manifest.postprocess, inputs, outputs, top_k=top_k)


def usable_threads(wanted: int) -> int:
    """At most the CPUs this process may run on: oversubscribed interpreters slow down by orders of magnitude."""
    try:
        available = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        available = os.cpu_count() or 1
    return max(1, min(wanted, available))


def load(path: str | os.PathLike[str], *, backend: str | None = None, threads: int | None = None) -> Model:
    """Verify the bundle at ``path`` and open it; ``backend`` overrides the manifest's runtime backend."""
    bundle = read_bundle(Path(path))
    manifest = bundle.manifest
    name = backend or manifest.backend
    session = open_session(
        name,
        bundle.model_path,
        threads=usable_threads(threads or manifest.threads),
        input_names=[spec.tensor or spec.name for spec in manifest.inputs],
    )
    found = session.input_specs()
    for declared, actual in zip(manifest.inputs, found, strict=True):
        if declared.shape != actual.shape or declared.dtype != actual.dtype:
            raise BundleError(
                f"{bundle.path}: model input {declared.name} is {actual.dtype}{list(actual.shape)}, "
                f"the manifest says {declared.dtype}{list(declared.shape)}"
            )
    return Model(bundle, session, name, usable_threads(threads or manifest.threads))
