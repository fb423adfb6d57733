"""OpenVINO int8: which activation range estimator each model gets, against what each one loses held out.

For each of the five reference models and the two models of tests/test_compute_placement.py that no choice was fitted
on (a MobileNetV3-shaped network and a pooled CNN, trained a little on digits), the float IR is quantized by NNCF with
each of ``RANGE_ESTIMATORS`` as the exporter does; each int8 model's output error on the calibration samples (the
root mean square of each sample's relative error: what the exporter chooses by) and the points it loses on the
held-out samples (accuracy against labels; the autoencoder's anomaly decisions at its threshold) are printed side by
side, with the estimator the exporter's rule chose and the one that lost least. Computed on this machine's CPU plugin
in f32 on two threads.

    python benchmarks/openvino_ranges.py --write benchmarks/results/openvino_ranges.md
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from report import markdown_table, publish

from edgeline.device_profiles import Precision
from edgeline.export.backends import ExportRequest
from edgeline.export.backends.openvino import (
    RANGE_ESTIMATORS,
    import_export_tools,
    output_error,
    quantization_parameters,
    to_openvino,
)

REFERENCES = ("digits", "resnet8", "ds_cnn", "vww", "autoencoder")
UNSEEN = ("mobilenet_v3_like", "pooled_cnn")


def reference(name: str) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, float | None]:
    """(module, calibration inputs, held-out inputs, their labels, the anomaly threshold or None)."""
    import torch

    from tests.cache import cached_reference

    prepared = cached_reference(name)
    directory = prepared.directory
    calibration = np.load(directory / "calibration.npz")
    validation = np.load(directory / "validation.npz")
    module = torch.export.load(str(directory / "model.pt2")).module()
    return module, calibration[calibration.files[0]], validation["x"], validation["labels"], prepared.threshold


def unseen(name: str) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, None]:
    """The model of tests/test_compute_placement.py, trained as that test trains it (same seed, data and steps)."""
    import torch
    from sklearn.datasets import load_digits

    from tests.test_compute_placement import MODELS

    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "models.py"
        source.write_text(MODELS, encoding="utf-8")
        spec = importlib.util.spec_from_file_location("compute_models", source)
        assert spec is not None and spec.loader is not None
        models = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(models)
        model = getattr(models, name)().train()
    data = load_digits()
    images = (data.images / 16.0).astype(np.float32)[:, None]
    labels = data.target.astype(np.int64)
    optimiser = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(4):
        for start in range(0, 1400, 64):
            x, y = torch.from_numpy(images[start : start + 64]), torch.from_numpy(labels[start : start + 64])
            optimiser.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimiser.step()
    return model.eval(), images[1400:1528], images[1528:1728], labels[1528:1728], None


def measure(name: str, ov: Any, nncf: Any) -> tuple[str, ...]:
    import torch

    module, calibration, x, labels, threshold = (reference if name in REFERENCES else unseen)(name)
    request = ExportRequest(module=module, example_inputs=(torch.from_numpy(calibration[:1]),),
                            calibration=[(sample[None],) for sample in calibration], precision=Precision.INT8_STATIC,
                            out_dir=Path(tempfile.gettempdir()), input_names=("x",))  # fmt: skip
    model, _ = to_openvino(ov, request)
    core = ov.Core()

    def outputs(ir: Any, inputs: np.ndarray) -> np.ndarray:
        compiled = core.compile_model(ir, "CPU", {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": 2})
        infer = compiled.create_infer_request()
        return np.stack(
            [np.asarray(infer.infer([s[None]])[compiled.output(0)], dtype=np.float64).ravel() for s in inputs]
        )

    def right(found: np.ndarray) -> float:
        if threshold is None:
            return float(np.mean(found.argmax(1) == labels))
        flagged = np.mean((found - x.reshape(len(x), -1)) ** 2, axis=1) > threshold
        return float(np.mean(flagged == labels.astype(bool)))

    reference_calibration, reference_right = outputs(model, calibration), right(outputs(model, x))
    feeds = nncf.Dataset([{"x": sample[None]} for sample in calibration])
    errors, lost = {}, {}
    for estimator in RANGE_ESTIMATORS:
        quantized = nncf.quantize(model.clone(), feeds, preset=nncf.QuantizationPreset.PERFORMANCE,
                                  target_device=nncf.TargetDevice.CPU, subset_size=len(calibration),
                                  advanced_parameters=quantization_parameters(estimator))  # fmt: skip
        errors[estimator] = output_error(list(outputs(quantized, calibration)), list(reference_calibration))
        lost[estimator] = 100.0 * (reference_right - right(outputs(quantized, x)))
    chosen = min(RANGE_ESTIMATORS, key=lambda estimator: errors[estimator])
    best = min(lost.values())
    return (
        name + ("" if name in REFERENCES else " (unseen)"),
        *(f"{errors[e]:.4f} / {lost[e]:+.2f}" for e in RANGE_ESTIMATORS),
        chosen,
        ", ".join(e for e in RANGE_ESTIMATORS if lost[e] == best),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, help="also save the table (markdown) to this file")
    args = parser.parse_args()
    ov, nncf = import_export_tools()
    rows: list[tuple[str, ...]] = [
        ("model", *(f"{e}: calibration error / points lost" for e in RANGE_ESTIMATORS), "chosen", "least lost")
    ]
    rows += [measure(name, ov, nncf) for name in (*REFERENCES, *UNSEEN)]
    publish(
        markdown_table(rows),
        script=__file__,
        title="OpenVINO int8: the activation range estimator per model",
        intro=__doc__.split("\n\n")[1].replace("\n", " "),
        write=args.write,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
