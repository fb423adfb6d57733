"""Qualcomm Hexagon NPU (HTP) through onnxruntime-qnn: int8 QDQ with QNN's quantization configuration, compiled to
an EP-context model (the QNN context binary for the profile's SoC) that a Snapdragon device loads without compiling.

The bundle holds ``model.onnx`` (one EPContext node pointing at ``model_qnn.bin``), the context binary, and the QDQ
model it was compiled from (``model.qdq.onnx``): a device whose onnxruntime has no QNN provider runs that copy on
its CPU provider, loudly, instead of refusing the bundle.

Fidelity runs the context binary on the wheel's HTP backend: on x86-64 an emulator of the NPU, which says nothing
about the device's speed. CPU fallback is disabled there, so an operator QNN refuses fails the export, by name.
"""

from __future__ import annotations

import json
import logging
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from importlib.metadata import version
from pathlib import Path
from typing import Any

from edgeline.backends.onnxruntime import (
    CPU_COPY_SUFFIX,
    QNN_EP,
    QNN_HTP,
    import_onnxruntime,
    qnn_session_options,
    qnn_unavailable,
)
from edgeline.device_profiles import Precision
from edgeline.device_profiles.schema import Qnn
from edgeline.export.backends import ExportedModel, ExportRequest, ExportTarget, Verification
from edgeline.export.backends.onnxruntime import (
    CONVERSIONS,
    calibration_reader,
    check_export_tools,
    module_nodes,
    onnx_placement,
    qdq_output_steps,
    torch_to_onnx,
)
from edgeline.export.errors import ExportError, LoweringError
from edgeline.export.layer_probes import LayerProbe, LayerReading, onnx_layers
from edgeline.manifest import Placement, RuntimeRequirement

__all__ = ["QnnHtpExporter", "refused_operators"]

logger = logging.getLogger(__name__)

MODEL_FILE = "model.onnx"
QDQ_FILE = MODEL_FILE.removesuffix(".onnx") + CPU_COPY_SUFFIX


def _quantize_for_qnn(request: ExportRequest, float_path: Path, out_path: Path) -> None:
    """uint8 activations and weights, per tensor: QNN's own QDQ configuration for the HTP."""
    from onnxruntime.quantization import QuantType, quantize
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config

    config = get_qnn_qdq_config(
        str(float_path),
        calibration_reader(request, request.input_names),
        activation_type=QuantType.QUInt8,
        weight_type=QuantType.QUInt8,
        nodes_to_exclude=module_nodes(float_path, request.keep_float),  # mixed precision: the HTP computes them in fp16
    )
    quantize(str(float_path), str(out_path), config)


def _compile_options(qnn: Qnn, context_path: Path) -> Any:
    options = qnn_session_options(1, soc_model=str(qnn.soc_model), htp_arch=str(qnn.htp_arch))
    options.add_session_config_entry("ep.context_enable", "1")
    options.add_session_config_entry("ep.context_file_path", str(context_path))
    options.add_session_config_entry("ep.context_embed_mode", "0")  # the binary beside the model, not inside it
    return options


def refused_operators(qdq_path: Path) -> Counter[str]:
    """Operator type -> count of the nodes QNN leaves to the CPU, found by opening the model once more with CPU
    fallback allowed and reading onnxruntime's record of which provider took which node."""
    ort = import_onnxruntime()
    options = qnn_session_options(1)
    options.add_session_config_entry("session.disable_cpu_ep_fallback", "0")
    options.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    session = ort.InferenceSession(str(qdq_path), options)
    return Counter(
        node.op_type
        for subgraph in session.get_provider_graph_assignment_info()
        if subgraph.ep_name != QNN_EP
        for node in subgraph.get_nodes()
        if node.op_type not in CONVERSIONS  # graph I/O (de)quantization QNN leaves to the CPU on purpose
    )


def _check_whole_model_on_htp(qdq_path: Path) -> None:
    """Open the QDQ model on the HTP with CPU fallback disabled: success means every node is on QNN."""
    ort = import_onnxruntime()
    try:
        ort.InferenceSession(str(qdq_path), qnn_session_options(1))
    except Exception as exc:  # onnxruntime's errors derive from Exception only
        raise _htp_failure(qdq_path, str(exc).strip().splitlines()[0][:300] if str(exc).strip() else repr(exc)) from exc


