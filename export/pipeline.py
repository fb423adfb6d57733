"""``edgeline export``: a torch model and a device profile in, one verified bundle out.

For each candidate target (the profile's, in order, unless the user names one): convert into a staging
directory, write a provisional manifest, load it back through ``edgeline`` exactly as a device
would, measure fidelity against the float model, write the golden self-test, check the budgets.
The first target that passes is moved into place; the report says why each earlier one did not.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import math
import os
import platform
import re
import shutil
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import ValidationError

from edgeline import bundle as bundle_io
from edgeline.backends import goes_into_firmware, open_session
from edgeline.detection import HEADS, check_output, head_from_config
from edgeline.device_profiles import Precision, Profile, Target, load_profile
from edgeline.errors import EdgelineError
from edgeline.export.backends import (
    EXPORT_BACKENDS,
    AccuracyControl,
    ExportedModel,
    ExportRequest,
    ExportTarget,
    Verification,
    get_exporter,
)
from edgeline.export.box_scaling import normalise_boxes
from edgeline.export.budgets import budget_violations, decisive_measure, fidelity_shortfall, fidelity_violations
from edgeline.export.c_sources import write_c_sources
from edgeline.export.calibration import check_model_runs, load_model_samples
from edgeline.export.colour_order import check_colour_order
from edgeline.export.conversion import (
    MissingKernel,
    check_traceable,
    convert,
    failure_reason,
    missing_kernel,
    on_micro_kernels,
    target_error,
)
from edgeline.export.detection_data import is_detection_dataset, read_detection_dataset
from edgeline.export.errors import BudgetError, CalibrationError, ExportError
from edgeline.export.fidelity import REFERENCE, FloatReference, compare_outputs, measure_fidelity, run_float
from edgeline.export.images import image_input, read_class_folders, read_image_folder
from edgeline.export.kept_float import file_operators, verify_kept
from edgeline.export.layers import (
    INPUT,
    LAYER_SAMPLES,
    export_program,
    fused_into,
    input_readers,
    measure_layers,
    module_macs,
    not_measured_layers,
    output_readers,
)
from edgeline.export.loading import LoadedModel, load_model
from edgeline.export.memory import measure_memory, not_measured
from edgeline.export.progress import Progress, Silent
from edgeline.export.report import ExportReport, TargetOutcome
from edgeline.export.staging import write_bundle, write_float_golden, write_golden
from edgeline.manifest import (
    NAME_PATTERN,
    Detection,
    Device,
    Fidelity,
    Firmware,
    ImagePreprocess,
    KeptFloat,
    Memory,
    Placement,
    Postprocess,
    QuantizationSummary,
    worst_layers,
)
from edgeline.model import load
from edgeline.native_output import capture_native_output
from edgeline.postprocess import interpret
from edgeline.samples import SampleSet
from edgeline.timing import median_latency_ms

__all__ = ["ExportOptions", "ExportReport", "TargetOutcome", "run_export"]

Task = Literal["classify", "regress", "anomaly", "detect", "raw"]
ANOMALY_PERCENTILE = 99.0
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExportOptions:
    model: str
    profile: str
    calibration: Path
    validation: Path | None = None
    backend: str | None = None
    precision: Precision | None = None
    out: Path | None = None
    name: str | None = None
    force: bool = False
    task: Task | None = None
    labels: tuple[str, ...] | None = None
    threshold: float | None = None
    all_targets: bool = False
    """``--all``: try every target and write each that passes to OUT/BACKEND-PRECISION; the order still picks."""
    version: int | None = None
    """``--version``: the bundle's version; None: 1, or one more than the bundle it replaces."""
    mixed_precision: bool = True
    """An int8-static target that misses only the accuracy budget keeps its most sensitive layers in float
    (``--no-mixed-precision``: it is rejected)."""
    labels_given: bool = True
    """Whether ``labels`` came from ``--labels`` (else from a validation folder's class sub-folders)."""
    preprocess: Mapping[str, object] | None = None
    """``--preprocess`` / ``[preprocess]``: an image model's pre-processing keys (``edgeline.imaging``), written as
    the manifest's ``image``; None: the one the model's module declares, if any (the reference image models')."""
    detection: Mapping[str, object] | None = None
    """``--head`` over a config's ``[detection]`` table: a detector's head (``edgeline.detection.head_from_config``
    keys) and its answers' ``score_threshold``, ``iou_threshold``, ``max_detections``; implies ``--task detect``."""
    scale_boxes: bool = True
    """False: the detector's boxes stay in pixels for integer targets, as a plain int8 export leaves them: for
    comparisons (library only: no flag)."""


def _targets(profile: Profile, backend: str | None, precision: Precision | None) -> list[Target]:
    for target in profile.targets:
        if target.backend not in EXPORT_BACKENDS:
            raise ExportError(
                f"profile {profile.id} ({profile.source or 'bundled'}): target backend {target.backend!r} "
                f"is unknown; valid: {', '.join(sorted(EXPORT_BACKENDS))}"
            )
    if backend is not None and backend not in EXPORT_BACKENDS:
        raise ExportError(f"unknown backend {backend!r}; valid: {', '.join(sorted(EXPORT_BACKENDS))}")
    if backend is not None and precision is not None:
        threads = next((t.threads for t in profile.targets), 1)
        return [Target(backend=backend, precision=precision, threads=threads)]
    chosen = [
        t
        for t in profile.targets
        if (backend is None or t.backend == backend) and (precision is None or t.precision == precision)
    ]
    if not chosen:
        listed = ", ".join(f"{t.backend}/{t.precision.value}" for t in profile.targets)
        raise ExportError(
            f"profile {profile.id} has no target matching "
            f"{backend or '*'}/{precision.value if precision else '*'}; its targets: {listed} "
            "(give both --backend and --precision to export any combination)"
        )
    return chosen


