"""``edgeline export``: a torch model and a device profile in, one verified bundle out.

For each candidate target (the profile's, in order, unless the user names one): convert into a staging
directory, write a provisional manifest, load it back through ``edge_runtime`` exactly as a device
would, measure fidelity against the float model, write the golden self-test, check the budgets.
The first target that passes is moved into place; the report says why each earlier one did not.
"""

from __future__ import annotations

import datetime as dt
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from device_profiles import Precision, Profile, Target, load_profile
from edge_runtime import bundle as bundle_io
from edge_runtime.errors import EdgelineError
from edge_runtime.manifest import Budgets, Fidelity, Golden, Manifest, Postprocess
from edge_runtime.model import load
from edge_runtime.postprocess import interpret
from edge_runtime.samples import SampleSet, read_npz
from edge_runtime.timing import median_latency_ms
from export.backends import (
    EXPORT_BACKENDS,
    ExportedModel,
    ExportRequest,
    get_exporter,
    operators_named_in,
)
from export.budgets import budget_violations
from export.errors import BudgetError, CalibrationError, ExportError, LoweringError
from export.fidelity import REFERENCE, FloatReference, measure_fidelity, run_float
from export.loading import LoadedModel, load_model
from export.native_output import capture_native_output

__all__ = ["ExportOptions", "ExportReport", "TargetOutcome", "run_export"]

Task = Literal["classify", "regress", "anomaly", "raw"]
GOLDEN_SAMPLES = 8
ANOMALY_PERCENTILE = 99.0


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


@dataclass
class TargetOutcome:
    backend: str
    precision: str
    threads: int
    status: Literal["selected", "rejected", "failed", "not tried"] = "not tried"
    reason: str | None = None
    size_bytes: int | None = None
    fidelity: Fidelity | None = None
    host_latency_ms: float | None = None
    seconds: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "precision": self.precision,
            "threads": self.threads,
            "status": self.status,
            "reason": self.reason,
            "size_bytes": self.size_bytes,
            "fidelity": self.fidelity.model_dump(mode="json") if self.fidelity else None,
            "host_latency_ms": self.host_latency_ms,
            "export_seconds": self.seconds,
        }


@dataclass
class ExportReport:
    name: str
    profile: str
    out: Path
    outcomes: list[TargetOutcome] = field(default_factory=list)
    version: int | None = None
    validation: Path | None = None

    @property
    def selected(self) -> TargetOutcome | None:
        return next((o for o in self.outcomes if o.status == "selected"), None)

    def next_command(self) -> str:
        samples = self.validation or "SAMPLES.npz"
        return f"edgeline infer {self.out} --input {samples}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "profile": self.profile,
            "bundle": str(self.out) if self.selected else None,
            "version": self.version,
            "targets": [o.as_dict() for o in self.outcomes],
            "next": self.next_command() if self.selected else None,
        }


Progress = Callable[[str], None]


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


def _samples(path: Path, role: str, loaded: LoadedModel, expected: SampleSet | None) -> SampleSet:
    try:
        arrays = read_npz(path, role)
    except EdgelineError as exc:
        raise CalibrationError(str(exc)) from exc
    labels = arrays.pop("labels", None)
    names = loaded.forward_parameters
    if names is not None and set(arrays) == set(names):
        ordered = [arrays[n] for n in names]
    else:
        ordered = list(arrays.values())
        names = tuple(arrays)
    if loaded.forward_parameters is not None and len(ordered) != len(loaded.forward_parameters):
        raise CalibrationError(
            f"{role} file {path} holds {len(ordered)} input arrays ({', '.join(arrays)}) but the model's "
            f"forward takes {len(loaded.forward_parameters)} ({', '.join(loaded.forward_parameters)})"
        )
    inputs = []
    for key, array in zip(names, ordered, strict=True):
        if not np.issubdtype(array.dtype, np.floating):
            raise CalibrationError(f"{role} file {path}[{key}]: dtype {array.dtype}, expected floating point")
        if array.ndim < 1 or array.shape[0] < 1:
            raise CalibrationError(f"{role} file {path}[{key}]: needs a first axis of samples, got {array.shape}")
        inputs.append(np.ascontiguousarray(array, dtype=np.float32))
    counts = {a.shape[0] for a in inputs}
    if len(counts) != 1:
        raise CalibrationError(f"{role} file {path}: arrays disagree on the number of samples: {sorted(counts)}")
    if labels is not None and labels.shape[:1] != inputs[0].shape[:1]:
        raise CalibrationError(f"{role} file {path}[labels]: {labels.shape[0]} labels for {inputs[0].shape[0]} samples")
    if expected is not None:
        for key, got, want in zip(names, inputs, expected.inputs, strict=True):
            if got.shape[1:] != want.shape[1:]:
                raise CalibrationError(
                    f"{role} file {path}[{key}]: sample shape {list(got.shape[1:])} differs from the "
                    f"calibration's {list(want.shape[1:])}"
                )
    return SampleSet(inputs, labels, str(path))


