"""``edgeline reference``: list the reference models, or train them and write what an export run needs.

    edgeline reference list [--json]
    edgeline reference prepare NAME [NAME ...] --out DIR [--json]     (or: prepare all --out DIR)

Registering imports neither torch nor the models; ``prepare`` imports them when it runs.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from edgeline.arguments import bounded_int
from edgeline.errors import EdgelineError
from edgeline.export.errors import require_export_extra
from edgeline.export.progress import Progress
from edgeline.export.reference.preparation import Prepared, find_prepared, prepare
from edgeline.export.reference.registry import CATALOGUE, REFERENCE_MODELS, resolve_names

__all__ = ["register"]

DEFAULT_PROFILE = "rpi5"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``reference`` and its actions to the ``edgeline`` command."""
    parser = subparsers.add_parser(
        "reference",
        help="list or prepare the reference models",
        description="The project's reference models (after MLPerf Tiny), trained on real or synthetic data.",
    )
    actions = parser.add_subparsers(dest="reference_action", metavar="ACTION", required=True)

    list_parser = actions.add_parser("list", help="names, tasks, input shapes and data of the reference models")
    list_parser.add_argument("--json", action="store_true", help="print the list as one JSON document")
    list_parser.set_defaults(func=_list)

    prepare_parser = actions.add_parser(
        "prepare",
        help="train reference models and write model.pt2, calibration and validation data",
        description="Train each named reference model and write DIR/NAME/{model.pt2, calibration.npz, "
        "validation.npz, labels.txt, reference.json} (a detector: calibration/ and validation/ folders of images "
        "in the YOLO layout instead of the .npz files). A model already prepared there with the same seed "
        "is not trained again.",
    )
    prepare_parser.add_argument(
        "names", nargs="+", metavar="NAME", help=f"one or more of: {', '.join(REFERENCE_MODELS)}; or 'all'"
    )
    prepare_parser.add_argument("--out", type=Path, required=True, metavar="DIR", help="output directory")
    prepare_parser.add_argument(
        "--seed", type=bounded_int(0), default=0, metavar="N", help="data, initialisation and training seed (default 0)"
    )
    prepare_parser.add_argument(
        "--json",
        action="store_true",
        help="print what was prepared (files, accuracy, export command) as one JSON document",
    )
    prepare_parser.set_defaults(func=_prepare)


def _list(args: argparse.Namespace) -> int:
    if args.json:
        entries = [
            {
                "name": info.name,
                "task": info.task,
                "input_shape": list(info.input_shape),
                "label_count": info.label_count,
                "data": info.data,
            }
            for info in CATALOGUE.values()
        ]
        print(json.dumps(entries, indent=2))
        return 0
    print(f"{'name':<12} {'task':<9} {'input':<9} {'labels':<7} data")
    for info in CATALOGUE.values():
        shape = "x".join(str(size) for size in info.input_shape)
        labels = str(info.label_count) if info.label_count else "-"
        print(f"{info.name:<12} {info.task:<9} {shape:<9} {labels:<7} {info.data}")
    return 0


def _prepare(args: argparse.Namespace) -> int:
    require_export_extra("sklearn")
    names = resolve_names(args.names)
    out: Path = args.out
    if out.exists() and not out.is_dir():
        raise EdgelineError(f"--out {out} exists and is not a directory")
    report: list[dict[str, Any]] = []
    for name in names:
        directory = out / name
        reused = find_prepared(name, directory, seed=args.seed) is not None
        try:
            with Progress() as progress:
                if not reused:
                    progress(f"{name}: training")
                prepared = prepare(name, directory, seed=args.seed)
        except OSError as exc:
            raise EdgelineError(f"cannot write {directory}: {exc}") from exc
        command = prepared.export_command(DEFAULT_PROFILE)
        report.append({**prepared.to_json(), "directory": os.fspath(directory), "reused": reused, "export": command})
        if not args.json:
            note = "  (already prepared)" if reused else ""
            print(f"{name}: {_figures(prepared)}  {directory}{note}", flush=True)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print("next:")
    for entry in report:
        print(f"  {entry['export']}")
    return 0


def _figures(prepared: Prepared) -> str:
    """What the float model scored on the held-out data, as one phrase."""
    if prepared.float_map50 is not None and prepared.float_map50_95 is not None:
        return f"float mAP@0.5 {prepared.float_map50:.4f}, mAP@0.5:0.95 {prepared.float_map50_95:.4f}"
    metric = "float accuracy"
    if prepared.threshold is not None:
        metric += f" (anomaly if score > {prepared.threshold:.4g})"
    return f"{metric} {prepared.float_accuracy:.4f}"
