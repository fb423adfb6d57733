"""Running one export backend, and turning a converter's failure into an error that names the operator; checking
once that torch.export, every backend's first step, captures the model; and saying why one target failed."""

from __future__ import annotations

import logging
import os
import re
import sysconfig
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgeline.device_profiles import Precision, Target
from edgeline.errors import EdgelineError
from edgeline.export.backends import (
    EXPORT_BACKENDS,
    ExportedModel,
    ExportRequest,
    ExportTarget,
    get_exporter,
    operators_named_in,
)
from edgeline.export.errors import ExportError, LoweringError, TraceError
from edgeline.export.graph import module_of_location, module_path
from edgeline.export.loading import LoadedModel
from edgeline.native_output import capture_native_output
from edgeline.samples import SampleSet

__all__ = [
    "Culprit",
    "MissingKernel",
    "check_traceable",
    "convert",
    "failure_reason",
    "find_culprit",
    "missing_kernel",
    "module_path",
    "node_culprit",
    "on_micro_kernels",
    "onnx_node_culprit",
    "target_error",
    "with_alternatives",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Culprit:
    """The graph node a converter was working on when it failed: its operator and, when known, the model's line."""

    operator: str
    module: str | None = None  # the submodule's path in the model, e.g. "encoder.gru"
    source: str | None = None  # "file.py:42: code", the model's own line that made the node


def _source_line(stack_trace: str | None) -> str | None:
    """The innermost frame of a node's stack trace that is the user's code, not torch's or a converter's."""
    if not stack_trace:
        return None
    frames = re.findall(r'File "([^"]+)", line (\d+), in \S+\n\s*(.*)', stack_trace)
    for path, line, code in reversed(frames):
        if not any(part in path for part in ("site-packages", "dist-packages", "/torch/", "<")):
            return f"{path}:{line}: {code.strip()}"
    return None


def node_culprit(node: Any, operator: str | None = None) -> Culprit:
    meta = getattr(node, "meta", {}) or {}
    module = module_path(node)
    target = getattr(node, "target", None)
    name = operator or str(getattr(target, "__name__", target))
    return Culprit(operator=name.replace("::", "."), module=module, source=_source_line(meta.get("stack_trace")))


def onnx_node_culprit(node: Any) -> Culprit:
    """An ONNX node of the dynamo exporter's: its operator type, the module whose code made it and the model's line
    (its ``pkg.torch.onnx`` metadata; a node of another exporter names its operator only)."""
    from edgeline.export.backends.onnxruntime import onnx_node_module

    meta = {prop.key: prop.value for prop in node.metadata_props}
    return Culprit(node.op_type, onnx_node_module(node), _source_line(meta.get("pkg.torch.onnx.stack_trace")))


def find_culprit(exc: BaseException) -> Culprit | None:
    """Walks the failing call's frames, innermost first, for the torch.fx node (or source partition, e.g. the
    nodes of one nn.GRU) the converter held when it failed."""
    import torch.fx

    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        for value in frame.f_locals.values():
            source = getattr(value, "source", None)
            nodes = getattr(value, "nodes", None)
            if source is not None and isinstance(nodes, list) and nodes and isinstance(nodes[0], torch.fx.Node):
                qualified = f"{getattr(source, '__module__', '')}.{getattr(source, '__qualname__', source)}"
                return node_culprit(
                    nodes[0], operator=qualified.lstrip(".").replace("torch.nn.modules.rnn", "torch.nn")
                )
        for value in frame.f_locals.values():
            if isinstance(value, torch.fx.Node) and value.op == "call_function":
                return node_culprit(value)
    return None


def describe_culprit(culprit: Culprit) -> str:
    where = f" in {culprit.module}" if culprit.module else ""
    line = f" ({culprit.source})" if culprit.source else ""
    return f"{culprit.operator}{where}{line}"


def lowering_error(target: Target, exc: BaseException, log: str) -> LoweringError:
    text = f"{exc}\n{log}"
    culprit = find_culprit(exc)
    operators = operators_named_in(text)
    if culprit is not None:
        operators = (culprit.operator, *(op for op in operators if op != culprit.operator))
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if culprit is not None:
        named = f" at {describe_culprit(culprit)}"
    else:
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


def _converts(backend: str, precision: Precision, loaded: LoadedModel, calibration: SampleSet, profile: Any) -> bool:
    import torch

    with tempfile.TemporaryDirectory() as scratch:
        samples = [tuple(torch.from_numpy(a) for a in calibration.sample(i)) for i in range(min(8, len(calibration)))]
        request = ExportRequest(
            module=loaded.module,
            example_inputs=samples[0],
            calibration=samples,
            precision=precision,
            out_dir=Path(scratch),
            input_names=loaded.forward_parameters or tuple(f"input_{i}" for i in range(len(calibration.inputs))),
            profile=profile,
        )
        try:
            convert(request, Target(backend=backend, precision=precision, threads=1))
        except EdgelineError:
            return False
        return True


def _precisions(backend: str) -> tuple[Precision, ...]:
    try:
        return tuple(get_exporter(backend).precisions)
    except EdgelineError:  # its optional dependency is not installed here
        return ()


def with_alternatives(
    exc: LoweringError, failed: Target, loaded: LoadedModel, calibration: SampleSet, profile: Any = None
) -> LoweringError:
    """Say where the user can go: the other backends that convert this model at the precision asked for, then the
    other precisions of the same backend (a few calibration samples are enough to tell)."""
    same = [
        backend
        for backend in sorted(EXPORT_BACKENDS)
        if backend != failed.backend
        and failed.precision in _precisions(backend)
        and _converts(backend, failed.precision, loaded, calibration, profile)
    ]
    precision = failed.precision.value
    hints = [
        f"backends that convert it at {precision}: {', '.join(same)}"
        if same
        else f"no other backend converts it at {precision}"
    ]
    others = [
        p.value
        for p in _precisions(failed.backend)
        if p is not failed.precision and _converts(failed.backend, p, loaded, calibration, profile)
    ]
    if others:
        hints.append(f"{failed.backend} converts it at {', '.join(others)}")
    return LoweringError(f"{exc}; {'; '.join(hints)}", operators=exc.operators)


def _model_line(exc: BaseException) -> str | None:
    """``file.py:42 (code)``: the innermost frame of the failing call that is neither torch's, the standard library's
    nor this module's (the model's forward, or a library it calls); else the user frame torch's message names."""
    import torch

    library = (str(Path(torch.__file__).parent) + os.sep, sysconfig.get_paths()["stdlib"] + os.sep)
    frames = [(f.filename, f.lineno, f.line or "") for f in traceback.extract_tb(exc.__traceback__)]
    named = re.findall(r'File "([^"]+)", line (\d+), in \S+\n\s*(.*)', str(exc))
    for path, line, code in [*reversed(frames), *reversed(named)]:
        if path != __file__ and not path.startswith(("<", *library)) and line is not None:
            return f"{path}:{line} ({code.strip()})" if code.strip() else f"{path}:{line}"
    return None


def check_traceable(module: Any, example_inputs: tuple[Any, ...]) -> None:
    """Every exporter starts from ``torch.export.export(module, example_inputs)``. A forward that decides on a
    tensor's value in Python (a loop, a branch, ``int()`` of a tensor) fails that step, so every target alike: a
    ``TraceError`` naming the model's line, before any target is tried. Any other failure here is left to the
    targets, which name their backend and operator."""
    import torch
    from torch._dynamo.exc import UserError
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    error: Exception | None = None
    with capture_native_output() as captured:  # torch logs the partial graph and a warning while failing
        try:
            torch.export.export(module, example_inputs)
        except Exception as exc:
            error = exc
    if captured.text.strip():
        logger.debug("torch.export printed while tracing the model:\n%s", captured.text.strip())
    if error is None:
        return
    if not isinstance(error, GuardOnDataDependentSymNode | UserError):
        logger.debug("torch.export failed on the model; each target reports it", exc_info=error)
        return
    line = _model_line(error)
    where = f" at {line}" if line else ""
    # The first line, without torch's symbolic restatement of the same expression
    first = re.sub(r"\s*\(unhinted:.*", "", _first_line(error))
    if isinstance(error, GuardOnDataDependentSymNode):
        raise TraceError(
            f"the model's forward decides on a tensor's value in Python{where}, which torch.export (every target's "
            f"first step) cannot capture: {first}; no target was tried. Make the loop count or the branch "
            "independent of the input's values: tensor operations (torch.where, masks) or torch.cond"
        ) from error
    raise TraceError(
        f"torch.export (every target's first step) cannot capture the model{where}: {first}; no target was tried"
    ) from error


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0][:300] if lines else type(exc).__name__