def _check_model_runs(loaded: LoadedModel, samples: SampleSet) -> list[np.ndarray]:
    try:
        return run_float(loaded.module, SampleSet(samples.sample(0), None, samples.source)).outputs[0]
    except Exception as exc:
        shapes = ", ".join(str(list(a.shape)) for a in samples.sample(0))
        raise CalibrationError(
            f"the model rejected a calibration sample of shape {shapes}: {type(exc).__name__}: {exc}"
        ) from exc


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
            raise ExportError(f"--labels gives {len(options.labels)} labels but the model has {classes} outputs")
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


def _out_dir(options: ExportOptions, name: str) -> tuple[Path, int]:
    out = options.out or Path("bundles") / name
    version = 1
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not options.force:
            raise ExportError(f"output directory {out} exists; pass --force to replace it")
        try:
            version = bundle_io.read_manifest(out).version + 1
        except EdgelineError:
            version = 1
    return out, version


def _lowering_error(target: Target, exc: BaseException, log: str) -> LoweringError:
    text = f"{exc}\n{log}"
    operators = operators_named_in(text)
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    named = f" (operators named: {', '.join(operators[:5])})" if operators else ""
    return LoweringError(
        f"{target.backend} could not convert the model to {target.precision.value}{named}: "
        f"{type(exc).__name__}: {first_line[:300]}",
        operators=operators,
    )


def _export_target(request: ExportRequest, target: Target) -> ExportedModel:
    exporter = get_exporter(target.backend)
    if request.precision not in exporter.precisions:
        valid = ", ".join(p.value for p in exporter.precisions)
        raise ExportError(f"{target.backend} does not export {request.precision.value}; valid: {valid}")
    with capture_native_output() as captured:
        try:
            return exporter.export(request)
        except EdgelineError:
            raise
        except Exception as exc:
            error = exc
    raise _lowering_error(target, error, captured.text) from error


def _write_bundle(staging: Path, exported: ExportedModel, manifest_fields: dict[str, Any]) -> Manifest:
    files = [bundle_io.file_entry(staging, p) for p in (exported.model_file, *exported.extra_files)]
    if (staging / "golden.npz").exists():
        files.append(bundle_io.file_entry(staging, "golden.npz"))
    manifest = Manifest(files=tuple(files), **manifest_fields)
    bundle_io.write_manifest(staging, manifest)
    return manifest


def _golden(staging: Path, model: Any, samples: SampleSet) -> Golden:
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
        step = 2 * spec.quantization.scale if spec.quantization else 0.0
        inside = 0.01 * (1.0 + magnitude) if quantized_inside else 0.0
        atol.append(max(step, inside, 1e-4 * (1.0 + magnitude)))
    return Golden(samples=count, atol=tuple(atol))


def _try_target(
    target: Target,
    outcome: TargetOutcome,
    loaded: LoadedModel,
    calibration: SampleSet,
    validation: SampleSet,
    reference: FloatReference,
    profile: Profile,
    common: dict[str, Any],
    staging: Path,
    progress: Progress,
) -> None:
    import time

    import torch

    start = time.perf_counter()
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    request = ExportRequest(
        module=loaded.module,
        example_inputs=tuple(torch.from_numpy(a) for a in calibration.sample(0)),
        calibration=[tuple(torch.from_numpy(a) for a in calibration.sample(i)) for i in range(len(calibration))],
        precision=target.precision,
        out_dir=staging,
        input_names=loaded.forward_parameters or tuple(f"input_{i}" for i in range(len(calibration.inputs))),
    )
    progress(f"{target.backend} {target.precision.value}: converting")
    exported = _export_target(request, target)
    from edge_runtime.backends import open_session

    session = open_session(
        exported.runtime_backend, staging / exported.model_file, threads=1, input_names=exported.input_names
    )
    fields = dict(
        common,
        backend=exported.runtime_backend,
        precision=target.precision.value,
        threads=target.threads,
        model=exported.model_file,
        inputs=tuple(
            spec.model_copy(update={"name": name, "tensor": spec.name if spec.name != name else None})
            for spec, name in zip(session.input_specs(), request.input_names, strict=True)
        ),
        outputs=tuple(
            spec.model_copy(update={"name": f"output_{j}", "tensor": spec.name if spec.name != f"output_{j}" else None})
            for j, spec in enumerate(session.output_specs())
        ),
        runtime=exported.runtime,
        placement=exported.placement,
        export=dict(common["export"], backend=target.backend, **exported.tool_versions),
        fidelity=Fidelity(status="not-measured", reason="export in progress", reference=REFERENCE),
    )
    del session
    _write_bundle(staging, exported, fields)
    progress(f"{target.backend} {target.precision.value}: checking fidelity on {len(validation)} samples")
    model = load(staging, threads=1)
    fidelity = measure_fidelity(model, reference, validation, fields["postprocess"])
    latency = median_latency_ms(model, validation.sample(0))
    golden = _golden(staging, model, validation)
    manifest = _write_bundle(staging, exported, dict(fields, fidelity=fidelity, golden=golden))
    load(staging, threads=1)  # the final bundle must verify exactly as a device will read it
    size = sum(entry.size for entry in manifest.files if entry.path != "golden.npz")
    outcome.size_bytes = size
    outcome.fidelity = fidelity
    outcome.host_latency_ms = latency
    outcome.seconds = time.perf_counter() - start
    violations = budget_violations(profile.budgets, size, fidelity)
    if violations:
        outcome.status = "rejected"
        outcome.reason = "; ".join(violations)
    else:
        outcome.status = "selected"


