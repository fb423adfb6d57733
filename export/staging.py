"""Writing a bundle into its staging directory: files, manifest and the golden self-test."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edgeline import bundle as bundle_io
from edgeline.export.backends import ExportedModel
from edgeline.manifest import Golden, Manifest
from edgeline.model import Model
from edgeline.samples import SampleSet

__all__ = ["FLOAT_GOLDEN_SAMPLES", "GOLDEN_SAMPLES", "write_bundle", "write_float_golden", "write_golden"]

GOLDEN_SAMPLES = 8
FLOAT_GOLDEN_SAMPLES = 32
"""Samples of a float-reference golden: it carries the bundle's whole fidelity check, so more than a self-test."""


def write_bundle(staging: Path, exported: ExportedModel, manifest_fields: dict[str, Any]) -> Manifest:
    files = [e for p in (exported.model_file, *exported.extra_files) for e in bundle_io.file_entries(staging, p)]
    if (staging / "golden.npz").exists():
        files.append(bundle_io.file_entry(staging, "golden.npz"))
    manifest = Manifest(files=tuple(files), **manifest_fields)
    bundle_io.write_manifest(staging, manifest)
    return manifest


def write_golden(staging: Path, model: Model, samples: SampleSet, output_steps: Sequence[float] = ()) -> Golden:
    """golden.npz from the bundle's own outputs here. ``output_steps``: per output, the quantization step of a float
    output dequantized inside the model (QDQ), which the tolerance allows twice like a quantized output's."""
    count = min(GOLDEN_SAMPLES, len(samples))
    outputs = [model.predict(*samples.sample(i)) for i in range(count)]
    arrays: dict[str, Any] = {f"input_{i}": samples.inputs[i][:count] for i in range(len(samples.inputs))}
    for j in range(len(outputs[0])):
        arrays[f"output_{j}"] = np.concatenate([o[j] for o in outputs])
    np.savez(staging / "golden.npz", allow_pickle=False, **arrays)
    # Another CPU may round differently: two quantization steps where the output is quantized, 1% of the
    # output's range where quantization happens inside the model, float noise otherwise.
    quantized_inside = model.manifest.precision != "fp32"
    atol = []
    for j, spec in enumerate(model.outputs):
        magnitude = float(np.abs(arrays[f"output_{j}"]).max())
        step = 2 * (spec.quantization.scale if spec.quantization else output_steps[j] if j < len(output_steps) else 0)
        inside = 0.01 * (1.0 + magnitude) if quantized_inside else 0.0
        atol.append(max(step, inside, 1e-4 * (1.0 + magnitude)))
    return Golden(samples=count, atol=tuple(atol))


def write_float_golden(staging: Path, samples: SampleSet, float_outputs: list[list[np.ndarray]]) -> Golden:
    """golden.npz with the float model's outputs, for a bundle nothing here can run: ``edgeline verify`` measures
    its fidelity on the device (``reference="float"``)."""
    count = min(FLOAT_GOLDEN_SAMPLES, len(samples))
    arrays: dict[str, Any] = {f"input_{i}": samples.inputs[i][:count] for i in range(len(samples.inputs))}
    for j in range(len(float_outputs[0])):
        arrays[f"output_{j}"] = np.concatenate([float_outputs[i][j] for i in range(count)])
    np.savez(staging / "golden.npz", allow_pickle=False, **arrays)
    return Golden(samples=count, reference="float")