def _postprocess(
    options: ExportOptions,
    loaded: LoadedModel,
    calibration: SampleSet,
    validation: SampleSet,
    outputs: list[np.ndarray],
) -> Postprocess:
    task = options.task
    classes = int(outputs[0].size)
    if task is None:
        labelled = validation.labels is not None and np.issubdtype(validation.labels.dtype, np.integer)
        task = "classify" if (options.labels or labelled) and outputs[0].ndim == 2 and classes > 1 else "raw"
    if task == "detect":
        return _detect_postprocess(options, validation, outputs)
    if options.labels is not None and task != "classify":
        raise ExportError(f"--labels names classes, but the task is {task}; use --task classify or drop --labels")
    if options.threshold is not None and task != "anomaly":
        raise ExportError(f"--threshold applies to --task anomaly, but the task is {task}")
    truth = validation.labels
    if (
        task == "classify"
        and truth is not None
        and truth.size
        and (not np.issubdtype(truth.dtype, np.integer) or truth.min() < 0 or truth.max() >= classes)
    ):
        outside = sorted({str(v) for v in truth.reshape(-1).tolist() if not (isinstance(v, int) and 0 <= v < classes)})
        raise CalibrationError(
            f"{validation.source}[labels]: class indices must be integers 0..{classes - 1} for a model with "
            f"{classes} outputs; found {', '.join(outside[:5])}"
        )
    if task == "classify":
        if options.labels is not None and len(options.labels) != classes:
            given = "--labels gives" if options.labels_given else "the validation folder has class sub-folders for"
            raise ExportError(f"{given} {len(options.labels)} labels but the model has {classes} outputs")
        return Postprocess(kind="classify", labels=options.labels)
    if task == "anomaly":
        threshold = options.threshold
        if threshold is None:
            reference = run_float(loaded.module, calibration)
            post = Postprocess(kind="anomaly", threshold=float("inf"))
            scores = [
                interpret(post, calibration.sample(i), outs).anomaly_score for i, outs in enumerate(reference.outputs)
            ]
            threshold = float(np.percentile(np.array(scores, dtype=np.float64), ANOMALY_PERCENTILE))
        return Postprocess(kind="anomaly", threshold=threshold)
    return Postprocess(kind=task)


DETECTION_SETTINGS = ("score_threshold", "iou_threshold", "max_detections")
"""The answers' defaults a ``[detection]`` table may set besides the head's keys."""


def _detect_postprocess(options: ExportOptions, validation: SampleSet, outputs: list[np.ndarray]) -> Postprocess:
    """A detector's ``postprocess``: its head checked against output 0's shape (one line saying what the shape says
    when it does not fit), the class count against ``--labels`` and the validation objects' classes."""
    where = "--head" if options.detection and set(options.detection) == {"head"} else "the detection head"
    table = dict(options.detection or {})
    if "head" not in table and "layout" not in table:
        raise ExportError(
            f"--task detect needs the output's layout: --head {' | '.join(HEADS)}, or a [detection] table in --config "
            "with layout, box_format, box_space, objectness, score_activation, has_nms"
        )
    settings = {key: table.pop(key) for key in DETECTION_SETTINGS if key in table}
    try:
        head = head_from_config(table, where)
        classes = check_output(head, outputs[0].shape, len(options.labels) if options.labels else None)
    except EdgelineError as exc:
        raise ExportError(str(exc)) from exc
    if head.layout == "end2end" and not classes and options.labels is None:
        raise ExportError("an end2end detector's output does not say how many classes it has: name them with --labels")
    if validation.truths is not None and classes:
        found = max((int(c.max()) for _, c in validation.truths if c.size), default=-1)
        if found >= classes:
            raise CalibrationError(
                f"{validation.source}: an object of class {found}, but the model scores {classes} classes "
                f"(0..{classes - 1})"
            )
    height, width = _input_size(validation)
    try:
        detection = Detection(**{f: getattr(head, f) for f in DETECTION_HEAD_FIELDS}, head=head.name,
                              input_size=(height, width), **settings)  # fmt: skip
    except ValidationError as exc:
        raise ExportError(f"the [detection] table: {exc.errors()[0]['loc'][0]}: {exc.errors()[0]['msg']}") from exc
    return Postprocess(kind="detect", labels=options.labels, detection=detection)


DETECTION_HEAD_FIELDS = ("layout", "box_format", "box_space", "objectness", "score_activation", "has_nms")


def _input_size(samples: SampleSet) -> tuple[int, int]:
    """The (height, width) a detector's pixel boxes are in: its image input's, channels first (1 or 3) or last."""
    shape = samples.inputs[0].shape[1:]
    if len(shape) != 3:
        raise ExportError(f"a detector takes an image (channels, height, width); its input is {list(shape)}")
    return (int(shape[1]), int(shape[2])) if shape[0] in (1, 3) else (int(shape[0]), int(shape[1]))


def _scale_boxes(
    loaded: LoadedModel, post: Postprocess, calibration: SampleSet, progress: Progress
) -> tuple[LoadedModel, Postprocess]:
    """For integer targets, a detector whose pixel boxes share output 0 with its scores gets them divided by the
    input size inside the model (``export.box_scaling``); the manifest's ``detection.box_scaling`` says so, or why
    not. Every target of the export then takes the same model, so the float model's outputs compare with each."""
    import torch

    settings = post.detection
    assert settings is not None
    if settings.layout == "end2end" or settings.box_space != "pixels":
        return loaded, post
    progress("dividing the detector's pixel boxes by the input size before they meet the scores")
    example = tuple(torch.from_numpy(a) for a in calibration.sample(0))
    found = normalise_boxes(loaded.module, settings.as_head(), settings.input_size, example)
    if isinstance(found, str):
        note = (
            f"left in pixels: {found}; integer quantization gives output 0 one scale for boxes and scores (the mAP "
            "budget judges what that costs)"
        )
        return loaded, post.model_copy(update={"detection": settings.model_copy(update={"box_scaling": note})})
    height, width = settings.input_size
    note = (
        f"divided by the input size ({width}x{height}) inside the model, before the concatenation that makes output "
        f"0 ({found.inputs} of its inputs scaled): integer quantization gives a tensor one scale, and pixel boxes "
        "would leave the scores a step of several tenths; decoding multiplies them back"
    )
    detection = settings.model_copy(update={"box_space": "normalised", "box_scaling": note})
    return replace(loaded, module=found.module), post.model_copy(update={"detection": detection})