def run_export(options: ExportOptions, progress: Progress = lambda line: None) -> ExportReport:
    import torch

    profile = load_profile(options.profile)
    targets = _targets(profile, options.backend, options.precision)
    name_hint = options.name
    if name_hint is not None:
        from pydantic import TypeAdapter, ValidationError
        from pydantic import constr as _constr

        try:
            TypeAdapter(_constr(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")).validate_python(name_hint)
        except ValidationError as exc:
            raise ExportError(f"--name {name_hint!r}: use letters, digits, '.', '_' and '-'") from exc
    # Cheap checks first: nothing slow runs before the output directory is known to be usable.
    if options.out is not None:
        _out_dir(options, name_hint or "model")
    progress(f"loading model {options.model}")
    torch.manual_seed(0)
    loaded = load_model(options.model)
    name = name_hint or loaded.default_name
    out, version = _out_dir(options, name)
    calibration = _samples(options.calibration, "calibration", loaded, None)
    validation = _samples(options.validation, "validation", loaded, calibration) if options.validation else calibration
    outputs = _check_model_runs(loaded, calibration)
    post = _postprocess(options, loaded, calibration, validation, outputs)
    role = "validation" if options.validation else "calibration"
    progress(f"running the float model on {len(validation)} {role} samples")
    reference = run_float(loaded.module, validation)
    report = ExportReport(name=name, profile=profile.id, out=out, validation=options.validation)
    report.outcomes = [TargetOutcome(t.backend, t.precision.value, t.threads) for t in targets]
    common: dict[str, Any] = {
        "name": name,
        "version": version,
        "created": dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z"),
        "profile": profile.id,
        "postprocess": post,
        "budgets": Budgets(**profile.budgets.model_dump()),
        "export": {"source": loaded.source, "edgeline": _edgeline_version()},
    }
    staging = out.parent / f".{out.name}.staging"
    explicit = options.backend is not None and options.precision is not None
    try:
        for target, outcome in zip(targets, report.outcomes, strict=True):
            try:
                _try_target(
                    target,
                    outcome,
                    loaded,
                    calibration,
                    validation,
                    reference,
                    profile,
                    common,
                    staging,
                    progress,
                )
            except LoweringError as exc:
                if explicit:
                    raise _with_alternatives(exc, target, loaded, calibration) from exc
                outcome.status, outcome.reason = "failed", str(exc)
            except ExportError as exc:
                if explicit:
                    raise
                outcome.status, outcome.reason = "failed", str(exc)
            if outcome.status == "selected":
                if out.exists():
                    shutil.rmtree(out)
                out.parent.mkdir(parents=True, exist_ok=True)
                staging.rename(out)
                report.version = version
                break
            progress(f"{target.backend} {target.precision.value}: {outcome.status}: {outcome.reason}")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if report.selected is None and explicit and report.outcomes[0].status == "rejected":
        raise BudgetError(
            f"{targets[0].backend} {targets[0].precision.value} misses the {profile.id} budgets: "
            f"{report.outcomes[0].reason}"
        )
    return report


def _with_alternatives(
    exc: LoweringError, failed: Target, loaded: LoadedModel, calibration: SampleSet
) -> LoweringError:
    """Name the backends that can convert this model (fp32), so the user knows where to go."""
    import tempfile

    import torch

    can = []
    for backend in sorted(EXPORT_BACKENDS):
        if backend == failed.backend:
            continue
        with tempfile.TemporaryDirectory() as scratch:
            request = ExportRequest(
                module=loaded.module,
                example_inputs=tuple(torch.from_numpy(a) for a in calibration.sample(0)),
                calibration=[],
                precision=Precision.FP32,
                out_dir=Path(scratch),
                input_names=loaded.forward_parameters or ("input_0",),
            )
            try:
                _export_target(request, Target(backend=backend, precision=Precision.FP32, threads=1))
                can.append(backend)
            except EdgelineError:
                pass
    hint = f"; backends that can convert it: {', '.join(can)}" if can else "; no other backend can convert it either"
    return LoweringError(f"{exc}{hint}", operators=exc.operators)


def _edgeline_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("edgeline")
    except PackageNotFoundError:
        return "unknown"
