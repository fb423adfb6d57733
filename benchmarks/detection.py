"""Detection, side by side in one run (issue 52, "Figures"):

    targets   the reference detector (``edgeline.export.reference.shapes``, 96x96, YOLOv8-style head, prepared with
              ``edgeline reference prepare``) through ``run_export`` on every export target and precision: COCO
              mAP@0.5 and @0.5:0.95 of the float model and of the bundle on the held-out images (the manifest's
              fidelity), the bundle's mAP against the float model's detections, model bytes, host latency, and
              ``edgeline.detection`` post-processing (decode, threshold, NMS) on that bundle's own output
    trap      pixel boxes concatenated with scores, int8: the reference detector and a 384x384 variant whose boxes
              span 0 to 384 (tests/detector_variants.py), exported with the boxes left in pixels
              (``ExportOptions.scale_boxes=False``, what a plain int8 export does) against what edgeline ships
              (divided by the input size inside the model): mAP, and the score values int8 leaves on one image
    large     a YOLOv8n-sized detector at 640x640 built here, untrained (strides 8/16/32: 8,400 candidates of 84
              attributes): its float time on onnxruntime, one thread, against post-processing on its real output
    post      post-processing alone on synthetic YOLOv8 outputs at 640x640 (1, 84, 8400), against onnxruntime's
              ``NonMaxSuppression``:
                typical   about 300 candidates over the 0.25 threshold (a real image), as answers run
                crowded   every candidate over the threshold (a model scoring everything high, or mAP's 0.001):
                          top 1000 kept
                nms only  8400 boxes, 80 classes, capped at 100 kept: ``nms`` alone, then onnxruntime's operator
                          (100 per class: its cap is per class, so it does more work than a global cap of 100)

Targets: the rpi5 profile's budgets and CPU with the targets it does not list added (litert fp32/fp16/int8-static,
onnxruntime, executorch-xnnpack and openvino fp32/int8-static; one thread each, so that host latencies compare),
exported with ``--all`` semantics: one float run serves every target, a failing or rejected target is a row with
its reason. qnn-htp on qcs6490 (its HTP emulator), tflite-micro on cortex-m4, ethos-u on ethos-u55-128: the
profiles that list them. Post-processing figures are the median of ``--repeats`` calls after one warm-up, in CPU
time of the calling thread (this 2-core machine is shared: the load is written with the tables).

    python benchmarks/detection.py --write benchmarks/results/detection.md
    python benchmarks/detection.py --parts post          # the post-processing table alone, in seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import functools
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edgeline.detection import HEADS, detect, nms  # noqa: E402
from tests.test_detection_oracles import nms_session  # noqa: E402

PARTS = ("targets", "trap", "large", "post")
PROFILES = ROOT / "device_profiles" / "profiles"
RPI5_TARGETS = (
    ("litert", "fp32"), ("litert", "fp16"), ("litert", "int8-static"), ("onnxruntime", "fp32"),
    ("onnxruntime", "int8-static"), ("executorch-xnnpack", "fp32"), ("executorch-xnnpack", "int8-static"),
    ("openvino", "fp32"), ("openvino", "int8-static"),
)  # fmt: skip
OTHER_TARGETS = (("qcs6490", "qnn-htp"), ("cortex-m4", "tflite-micro"), ("ethos-u55-128", "ethos-u"))
"""(bundled profile, backend): each exported on the profile that lists it, the other targets of it left out."""
INT8_MAP_TOLERANCE = 0.02
LATENCY_KIND = {
    "qnn-htp": "HTP emulator on the host",
    "tflite-micro": "TFLite Micro interpreter on the host",
    "ethos-u": "vela estimate",
}
"""What a target's latency figure is, where it is not the runtime itself timed on this host."""