def _samples(
    options: ExportOptions, loaded: LoadedModel
) -> tuple[SampleSet, SampleSet, ImagePreprocess | None, tuple[str, ...] | None]:
    """Calibration and validation samples (.npz files, or image folders read through the image pre-processing),
    the manifest's ``image``, and the class names (``--labels``, or a validation folder's class sub-folders)."""
    keys = options.preprocess if options.preprocess is not None else loaded.image
    folders = [
        f"--{role} {path}"
        for role, path in (("calibration", options.calibration), ("validation", options.validation))
        if path is not None and path.is_dir()
    ]
    if folders and keys is None:
        raise CalibrationError(
            f"{folders[0]} is a folder of images; image folders are read through the model's image pre-processing: "
            "give --preprocess KEY=VALUE,... (e.g. resize=letterbox,color=rgb) or a [preprocess] table"
        )
    detector = options.task == "detect" or options.detection is not None
    datasets = [path for path in (options.calibration, options.validation)
                if path is not None and detector and is_detection_dataset(path)]  # fmt: skip
    if datasets and keys is None:
        raise CalibrationError(
            f"{datasets[0]} is a detection dataset; its images are read through the model's image pre-processing: "
            "give --preprocess KEY=VALUE,... (e.g. resize=letterbox,color=rgb) or a [preprocess] table"
        )
    on_disk = options.calibration.is_dir() or options.calibration in datasets
    calibration = None if on_disk else load_model_samples(options.calibration, "calibration", loaded, None)
    image = prep = None
    if keys is not None:
        image, prep = image_input(loaded, keys, calibration, "image pre-processing")
    labels = options.labels
    if calibration is None:
        assert prep is not None
        if options.calibration in datasets:  # its objects are not needed: a calibration reads the images
            calibration = read_detection_dataset(options.calibration, "calibration", prep, labels).samples
        else:
            calibration = read_image_folder(options.calibration, "calibration", prep)
    if options.validation is None:
        return calibration, calibration, image, labels
    if options.validation in datasets:
        assert prep is not None
        found = read_detection_dataset(options.validation, "validation", prep, labels)
        return calibration, found.samples, image, labels or found.labels
    if detector and options.validation.is_dir():  # images without their objects: judged against the float model
        assert prep is not None
        return calibration, read_image_folder(options.validation, "validation", prep), image, labels
    if options.validation.is_dir():
        assert prep is not None
        validation, classes = read_class_folders(options.validation, prep, options.labels)
        if validation.inputs[0].shape[1:] != calibration.inputs[0].shape[1:]:
            raise CalibrationError(
                f"validation folder {options.validation}: sample shape {list(validation.inputs[0].shape[1:])} "
                f"differs from the calibration's {list(calibration.inputs[0].shape[1:])}"
            )
        return calibration, validation, image, labels or classes
    return calibration, load_model_samples(options.validation, "validation", loaded, calibration), image, labels


def _check_name(name: str, what: str) -> str:
    if not re.fullmatch(NAME_PATTERN, name):
        raise ExportError(f"{what} {name!r}: a bundle name is letters, digits, '.', '_' and '-' (128 at most)")
    return name


def _out_dir(options: ExportOptions, name: str) -> tuple[Path, int]:
    out = options.out or Path("bundles") / name
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not options.force:
        raise ExportError(f"output directory {out} exists; pass --force to replace it")
    return out, _next_version(out, options.version)


def _next_version(path: Path, wanted: int | None = None) -> int:
    """``wanted`` (``--version``), or else 1, or one more than the bundle already at ``path`` (replaced with
    --force). That versions of one name only grow is the repository's rule: ``edgeline publish`` refuses a version
    not above the newest it holds."""
    if wanted is not None:
        return wanted
    try:
        return bundle_io.read_manifest(path).version + 1
    except EdgelineError:
        return 1


def _destination(options: ExportOptions, out: Path, target: Target) -> Path:
    return out / f"{target.backend}-{target.precision.value}" if options.all_targets else out


MIXED_STEPS = 4
"""At most this many groups tried in float (a build each), one at a time, when int8 misses the accuracy budget."""
MIXED_MAX_WEIGHTS = 0.5
"""Mixed precision skips a group that would make the layers kept in float hold more than this share of the weights
(the profile's float target is the cheaper choice then) and tries the next one in the ranking."""


@dataclass(frozen=True)
class _Shared:
    """What every target of one export shares: the model, its samples and float outputs, the profile, the
    manifest's common fields, the staging folder, the progress line, and whether mixed precision may be tried."""

    loaded: LoadedModel
    calibration: SampleSet
    validation: SampleSet
    reference: FloatReference
    profile: Profile
    common: dict[str, Any]
    staging: Path
    progress: Progress
    mixed_precision: bool = True


def _try_target(target: Target, outcome: TargetOutcome, shared: _Shared) -> None:
    """Export, measure and judge one target; an int8-static target that misses only the accuracy budget tries
    mixed precision (see ``_keep_float``)."""
    violations = _build(target, outcome, shared)
    missed_accuracy_only = (
        shared.mixed_precision
        and outcome.status == "rejected"
        and target.precision is Precision.INT8_STATIC
        and outcome.fidelity is not None
        and violations == fidelity_violations(shared.profile.budgets, outcome.fidelity)
    )
    if not missed_accuracy_only:
        return
    exporter = get_exporter(target.backend)
    if exporter.own_accuracy_control:
        _accuracy_control(target, outcome, shared)
    elif exporter.keeps_float and outcome.layers:
        _keep_float(target, outcome, shared, exporter)


def _accuracy_control(target: Target, outcome: TargetOutcome, shared: _Shared) -> None:
    """Mixed precision by the exporter's own quantizer (NNCF's accuracy control): the target built again with
    what it needs, the budget measured as edgeline judges it; the layers it reverted come back as ``kept_float``."""
    assert outcome.fidelity is not None
    measure = decisive_measure(outcome.fidelity)
    if measure is None:
        return
    first_reason = outcome.reason
    control = _budget_score(shared, measure)
    shared.progress(f"{target.backend} {target.precision.value}: {first_reason}; NNCF's accuracy control")
    try:
        _build(target, outcome, shared, int8_missed=first_reason, accuracy_control=control)
    except ExportError as exc:
        outcome.status = "rejected"
        outcome.reason = f"{first_reason}; NNCF's accuracy control failed: {exc}"
        return
    if outcome.status != "selected":
        kept = ", ".join(k.module for k in outcome.kept_float) or "no layer"
        outcome.reason = f"{first_reason}; NNCF's accuracy control kept {kept} in float: {outcome.reason}"