_QNN_STATUS = re.compile(r"Error: (QNN_[A-Z0-9_]+): ([^,]*)[.,]*\s*Code: (\d+)")
"""onnxruntime's message for a QNN call that failed: the status's name, QNN's words for it and its number."""
_LOG_NAMES = re.compile(r'"([^"]+)"')
"""A node QNN's own error lines name (``<E> "node_gru__1_cell_t0_forward" generated: could not create op``)."""
QNN_LOG_TIMEOUT_S = 300
_QNN_LOG = """\
import json, sys
from edgeline.backends.onnxruntime import import_onnxruntime, qnn_session_options
ort = import_onnxruntime()
errors = []
def keep(severity, category, logid, location, message):
    if len(errors) < 200 and ("<E>" in message or "::ERROR:" in message):
        errors.append(message.strip())
ort.set_default_logger_callback(keep, 0)
options = qnn_session_options(1)
options.log_severity_level = 0
try:
    ort.InferenceSession(sys.argv[1], options)
except Exception:
    pass
ort.set_default_logger_callback(None)
print(json.dumps(errors))
"""
"""Opens a QDQ model on the HTP as ``_check_whole_model_on_htp`` does, QNN's log at its most verbose, and prints its
error lines. In a process of its own: QNN sets its log level once per process, when its backend is first set up."""