def progress_line(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


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


# -- the reference detector through run_export ------------------------------------------------------------------------


@dataclasses.dataclass
class TargetRow:
    """One export target's figures (None where the export did not get that far)."""

    model: str
    profile: str
    backend: str
    precision: str
    status: str
    fidelity: Any = None
    size_bytes: int | None = None
    latency: str = "-"
    nms_ms: str = "-"
    bundle: Path | None = None

    def cells(self) -> list[str]:
        f = self.fidelity

        def pair(bundle: float | None, float_: float | None) -> str:
            return "-" if bundle is None or float_ is None else f"{float_:.3f} → {bundle:.3f}"

        figures = [
            pair(getattr(f, "map50", None), getattr(f, "map50_float", None)),
            pair(getattr(f, "map50_95", None), getattr(f, "map50_95_float", None)),
            "-" if getattr(f, "map50_agreement", None) is None else f"{f.map50_agreement:.3f}",
        ]
        size = "-" if self.size_bytes is None else f"{self.size_bytes:,}"
        return [self.profile, f"{self.backend} {self.precision}", *figures, size, self.latency, self.nms_ms,
                self.status]  # fmt: skip


def profile_copy(folder: Path, base: str, targets: tuple[tuple[str, str], ...], *,
                 max_map_drop: float | None = None) -> Path:  # fmt: skip
    """Bundled profile ``base`` with ``targets`` instead of its own (one thread each), its budgets as they are
    (``max_map_drop`` replaced when given), written into ``folder``."""
    text = (PROFILES / f"{base}.toml").read_text(encoding="utf-8")
    head, _, rest = text.partition("[[targets]]")
    budgets = rest[rest.index("[budgets]") :]
    if max_map_drop is not None:
        budgets = budgets.replace("[budgets]\n", f"[budgets]\nmax_map_drop = {max_map_drop:g}\n", 1)
    listed = "".join(f'[[targets]]\nbackend = "{b}"\nprecision = "{p}"\nthreads = 1\n\n' for b, p in targets)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{base}.toml"
    path.write_text(head + listed + budgets, encoding="utf-8")
    return path


def export_rows(reference: Any, model: str, profile: Path | str, out: Path, label: str, *, backend: str | None = None,
                preprocess: bool = True, **options: Any) -> list[TargetRow]:  # fmt: skip
    """``run_export`` with every target of ``profile`` (``--all``), one row each; a run that fails as a whole gives
    one failed row."""
    from edgeline.export.pipeline import ExportOptions, run_export
    from edgeline.export.progress import Progress
    from edgeline.imaging import parse_preprocess

    request = ExportOptions(
        model=model, profile=str(profile), calibration=reference.calibration_path,
        validation=reference.validation_path, backend=backend, out=out, force=True, task="detect",
        labels=reference.labels, all_targets=True, detection={"head": "yolov8"},
        preprocess=parse_preprocess(reference.image) if preprocess else None, **options,
    )  # fmt: skip
    profile_id = Path(profile).stem
    progress_line(f"{label}: exporting {model} for {profile_id}")
    try:
        report = run_export(request, Progress(sys.stderr, live=False))
    except Exception as exc:  # a run that fails as a whole is a row with its reason, not a crash
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return [TargetRow(label, profile_id, backend or "*", "*", f"failed: {reason}")]
    rows = []
    for outcome in report.outcomes:
        status = {"passed": "selected"}.get(outcome.status, outcome.status)
        if outcome.reason:
            status += f": {outcome.reason}"
        if outcome.kept_float:
            status += f" (mixed precision: {len(outcome.kept_float)} layers kept in float)"
        latency = "-"
        kind = LATENCY_KIND.get(outcome.backend, "host")
        if outcome.host_latency_ms is not None:
            latency = f"{outcome.host_latency_ms:.3f} ms ({kind})"
        elif outcome.estimates is not None and outcome.estimates.inference_ms is not None:
            estimates = outcome.estimates
            latency = f"{estimates.inference_ms:.3f} ms ({kind}, {estimates.clock_mhz:g} MHz)"
        rows.append(TargetRow(label, profile_id, outcome.backend, outcome.precision, status, outcome.fidelity,
                              outcome.size_bytes, latency, bundle=outcome.bundle))  # fmt: skip
    return rows


def bundle_output(bundle: Path, image: Path) -> tuple[Any, np.ndarray, Callable[[], object]]:
    """The bundle's manifest, its output 0 on ``image`` through ``edgeline.load`` as a device runs it, and that
    call (for timing)."""
    from edgeline.imaging import FramePrep, read_image
    from edgeline.model import load

    model = load(bundle, threads=1)
    prep = FramePrep(model.manifest.image, model.inputs[0])  # type: ignore[arg-type]
    frame = prep(read_image(image))
    return model.manifest, model.predict(frame)[0], functools.partial(model.predict, frame)


def time_post(rows: list[TargetRow], image: Path, repeats: int) -> None:
    """Each row's NMS column: the device's post-processing (``frame_detections``: decode, threshold, NMS) on that
    bundle's own output for ``image``, median CPU ms; and where the export timed nothing (an emulator, an
    interpreter), the latency column from ``edgeline.load``'s predict here."""
    from edgeline.postprocess import frame_detections

    for row in rows:
        if row.bundle is None:
            continue
        try:
            manifest, output, predict = bundle_output(row.bundle, image)
        except Exception as exc:  # a bundle this host cannot run (an NPU's): say so in its cell
            row.nms_ms = f"not run here ({type(exc).__name__}: {str(exc).splitlines()[0][:80]})"
            continue
        post = manifest.postprocess
        kept = len(frame_detections(post, output, None))
        cpu, _ = median_ms(lambda: frame_detections(post, output, None), repeats)  # noqa: B023
        row.nms_ms = f"{cpu:.3f} ({kept} kept)"
        if row.backend == "ethos-u":  # edgeline.load runs the bundle's int8 model on TFLite Micro without the NPU
            row.nms_ms += " on model_int8.tflite's output (the NPU is not here)"
        if row.latency == "-":
            _, wall = median_ms(predict, max(5, repeats // 5))
            kind = LATENCY_KIND.get(row.backend, "host")
            row.latency = f"{wall:.3f} ms ({kind}; not timed by the export: edgeline.load's predict, wall)"


def int8_verdict(row: TargetRow) -> str | None:
    """Whether an integer bundle keeps mAP@0.5 within ``INT8_MAP_TOLERANCE`` of the float model's, and if not why."""
    f = row.fidelity
    if "int8" not in row.precision or f is None or f.map50 is None or f.map50_float is None:
        return None
    drop = f.map50_float - f.map50
    within = "within" if drop <= INT8_MAP_TOLERANCE else "NOT within"
    line = f"{row.backend} {row.precision}: mAP@0.5 {f.map50_float:.3f} → {f.map50:.3f} (drop {drop:+.3f}), "
    line += f"{within} {INT8_MAP_TOLERANCE} on {f.samples} held-out images"
    if drop > INT8_MAP_TOLERANCE:
        line += f" ({row.status})"
    return line


def score_levels(output: np.ndarray) -> str:
    """The distinct score values of an attributes-first output (1, 4+C, N): how finely int8 left them."""
    levels = np.unique(np.round(output[0, 4:].astype(np.float64), 6))
    shown = ", ".join(f"{v:.3g}" for v in levels[:5])
    return f"{len(levels)}: {shown}{', ...' if len(levels) > 5 else ''} (max {levels[-1]:.3g})"


def prepared_reference(work: Path) -> Any:
    from edgeline.export.reference import prepare

    progress_line("the reference detector: edgeline reference prepare shapes (trained once per --work folder)")
    return prepare("shapes", work / "reference" / "shapes")


# -- the pixel-box-concat trap ----------------------------------------------------------------------------------------


def trap_rows(reference: Any, work: Path, shipped: list[TargetRow]) -> list[tuple[TargetRow, str, str]]:
    """(row, box handling, score levels on the first held-out image) for plain and shipped int8 exports of the
    reference detector and of the 384x384 variant."""
    import torch

    from edgeline.device_profiles.loader import load_profile
    from edgeline.export.reference import shapes
    from tests.detector_variants import UPSCALED_FILE, write_variants

    variants = work / "variants"
    variants.mkdir(parents=True, exist_ok=True)
    program = torch.export.load(reference.model_path)
    weights = shapes.build(0).state_dict()
    torch.save({key: program.state_dict[key] for key in weights}, variants / "detector.pt")
    write_variants(variants)
    pairs = (("litert", "int8-static"), ("onnxruntime", "int8-static"))
    budget = load_profile("rpi5").budgets.max_map_drop
    opened = profile_copy(work / "profiles" / "opened", "rpi5", pairs, max_map_drop=100)
    real = profile_copy(work / "profiles" / "trap", "rpi5", pairs)
    image = sorted((reference.validation_path / "images").iterdir())[0]
    cases = (
        ("shapes 96x96, boxes 0-96", str(reference.model_path), True),
        ("upscaled 384x384, boxes 0-384", f"{variants / UPSCALED_FILE}:model", False),
    )
    rows: list[tuple[TargetRow, str, str]] = []
    for label, model, preprocess in cases:
        plain = export_rows(reference, model, opened, work / "bundles" / f"plain-{len(rows)}", label,
                            preprocess=preprocess, scale_boxes=False, mixed_precision=False)  # fmt: skip
        for row in plain:  # measured with the budget opened (so the bundle is written): judged here by rpi5's
            f = row.fidelity
            if f is not None and f.map50 is not None and f.map50_float is not None:
                drop = (f.map50_float - f.map50) * 100
                verdict = "rejected" if drop > budget else "passes"
                row.status = f"{verdict} by rpi5's budget: mAP@0.5 drop {drop:.2f} points (budget {budget:g})"
        reused = [r for r in shipped if r.model == "shapes" and (r.backend, r.precision) in pairs]
        if preprocess and len(reused) == len(pairs):
            ours = [dataclasses.replace(r, model=label) for r in reused]
        else:
            ours = export_rows(reference, model, real, work / "bundles" / f"shipped-{len(rows)}", label,
                               preprocess=preprocess)  # fmt: skip
        for row, handling in [*((r, "left in pixels (plain int8)") for r in plain),
                              *((r, "divided inside the model (edgeline)") for r in ours)]:  # fmt: skip
            levels = "-"
            if row.bundle is not None:
                _, output, _ = bundle_output(row.bundle, image)
                levels = score_levels(output)
                handling += f"; step of output 0 {_step(output)}, of its scores {_step(output[0, 4:])}"
            rows.append((row, handling, levels))
    return rows


def _step(output: np.ndarray) -> str:
    """The median gap between neighbouring distinct values: the int8 step they were left on."""
    gaps = np.diff(np.unique(np.round(output.astype(np.float64), 6)))
    return f"{np.median(gaps):.3g}" if len(gaps) else "-"


# -- a YOLOv8n-sized model at 640x640 ---------------------------------------------------------------------------------


def yolov8n(classes: int = 80) -> Any:
    """YOLOv8n's layout (width 0.25, depth 0.33: Conv-BN-SiLU, C2f, SPPF, FPN+PAN neck, decoupled head with DFL),
    untrained, giving what Ultralytics exports: (1, 4+C, 8400), cx, cy, w, h in input pixels, sigmoid scores."""
    import torch
    from torch import nn

    class Conv(nn.Sequential):
        def __init__(self, c1: int, c2: int, k: int = 1, s: int = 1):
            super().__init__(nn.Conv2d(c1, c2, k, s, k // 2, bias=False), nn.BatchNorm2d(c2), nn.SiLU())

    class Bottleneck(nn.Module):
        def __init__(self, c: int, shortcut: bool):
            super().__init__()
            self.cv1, self.cv2, self.add = Conv(c, c, 3), Conv(c, c, 3), shortcut

        def forward(self, x: Any) -> Any:
            y = self.cv2(self.cv1(x))
            return x + y if self.add else y

    class C2f(nn.Module):
        def __init__(self, c1: int, c2: int, n: int, shortcut: bool = True):
            super().__init__()
            self.c = c2 // 2
            self.cv1, self.cv2 = Conv(c1, 2 * self.c), Conv((2 + n) * self.c, c2)
            self.m = nn.ModuleList(Bottleneck(self.c, shortcut) for _ in range(n))

        def forward(self, x: Any) -> Any:
            y = list(self.cv1(x).chunk(2, 1))
            y.extend(m(y[-1]) for m in self.m)
            return self.cv2(torch.cat(y, 1))

    class SPPF(nn.Module):
        def __init__(self, c1: int, c2: int):
            super().__init__()
            self.cv1, self.cv2, self.m = Conv(c1, c1 // 2), Conv(c1 * 2, c2), nn.MaxPool2d(5, 1, 2)

        def forward(self, x: Any) -> Any:
            y = [self.cv1(x)]
            y.extend(self.m(y[-1]) for _ in range(3))
            return self.cv2(torch.cat(y, 1))

    class Detector(nn.Module):
        points: torch.Tensor
        strides: torch.Tensor

        def __init__(self) -> None:
            super().__init__()
            up = nn.Upsample(scale_factor=2.0, mode="nearest")
            self.b1 = nn.Sequential(Conv(3, 16, 3, 2), Conv(16, 32, 3, 2), C2f(32, 32, 1), Conv(32, 64, 3, 2),
                                    C2f(64, 64, 2))  # fmt: skip
            self.b2 = nn.Sequential(Conv(64, 128, 3, 2), C2f(128, 128, 2))
            self.b3 = nn.Sequential(Conv(128, 256, 3, 2), C2f(256, 256, 1), SPPF(256, 256))
            self.up, self.n1, self.n2 = up, C2f(384, 128, 1, False), C2f(192, 64, 1, False)
            self.d1, self.n3 = Conv(64, 64, 3, 2), C2f(192, 128, 1, False)
            self.d2, self.n4 = Conv(128, 128, 3, 2), C2f(384, 256, 1, False)
            self.box = nn.ModuleList(nn.Sequential(Conv(c, 64, 3), Conv(64, 64, 3), nn.Conv2d(64, 64, 1))
                                     for c in (64, 128, 256))  # fmt: skip
            self.cls = nn.ModuleList(nn.Sequential(Conv(c, 80, 3), Conv(80, 80, 3), nn.Conv2d(80, classes, 1))
                                     for c in (64, 128, 256))  # fmt: skip
            self.dfl = nn.Conv2d(16, 1, 1, bias=False).requires_grad_(False)
            self.dfl.weight.data[:] = torch.arange(16, dtype=torch.float32).view(1, 16, 1, 1)
            points, strides = [], []
            for stride in (8, 16, 32):
                side = 640 // stride
                ys, xs = torch.meshgrid(torch.arange(side) + 0.5, torch.arange(side) + 0.5, indexing="ij")
                points.append(torch.stack([xs.flatten(), ys.flatten()]))
                strides.append(torch.full((1, side * side), float(stride)))
            self.register_buffer("points", torch.cat(points, 1))
            self.register_buffer("strides", torch.cat(strides, 1))

        def forward(self, x: Any) -> Any:
            p3 = self.b1(x)
            p4 = self.b2(p3)
            p5 = self.b3(p4)
            n4 = self.n1(torch.cat([self.up(p5), p4], 1))
            n3 = self.n2(torch.cat([self.up(n4), p3], 1))
            n4 = self.n3(torch.cat([self.d1(n3), n4], 1))
            n5 = self.n4(torch.cat([self.d2(n4), p5], 1))
            levels = (n3, n4, n5)
            box = torch.cat([b(f).flatten(2) for b, f in zip(self.box, levels, strict=True)], 2)  # (1, 64, 8400)
            cls = torch.cat([c(f).flatten(2) for c, f in zip(self.cls, levels, strict=True)], 2)
            bins = box.view(1, 4, 16, -1).transpose(2, 1).softmax(1)
            distances = self.dfl(bins).view(1, 4, -1)  # left, top, right, bottom in cells
            top_left, bottom_right = self.points - distances[:, :2], self.points + distances[:, 2:]
            xywh = torch.cat([(top_left + bottom_right) / 2, bottom_right - top_left], 1) * self.strides
            return torch.cat([xywh, cls.sigmoid()], 1)

    return Detector().eval()


def conv_macs(model: Any, example: Any) -> int:
    """Multiply-accumulates of every convolution in one forward pass."""
    import torch
    from torch import nn

    total = [0]

    def count(module: Any, _: Any, output: Any) -> None:
        total[0] += (
            output.numel() * (module.in_channels // module.groups) * module.kernel_size[0] * module.kernel_size[1]
        )

    hooks = [m.register_forward_hook(count) for m in model.modules() if isinstance(m, nn.Conv2d)]
    with torch.no_grad():
        model(example)
    for hook in hooks:
        hook.remove()
    return total[0]


def large_rows(work: Path, repeats: int) -> list[tuple[str, str, str]]:
    """The 640x640 model's float time on onnxruntime (one thread) and post-processing on its real output."""
    import onnxruntime
    import torch

    progress_line("large: building and exporting a YOLOv8n-sized detector (640x640) to ONNX")
    torch.manual_seed(0)
    model = yolov8n()
    example = torch.rand(1, 3, 640, 640)
    macs = conv_macs(model, example)
    parameters = sum(p.numel() for p in model.parameters())
    path = work / "yolov8n-sized.onnx"
    torch.onnx.export(model, (example,), str(path), dynamo=True, verbose=False)
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    feed = {name: example.numpy()}
    output = session.run(None, feed)[0]
    assert output.shape == (1, 84, 8400), output.shape
    progress_line("large: timing the model and post-processing")
    model_cpu, model_wall = median_ms(lambda: session.run(None, feed), max(5, repeats // 5))
    head, size = HEADS["yolov8"], (640, 640)
    kept = len(detect(output, head, size))
    over = int((output[0, 4:].max(0) > 0.25).sum())
    post_cpu, post_wall = median_ms(functools.partial(detect, output, head, size), repeats)
    what = f"untrained, {parameters / 1e6:.2f} M parameters, {macs / 1e9:.2f} G multiply-accumulates"
    return [
        ("YOLOv8n-sized detector 640x640, float, onnxruntime (1 thread)", f"{model_cpu:.1f} / {model_wall:.1f}", what),
        ("edgeline.detection.detect on its output (decode, threshold 0.25, top 1000, NMS, cap 100)",
         f"{post_cpu:.2f} / {post_wall:.2f}",
         f"{over} of 8400 candidates over 0.25, {kept} kept; {post_cpu / model_cpu:.1%} of the model's CPU time"),
    ]  # fmt: skip


# -- post-processing alone --------------------------------------------------------------------------------------------


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
    import onnxruntime
    import torch

    from edgeline.export.reference import shapes

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


def post_rows(repeats: int) -> list[tuple[str, str, tuple[float, float], str]]:
    progress_line("post: post-processing on synthetic 640x640 outputs")
    rng = np.random.default_rng(0)
    head, size = HEADS["yolov8"], (640, 640)
    rows: list[tuple[str, str, tuple[float, float], str]] = []
    for name, hot in (("typical", 300 / 8400), ("crowded", 1.0)):
        output = yolov8_output(rng, hot)
        if name == "crowded":
            output[0, 4:] += 0.3
        kept = len(detect(output, head, size))
        figures = median_ms(functools.partial(detect, output, head, size), repeats)
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
                 median_ms(lambda: nms(boxes, best, classes, 0.45, 100), repeats), f"{kept} kept"))  # fmt: skip
    one_class = np.full_like(scores_table, -np.inf)
    one_class[classes, np.arange(len(classes))] = best  # each box scores for its best class only, as ours reads it
    run = functools.partial(nms_session(), np.ascontiguousarray(boxes[None][:, :, [1, 0, 3, 2]]), one_class[None],
                            100, 0.45, 0.25)  # fmt: skip
    selected = len(run())
    rows.append(("nms only", "onnxruntime NonMaxSuppression (1 thread), 8400 boxes, 80 classes, 100 per class",
                 median_ms(run, repeats), f"{selected} kept"))  # fmt: skip
    torch_ms, ort_ms = reference_model_ms(repeats)
    rows.append(("model", "shapes detector 96x96, float, torch (1 thread)", torch_ms, "for scale"))
    rows.append(("model", "shapes detector 96x96, float, onnxruntime (1 thread)", ort_ms, "for scale"))
    return rows


# -- the run ----------------------------------------------------------------------------------------------------------


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [f"| {' | '.join(header)} |", f"|{'---|' * len(header)}", *(f"| {' | '.join(r)} |" for r in rows), ""]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)} (all)")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--work", type=Path, help="keep the prepared reference and the bundles here (else a temporary "
                        "folder); a reference prepared there before is reused")  # fmt: skip
    parser.add_argument("--write", type=Path, help="write the tables (markdown) here")
    args = parser.parse_args()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        parser.error(f"--parts: unknown {', '.join(unknown) or '(none given)'}; valid: {', '.join(PARTS)}")
    if parts != ["post"]:
        from edgeline.export.cli import pin_hash_seed

        pin_hash_seed()  # as the command does: the same export every run
    import torch

    torch.set_num_threads(1)  # one thread: the machine is shared, and host latencies compare with one each
    began, load_before = time.perf_counter(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="edgeline-detection-") as scratch:
        work = args.work or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        lines = run(parts, work, args.repeats)
    load = os.getloadavg()
    minutes = (time.perf_counter() - began) / 60
    command = "python benchmarks/detection.py" + ("" if parts == list(PARTS) else f" --parts {','.join(parts)}")
    header = [
        "# Detection: per-target figures of the reference detector, the int8 box trap, post-processing",
        "",
        f"    {command} --write benchmarks/results/detection.md",
        "",
        f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC; {platform.machine()}, {os.cpu_count()} CPUs "
        f"(shared), {platform.system()} {platform.release()}, Python {platform.python_version()}, numpy "
        f"{np.__version__}, torch {torch.__version__}; load average {load_before[0]:.1f} at the start, "
        f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} at the end; {minutes:.1f} min in all. Host figures: "
        "none of them is a device's.",
        "",
    ]
    text = "\n".join(header + lines)
    print(text)
    if args.write:
        args.write.write_text(text, encoding="utf-8")
    return 0


def run(parts: list[str], work: Path, repeats: int) -> list[str]:
    lines: list[str] = []
    reference: Any = prepared_reference(work) if {"targets", "trap"} & set(parts) else None
    target_rows: list[TargetRow] = []
    if "targets" in parts:
        image = sorted((reference.validation_path / "images").iterdir())[0]
        rpi5 = profile_copy(work / "profiles" / "targets", "rpi5", RPI5_TARGETS)
        target_rows = export_rows(reference, str(reference.model_path), rpi5, work / "bundles" / "rpi5", "shapes")
        for profile, backend in OTHER_TARGETS:
            target_rows += export_rows(reference, str(reference.model_path), profile, work / "bundles" / profile,
                                       "shapes", backend=backend)  # fmt: skip
        progress_line("targets: post-processing on each bundle's output")
        time_post(target_rows, image, repeats)
        samples = next((r.fidelity.samples for r in target_rows if r.fidelity is not None), 0)
        lines += [
            "## The reference detector on every target",
            "",
            f"`edgeline reference prepare shapes`: 96x96, 4 classes, YOLOv8-style head (1, 8, 144); mAP on its "
            f"{samples} held-out images (COCO, through each bundle's own decoding and NMS; float → bundle). rpi5's "
            "budgets (mAP@0.5 drop at most 2 points) with every rpi5 target below on it, one thread, exported in one "
            "run (`--all`: one float run, and, as there are integer targets, boxes divided inside the model for all; "
            "selected = passes the budgets, as `--backend X --precision P` would select it); the last three on the "
            "profile that lists them. Host latency: the export's own timing on this x86-64 host (not a device "
            "figure); NMS: `frame_detections` (decode, threshold 0.25, NMS, cap 100) on that bundle's output for "
            "one held-out image, median CPU ms.",
            "",
            *table(
                [
                    "profile",
                    "target",
                    "mAP@0.5",
                    "mAP@0.5:0.95",
                    "mAP vs float model",
                    "model bytes",
                    "host latency",
                    "NMS CPU ms",
                    "status",
                ],
                [r.cells() for r in target_rows],
            ),
            "Int8 against float (mAP@0.5 within 0.02 on the held-out images):",
            "",
            *(f"- {v}" for v in map(int8_verdict, target_rows) if v),
            "",
        ]
    if "trap" in parts:
        trap = trap_rows(reference, work, target_rows)
        lines += [
            "## The pixel-box-concat trap, int8",
            "",
            "Output 0 concatenates boxes in input pixels with scores in 0-1: int8 gives the tensor one scale. Plain: "
            "`ExportOptions(scale_boxes=False)`, the boxes left in pixels as a plain int8 export leaves them, no "
            "mixed precision, exported under rpi5 with the mAP budget opened so that the bundle is written (the "
            "status is rpi5's real budget applied to the figures). edgeline: what `edgeline export` ships (boxes "
            "divided by the input size inside the model, rpi5's budgets). Score levels: the distinct score values "
            "of output 0 on one held-out image (smallest first); a step: the median gap between neighbouring "
            "distinct values. "
            "Where a shipped row's scores still have a coarse step, a tensor before output 0 holds pixel boxes "
            "beside scores: the 384x384 variant wraps the reference detector, whose own output is such a "
            "concatenation (0-96), and its result is scaled by 4; edgeline divides at output 0's concatenation "
            "only, and onnxruntime's QDQ quantizes every tensor in between.",
            "",
            *table(
                ["model", "target", "boxes", "mAP@0.5", "mAP@0.5:0.95", "score levels on one image", "status"],
                [
                    [row.model, f"{row.backend} {row.precision}", handling, *row.cells()[2:4], levels, row.status]
                    for row, handling, levels in trap
                ],
            ),
        ]
    if "large" in parts:
        lines += [
            "## NMS against a 640x640 model's own time (host figures)",
            "",
            "A detector of YOLOv8n's layout built in the script (untrained, PyTorch's default initialisation: "
            "its scores sit near 0.5, so every candidate passes the threshold and NMS takes the full top 1000; "
            "its boxes, one size per stride, overlap much, so few survive). CPU / wall ms, median; on this x86-64 "
            "host, not a device.",
            "",
            *table(["what", "CPU / wall ms", ""], [list(r) for r in large_rows(work, repeats)]),
        ]
    if "post" in parts:
        rows = post_rows(repeats)
        lines += [
            "## Post-processing alone (synthetic YOLOv8 outputs, 640x640, 80 classes)",
            "",
            f"Median of {repeats} calls after one warm-up.",
            "",
            *table(["case", "what", "CPU ms", "wall ms", ""],
                   [[case, what, f"{cpu:.2f}", f"{wall:.2f}", note] for case, what, (cpu, wall), note in rows]),
        ]  # fmt: skip
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