def _budget_score(shared: _Shared, measure: str) -> AccuracyControl:
    """The validation samples and the score the budget judges ``measure`` by on some of them (higher better: the
    measure itself, points of accuracy or agreement, or the minimum cosine), its largest drop the budget."""
    budgets, reference, validation = shared.profile.budgets, shared.reference, shared.validation
    post = shared.common["postprocess"]
    perfect, max_drop = (
        (1.0, 1.0 - (budgets.min_cosine or 0.0))
        if measure == "cosine"
        else (100.0, budgets.max_map_drop)
        if measure.startswith("map")
        else (100.0, budgets.max_accuracy_drop)
    )

    def score(indices: Sequence[int], outputs: Sequence[tuple[np.ndarray, ...]]) -> float:
        chosen = tuple(indices)
        fidelity = compare_outputs(
            [reference.outputs[i] for i in chosen], outputs, _subset(validation, chosen), post, "accuracy control"
        )
        return perfect - fidelity_shortfall(fidelity)  # NNCF divides by the float model's score: never 0

    names = {"accuracy": "accuracy", "top1": "top-1 agreement", "anomaly": "anomaly agreement", "cosine": "cosine",
             "map": "mAP@0.5", "map-agreement": "mAP@0.5 against the float model"}  # fmt: skip
    return AccuracyControl(
        samples=[tuple(validation.sample(i)) for i in range(len(validation))],
        score=score,
        max_drop=max_drop,
        measure=names[measure],
    )


def _labelled_score(target: Target, shared: _Shared) -> AccuracyControl | None:
    """The accuracy budget's score on labelled validation samples, for an int8-static export that chooses among ways
    of quantizing (``ExportRequest.validation_score``); None without labels or for a detector."""
    kind = shared.common["postprocess"].kind
    if target.precision is not Precision.INT8_STATIC or shared.validation.labels is None:
        return None
    return _budget_score(shared, "accuracy") if kind in ("classify", "anomaly") else None


def _keep_float(target: Target, outcome: TargetOutcome, shared: _Shared, exporter: ExportTarget) -> None:
    """Mixed precision by the accuracy budget, as NNCF's accuracy control does it: the layers ranked by the noise
    they add (``quantization.layers``); the top one's output tensor kept in float, which takes the layer and every
    layer that reads that tensor (they share its quantization); the fidelity measured again, and a group that did
    not help put back in int8; until the budget holds, ``MIXED_STEPS`` groups were tried, or no ranked layer is left.
    A group that would make the float layers hold more than ``MIXED_MAX_WEIGHTS`` of the weights is skipped (a float
    target is cheaper than that one) and the next is tried. The outcome is the last build's; one that never met the
    budget says what was tried, what was skipped and why it stopped."""
    loaded, calibration, progress = shared.loaded, shared.calibration, shared.progress
    first_reason = outcome.reason
    best = fidelity_shortfall(outcome.fidelity) if outcome.fidelity is not None else math.inf
    modules = dict(loaded.module.named_modules())
    operators = {layer.module: layer.operator for layer in outcome.layers}
    total = sum(p.numel() for p in loaded.module.parameters()) or 1
    program = export_program(loaded.module, calibration.sample(0))
    readers = output_readers(loaded.module, program)
    readers.update(input_readers(loaded.module, program, _input_names(loaded, calibration)))
    plain = outcome.placement
    macs = module_macs(program) if plain and plain.accelerator else None
    kept: list[KeptFloat] = []
    tried: list[str] = []
    too_heavy: list[str] = []  # the groups skipped: they would have held more than MIXED_MAX_WEIGHTS float
    advice = ""
    ranked = worst_layers(outcome.layers, count=len(outcome.layers))
    for rank, layer in enumerate(ranked, 1):
        if len(tried) == MIXED_STEPS:
            break
        if layer.module.startswith(INPUT):  # the data itself: keeping it float means keeping its readers float
            lost = f"int8 keeps least of {layer.module} ({layer.channel_sqnr_db:.1f} dB SQNR in its worst channel)"
            if exporter.full_integer or not readers.get(layer.module):
                advice = advice or (
                    f"; {lost}: its features span very different ranges; scale them alike before the model (a "
                    "microcontroller's model takes int8 input)"
                    if exporter.full_integer
                    else f"; {lost}, and an operator outside every module reads it first: scale its features alike "
                    "before the model, or in a module"
                )
                continue
        fused = fused_into(layer.module, readers, set(operators))
        members = (*fused, layer.module, *readers.get(layer.module, ()))
        group = [
            name
            for name in dict.fromkeys(members)
            if name not in {k.module for k in kept} and not name.startswith(INPUT)
        ]
        if not group:
            continue
        weights = {name: sum(p.numel() for p in modules[name].parameters()) for name in group}
        float_weights = sum(k.added_bytes for k in kept) // 3 + sum(weights.values())
        if Fraction(float_weights, total) > Fraction(str(MIXED_MAX_WEIGHTS)):  # in integers: 50% is allowed
            # too much float with this group: a smaller one further down the ranking may still do
            too_heavy.append(f"{', '.join(group)} ({float_weights / total:.0%} of the weights)")
            progress(
                f"{target.backend} {target.precision.value}: {first_reason}; not keeping {', '.join(group)} in float: "
                f"{float_weights / total:.0%} of the weights would be float (at most {MIXED_MAX_WEIGHTS:.0%})"
            )
            continue
        why = f"its output ranked {rank} by the noise int8 adds to it ({layer.added_sqnr_db:.1f} dB SQNR)"
        if too_heavy:
            why += f"; skipped before it, as more than {MIXED_MAX_WEIGHTS:.0%} of the weights would be float: "
            why += "; ".join(too_heavy)
        candidates = [
            KeptFloat(
                module=name,
                operator=operators.get(name) or type(modules[name]).__name__,
                added_bytes=3 * weights[name],
                precision=exporter.kept_float_precision,
                reason=why
                if name == layer.module
                else f"computes in one kernel with {layer.module} (no tensor of its own)"
                if name in fused
                else f"reads {layer.module}, which int8 lost the most of ({layer.added_sqnr_db:.1f} dB SQNR): "
                "kept float with it"
                if layer.module.startswith(INPUT)
                else f"reads the output of {layer.module}, kept float with it",
            )
            for name in group
        ]
        tried.append(layer.module)
        progress(f"{target.backend} {target.precision.value}: {first_reason}; keeping {', '.join(group)} in float")
        try:
            _build(target, outcome, shared, kept=(*kept, *candidates), int8_missed=first_reason, plain=plain, macs=macs)
        except ExportError as exc:  # the plain int8 outcome stands, rejected for its accuracy; this says why no more
            outcome.status = "rejected"
            outcome.reason = f"{first_reason}; keeping {', '.join(group)} in float (mixed precision) failed: {exc}"
            return
        if outcome.status == "selected":
            return
        if outcome.fidelity is not None and not fidelity_violations(shared.profile.budgets, outcome.fidelity):
            # the accuracy budget holds, another does not (the float layers took too much off the accelerator, or
            # out of int8): keeping more in float cannot help that
            outcome.reason = (
                f"{first_reason}; with {', '.join(k.module for k in (*kept, *candidates))} kept float (mixed "
                f"precision) the accuracy budget holds, but {outcome.reason}"
            )
            return
        shortfall = fidelity_shortfall(outcome.fidelity) if outcome.fidelity is not None else math.inf
        missed = fidelity_violations(shared.profile.budgets, outcome.fidelity) if outcome.fidelity else []
        verdict = missed[0] if missed else "not measured"
        claimed = {k.module for k in outcome.kept_float}  # this build's, as its model file bears them out
        in_int8 = [c.module for c in candidates if c.module not in claimed] if missed else []
        if in_int8:  # the converter computed them in integer all the same (edgeline.export.kept_float)
            verdict = f"{verdict}; the converter computes {', '.join(in_int8)} in int8 all the same"
        if shortfall < best:  # it helped: kept, and the next group goes on from here
            kept.extend(candidates)
            best = shortfall
            tried[-1] = f"{tried[-1]} ({', '.join(group)}: {verdict}, kept)"
        else:
            tried[-1] = f"{tried[-1]} ({', '.join(group)}: {verdict}, no better: put back in int8)"
    outcome.reason = f"{first_reason}; {_why_mixed_stopped(tried, too_heavy, len(ranked))}{advice}"


