"""ONNX Runtime (.onnx): torch.export program -> ONNX (the dynamo exporter), fp32 or int8 QDQ calibrated on our samples.

The bundle's placement comes from the ONNX graph itself: which nodes compute between a DequantizeLinear and a
QuantizeLinear (quantized), which are left in float, and, for a GPU accelerator named by the profile, that the
split between the GPU and the CPU is decided by onnxruntime on the device (unknown here, and said so).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np

from edgeline.backends.onnxruntime import CPU, import_onnxruntime
from edgeline.device_profiles import Precision, Profile
from edgeline.export.backends import ExportedModel, ExportRequest, ExportTarget, Verification
from edgeline.export.errors import ExportError
from edgeline.export.layer_probes import LayerProbe, LayerReading, onnx_layers
from edgeline.export.placement import code_source
from edgeline.manifest import Placement, RuntimeRequirement

__all__ = [
    "OnnxRuntimeExporter",
    "calibration_reader",
    "check_export_tools",
    "cpu_float_nodes",
    "module_nodes",
    "onnx_node_module",
    "onnx_node_source",
    "onnx_placement",
    "profile_accelerator",
    "quantized_nodes",
    "torch_to_onnx",
]

MODEL_FILE = "model.onnx"
CONVERSIONS = frozenset({"QuantizeLinear", "DequantizeLinear"})
# Operators that compute on integers themselves (the QOperator format), counted as quantized wherever they are.
INTEGER_OPS = frozenset(
    {"QLinearConv", "QLinearMatMul", "ConvInteger", "MatMulInteger", "QLinearAdd", "QLinearMul", "QGemm"}
)


def check_export_tools() -> None:
    """onnxruntime, onnx and onnxscript (the dynamo exporter's), or one error naming the extra that installs them."""
    import importlib.util

    import_onnxruntime()
    missing = [name for name in ("onnx", "onnxscript") if importlib.util.find_spec(name) is None]
    if missing:
        raise ExportError(f"exporting to ONNX needs {' and '.join(missing)}: pip install 'edgeline[export]'")


def torch_to_onnx(request: ExportRequest, path: Path) -> None:
    """The dynamo exporter on a torch.export program (the legacy exporter cannot take ``ep.module()``); inputs are
    named like forward()'s parameters so the manifest and the model agree without a mapping."""
    import torch

    program = torch.export.export(request.module, request.example_inputs)
    onnx_program = torch.onnx.export(
        program, request.example_inputs, dynamo=True, input_names=list(request.input_names), verbose=False
    )
    if onnx_program is None:  # only the legacy exporter returns nothing
        raise ExportError("torch.onnx.export returned no program")
    onnx_program.save(str(path))


def calibration_reader(request: ExportRequest, input_names: Sequence[str]) -> Any:
    """Our calibration samples as onnxruntime's CalibrationDataReader: one batch-1 feed per sample."""
    from onnxruntime.quantization import CalibrationDataReader

    class _Samples(CalibrationDataReader):  # type: ignore[misc]
        def __init__(self) -> None:
            self._feeds: Iterator[dict[str, Any]] = iter(
                {name: tensor.numpy() for name, tensor in zip(input_names, sample, strict=True)}
                for sample in request.calibration
            )

        def get_next(self) -> dict[str, Any] | None:
            return next(self._feeds, None)

    return _Samples()


def _quantize_for_cpu(request: ExportRequest, float_path: Path, out_path: Path) -> None:
    """QDQ with uint8 activations and per-channel uint8 weights (U8U8), so every CPU computes the same integers.

    U8S8 (int8 weights, onnxruntime's fastest format) saturates in the int16 pairwise sums of x86's VPMADDUBSW
    (AVX2 and AVX-512 without VNNI; onnxruntime's quantization docs): exported on such a machine, the fidelity and
    golden outputs were this machine's saturated ones, and every device computing the exact result failed its own
    golden self-test (the emulated Cortex-A72 and A76 of tests/test_emulated.py: up to 2.9 on ResNet-8's logits
    against a tolerance of 0.23). S8S8 is turned into U8S8 on x86 and saturates too. U8U8 has no saturating step
    on either architecture: the Pi's outputs equal x86's bit for bit, at the same accuracy."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    quantize_static(
        str(float_path),
        str(out_path),
        calibration_reader(request, request.input_names),
        quant_format=QuantFormat.QDQ,
        per_channel=True,
        activation_type=QuantType.QUInt8,
        weight_type=QuantType.QUInt8,
        calibrate_method=CalibrationMethod.MinMax,
        nodes_to_exclude=module_nodes(float_path, request.keep_float),
    )


def module_nodes(path: Path, modules: tuple[str, ...]) -> list[str]:
    """The ONNX nodes the dynamo exporter made from the code of ``modules`` (its ``name_scopes`` metadata)."""
    if not modules:
        return []
    import ast

    import onnx

    found = []
    for node in onnx.load(str(path), load_external_data=False).graph.node:
        scopes = next((p.value for p in node.metadata_props if p.key == "pkg.torch.onnx.name_scopes"), None)
        names = ast.literal_eval(scopes) if scopes else []
        if any(name == m or str(name).startswith(m + ".") for name in names for m in modules):
            found.append(node.name)
    if not found:
        raise ExportError(f"onnxruntime: no node of the ONNX graph comes from {', '.join(modules)} (name_scopes)")
    return found


def quantized_nodes(graph: Any) -> tuple[list[Any], list[Any]]:
    """(quantized, float) compute nodes of an ONNX graph, leaving out the Q/DQ conversions.

    Quantized: an integer operator, or a node whose first (activation) input is a DequantizeLinear's output and
    whose outputs all go to QuantizeLinear nodes: the pattern a QDQ runtime fuses into an integer kernel.
    """
    producer = {output: node for node in graph.node for output in node.output}
    consumers: dict[str, list[Any]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    quantized: list[Any] = []
    left_in_float: list[Any] = []
    for node in graph.node:
        if node.op_type in CONVERSIONS:
            continue
        source = producer.get(node.input[0]) if node.input else None
        users = [user for output in node.output for user in consumers.get(output, [])]
        in_qdq = (
            source is not None
            and source.op_type == "DequantizeLinear"
            and bool(users)
            and all(user.op_type == "QuantizeLinear" for user in users)
        )
        (quantized if in_qdq or node.op_type in INTEGER_OPS else left_in_float).append(node)
    return quantized, left_in_float


def qdq_output_steps(path: Path) -> tuple[float, ...]:
    """Per graph output, the largest scale of the DequantizeLinear that makes it (0 where none does)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    initializers = {tensor.name: tensor for tensor in graph.initializer}
    producers = {output: node for node in graph.node for output in node.output}
    steps = []
    for output in graph.output:
        node = producers.get(output.name)
        scale = None
        if node is not None and node.op_type == "DequantizeLinear" and node.input[1] in initializers:
            scale = float(numpy_helper.to_array(initializers[node.input[1]]).max())
        steps.append(scale or 0.0)
    return tuple(steps)


def profile_accelerator(profile: Profile | None) -> str | None:
    """The profile's first onnxruntime provider that is not the CPU's, or None."""
    if profile is None or profile.onnxruntime is None:
        return None
    return next((name for name in profile.onnxruntime.providers if name != CPU), None)


def onnx_placement(
    model_path: Path,
    precision: Precision,
    *,
    accelerator: str | None = None,
    accelerator_ops: int | None = None,
    unknown: dict[str, str] | None = None,
    cpu_fusions: bool = False,
) -> Placement:
    """Placement read from the ONNX graph at ``model_path``. ``fallback`` lists the nodes left in float (integer
    precisions only: in fp32 nothing is meant to be quantized)."""
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    graph = model.graph
    quantized, left_in_float = quantized_nodes(graph)
    if cpu_fusions and precision.integer:  # what ONNX Runtime's CPU provider really fuses: the rest is float
        unfused = cpu_float_nodes(model_path)
        left_in_float += [node for node in quantized if node.name in unfused]
        quantized = [node for node in quantized if node.name not in unfused]
    fallback = Counter(node.op_type for node in left_in_float) if precision.integer else Counter()
    sources: dict[str, list[str]] = {}
    for node in left_in_float if precision.integer else ():
        where = onnx_node_source(node)
        if where and where not in sources.setdefault(node.op_type, []):
            sources[node.op_type].append(where)
    work = onnx_macs(model)
    nodes = quantized + left_in_float
    counted = all(work.get(id(node)) is not None for node in nodes)
    unknown = dict(unknown or {})
    if not counted:
        missing = sorted({node.op_type for node in nodes if work.get(id(node)) is None})
        unknown["macs"] = f"ONNX shape inference gives no shapes for {', '.join(missing[:5])}"
    macs = sum(work[id(node)] or 0 for node in nodes) if counted else None
    return Placement(
        accelerator=accelerator,
        ops=len(nodes),
        accelerator_ops=accelerator_ops,
        quantized_ops=len(quantized) if precision.integer else None,  # a float precision declares no integer ops
        macs=macs,
        quantized_macs=sum(work[id(node)] or 0 for node in quantized) if counted and precision.integer else None,
        fallback=dict(sorted(fallback.items())),
        fallback_sources={op: found for op, found in sorted(sources.items()) if found},
        unknown=unknown,
    )


def cpu_float_nodes(model_path: Path) -> set[str]:
    """The names of the nodes of a QDQ model that ONNX Runtime's CPU provider computes in float: those still reading a
    DequantizeLinear's output once its graph optimizer has fused every pattern it has an integer kernel for (read
    from the model it optimizes, at the level that does the QDQ fusions and no hardware-specific layout). A node
    between a DequantizeLinear and a QuantizeLinear it has no kernel for (CumSum) stays so: float, with conversions
    around it."""
    import tempfile

    import onnx

    ort = import_onnxruntime()
    with tempfile.TemporaryDirectory(prefix="edgeline-ort-") as folder:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        options.optimized_model_filepath = str(Path(folder) / "optimized.onnx")
        ort.InferenceSession(str(model_path), options, providers=[CPU])
        graph = onnx.load(options.optimized_model_filepath, load_external_data=False).graph
    producer = {output: node for node in graph.node for output in node.output}
    return {
        node.name
        for node in graph.node
        if node.op_type not in CONVERSIONS
        and any(getattr(producer.get(name), "op_type", None) == "DequantizeLinear" for name in node.input)
    }


def onnx_node_module(node: Any) -> str | None:
    """The module whose code made a node of torch's dynamo ONNX exporter: the innermost module path of its
    ``name_scopes`` (``['', 'features', 'features.1', 'prelu']``: the model, each module's full path, the torch
    operator's own name); None outside every module, or for a node of another exporter."""
    import ast

    meta = {prop.key: prop.value for prop in node.metadata_props}
    try:
        scopes = ast.literal_eval(meta.get("pkg.torch.onnx.name_scopes", "[]"))
    except (ValueError, SyntaxError):
        return None
    return str(scopes[-2]) or None if isinstance(scopes, list) and len(scopes) >= 3 else None


def onnx_node_source(node: Any) -> str:
    """``features.1 (model.py:14)`` for a node of torch's dynamo ONNX exporter: its module (``onnx_node_module``)
    and the model's line in its ``stack_trace``; "" for a node of another exporter."""
    meta = {prop.key: prop.value for prop in node.metadata_props}
    return code_source(onnx_node_module(node), meta.get("pkg.torch.onnx.stack_trace", ""))


def onnx_macs(model: Any) -> dict[int, int | None]:
    """Per node (keyed by ``id``), its multiply-accumulates from the shapes ONNX shape inference gives: Conv,
    ConvTranspose, Gemm and MatMul (and their integer forms) by their reduction, every other node one per output
    element; None where a shape is unknown."""
    import onnx

    inferred = onnx.shape_inference.infer_shapes(model)
    shapes: dict[str, tuple[int, ...] | None] = {}
    for info in (*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output):
        dims = info.type.tensor_type.shape.dim
        shapes[info.name] = tuple(d.dim_value for d in dims) if all(d.HasField("dim_value") for d in dims) else None
    for tensor in model.graph.initializer:
        shapes[tensor.name] = tuple(int(d) for d in tensor.dims)
    work: dict[int, int | None] = {}
    for node, counted in zip(model.graph.node, inferred.graph.node, strict=True):
        out = shapes.get(counted.output[0]) if counted.output else None
        ins = [shapes.get(name) if name else None for name in counted.input]
        work[id(node)] = _node_macs(counted, ins, out)
    return work


def _node_macs(node: Any, ins: list[tuple[int, ...] | None], out: tuple[int, ...] | None) -> int | None:
    op = node.op_type
    if out is None:
        return None
    elements = int(np.prod(out, dtype=np.int64))
    if op in ("Conv", "ConvInteger", "QLinearConv"):  # weights [out, in / groups, k...]
        weight = ins[3] if op == "QLinearConv" and len(ins) > 3 else (ins[1] if len(ins) > 1 else None)
        return None if weight is None else elements * int(np.prod(weight[1:], dtype=np.int64))
    if op == "ConvTranspose":  # weights [in, out / groups, k...]: each input element spreads over them
        source, weight = ins[0], ins[1] if len(ins) > 1 else None
        if source is None or weight is None:
            return None
        return int(np.prod(source, dtype=np.int64)) * int(np.prod(weight[1:], dtype=np.int64))
    if op in ("Gemm", "MatMul", "MatMulInteger", "QLinearMatMul"):
        left = ins[0]
        if left is None or not left:
            return None
        transposed = op == "Gemm" and any(a.name == "transA" and a.i for a in node.attribute)
        return elements * (left[0] if transposed else left[-1])
    return elements


class OnnxRuntimeExporter(ExportTarget):
    name = "onnxruntime"
    runtime_backend = "onnxruntime"
    precisions = (Precision.FP32, Precision.INT8_STATIC)
    keeps_float = True  # ONNX Runtime's nodes_to_exclude

    def runs_with(self, profile: Profile | None) -> tuple[str, str | None]:
        return self.runtime_backend, profile_accelerator(profile)  # the profile's GPU provider, else the CPU's

    def layer_probe(self, reading: LayerReading) -> LayerProbe | None:
        return onnx_layers(reading)

    def export(self, request: ExportRequest) -> ExportedModel:
        import tempfile

        if request.precision not in self.precisions:
            raise ExportError(f"onnxruntime cannot export {request.precision.value}")
        check_export_tools()
        path = request.out_dir / MODEL_FILE
        if request.precision is Precision.FP32:
            torch_to_onnx(request, path)
        else:
            with tempfile.TemporaryDirectory() as scratch:
                float_path = Path(scratch) / "float.onnx"
                torch_to_onnx(request, float_path)
                _quantize_for_cpu(request, float_path, path)
        accelerator = profile_accelerator(request.profile)
        unknown = {}
        verification = None
        if accelerator is not None:
            unknown["accelerator_ops"] = (
                f"onnxruntime splits the graph between {accelerator} and the CPU when the session opens on the "
                "device; that provider is not on this machine"
            )
            verification = _verification_without(accelerator)
        return ExportedModel(
            model_file=MODEL_FILE,
            runtime_backend=self.runtime_backend,
            runtime=RuntimeRequirement(package="onnxruntime", min_version="1.17"),  # opset 20 (the dynamo exporter's)
            input_names=tuple(request.input_names),
            placement=onnx_placement(
                path, request.precision, accelerator=accelerator, unknown=unknown, cpu_fusions=accelerator is None
            ),
            tool_versions={"torch": version("torch"), "onnx": version("onnx"), "onnxruntime": version("onnxruntime")},
            verification=verification,
            output_steps=qdq_output_steps(path) if request.precision is Precision.INT8_STATIC else (),
        )


def _verification_without(accelerator: str) -> Verification:
    """Fidelity measured on the CPU provider, said so: a GPU bundle's numbers here are the CPU's, and its host
    latency is not taken at all (it would be read as the GPU's)."""
    import platform

    return Verification(
        backend="onnxruntime",
        measured_with=(
            f"onnxruntime {version('onnxruntime')} CPU provider on this {platform.machine()} machine; the bundle "
            f"is built for {accelerator}, which was not measured"
        ),
    )
