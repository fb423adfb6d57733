"""``edgeline export``. Registering the command imports nothing heavy; running it needs the export extra."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from edgeline.arguments import bounded_int
from edgeline.device_profiles.precision import Precision
from edgeline.errors import EdgelineError
from edgeline.export.backends import EXPORT_BACKENDS
from edgeline.export.errors import ExportError, require_export_extra

__all__ = ["register"]


HEAD_NAMES = ("end2end", "yolov5", "yolov8")
"""``edgeline.detection.HEADS``' names (a test keeps them equal), here so that registering imports no numpy."""


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "export",
        help="convert, quantize and verify a PyTorch model for a device profile",
        description="Convert and quantize a PyTorch model for a device profile, check it against the float "
        "model on real samples, and write a self-describing bundle.",
    )
    parser.add_argument(
        "model", metavar="MODEL", help="path/to/file.py:function, package.module:function, or a .pt2 file"
    )
    parser.add_argument(
        "--profile", required=True, help="device profile id (see `edgeline profiles list`) or a .toml file"
    )
    parser.add_argument(
        "--calibration",
        required=True,
        type=Path,
        metavar="CAL.npz",
        help="one array per model input, first axis = samples; or, with an image pre-processing, a folder of "
        "images (any sub-folders)",
    )
    parser.add_argument(
        "--validation",
        type=Path,
        metavar="VAL.npz",
        help="held-out samples (same arrays) with an optional `labels` array; or, with an image pre-processing, "
        "a folder with one sub-folder of images per class (classes in sorted order unless --labels names them)",
    )
    parser.add_argument(
        "--preprocess",
        metavar="KEY=VALUE,...",
        help="an image model's pre-processing, written into the bundle (the daemon applies it to camera frames): "
        "resize=letterbox|squash|center-crop (letterbox), pad=0..255 (114), color=rgb|bgr|gray (rgb, gray for a "
        "1-channel input), scale (1/255), mean and std (0 and 1; per channel as 0.485/0.456/0.406), "
        "layout=nchw|nhwc (nchw), size=HxW (the model's input); these keys override a --config [preprocess] table's",
    )
    parser.add_argument(
        "--config",
        type=Path,
        metavar="EXPORT.toml",
        help="an export config file; its [preprocess] table takes the keys of --preprocess, its [detection] table "
        "a detector's head (head, layout, box_format, box_space, objectness, score_activation, has_nms) and its "
        "answers' score_threshold, iou_threshold and max_detections",
    )
    parser.add_argument(
        "--backend",
        choices=sorted(EXPORT_BACKENDS),
        metavar="EXPORTER",
        help="export target: the converter that writes the model file, %(choices)s (default: the profile's "
        "targets, in order; the bundle then names the runtime backend that runs it)",
    )
    parser.add_argument(
        "--precision",
        choices=[p.value for p in Precision],
        metavar="PRECISION",
        help="%(choices)s (default: the profile's)",
    )
    parser.add_argument("--out", type=Path, metavar="DIR", help="bundle directory (default: bundles/NAME)")
    parser.add_argument("--name", help="bundle name (default: from MODEL)")
    parser.add_argument("--force", action="store_true", help="replace an existing output directory")
    parser.add_argument(
        "--version",
        type=bounded_int(1),
        metavar="N",
        help="the bundle's version, which `edgeline publish` and devices compare: versions of one name only grow "
        "(default: 1, or one more than the bundle it replaces)",
    )
    parser.add_argument(
        "--all",
        action="store_true",
        help="try every target of the profile, write each bundle that passes to OUT/BACKEND-PRECISION and show "
        "them side by side; the profile's order still picks one",
    )
    parser.add_argument(
        "--task",
        choices=["classify", "regress", "anomaly", "detect", "raw"],
        metavar="TASK",
        help="how to read the outputs: %(choices)s (default: classify when validation has labels; detect with "
        "--head). A detector's calibration and validation are folders in the YOLO layout (images/, labels/*.txt) "
        "or a COCO .json, or plain image folders",
    )
    parser.add_argument(
        "--head",
        choices=HEAD_NAMES,
        metavar="HEAD",
        help="a detector's output layout, one of %(choices)s: yolov8 ((1, 4+C, N), boxes cx, cy, w, h in input "
        "pixels, no objectness), yolov5 ((1, N, 5+C), with objectness), end2end ((1, M, 6): x1, y1, x2, y2, "
        "score, class, NMS in the model); any other by the keys of a --config [detection] table",
    )
    parser.add_argument("--labels", metavar="FILE", type=Path, help="class names, one per line")
    parser.add_argument(
        "--threshold",
        type=float,
        help="anomaly threshold (default: 99th percentile of the float model's calibration scores)",
    )
    parser.add_argument(
        "--no-mixed-precision",
        dest="mixed_precision",
        action="store_false",
        help="when int8-static misses the accuracy budget, reject it rather than keep its most sensitive layers in "
        "float (LiteRT, ONNX Runtime and ExecuTorch keep them by default, OpenVINO by NNCF's accuracy control; the "
        "manifest's quantization.kept_float lists them)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as one JSON document")
    parser.set_defaults(func=run)