def _why_mixed_stopped(tried: list[str], too_heavy: list[str], ranked: int) -> str:
    """Why mixed precision stopped short of the budget: the groups it tried, those it skipped for the weight limit,
    and whether it ran out of steps or of ranked layers."""
    said = (
        f"keeping the outputs of {', '.join(tried)} in float one at a time (mixed precision) did not meet it"
        if tried
        else "no layer could be kept in float (mixed precision)"
    )
    if too_heavy:
        said += (
            f"; skipped, as more than {MIXED_MAX_WEIGHTS:.0%} of the weights would be float (a float target is "
            f"cheaper then): {'; '.join(too_heavy)}"
        )
    if len(tried) == MIXED_STEPS:
        return f"{said}; stopped after {MIXED_STEPS} groups tried (the most it tries)"
    return f"{said}; no other layer of the {ranked} ranked by the noise int8 adds was left to try"


def _ranking_subset(errors: list[float]) -> tuple[int, ...]:
    """The indices of the (at most ``LAYER_SAMPLES``) samples with the largest errors, in their order: the ranking
    subset NNCF's accuracy control ranks layers on. Every sample when there are no more than that."""
    if len(errors) <= LAYER_SAMPLES:
        return tuple(range(len(errors)))
    worst = np.argsort(-np.asarray(errors), kind="stable")[:LAYER_SAMPLES]
    return tuple(sorted(int(i) for i in worst))


def _subset(samples: SampleSet, indices: tuple[int, ...]) -> SampleSet:
    return samples if len(indices) == len(samples) else samples.subset(indices)


def _input_names(loaded: LoadedModel, calibration: SampleSet) -> tuple[str, ...]:
    """The model's inputs by forward()'s parameter names, else ``input_0``, ...: the names the bundle gives them."""
    return loaded.forward_parameters or tuple(f"input_{i}" for i in range(len(calibration.inputs)))


def _off_accelerator(
    kept: tuple[KeptFloat, ...],
    plain: Placement | None,
    mixed: Placement | None,
    macs: tuple[dict[str, int], int] | None,
) -> tuple[KeptFloat, ...]:
    """``kept`` with each layer's share of the model's multiply-accumulates that it takes off the accelerator: its
    own share where the mixed model's placement has fewer on the accelerator than plain int8's had (the Ethos-U runs
    no float operator: the CPU does), none where they stayed (a GPU computes float as well). Unset without an
    accelerator."""
    if not kept or macs is None or plain is None or mixed is None or plain.accelerator is None:
        return kept
    per_module, total = macs
    before, after = plain.accelerator_macs, mixed.accelerator_macs
    if not total or before is None or after is None:
        return kept
    left = after < before
    return tuple(
        k.model_copy(update={"accelerator_macs_share": min(1.0, per_module.get(k.module, 0) / total) if left else 0.0})
        for k in kept
    )


def _kept_in_file(
    kept: tuple[KeptFloat, ...], model_file: Path, target: Target, shared: _Shared
) -> tuple[KeptFloat, ...]:
    """The kept layers the converted model file bears out (``edgeline.export.kept_float``): a module the converter
    computes in integer all the same is not claimed float, and the progress line says so; one the file names no
    operator after keeps its claim, said unverified."""
    if not kept:
        return kept
    program = export_program(shared.loaded.module, shared.calibration.sample(0))
    operators = file_operators(
        model_file, target.precision, program, shared.loaded.module, cpu_fusions=target.backend == "onnxruntime"
    )
    verified = verify_kept(kept, operators)
    if verified.int8:
        shared.progress(
            f"{target.backend} {target.precision.value}: asked to stay float, the converter computes in integer "
            f"(not listed as kept float): {verified.said()}"
        )
    return verified.kept


