"""``Model``: a verified bundle opened on a runtime backend. Floats in, floats out."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from edgeline.arrays import all_finite
from edgeline.backends import RUNTIME_BACKENDS, Session, open_session
from edgeline.bundle import Bundle, read_bundle
from edgeline.errors import BackendUnavailableError, BundleError, PayloadError
from edgeline.imaging import frame_geometry
from edgeline.manifest import Manifest, TensorSpec
from edgeline.postprocess import Interpretation, interpret

__all__ = ["Model", "load", "open_bundle", "usable_threads"]

Converter = Callable[[np.ndarray], np.ndarray]
_F32 = np.dtype(np.float32)


class _InputConverter:
    """Checks caller arrays for one input and turns them into what the model's input tensor holds.

    The hot path: called once per input per inference, so everything that can be is computed here, once.
    ``checked`` refuses what cannot be used (shape, dtype, NaN or Inf) and gives float32 at the input's shape;
    ``convert`` quantizes (or preprocesses) checked floats of any batch size, so a batch of samples is converted in
    one pass (``Model.predict_batch``) with the same arithmetic, element for element, as one sample.
    """

    def __init__(self, index: int, spec: TensorSpec, manifest: Manifest):
        self.shape = spec.shape
        self._sample_shape = self.shape[1:] if self.shape[0] == 1 else None
        self.where = f"input {index} ({spec.name})"
        self.dtype = np.dtype(spec.dtype)
        self._pre = manifest.preprocess
        params = spec.quantization
        self._quantized = params is not None and self.dtype.kind in "iu"
        self.identity = not self._quantized and self._pre is None and self.dtype == _F32
        """Checked floats are what the model takes: ``convert`` returns them as they are."""
        if self._quantized:
            assert params is not None
            self._scale = np.float32(params.scale)
            self._zero_point = np.float32(params.zero_point)
            info = np.iinfo(self.dtype)
            self._low, self._high = np.float32(info.min), np.float32(info.max)
            self._pre_scale = np.float32(self._pre.scale) if self._pre else None
            self._pre_offset = np.float32(self._pre.offset) if self._pre else np.float32(0.0)
        self._scratch: dict[tuple[int, ...], np.ndarray] = {}
        self._out = np.empty(self.shape, self.dtype)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """One sample, checked and converted (into a buffer reused by the next call)."""
        return self.convert(self.checked(x), self._out)

    def checked(self, x: np.ndarray) -> np.ndarray:
        if not isinstance(x, np.ndarray):
            x = np.asarray(x)
        if x.shape != self.shape:
            if x.shape != self._sample_shape:
                raise PayloadError(
                    f"{self.where}: shape {list(x.shape)}, expected {list(self.shape)}", code="wrong-shape"
                )
            x = x.reshape(self.shape)
        if x.dtype != _F32:
            if x.dtype.kind not in "fiu":
                raise PayloadError(f"{self.where}: dtype {x.dtype}, expected float32", code="wrong-dtype")
            with np.errstate(over="ignore"):  # out-of-range values become Inf, refused just below
                x = x.astype(_F32)
        if not all_finite(x):
            raise PayloadError(f"{self.where}: contains NaN or Inf", code="non-finite")
        return x

    def convert(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        """``x`` (checked float32, any leading size) as the model's input, written to ``out`` of the same shape
        (except when checked floats are the input already: then ``x`` itself)."""
        if self.identity:
            return x
        if not self._quantized:
            assert self._pre is not None or self.dtype != _F32
            y = x * self._pre.scale + self._pre.offset if self._pre is not None else x
            np.copyto(out, y, casting="unsafe")
            return out
        scratch = self._scratch.get(x.shape)
        if scratch is None:
            scratch = self._scratch[x.shape] = np.empty(x.shape, _F32)
        if self._pre_scale is not None:
            np.multiply(x, self._pre_scale, out=scratch)
            np.add(scratch, self._pre_offset, out=scratch)
            np.divide(scratch, self._scale, out=scratch)
        else:
            np.divide(x, self._scale, out=scratch)
        np.rint(scratch, out=scratch)
        np.add(scratch, self._zero_point, out=scratch)
        np.maximum(scratch, self._low, out=scratch)
        np.minimum(scratch, self._high, out=scratch)
        np.copyto(out, scratch, casting="unsafe")
        return out


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
        self._to_model = [_InputConverter(i, spec, self.manifest) for i, spec in enumerate(self.inputs)]
        self._from_model = [_output_converter(spec) for spec in self.outputs]
        self._arity = len(self.inputs)
        self._single = len(self.inputs) == 1 and len(self.outputs) == 1
        self._run = session.run
        self.threads = threads
        self.batch_size = 1
        """Samples per call of ``predict_batch``: 1 until ``enable_batching`` has checked a larger size."""
        self.batching = "off"
        """Why ``batch_size`` is what it is, for logs and the daemon's start-up line."""
        self._batched: Session | None = None
        self._batch_inputs: list[np.ndarray] = []
        self._batch_checked: list[np.ndarray] = []

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def accelerator(self) -> str | None:
        """What really runs the model here (None: the CPU)."""
        return self._session.accelerator

    @property
    def runtime(self) -> str | None:
        """Which of its backend's runtimes runs the model, where a backend has more than one: ExecuTorch's
        ``torch-free`` C++ runtime or its ``python`` runtime (which imports torch); None otherwise."""
        kind = getattr(self._session, "runtime", None)
        return kind if isinstance(kind, str) else None

    @property
    def computes(self) -> str | None:
        """The arithmetic the runtime computes the model's floating-point operators in here, as its session says
        (OpenVINO's CPU plugin chooses by the CPU: f32 or f16; the CPU runtimes f32; QNN's HTP f16); None where a
        session cannot say (Core ML, an ExecuTorch delegate)."""
        found = getattr(self._session, "computes", None)
        return found if isinstance(found, str) else None

    @property
    def from_cache(self) -> bool | None:
        """Whether the runtime loaded the model already compiled from its cache (OpenVINO's, in the daemon's state
        directory) rather than compiling it; None for a runtime without one."""
        found = getattr(self._session, "from_cache", None)
        return found if isinstance(found, bool) else None

    @property
    def accelerator_fallback(self) -> str | None:
        """Why the model does not run on the accelerator its bundle was built for, or None when it does."""
        wanted = self.manifest.placement.accelerator if self.manifest.placement else None
        if wanted is None or self._session.accelerator == wanted:
            return None
        found = self._session.accelerator or "the CPU"
        reason = getattr(self._session, "fallback_reason", None)
        return f"built for {wanted} but running on {found}" + (f": {reason}" if reason else "")

    @property
    def model_file(self) -> str:
        """The bundle's file the runtime runs: the manifest's model, or the int8 model an Ethos-U bundle runs on the
        CPU where the NPU is absent."""
        path = getattr(self._session, "model_path", None)
        return path.name if isinstance(path, Path) else self.manifest.model

    @property
    def arena_bytes(self) -> int | None:
        """The tensor arena the runtime used for the model (TFLite Micro's), or None where a runtime has none."""
        used = getattr(self._session, "arena_used_bytes", None)
        return used() if callable(used) else None

    @property
    def emulator(self) -> str | None:
        """What emulates the accelerator here (e.g. the QNN HTP emulator on x86-64), or None: its timings say
        nothing about the device."""
        return getattr(self._session, "emulator", None)

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

    def enable_batching(self, size: int) -> int:
        """Run ``size`` samples per call from now on, if the model allows it; returns the batch size in force.

        Allowed only when the runtime can resize the model's inputs, and the resized model gives the single-sample
        outputs on every golden sample (tiled to ``size``): a check on this device, with this runtime, at start-up.
        """
        if size <= 1:
            self.batching = "off"
            return self.batch_size
        reason = self._batching_refused(size)
        if reason is not None:
            self.batching = f"one sample per call: {reason}"
            return self.batch_size
        self.batching = f"up to {size} queued samples per call (checked against single calls on golden.npz)"
        return size

    def _batching_refused(self, size: int) -> str | None:
        if any(spec.shape[0] != 1 for spec in self.inputs) or any(spec.shape[0] != 1 for spec in self.outputs):
            return "the model's first dimension is not a batch of 1"
        opener = getattr(self._session, "batched", None)
        if opener is None:
            return f"the {self.backend} runtime runs the model at its exported shape"
        golden = self.manifest.golden
        if golden is None:
            return "no golden.npz to check batched outputs against"
        batched: Session | None = opener(size)
        if batched is None:
            return "the model's graph is fixed to a batch of 1"
        from edgeline.samples import read_golden

        inputs, _ = read_golden(self.bundle.file(golden.path), golden, self.inputs, self.outputs)
        picks = [i % golden.samples for i in range(size)]
        samples = [[np.asarray(a[i : i + 1], np.float32) for a in inputs] for i in picks]
        single = [self.predict(*sample) for sample in samples]
        self._batched, self.batch_size = batched, size
        self._batch_checked = [np.zeros((size, *spec.shape[1:]), _F32) for spec in self.inputs]
        self._batch_inputs = [
            checked if convert.identity else np.zeros(checked.shape, convert.dtype)
            for checked, convert in zip(self._batch_checked, self._to_model, strict=True)
        ]
        together = self.predict_batch(samples)
        for one, other in zip(single, together, strict=True):
            if isinstance(other, PayloadError) or not all(
                np.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(one, other, strict=True)
            ):
                self._batched, self._batch_inputs, self._batch_checked, self.batch_size = None, [], [], 1
                return "batched outputs differ from single ones on golden.npz"
        return None

    def predict_batch(self, samples: Sequence[Sequence[np.ndarray]]) -> list[list[np.ndarray] | PayloadError]:
        """Up to ``batch_size`` samples in one call. Each sample is what ``predict`` takes; each answer is what
        ``predict`` returns, or the ``PayloadError`` that sample alone earned (the others still run)."""
        if self._batched is None:
            raise RuntimeError("predict_batch before enable_batching allowed it")
        if len(samples) > self.batch_size:
            raise ValueError(f"{len(samples)} samples for a batch of {self.batch_size}")
        answers: list[list[np.ndarray] | PayloadError] = []
        good: list[int] = []
        for row, arrays in enumerate(samples):
            try:
                if len(arrays) != self._arity:
                    raise PayloadError(
                        f"{self.name} takes {self._arity} input(s), got {len(arrays)}", code="missing-input"
                    )
                checked = [convert.checked(array) for convert, array in zip(self._to_model, arrays, strict=True)]
            except PayloadError as exc:
                answers.append(exc)
                continue
            for buffer, x in zip(self._batch_checked, checked, strict=True):
                buffer[row] = x[0]
            answers.append([])
            good.append(row)
        if good:  # rows past len(samples), or refused, hold stale (checked) inputs: their outputs are never read
            inputs = [
                convert.convert(checked, out)
                for convert, checked, out in zip(self._to_model, self._batch_checked, self._batch_inputs, strict=True)
            ]
            raw = self._batched.run(inputs)
            outputs = [y if convert is None else convert(y) for convert, y in zip(self._from_model, raw, strict=True)]
            for row in good:
                answers[row] = [output[row : row + 1].copy() for output in outputs]
        return answers

    def interpret(
        self,
        inputs: Sequence[np.ndarray],
        outputs: Sequence[np.ndarray],
        *,
        top_k: int = 1,
        frame_size: tuple[int, int] | None = None,
        overrides: Mapping[str, float] | None = None,
    ) -> Interpretation:
        """Labels and scores (classifiers), anomaly score and flag, or boxes (detectors), from one sample's float
        outputs. ``frame_size`` (height, width): the frame input 0 was made from by the manifest's ``image``, whose
        coordinates a detector's boxes are given in (normalised); without it, the input's."""
        geometry = None
        post = self.manifest.postprocess
        if frame_size is not None and self.manifest.image is not None and post.kind == "detect":
            geometry = frame_geometry(self.manifest.image, *frame_size)
        return interpret(post, inputs, outputs, top_k=top_k, geometry=geometry, overrides=overrides)


