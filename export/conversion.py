"""Running one export backend, and turning a converter's failure into an error that names the operator."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from edgeline.device_profiles import Precision, Target
from edgeline.errors import EdgelineError
from edgeline.export.backends import EXPORT_BACKENDS, ExportedModel, ExportRequest, get_exporter, operators_named_in
from edgeline.export.errors import ExportError, LoweringError
from edgeline.export.loading import LoadedModel
from edgeline.native_output import capture_native_output
from edgeline.samples import SampleSet

__all__ = ["convert", "with_alternatives"]

logger = logging.getLogger(__name__)


def lowering_error(target: Target, exc: BaseException, log: str) -> LoweringError:
    text = f"{exc}\n{log}"
    operators = operators_named_in(text)
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    named = f" (operators named: {', '.join(operators[:5])})" if operators else ""
    return LoweringError(
        f"{target.backend} could not convert the model to {target.precision.value}{named}: "
        f"{type(exc).__name__}: {first_line[:300]}",
        operators=operators,
    )


def convert(request: ExportRequest, target: Target) -> ExportedModel:
    exporter = get_exporter(target.backend)
    if request.precision not in exporter.precisions:
        valid = ", ".join(p.value for p in exporter.precisions)
        raise ExportError(f"{target.backend} does not export {request.precision.value}; valid: {valid}")
    error: Exception | None = None
    with capture_native_output() as captured:
        try:
            exported = exporter.export(request)
        except EdgelineError:
            raise
        except Exception as exc:
            error = exc
    if error is not None:  # captured.text is complete once the descriptors are back
        raise lowering_error(target, error, captured.text) from error
    if captured.text.strip():  # shown with -v
        logger.debug("%s printed while converting:\n%s", target.backend, captured.text.strip())
    return exported


def with_alternatives(exc: LoweringError, failed: Target, loaded: LoadedModel, calibration: SampleSet) -> LoweringError:
    """Name the backends that can convert this model (fp32), so the user knows where to go."""
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
                convert(request, Target(backend=backend, precision=Precision.FP32, threads=1))
                can.append(backend)
            except EdgelineError:
                pass
    hint = f"; backends that can convert it: {', '.join(can)}" if can else "; no other backend can convert it either"
    return LoweringError(f"{exc}{hint}", operators=exc.operators)