def _build(
    target: Target,
    outcome: TargetOutcome,
    shared: _Shared,
    *,
    kept: tuple[KeptFloat, ...] = (),
    int8_missed: str | None = None,
    plain: Placement | None = None,
    macs: tuple[dict[str, int], int] | None = None,
    accuracy_control: AccuracyControl | None = None,
) -> list[str]:
    """One export of ``target`` into ``staging``, measured and judged into ``outcome``; its budget violations.
    ``kept``: mixed precision's float layers (``int8_missed``: why, ``plain``: plain int8's placement, ``macs``: each
    module's multiply-accumulates and the model's, which say the share each kept layer takes off an accelerator)."""
    import torch

    loaded, calibration, validation, reference = shared.loaded, shared.calibration, shared.validation, shared.reference
    profile, common, staging, progress = shared.profile, shared.common, shared.staging, shared.progress
    start = time.perf_counter()
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    request = ExportRequest(
        module=loaded.module,
        example_inputs=tuple(torch.from_numpy(a) for a in calibration.sample(0)),
        calibration=[tuple(torch.from_numpy(a) for a in calibration.sample(i)) for i in range(len(calibration))],
        precision=target.precision,
        out_dir=staging,
        input_names=_input_names(loaded, calibration),
        profile=profile,
        keep_float=tuple(k.module for k in kept),
        accuracy_control=accuracy_control,
        validation_score=_labelled_score(target, shared),
    )
    progress(f"{target.backend} {target.precision.value}: converting")
    exported = convert(request, target)
    if accuracy_control is not None:  # what the exporter's own accuracy control left in float
        kept = exported.kept_float
    asked = _off_accelerator(kept, plain, exported.placement, macs)  # what the quantizer was asked to keep float
    check = exported.verification or Verification(backend=exported.runtime_backend)
    measured_file = check.model_file or exported.model_file
    kept = _kept_in_file(asked, staging / measured_file, target, shared)  # what the manifest may claim
    inputs, outputs = exported.inputs, exported.outputs
    accelerator = exported.placement.accelerator if exported.placement else None
    if check.backend is not None:
        with _runtime_quiet():
            session = open_session(
                check.backend,
                staging / measured_file,
                threads=1,
                input_names=exported.input_names,
                accelerator=accelerator,
            )
        inputs, outputs = inputs or tuple(session.input_specs()), outputs or tuple(session.output_specs())
        del session
    if inputs is None or outputs is None:
        raise ExportError(f"{target.backend}: nothing here opens {exported.model_file}, and the exporter gave no specs")
    fields = dict(
        common,
        backend=exported.runtime_backend,
        precision=target.precision.value,
        threads=target.threads,
        model=exported.model_file,
        inputs=tuple(
            spec.model_copy(update={"name": name, "tensor": spec.name if spec.name != name else None})
            for spec, name in zip(inputs, request.input_names, strict=True)
        ),
        outputs=tuple(
            spec.model_copy(update={"name": f"output_{j}", "tensor": spec.name if spec.name != f"output_{j}" else None})
            for j, spec in enumerate(outputs)
        ),
        runtime=exported.runtime,
        placement=exported.placement,
        estimates=exported.estimates,
        quantization=QuantizationSummary(rewrites=exported.rewrites) if exported.rewrites else None,
        export=dict(common["export"], backend=target.backend, **exported.tool_versions),
        fidelity=Fidelity(status="not-measured", reason="export in progress", reference=REFERENCE),
    )
    write_bundle(staging, exported, fields)
    if check.backend is None:  # nothing here runs it: say so, never a number; the device measures it (verify)
        fidelity = Fidelity(status="not-measured", reason=check.reason or "no runtime here", reference=REFERENCE)
        if target.precision.integer:
            fields["quantization"] = QuantizationSummary(
                rewrites=exported.rewrites,
                activation_ranges=exported.activation_ranges,
                **not_measured_layers(check.reason or "no runtime here").fields(),
            )
        golden = write_float_golden(staging, validation, reference.outputs)
        manifest = write_bundle(staging, exported, dict(fields, fidelity=fidelity, golden=golden))
        bundle_io.read_bundle(staging)  # sizes and hashes, as a device checks them
        latency = None
    else:
        progress(f"{target.backend} {target.precision.value}: checking fidelity on {len(validation)} samples")
        with _runtime_quiet():
            model = load(staging, backend=check.backend, model_file=check.model_file, threads=1)
        errors: list[float] = []
        fidelity = measure_fidelity(model, reference, validation, fields["postprocess"], progress, errors)
        if check.measured_with:
            fidelity = fidelity.model_copy(update={"measured_with": check.measured_with})
        latency = median_latency_ms(model, validation.sample(0)) if exported.verification is None else None
        golden = write_golden(staging, model, validation, exported.output_steps)
        if target.precision.integer:
            progress(f"{target.backend} {target.precision.value}: comparing each layer with the float model's")
            if not asked:  # the ranking subset (NNCF's): the samples plain int8 does worst on; mixed builds reuse it
                outcome.ranking = _ranking_subset(errors)
            layers = measure_layers(
                loaded.module,
                _subset(validation, outcome.ranking) if outcome.ranking else validation,
                target.backend,
                check.backend,
                staging / measured_file,
                exported.input_names,
                calibration,
                dynamic=target.precision is Precision.INT8_DYNAMIC,
                keep_float=tuple(k.module for k in asked),
                labels=request.input_names,
                quantized_graph=exported.quantized_graph,
            )
            if layers.measured_with is not None and 0 < len(outcome.ranking) < len(validation):
                layers = replace(
                    layers,
                    measured_with=f"{layers.measured_with}; on the {len(outcome.ranking)} of {len(validation)} "
                    "validation samples plain int8 did worst on (the ranking subset, as NNCF's accuracy control)",
                )
            fields["quantization"] = QuantizationSummary(
                rewrites=exported.rewrites,
                kept_float=kept,
                int8_missed=int8_missed,
                activation_ranges=exported.activation_ranges,
                **layers.fields(),
            )
            if not asked:  # the ranking mixed precision goes by is plain int8's
                outcome.layers = layers.layers
            outcome.kept_float, outcome.int8_missed = kept, int8_missed
        manifest = write_bundle(staging, exported, dict(fields, fidelity=fidelity, golden=golden))
        with _runtime_quiet():  # the final bundle must verify exactly as a device will read it
            load(staging, backend=check.backend, model_file=check.model_file, threads=1)
    memory = _memory(staging, exported, check, profile)
    fields = dict(fields, fidelity=fidelity, golden=manifest.golden, memory=memory)
    manifest = write_bundle(staging, exported, fields)
    firmware = None
    if goes_into_firmware(exported.runtime_backend):  # a microcontroller's firmware takes it: as C sources too
        firmware = write_c_sources(staging, manifest, check.model_file or exported.model_file)
        exported = replace(exported, extra_files=(*exported.extra_files, firmware.sources))
        memory = firmware_memory(firmware)
        manifest = write_bundle(staging, exported, dict(fields, firmware=firmware, memory=memory))
    counted = exported.flash_files
    size = sum(e.size for e in manifest.files if e.path != "golden.npz" and (counted is None or e.path in counted))
    outcome.size_bytes = size
    outcome.fidelity = fidelity
    outcome.placement = exported.placement
    outcome.estimates = exported.estimates
    outcome.rewrites = exported.rewrites
    outcome.host_latency_ms = latency
    outcome.seconds = time.perf_counter() - start
    outcome.memory = memory
    violations = budget_violations(
        profile.budgets, size, fidelity, exported.placement, target.precision, memory, firmware=firmware
    )
    if violations:
        outcome.status = "rejected"
        outcome.reason = "; ".join(violations)
    else:
        outcome.status = "selected"
    return violations