def _read_labels(path: Path | None) -> tuple[str, ...] | None:
    if path is None:
        return None
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise EdgelineError(f"--labels {path}: {exc.strerror or exc}") from exc
    labels = tuple(line.strip() for line in lines if line.strip())
    if not labels:
        raise EdgelineError(f"--labels {path}: no labels in the file")
    return labels


CONFIG_TABLES = ("preprocess", "detection")


def _config(config: Path | None) -> dict[str, dict[str, object]]:
    """A config file's tables (``CONFIG_TABLES``), each checked to be a table; nothing without a file."""
    if config is None:
        return {}
    from edgeline.device_profiles.toml import tomllib

    try:
        document = tomllib.loads(config.read_text(encoding="utf-8"))
    except OSError as exc:
        raise EdgelineError(f"--config {config}: {exc.strerror or exc}") from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise EdgelineError(f"--config {config}: not valid TOML ({exc})") from exc
    unknown = [key for key in document if key not in CONFIG_TABLES]
    if unknown:
        raise EdgelineError(
            f"--config {config}: unknown key or table {unknown[0]!r}; valid: [{'], ['.join(CONFIG_TABLES)}]"
        )
    for name, table in document.items():
        if not isinstance(table, dict):
            raise EdgelineError(f"--config {config}: {name} must be a table ([{name}])")
    return document


def _preprocess(
    config: Path | None, tables: dict[str, dict[str, object]], text: str | None
) -> dict[str, object] | None:
    """The image pre-processing keys: a config file's [preprocess] table, with --preprocess's keys over it."""
    from edgeline.imaging import parse_preprocess, preprocess_table

    keys: dict[str, object] | None = None
    if "preprocess" in tables:
        keys = preprocess_table(tables["preprocess"], f"--config {config} [preprocess]")
    if text is not None:
        keys = {**(keys or {}), **parse_preprocess(text)}
    return keys


def _detection(tables: dict[str, dict[str, object]], head: str | None) -> dict[str, object] | None:
    """A detector's keys: a config file's [detection] table, with --head over its ``head``."""
    if head is None and "detection" not in tables:
        return None
    return {**tables.get("detection", {}), **({"head": head} if head is not None else {})}


HASH_SEED = "0"


def pin_hash_seed() -> None:
    """Re-run this command with a fixed ``PYTHONHASHSEED`` unless it already has it.

    Converters iterate sets and dicts keyed by strings (torchao's prepare step, for one); with Python's per-process
    random string hashing, one model can convert in one run and fail in the next, and the automatic choice then
    picks another target. One seed makes the same command give the same bundle every run.
    """
    if os.environ.get("PYTHONHASHSEED") == HASH_SEED or not sys.orig_argv:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], dict(os.environ, PYTHONHASHSEED=HASH_SEED))


def run(args: argparse.Namespace) -> int:
    if getattr(args, "from_process_argv", False):
        pin_hash_seed()
    require_export_extra()
    from edgeline.export.pipeline import ExportOptions, run_export
    from edgeline.export.progress import Progress
    from edgeline.export.report import format_report

    tables = _config(args.config)
    if (args.head is not None or "detection" in tables) and args.task not in (None, "detect"):
        given = "--head" if args.head is not None else f"--config {args.config} [detection]"
        raise EdgelineError(f"{given} describes a detector's output, but the task is {args.task}; use --task detect")
    options = ExportOptions(
        model=args.model,
        profile=args.profile,
        calibration=args.calibration,
        validation=args.validation,
        backend=args.backend,
        precision=Precision(args.precision) if args.precision else None,
        out=args.out,
        name=args.name,
        force=args.force,
        task="detect" if args.head is not None or "detection" in tables else args.task,
        labels=_read_labels(args.labels),
        threshold=args.threshold,
        all_targets=args.all,
        version=args.version,
        mixed_precision=args.mixed_precision,
        preprocess=_preprocess(args.config, tables, args.preprocess),
        detection=_detection(tables, args.head),
    )
    try:
        with Progress() as progress:
            report = run_export(options, progress)
    except ExportError as exc:
        if args.json and exc.report is not None:  # the error points at the target's outcome: print it, then fail
            print(json.dumps(exc.report.as_dict(), indent=2))
        raise
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        print(format_report(report))
    return 0 if report.selected else 1
