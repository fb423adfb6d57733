"""Plain int8, mixed precision and float side by side, on the digits CNN with one outlier channel.

The model is ``tests/outlier_model.py``'s (trained once, cached by content): plain int8 gives its outlier tensor one
scale and loses about 15 points; mixed precision keeps that tensor float (``conv1``, ``act1``, ``mix``: what
``edgeline export`` chooses for it, checked by tests/test_mixed_precision.py); float32 is the reference. Each variant
is exported by the same exporter (LiteRT, ONNX Runtime, TFLite Micro for cortex-m4, the Ethos-U for ethos-u55-128),
and measured in one run: accuracy on the 397 held-out digits (the microcontrollers' int8 model run by TFLite Micro's
reference kernels), the model file's size (the firmware's model array: vela's for the Ethos-U), the share of operators
computing in int8, the share of the work vela placed on the NPU, and the median latency of one inference on this
machine, one thread (interleaved rounds; a host figure, not a device's; for the Ethos-U, vela's estimate of its NPU
part, which leaves out what the Cortex-M runs).

    python benchmarks/mixed_precision.py --write benchmarks/results/mixed_precision.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from report import markdown_table, publish

from edgeline.backends import open_session
from edgeline.device_profiles import Precision, load_profile
from edgeline.export.backends import ExportRequest, get_exporter
from edgeline.export.loading import load_model
from edgeline.manifest import percent
from edgeline.quantization import dequantize, quantize
from tests.outlier_model import CALIBRATION, KEPT, TRAIN, digits, trained_outlier_model

VARIANTS = (("int8, every layer", Precision.INT8_STATIC, ()), ("int8, mixed", Precision.INT8_STATIC, KEPT),
            ("float32", Precision.FP32, ()))  # fmt: skip


MICRO = {"tflite-micro": "cortex-m4", "ethos-u": "ethos-u55-128"}
"""The microcontroller exporters, and the profile each is exported for."""


def _export(module: Any, backend: str, precision: Precision, kept: tuple[str, ...], out: Path) -> tuple[Path, Any]:
    """The model file a host can run (the int8 model vela compiled, for the Ethos-U), and what the exporter said."""
    import torch

    images, _ = digits()
    calibration = [(torch.from_numpy(images[i : i + 1]),) for i in range(CALIBRATION)]
    profile = load_profile(MICRO[backend]) if backend in MICRO else None
    request = ExportRequest(module, calibration[0], calibration, precision, out, ("x",), profile, keep_float=kept)
    exported = get_exporter(backend).export(request)
    check = exported.verification
    return out / (check.model_file if check and check.model_file else exported.model_file), exported


class _Runner:
    def __init__(self, backend: str, path: Path):
        self.session = open_session(backend, path, threads=1)
        (self.spec,), (self.output,) = self.session.input_specs(), self.session.output_specs()

    def __call__(self, image: np.ndarray) -> np.ndarray:
        x = image[None] if self.spec.quantization is None else quantize(image[None], self.spec.quantization, np.int8)
        (y,) = self.session.run([x])
        return y if self.output.quantization is None else dequantize(y, self.output.quantization)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved latency rounds")
    parser.add_argument("--write", type=Path)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    images, labels = digits()
    held_out, truth = images[TRAIN:], labels[TRAIN:]
    module = load_model(f"{trained_outlier_model()}:outlier").module
    rows = [("backend", "variant", "kept float", "held-out accuracy", "model bytes", "int8 operators", "work on NPU",
             "median ms")]  # fmt: skip
    with tempfile.TemporaryDirectory() as scratch:
        for backend in ("litert", "onnxruntime", "tflite-micro", "ethos-u"):
            runners, results, estimates = {}, {}, {}
            variants = VARIANTS if backend not in MICRO else VARIANTS[:2]  # int8 only: they take no float model
            for name, precision, kept in variants:
                out = Path(scratch) / f"{backend}-{len(runners)}"
                out.mkdir()
                path, exported = _export(module, backend, precision, kept, out)
                check = exported.verification
                runner = _Runner(check.backend if check and check.backend else exported.runtime_backend, path)
                accuracy = float(np.mean([int(np.argmax(runner(image))) == label for image, label in
                                          zip(held_out, truth, strict=True)]))  # fmt: skip
                placement = exported.placement
                share = (
                    f"{placement.quantized_ops}/{placement.ops}"
                    if placement is not None and placement.quantized_ops is not None
                    else "-"
                )
                npu = placement.accelerator_macs_share if placement is not None else None
                runners[name] = runner
                size = sum((out / f).stat().st_size for f in exported.flash_files or (exported.model_file,))
                results[name] = (", ".join(kept) or "-", f"{accuracy:.1%}", f"{size:,}", share,
                                 "-" if npu is None else percent(npu))  # fmt: skip
                if exported.estimates is not None and exported.estimates.inference_ms is not None:
                    estimates[name] = f"~{exported.estimates.inference_ms:.4f} (vela, the NPU's part)"
            times: dict[str, list[float]] = {name: [] for name in runners}
            for _ in range(args.rounds):
                for name, runner in runners.items():
                    for _ in range(20):
                        runner(held_out[0])
                    start = time.perf_counter()
                    for image in held_out[:200]:
                        runner(image)
                    times[name].append((time.perf_counter() - start) / 200 * 1000)
            for name, _, _ in variants:
                measured = f"{statistics.median(times[name]):.4f}"
                if backend in MICRO:
                    measured += " (TFLite Micro's reference kernels)"
                rows.append((backend, name, *results[name], estimates.get(name, measured)))
    publish(
        markdown_table(rows),
        script=__file__,
        title="Mixed precision: plain int8, mixed and float on a model with an outlier channel",
        intro="tests/outlier_model.py's digits CNN (one channel of `act1` 300 times the others; the float function "
        "unchanged). Accuracy on the 397 held-out digits (float: the reference; tflite-micro and ethos-u: their int8 "
        "model run by TFLite Micro's reference kernels); size of the model file (the firmware's model array; vela's "
        "for the Ethos-U); operators computing in int8 (the exporter's placement); the share of the work vela placed "
        "on the Ethos-U55-128's NPU; median latency of one inference through edgeline's session, 1 thread, mean of "
        f"200 digits per round, median of {args.rounds} interleaved rounds, on this 2-core x86-64 host (not a device "
        "figure; TFLite Micro's reference kernels are not a Cortex-M's CMSIS-NN), or for the Ethos-U vela's estimate "
        "of the NPU's part, which leaves out the operators the Cortex-M55 runs.",
        write=args.write,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