def _supported_by(profile: Profile) -> str:
    """The profile's targets whose runtime has every TFLite builtin kernel (LiteRT: ``litert``, and ``ethos-u`` on
    Linux, whose CPU part LiteRT runs: ``ExportTarget.has_every_tflite_kernel``); the others' formats have their own
    operators, known only once tried."""
    full = [f"{t.backend} {t.precision.value}" for t in profile.targets if _has_every_tflite_kernel(t, profile)]
    return f"targets of {profile.id} whose runtime has it (LiteRT): {', '.join(full)}" if full else (
        f"no target of {profile.id} runs LiteRT, which has every TFLite kernel"
    )  # fmt: skip


def _has_every_tflite_kernel(target: Target, profile: Profile) -> bool:
    try:
        return get_exporter(target.backend).has_every_tflite_kernel(profile)
    except EdgelineError:  # a target this install cannot load: its own row says why
        return False


def _made_at(missing: MissingKernel) -> str:
    """Where the model makes the operator a kernel is missing for: "; the model makes SIGN at aten.sign in head
    (model.py:31: ...)", or "; the model makes SIGN in head"."""
    where = missing.where if missing.where.startswith("in ") else f"at {missing.where}"
    return f"; the model makes {missing.operator} {where}" if missing.where else ""


def _missing_reason(reason: str, missing: MissingKernel, profile: Profile) -> str:
    return f"{reason}{_made_at(missing)}; {_supported_by(profile)}"


def _not_again(missing: MissingKernel, profile: Profile) -> str:
    """Why a later TFLite Micro target is not converted: the same int8 model would fail on the same kernel."""
    where = f" (made by {missing.where})" if missing.where else ""
    return (
        f"not converted again: its model runs on TFLite Micro's kernels, which lack {missing.operator}{where}, as "
        f"{missing.found_by} found; {_supported_by(profile)}"
    )


def firmware_memory(firmware: Firmware) -> Memory:
    """A microcontroller bundle's one memory figure: the tensor arena its firmware reserves (``EDGELINE_ARENA_BYTES``),
    which ``max_arena_bytes`` judges; what it rests on (TFLite Micro's measure of the model array, or a compiler's
    estimate) in ``measured_with``."""
    return Memory(
        arena_bytes=firmware.arena_bytes,
        measured_with=f"the tensor arena the firmware reserves (EDGELINE_ARENA_BYTES): {firmware.arena_margin} over "
        f"{firmware.arena_basis_bytes:,} B {firmware.arena_basis} ({firmware.arena_basis_with})",
        unknown={"resident_mb": "a microcontroller runs no process: its figure is the arena"},
    )


def _memory(staging: Path, exported: ExportedModel, check: Verification, profile: Profile) -> Memory:
    """What the bundle needs in memory, where this machine runs it as the device does: the bundle's model on its
    own runtime (a process's resident memory), or TFLite Micro for a microcontroller (its arena)."""
    host = f"{platform.machine()} ({platform.system()})"
    if goes_into_firmware(check.backend):
        assert check.backend is not None
        memory = measure_memory(staging, check.backend, check.model_file, f"TFLite Micro on {host}")
        unknown = {k: v for k, v in memory.unknown.items() if k != "resident_mb"}
        unknown["resident_mb"] = "a microcontroller runs no process: its figure is the arena"
        return memory.model_copy(update={"resident_mb": None, "unknown": unknown})
    if exported.verification is not None or check.backend is None:
        why = check.measured_with or check.reason or "no runtime here runs it"
        return not_measured(f"the bundle's model does not run here as on the device ({why})")
    return measure_memory(staging, exported.runtime_backend, None, f"{exported.runtime_backend} on {host}")