def failure_reason(exc: Exception, staging: Path) -> str:
    """Why one target failed, in one line for its row of the report: an error of ours as it says it, anyone else's
    (a converter's RuntimeError, ...) as its type and first line. The target was staged in ``staging``, deleted by
    the time anyone reads this: a path inside it becomes the bundle's file name, the folder itself "the bundle"."""
    text = str(exc).strip() if isinstance(exc, EdgelineError) else f"{type(exc).__name__}: {_first_line(exc)}"
    for folder in sorted({str(staging), str(staging.absolute()), str(staging.resolve())}, key=len, reverse=True):
        text = text.replace(folder + os.sep, "").replace(folder, "the bundle")
    return text or type(exc).__name__


_MISSING_KERNEL = re.compile(r"TFLite Micro could not load the model: Didn't find op for builtin opcode '([A-Z0-9_]+)'")


@dataclass(frozen=True)
class MissingKernel:
    """A TFLite builtin operator the model needs and TFLite Micro has no kernel for, found by ``found_by``."""

    operator: str  # the TFLite builtin, e.g. "SIGN"
    where: str  # the torch code that made it: "aten.sign in head (model.py:12: return torch.sign(x))", or ""
    found_by: str  # the target that failed on it, e.g. "ethos-u int8-static"


def on_micro_kernels(target: Target, profile: Any) -> bool:
    """Whether TFLite Micro's kernels run this target's model here and on the device (its class says:
    ``ExportTarget.on_micro_kernels``); False for a target this install cannot load."""
    found = _target_of(target.backend)
    return found is not None and found.on_micro_kernels(profile)


