"""Sample files for export: CAL.npz / VAL.npz matched to the model's forward() and checked against it."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edgeline.errors import EdgelineError
from edgeline.export.errors import CalibrationError
from edgeline.export.fidelity import run_float
from edgeline.export.loading import LoadedModel
from edgeline.samples import SampleSet, check_sample_counts, match_inputs, read_npz

__all__ = ["check_model_runs", "load_model_samples"]


def load_model_samples(path: Path, role: str, loaded: LoadedModel, expected: SampleSet | None) -> SampleSet:
    source = f"{role} file {path}"
    try:
        arrays = read_npz(path, role)
        names, ordered, labels = match_inputs(arrays, loaded.forward_parameters, source, taker="the model's forward")
        inputs = []
        for key, array in zip(names, ordered, strict=True):
            if not np.issubdtype(array.dtype, np.floating):
                raise CalibrationError(f"{source}[{key}]: dtype {array.dtype}, expected floating point")
            if array.ndim < 1 or array.shape[0] < 1:
                raise CalibrationError(f"{source}[{key}]: needs a first axis of samples, got {array.shape}")
            inputs.append(np.ascontiguousarray(array, dtype=np.float32))
        check_sample_counts(inputs, labels, source)
    except CalibrationError:
        raise
    except EdgelineError as exc:
        raise CalibrationError(str(exc)) from exc
    if expected is not None:
        for key, got, want in zip(names, inputs, expected.inputs, strict=True):
            if got.shape[1:] != want.shape[1:]:
                raise CalibrationError(
                    f"{role} file {path}[{key}]: sample shape {list(got.shape[1:])} differs from the "
                    f"calibration's {list(want.shape[1:])}"
                )
    return SampleSet(inputs, labels, str(path))


def check_model_runs(loaded: LoadedModel, samples: SampleSet) -> list[np.ndarray]:
    try:
        return run_float(loaded.module, SampleSet(samples.sample(0), None, samples.source)).outputs[0]
    except Exception as exc:
        shapes = ", ".join(str(list(a.shape)) for a in samples.sample(0))
        raise CalibrationError(
            f"the model rejected a calibration sample of shape {shapes}: {type(exc).__name__}: {exc}"
        ) from exc