def run_export(options: ExportOptions, progress: Progress | None = None) -> ExportReport:
    import torch

    if progress is None:
        progress = Silent()

    profile = load_profile(options.profile)
    targets = _targets(profile, options.backend, options.precision)
    if options.name is not None:
        _check_name(options.name, "--name")
    # Cheap checks first: nothing slow runs before the output directory is known to be usable.
    if options.out is not None:
        _out_dir(options, options.name or "model")
    progress(f"loading model {options.model}")
    torch.manual_seed(0)
    loaded = load_model(options.model)
    name = options.name or _check_name(loaded.default_name, f"the name taken from {options.model} (give --name)")
    out, version = _out_dir(options, name)
    calibration, validation, image, labels = _samples(options, loaded)
    options = replace(options, labels=labels, labels_given=options.labels is not None)
    outputs = check_model_runs(loaded, calibration)
    post = _postprocess(options, loaded, calibration, validation, outputs)
    if options.scale_boxes and post.detection is not None and any(t.precision.integer for t in targets):
        loaded, post = _scale_boxes(loaded, post, calibration, progress)
    progress("tracing the model with torch.export")
    check_traceable(loaded.module, tuple(torch.from_numpy(a) for a in calibration.sample(0)))
    role = "validation" if options.validation else "calibration"
    progress(f"running the float model on {len(validation)} {role} samples")
    reference = run_float(loaded.module, validation, progress)
    check_colour_order(loaded.module, validation, reference, post, image)
    report = ExportReport(
        name=name, profile=profile.id, out=out, validation=options.validation, budgets=profile.budgets,
        box_scaling=post.detection.box_scaling if post.detection is not None else None,
    )  # fmt: skip
    report.outcomes = [TargetOutcome(t.backend, t.precision.value, t.threads) for t in targets]
    common: dict[str, Any] = {
        "name": name,
        "version": version,
        "created": dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z"),
        "profile": profile.id,
        "postprocess": post,
        "image": image,
        "budgets": profile.budgets,
        "device": Device(arch=profile.cpu.arch, cpu=profile.cpu.name),
        # PYTHONHASHSEED: "0" from the command line (which pins it); other values when called as a library
        "export": {
            "source": loaded.source,
            "edgeline": _edgeline_version(),
            "python_hash_seed": os.environ.get("PYTHONHASHSEED", "random"),
        },
    }
    staging = out.parent / f".{out.name}.staging"
    explicit = options.backend is not None and options.precision is not None
    destinations = [_destination(options, out, target) for target in targets]
    versions = (
        [_next_version(d, options.version) for d in destinations] if options.all_targets else [version] * len(targets)
    )
    cleared = not options.all_targets
    shared = _Shared(
        loaded, calibration, validation, reference, profile, common, staging, progress, options.mixed_precision
    )
    missing: MissingKernel | None = None  # a TFLite Micro kernel the model needs and that runtime lacks
    try:
        for target, outcome, destination, version in zip(targets, report.outcomes, destinations, versions, strict=True):
            if missing is not None and on_micro_kernels(target, profile):
                outcome.status, outcome.reason = "failed", _not_again(missing, profile)
                progress(f"{target.backend} {target.precision.value}: not converted: {outcome.reason}")
                continue
            try:
                _try_target(target, outcome, replace(shared, common=dict(common, version=version)))
            except MemoryError:
                raise
            except Exception as exc:  # whatever fails inside one target (a runtime refusing its model, ...) is its own
                logger.debug("%s %s failed", target.backend, target.precision.value, exc_info=exc)
                reason = failure_reason(exc, staging)
                if explicit and on_micro_kernels(target, profile):  # name where the model makes what is missing
                    example = tuple(torch.from_numpy(a) for a in calibration.sample(0))
                    named = missing_kernel(reason, target, staging, loaded.module, example)
                    if named is not None and named.where:
                        reason = f"{reason}{_made_at(named)}"
                if explicit:
                    outcome.status, outcome.reason = "failed", reason
                    error = target_error(exc, reason, target, loaded, calibration, profile)
                    error.report = report  # what --json prints
                    if error is exc:
                        raise
                    raise error from exc
                if on_micro_kernels(target, profile):
                    example = tuple(torch.from_numpy(a) for a in calibration.sample(0))
                    missing = missing_kernel(reason, target, staging, loaded.module, example) or missing
                    if missing is not None and missing.found_by == f"{target.backend} {target.precision.value}":
                        reason = _missing_reason(reason, missing, profile)
                outcome.status, outcome.reason = "failed", reason
            if outcome.status == "selected":
                if report.selected is not outcome:  # an earlier target was picked: this one only passed (--all)
                    outcome.status = "passed"
                if not cleared and out.exists():  # --all replaces the whole folder (--force was given)
                    if out.is_dir():
                        shutil.rmtree(out)
                    else:
                        out.unlink()
                cleared = True
                if destination.exists():
                    shutil.rmtree(destination)
                destination.parent.mkdir(parents=True, exist_ok=True)
                staging.rename(destination)
                outcome.bundle = destination
                if outcome.status == "selected":
                    report.out, report.version = destination, version
                if not options.all_targets:
                    break
                continue
            progress(f"{target.backend} {target.precision.value}: {outcome.status}: {outcome.reason}")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if report.selected is None and explicit and report.outcomes[0].status == "rejected":
        worst = worst_layers(report.outcomes[0].layers, 1)
        what = "what" if worst and worst[0].module.startswith(INPUT) else "the layer that"
        where = (
            f"; {what} lost the most in int8: {worst[0].module} ({worst[0].operator}, the noise it adds at "
            f"{worst[0].added_sqnr_db:.1f} dB SQNR; edgeline export --json lists every layer)"
            if worst
            else ""
        )
        boxes = f"; the boxes were {report.box_scaling}" if (report.box_scaling or "").startswith("left") else ""
        missed = BudgetError(
            f"{targets[0].backend} {targets[0].precision.value} misses the {profile.id} budgets: "
            f"{report.outcomes[0].reason}{where}{boxes}"
        )
        missed.report = report  # what --json prints: the target's outcome and every layer
        raise missed
    return report


@contextlib.contextmanager
def _runtime_quiet() -> Iterator[None]:
    """What a runtime prints on the descriptors while loading (ExecuTorch's cpuinfo and threadpool lines, LiteRT's
    delegate line) goes to the debug log (-v), not between the progress lines."""
    with capture_native_output() as captured:
        yield
    if captured.text.strip():
        logger.debug("the runtime printed while loading:\n%s", captured.text.strip())


def _edgeline_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("edgeline")
    except PackageNotFoundError:
        return "unknown"