def qnn_log_errors(qdq_path: Path) -> list[str]:
    """The error lines QNN's HTP backend logs while it takes ``qdq_path`` (CPU fallback disabled); none when the
    log cannot be read."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _QNN_LOG, str(qdq_path)],
            capture_output=True, text=True, timeout=QNN_LOG_TIMEOUT_S, check=False,
        )  # fmt: skip
        found = json.loads(done.stdout.strip().splitlines()[-1]) if done.stdout.strip() else []
    except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
        logger.debug("QNN's log could not be read: %s", exc)
        return []
    return [str(line) for line in found] if isinstance(found, list) else []


def _unbuilt_nodes(qdq_path: Path, errors: list[str]) -> list[Any]:
    """The QDQ model's nodes QNN's error lines name, in graph order: QNN names what it builds from a node after it
    (``node_gru__1_cell_t0_forward`` from ``node_gru__1``), so a name is the longest node name it starts with."""
    import onnx

    nodes = [node for node in onnx.load(str(qdq_path), load_external_data=False).graph.node if node.name]
    by_length = sorted(nodes, key=lambda node: len(node.name), reverse=True)
    found: set[str] = set()
    for name in {name for line in errors for name in _LOG_NAMES.findall(line)}:
        node = next((node for node in by_length if name.startswith(node.name)), None)
        if node is not None:
            found.add(node.name)
    return [node for node in nodes if node.name in found]


def _htp_failure(qdq_path: Path, first_line: str, during: str | None = None) -> LoweringError:
    """Why the HTP did not take the QDQ model: the operators it refused (left to a CPU it may not use), or the
    status of the graph it took but could not prepare (a memory-allocation error is not a refusal), with the
    operators QNN's log says it could not create, their module and the model's line. ``during``: the step that
    failed, when not opening the model."""
    from edgeline.export.conversion import describe_culprit, onnx_node_culprit

    try:
        refused = refused_operators(qdq_path)
    except Exception:  # the diagnosis is a courtesy: the first error is the one to report
        refused = Counter()
    whole = "CPU fallback is disabled, so the whole model must run on the NPU"
    if refused:
        named = ", ".join(f"{op} x{count}" for op, count in sorted(refused.items()))
        return LoweringError(f"qnn-htp: QNN's HTP backend refused {named} ({whole}): {first_line}",
                             operators=tuple(sorted(refused)))  # fmt: skip
    try:
        culprits = [onnx_node_culprit(node) for node in _unbuilt_nodes(qdq_path, qnn_log_errors(qdq_path))]
    except Exception as exc:  # a model that does not load again: said without its operators
        logger.debug("QNN's failing operators not found: %s", exc)
        culprits = []
    status = _QNN_STATUS.search(first_line)
    if status is None:
        what = f"QNN's HTP backend failed on the model ({whole}): {first_line}"
    else:
        name, words, code = status.groups()
        kind = "a memory-allocation error" if "MEM_ALLOC" in name else "an error"
        stage = "prepare" if "finalize" in first_line.lower() else "set up"
        what = (
            f"QNN's HTP backend took every operator, then could not {stage} the graph: {kind} ({name}, code {code}: "
            f"{words.strip().rstrip('.')})"
        )
    if during:
        what = f"{what}, {during}"
    where = (
        f"; QNN's log says it could not create {', '.join(describe_culprit(c) for c in culprits)}"
        if culprits
        else "; QNN's log names no operator"
    )
    operators = tuple(dict.fromkeys(culprit.operator for culprit in culprits))
    return LoweringError(f"qnn-htp: {what}{where}", operators=operators)


def _context_binary(context_path: Path) -> str:
    """The file name of the context binary the EP-context model points at (its EPContext node's attribute)."""
    import onnx

    for node in onnx.load(str(context_path)).graph.node:
        if node.op_type == "EPContext":
            for attribute in node.attribute:
                if attribute.name == "ep_cache_context":
                    return attribute.s.decode()
    raise ExportError(f"qnn-htp: {context_path.name} has no EPContext node pointing at a context binary")


def _measured_with(qnn: Qnn) -> str:
    from onnxruntime_qnn.build_and_package_info import qnn_version

    machine = platform.machine()
    where = f"HTP emulator ({machine} QNN {qnn_version})" if machine in ("x86_64", "AMD64") else f"HTP ({machine})"
    return (
        f"onnxruntime-qnn {version('onnxruntime-qnn')} {where}, context binary for soc_model {qnn.soc_model} "
        f"(HTP v{qnn.htp_arch}), CPU fallback disabled"
    )


class QnnHtpExporter(ExportTarget):
    name = "qnn-htp"
    runtime_backend = "onnxruntime"
    accelerator = QNN_HTP
    precisions = (Precision.INT8_STATIC,)
    keeps_float = True  # the QDQ configuration's nodes_to_exclude; its CPU fallback stays off
    kept_float_precision = "float16"  # the HTP computes float operators in fp16

    def layer_probe(self, reading: LayerReading) -> LayerProbe | None:
        """The QDQ model beside the context binary, on onnxruntime's CPU provider: the HTP emulator runs the binary
        as one node."""
        return onnx_layers(reading, reading.model_path.with_name(QDQ_FILE), qnn=True)

    def export(self, request: ExportRequest) -> ExportedModel:
        if request.precision not in self.precisions:
            raise ExportError(f"qnn-htp exports int8-static only, not {request.precision.value}")
        qnn = request.profile_section("qnn", "qnn-htp", "soc_model, htp_arch")
        check_export_tools()
        missing = qnn_unavailable()
        if missing is not None:
            raise ExportError(f"qnn-htp: the QNN HTP provider is not usable here: {missing}")
        out = request.out_dir
        qdq_path, context_path = out / QDQ_FILE, out / MODEL_FILE
        with tempfile.TemporaryDirectory() as scratch:
            float_path = Path(scratch) / "float.onnx"
            torch_to_onnx(request, float_path)
            _quantize_for_qnn(request, float_path, qdq_path)
        _check_whole_model_on_htp(qdq_path)
        # The context is compiled in a scratch folder: onnxruntime refuses to overwrite, and leaves nothing half-made.
        with tempfile.TemporaryDirectory() as scratch:
            compiled = Path(scratch) / MODEL_FILE
            ort = import_onnxruntime()
            try:
                # From bytes, not the file: onnxruntime names the EPContext node (and the graph inside the context
                # binary) after a hash of the model's path when it has one, so the bundle's bytes would depend on
                # where it was written; without a path it hashes the graph's tensor names instead. (QNN's HTP
                # backend also numbers the graphs it serializes per process: one command is one process, so the
                # same command gives the same bytes; a second compile in one library process differs inside.)
                ort.InferenceSession(qdq_path.read_bytes(), _compile_options(qnn, compiled))
            except Exception as exc:  # onnxruntime's errors derive from Exception only
                first_line = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else repr(exc)
                compiling = f"compiling the context binary for soc_model {qnn.soc_model} (HTP v{qnn.htp_arch})"
                if _QNN_STATUS.search(first_line):
                    # QNN's own status on a graph the check above opened: in a process that had compiled for
                    # another SoC before (a second export in one library process), the check's session can prepare
                    # the graph and this one not; diagnosed as the check's failure is, its operators from QNN's log
                    raise _htp_failure(qdq_path, first_line, during=compiling) from exc
                raise ExportError(f"qnn-htp: {compiling} failed: {first_line}") from exc
            binary = _context_binary(compiled)
            shutil.move(compiled, context_path)
            shutil.move(Path(scratch) / binary, out / binary)
        counted = onnx_placement(qdq_path, request.precision)
        # The session above had CPU fallback disabled and opened: QNN took every node of the QDQ model.
        placement = Placement(
            accelerator=QNN_HTP,
            ops=counted.ops,
            accelerator_ops=counted.ops,
            quantized_ops=counted.quantized_ops,
            macs=counted.macs,
            accelerator_macs=counted.macs,
            quantized_macs=counted.quantized_macs,
            fallback=counted.fallback,
            unknown=counted.unknown,
        )
        return ExportedModel(
            model_file=MODEL_FILE,
            runtime_backend=self.runtime_backend,
            runtime=RuntimeRequirement(package="onnxruntime-qnn", min_version="2.7"),
            input_names=tuple(request.input_names),
            extra_files=(binary, QDQ_FILE),
            placement=placement,
            tool_versions={
                "torch": version("torch"),
                "onnxruntime": version("onnxruntime"),
                "onnxruntime-qnn": version("onnxruntime-qnn"),
            },
            verification=Verification(backend="onnxruntime", measured_with=_measured_with(qnn)),
            output_steps=qdq_output_steps(qdq_path),
        )
