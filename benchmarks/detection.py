"""Detection's post-processing, side by side in one run: ``edgeline.detection``'s decoding and class-aware NMS
(numpy) against onnxruntime's ``NonMaxSuppression`` on the same candidates, and against the time of the reference
detector itself (``edgeline.export.reference.shapes``, float, torch and onnxruntime on one thread).

Candidates are a YOLOv8 output at 640x640: (1, 84, 8400), 80 classes, boxes clustered around 40 objects. Rows:

    typical   about 300 candidates over the 0.25 threshold (a real image), as answers run
    crowded   every candidate over the threshold (a model scoring everything high, or mAP's 0.001): top 1000 kept
    nms only  8400 boxes, 80 classes, capped at 100 kept: ``nms`` alone, then onnxruntime's operator (per class,
              100 per class: its cap is per class, so it does more work than a global cap of 100)

Each figure is the median of ``--repeats`` calls after one warm-up, in CPU time of the calling thread and in wall
time. The machine's load is printed with the table: this 2-core machine is shared, and load inflates wall times.

    python benchmarks/detection.py --write benchmarks/results/detection.md
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edgeline.detection import HEADS, detect, nms  # noqa: E402
from tests.test_detection_oracles import nms_session  # noqa: E402


def median_ms(call: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median CPU time of the calling thread and median wall time, in ms: on a shared machine the CPU figure is the
    one that holds (every call here runs on the calling thread: numpy, and onnxruntime with one intra-op thread)."""
    call()
    cpu, wall = [], []
    for _ in range(repeats):
        began, began_cpu = time.perf_counter(), time.thread_time()
        call()
        cpu.append(time.thread_time() - began_cpu)
        wall.append(time.perf_counter() - began)
    return statistics.median(cpu) * 1000.0, statistics.median(wall) * 1000.0


def yolov8_output(rng: np.random.Generator, hot: float) -> np.ndarray:
    """(1, 84, 8400): boxes around 40 objects; a ``hot`` share of candidates score over 0.25."""
    count, classes = 8400, 80
    centres = rng.uniform(40, 600, size=(40, 2))
    picked = centres[rng.integers(0, 40, size=count)] + rng.normal(0, 15, size=(count, 2))
    sizes = rng.uniform(20, 160, size=(count, 2))
    scores = rng.uniform(0, 0.2, size=(classes, count))
    hot_ones = rng.random(count) < hot
    chosen = rng.integers(0, classes, size=count)[hot_ones]
    scores[chosen, np.flatnonzero(hot_ones)] = rng.uniform(0.26, 1.0, int(hot_ones.sum()))
    return np.concatenate([picked.T, sizes.T, scores]).astype(np.float32)[None]


def reference_model_ms(repeats: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """The shapes detector (untrained weights: the time does not depend on them), torch and onnxruntime."""
    import tempfile

    import onnxruntime
    import torch

    from edgeline.export.reference import shapes

    torch.set_num_threads(1)
    model = shapes.build(0)
    example = torch.rand(1, *shapes.INPUT_SHAPE)
    with torch.no_grad():
        torch_ms = median_ms(lambda: model(example), repeats)
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "shapes.onnx"
        torch.onnx.export(model, (example,), str(path), dynamo=True, verbose=False)
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = 1
        session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        name = session.get_inputs()[0].name
        ort_ms = median_ms(lambda: session.run(None, {name: example.numpy()}), repeats)
    return torch_ms, ort_ms


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--write", type=Path, help="write the table (markdown) here")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    head, size = HEADS["yolov8"], (640, 640)
    rows: list[tuple[str, str, tuple[float, float], str]] = []
    for name, hot in (("typical", 300 / 8400), ("crowded", 1.0)):
        output = yolov8_output(rng, hot)
        if name == "crowded":
            output[0, 4:] += 0.3
        kept = len(detect(output, head, size))
        figures = median_ms(functools.partial(detect, output, head, size), args.repeats)
        rows.append(
            (name, "edgeline.detection.detect (decode, threshold, top 1000, NMS, cap 100)", figures, f"{kept} kept")
        )
    output = yolov8_output(rng, 1.0)
    output[0, 4:] += 0.3
    rows_cx = output[0, :4].T
    boxes = np.concatenate([rows_cx[:, :2] - rows_cx[:, 2:] / 2, rows_cx[:, :2] + rows_cx[:, 2:] / 2], 1)
    scores_table = output[0, 4:]
    classes = scores_table.argmax(0)
    best = scores_table[classes, np.arange(scores_table.shape[1])]
    kept = len(nms(boxes, best, classes, 0.45, 100))
    rows.append(("nms only", "edgeline.detection.nms, 8400 boxes, class-aware, cap 100",
                 median_ms(lambda: nms(boxes, best, classes, 0.45, 100), args.repeats), f"{kept} kept"))  # fmt: skip
    one_class = np.full_like(scores_table, -np.inf)
    one_class[classes, np.arange(len(classes))] = best  # each box scores for its best class only, as ours reads it
    run = functools.partial(nms_session(), np.ascontiguousarray(boxes[None][:, :, [1, 0, 3, 2]]), one_class[None],
                            100, 0.45, 0.25)  # fmt: skip
    selected = len(run())
    rows.append(("nms only", "onnxruntime NonMaxSuppression (1 thread), 8400 boxes, 80 classes, 100 per class",
                 median_ms(run, args.repeats), f"{selected} kept"))  # fmt: skip
    torch_ms, ort_ms = reference_model_ms(args.repeats)
    rows.append(("model", "shapes detector 96x96, float, torch (1 thread)", torch_ms, "for scale"))
    rows.append(("model", "shapes detector 96x96, float, onnxruntime (1 thread)", ort_ms, "for scale"))
    load = os.getloadavg()
    lines = [
        "# Detection post-processing",
        "",
        "    python benchmarks/detection.py --write benchmarks/results/detection.md",
        "",
        f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, numpy {np.__version__}; "
        f"load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}. Median of {args.repeats} calls.",
        "",
        "| case | what | CPU ms | wall ms | |",
        "|---|---|---|---|---|",
        *(f"| {case} | {what} | {cpu:.2f} | {wall:.2f} | {note} |" for case, what, (cpu, wall), note in rows),
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.write:
        args.write.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