def usable_threads(wanted: int) -> int:
    """At most the CPUs this process may run on: oversubscribed interpreters slow down by orders of magnitude."""
    try:
        available = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        available = os.cpu_count() or 1
    return max(1, min(wanted, available))


def load(
    path: str | os.PathLike[str],
    *,
    backend: str | None = None,
    threads: int | None = None,
    model_file: str | None = None,
) -> Model:
    """Verify the bundle at ``path`` and open it; ``backend`` overrides the manifest's runtime backend and
    ``model_file`` (a file the manifest lists) its model, as export does to measure a model it cannot run here."""
    return open_bundle(read_bundle(Path(path)), backend=backend, threads=threads, model_file=model_file)


def open_bundle(
    bundle: Bundle,
    *,
    backend: str | None = None,
    threads: int | None = None,
    model_file: str | None = None,
) -> Model:
    """``load`` for a bundle read (and verified) already by ``edgeline.bundle.read_bundle``: the daemon reads its
    bundle once and opens what it read, without parsing the manifest or hashing the files again."""
    manifest = bundle.manifest
    name = backend or manifest.backend
    model_path = bundle.model_path
    if model_file is None:  # what `edgeline doctor BUNDLE` answers; export opens a named file to measure it
        from edgeline.verdicts import verdict_for

        verdict = verdict_for(manifest, backend=backend)
        if not verdict.runs and name in RUNTIME_BACKENDS:  # an unknown name: open_session lists the valid ones
            raise BackendUnavailableError(f"{bundle.path} cannot run here: {verdict.reason}")
        if verdict.cpu_instead:  # a fallback only the verdict sees: the CPU copy, on the CPU
            session = open_session(
                name,
                bundle.file(verdict.model),
                threads=usable_threads(threads or manifest.threads),
                input_names=[spec.tensor or spec.name for spec in manifest.inputs],
            )
            session.fallback_reason = verdict.fallback  # type: ignore[attr-defined]
            session.model_path = bundle.file(verdict.model)  # type: ignore[attr-defined]  # Model.model_file
            return _checked(bundle, session, name, threads)
    else:
        if model_file not in {entry.path for entry in manifest.files}:
            raise BundleError(f"{bundle.path}: {model_file} is not a file of the bundle")
        model_path = bundle.file(model_file)
    session = open_session(
        name,
        model_path,
        threads=usable_threads(threads or manifest.threads),
        input_names=[spec.tensor or spec.name for spec in manifest.inputs],
        accelerator=manifest.placement.accelerator if manifest.placement else None,
    )
    return _checked(bundle, session, name, threads)


def _checked(bundle: Bundle, session: Session, name: str, threads: int | None) -> Model:
    """The model, once its inputs are what the manifest says."""
    manifest = bundle.manifest
    found = session.input_specs()
    for declared, actual in zip(manifest.inputs, found, strict=True):
        if declared.shape != actual.shape or declared.dtype != actual.dtype:
            raise BundleError(
                f"{bundle.path}: model input {declared.name} is {actual.dtype}{list(actual.shape)}, "
                f"the manifest says {declared.dtype}{list(declared.shape)}"
            )
    return Model(bundle, session, name, usable_threads(threads or manifest.threads))