def _target_of(backend: str) -> ExportTarget | None:
    """The class of ``backend``; None where this install cannot load it (its export fails on its own)."""
    try:
        return get_exporter(backend)
    except EdgelineError:
        return None


def missing_kernel(
    reason: str, target: Target, staging: Path, module: Any, example: tuple[Any, ...]
) -> MissingKernel | None:
    """The TFLite Micro kernel ``reason`` (a target's failure) says is missing, and where the model made it: the
    operator's output tensor in the staged LiteRT model names the torch module (litert-torch writes its location),
    and torch.export's record of that module's nodes gives the line."""
    found = _MISSING_KERNEL.search(reason)
    if found is None:
        return None
    operator = found.group(1)
    where = ""
    try:
        where = _where_in_model(operator, staging, module, example)
    except Exception:  # naming the place is a courtesy; the operator itself is certain
        logger.debug("could not find where the model makes %s", operator, exc_info=True)
    return MissingKernel(operator, where, f"{target.backend} {target.precision.value}")


def _where_in_model(operator: str, staging: Path, module: Any, example: tuple[Any, ...]) -> str:
    import torch
    from ai_edge_litert.interpreter import Interpreter

    for path in sorted(staging.glob("*.tflite")):
        interpreter = Interpreter(model_path=str(path))
        ops = getattr(interpreter, "_get_ops_details", None)  # the only listing of operators in its Python API
        if ops is None:
            return ""
        names = {detail["index"]: str(detail["name"]) for detail in interpreter.get_tensor_details()}
        places = [
            place
            for op in ops()
            if op["op_name"] == operator
            for index in op["outputs"]
            for location in names.get(index, "").split(";")
            if (place := module_of_location(location, module)) is not None
        ]
        if not places:
            continue
        for node in torch.export.export(module, example).graph.nodes:
            aten = str(getattr(node.target, "__name__", node.target)).split(".")[0]
            if node.op == "call_function" and (module_path(node) or "") == places[0] and aten == operator.lower():
                return describe_culprit(node_culprit(node, operator=f"aten.{aten}"))
        return f"in {places[0]}" if places[0] else "in the model's own forward"
    return ""


def target_error(
    exc: Exception, reason: str, target: Target, loaded: LoadedModel, calibration: SampleSet, profile: Any
) -> ExportError:
    """The error to raise when the one target the user named (``--backend`` and ``--precision``) failed with
    ``exc``, ``reason`` being :func:`failure_reason`: an ExportError as it was (unless its message named the
    staging folder); a converter's failure with the backends and precisions that do convert the model; anything
    else (a runtime refusing the model, ...) as an ExportError naming the target."""
    if isinstance(exc, LoweringError):
        return with_alternatives(LoweringError(reason, operators=exc.operators), target, loaded, calibration, profile)
    if isinstance(exc, ExportError) and reason == str(exc):
        return exc
    return ExportError(f"{target.backend} {target.precision.value}: {reason}")
