"""Core ML packages (``.mlpackage``, an ML program) for Apple's Neural Engine, GPU and CPU: fp16, or int8 weights.

coremltools converts on any OS, but only Apple's OSes run a package. So here the exporter checks everything the
package itself says (its spec): that it reads back, that its inputs and outputs are the torch model's, that it asks
for the profile's deployment target and compute units. The fidelity check runs where Core ML does (``edgeline
verify`` on a Mac). Compute units are a load-time option, not part of the Core ML format: the package records the
profile's choice in its user-defined metadata, and the runtime loads it with that.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

from edgeline.backends.coreml import COMPUTE_UNITS_KEY, accelerator_for
from edgeline.device_profiles import Precision, Profile
from edgeline.device_profiles.schema import CoreML
from edgeline.export.backends import ExportedModel, ExportRequest, ExportTarget, Verification
from edgeline.export.errors import ExportError
from edgeline.manifest import Dtype, Placement, RuntimeRequirement, TensorSpec

__all__ = [
    "COMPUTE_UNITS_KEY",
    "MODEL_FILE",
    "CoreMLExporter",
    "ProgramOps",
    "program_ops",
    "read_spec",
]

MODEL_FILE = "model.mlpackage"
NOT_HERE = "Core ML runs on macOS only"
PLACED_AT_LOAD = (
    "Core ML assigns each operation to the Neural Engine, GPU or CPU when the model loads on the device; "
    "not knowable before"
)
WEIGHT_THRESHOLD = 2048
"""Weights with fewer elements stay in float (coremltools' default): compressing them saves little and costs the
most accuracy. They are counted in the placement's fallback, never hidden."""

_DTYPES: dict[str, Dtype] = {"FLOAT32": "float32", "FLOAT16": "float16", "INT32": "int32"}
_TORCH_DTYPES: dict[str, Dtype] = {"torch.float32": "float32", "torch.float16": "float16", "torch.int32": "int32"}


def read_spec(package: Path) -> Any:
    """The package's protobuf spec, read without compiling the model (which needs macOS)."""
    import coremltools as ct

    try:
        return ct.models.MLModel(str(package), skip_model_load=True).get_spec()
    except Exception as exc:  # coremltools raises bare Exceptions for a malformed package
        raise ExportError(f"{package}: the Core ML package does not read back: {exc}") from exc


@dataclass(frozen=True)
class ProgramOps:
    """The operations of an ML program's main function, constants left out, and how their weights are stored."""

    types: tuple[str, ...]  # every non-constant operation, in program order
    compressed: tuple[str, ...]  # operations all of whose weights are int8 (read through constexpr_* dequantization)
    float_weights: tuple[str, ...]  # operations with at least one weight stored in float
    macs: tuple[int | None, ...] = ()  # per operation of ``types``: its multiply-accumulates (None: shapes unknown)
    float_macs: int | None = None  # the multiply-accumulates of the operations with float weights


def _is_constant(op_type: str) -> bool:
    return op_type == "const" or op_type.startswith("constexpr_")


def _blocks(block: Any) -> Any:
    """A block and the blocks nested in its operations (cond, while_loop), depth first."""
    yield block
    for op in block.operations:
        for inner in op.blocks:
            yield from _blocks(inner)


def program_ops(spec: Any) -> ProgramOps:
    """Count the main function's operations from the spec.

    A weight is a constant tensor of rank 2 or more (a convolution kernel, a matrix); biases, scales, shapes and
    scalars are rank 0 or 1. A ``const`` holds it in float; a ``constexpr_*`` operation holds it compressed and
    dequantizes it when the model loads.
    """
    from coremltools.proto import MIL_pb2

    function = spec.mlProgram.functions["main"]
    block = function.block_specializations[function.opset]
    operations = [op for inner in _blocks(block) for op in inner.operations]
    weights: dict[str, bool] = {}  # output name -> compressed?
    float_types = {MIL_pb2.DataType.FLOAT16, MIL_pb2.DataType.FLOAT32, MIL_pb2.DataType.FLOAT64}
    for op in operations:
        if not _is_constant(op.type):
            continue
        for output in op.outputs:
            tensor = output.type.tensorType
            if tensor.rank >= 2 and tensor.dataType in float_types:
                weights[output.name] = op.type != "const"
    shapes = {output.name: _dimensions(output.type.tensorType) for op in operations for output in op.outputs} | {
        value.name: _dimensions(value.type.tensorType) for value in function.inputs
    }
    types, compressed, float_weights, macs = [], [], [], []
    float_macs: int | None = 0
    for op in operations:
        if _is_constant(op.type):
            continue
        types.append(op.type)
        work = _mil_macs(op, shapes)
        macs.append(work)
        used = [weights[arg.name] for binding in op.inputs.values() for arg in binding.arguments if arg.name in weights]
        if used and all(used):
            compressed.append(op.type)
        elif used:
            float_weights.append(op.type)
            float_macs = None if float_macs is None or work is None else float_macs + work
    return ProgramOps(tuple(types), tuple(compressed), tuple(float_weights), tuple(macs), float_macs)


def _dimensions(tensor: Any) -> tuple[int, ...] | None:
    dims = tuple(tensor.dimensions)
    if not all(d.HasField("constant") for d in dims):
        return None  # an unknown (runtime) size
    return tuple(int(d.constant.size) for d in dims)


def _mil_macs(op: Any, shapes: dict[str, tuple[int, ...] | None]) -> int | None:
    """An ML program operation's multiply-accumulates from the shapes its spec records: conv, linear and matmul by
    their reduction, every other operation one per output element."""
    import numpy as np

    def named(key: str) -> tuple[int, ...] | None:
        binding = op.inputs.get(key)
        return shapes.get(binding.arguments[0].name) if binding is not None and binding.arguments else None

    out = shapes.get(op.outputs[0].name) if op.outputs else None
    if out is None:
        return None
    elements = int(np.prod(out, dtype=np.int64))
    if op.type == "conv":  # weight [out, in / groups, k...]
        weight = named("weight")
        return None if weight is None else elements * int(np.prod(weight[1:], dtype=np.int64))
    if op.type == "conv_transpose":  # weight [in, out / groups, k...]
        weight, source = named("weight"), named("x")
        return None if weight is None or source is None else int(np.prod(source)) * int(np.prod(weight[1:]))
    if op.type == "linear":  # weight [out, in]
        weight = named("weight")
        return None if weight is None else elements * weight[-1]
    if op.type == "matmul":
        left = named("x")
        if left is None or not left:
            return None
        transposed = "transpose_x" in op.attributes or False  # attributes hold only non-default literals here
        return elements * (left[-2] if transposed and len(left) >= 2 else left[-1])
    return elements


def _placement(ops: ProgramOps, compute_units: str, precision: Precision) -> Placement:
    accelerator = accelerator_for(compute_units)
    unknown = {"accelerator_ops": PLACED_AT_LOAD} if accelerator is not None else {}
    counted = bool(ops.macs) and all(work is not None for work in ops.macs)
    macs = sum(work or 0 for work in ops.macs) if counted else None
    if not counted:
        unknown["macs"] = "the program's spec does not record every operation's shapes"
    if precision is not Precision.INT8_WEIGHTS:
        return Placement(accelerator=accelerator, ops=len(ops.types), macs=macs, unknown=unknown)
    fallback: dict[str, int] = {}
    for op_type in ops.float_weights:
        fallback[op_type] = fallback.get(op_type, 0) + 1
    # int8-weights declares the weights' precision only (export/placement.py's rule for weight precisions): an
    # operation without weights has nothing to quantize and is not held against the share.
    return Placement(
        accelerator=accelerator,
        ops=len(ops.types),
        quantized_ops=len(ops.types) - len(ops.float_weights),
        macs=macs,
        quantized_macs=macs - ops.float_macs if macs is not None and ops.float_macs is not None else None,
        fallback=fallback,
        unknown=unknown,
    )


def _settings(request: ExportRequest) -> CoreML:
    settings: CoreML = request.profile_section("coreml", "coreml", "compute_units and minimum_deployment_target")
    return settings


def _tensor_specs(features: Any, what: str) -> tuple[TensorSpec, ...]:
    specs = []
    for feature in features:
        if feature.type.WhichOneof("Type") != "multiArrayType":
            raise ExportError(f"Core ML package {what} {feature.name!r} is not a tensor (multiArray)")
        array = feature.type.multiArrayType
        from coremltools.proto import FeatureTypes_pb2

        dtype_name = FeatureTypes_pb2.ArrayFeatureType.ArrayDataType.Name(array.dataType)
        if dtype_name not in _DTYPES:
            raise ExportError(f"Core ML package {what} {feature.name!r} has dtype {dtype_name}, which edgeline lacks")
        specs.append(TensorSpec(name=feature.name, dtype=_DTYPES[dtype_name], shape=tuple(int(d) for d in array.shape)))
    return tuple(specs)


def _torch_specs(request: ExportRequest) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """The torch model's inputs and outputs (batch 1), as the package must reproduce them."""
    import torch

    with torch.no_grad():
        raw = request.module(*request.example_inputs)
    outputs = tuple(raw) if isinstance(raw, tuple | list) else (raw,)

    def spec(name: str, tensor: Any) -> TensorSpec:
        dtype = _TORCH_DTYPES.get(str(tensor.dtype))
        if dtype is None:
            raise ExportError(f"coreml: tensor {name} is {tensor.dtype}; Core ML packages take float32, float16, int32")
        return TensorSpec(name=name, dtype=dtype, shape=tuple(tensor.shape))

    inputs = tuple(spec(n, t) for n, t in zip(request.input_names, request.example_inputs, strict=True))
    return inputs, tuple(spec(f"output_{j}", t) for j, t in enumerate(outputs))


def check_package(spec: Any, request: ExportRequest, settings: CoreML, package: Path) -> None:
    """What Linux can verify of a package: format, deployment target, compute units, inputs and outputs."""
    import coremltools as ct

    kind = spec.WhichOneof("Type")
    if kind != "mlProgram":
        raise ExportError(f"{package}: holds a Core ML {kind}, not an ML program")
    wanted = ct.target[settings.minimum_deployment_target].value
    if spec.specificationVersion != wanted:
        raise ExportError(
            f"{package}: specification version {spec.specificationVersion}, but {settings.minimum_deployment_target} "
            f"(the profile's minimum_deployment_target) reads version {wanted}"
        )
    recorded = spec.description.metadata.userDefined.get(COMPUTE_UNITS_KEY)
    if recorded != settings.compute_units:
        raise ExportError(
            f"{package}: metadata {COMPUTE_UNITS_KEY} is {recorded!r}, the profile asks for {settings.compute_units!r}"
        )
    torch_inputs, torch_outputs = _torch_specs(request)
    for what, found, expected in (
        ("input", _tensor_specs(spec.description.input, "input"), torch_inputs),
        ("output", _tensor_specs(spec.description.output, "output"), torch_outputs),
    ):
        got = [(s.name, s.dtype, s.shape) for s in found]
        want = [(s.name, s.dtype, s.shape) for s in expected]
        if got != want:
            raise ExportError(f"{package}: {what}s {got} do not match the torch model's {want}")


def _convert(request: ExportRequest, settings: CoreML) -> Any:
    import coremltools as ct
    import numpy as np
    import torch

    program = torch.export.export(request.module, request.example_inputs).run_decompositions({})
    _, torch_outputs = _torch_specs(request)
    return ct.convert(
        program,
        convert_to="mlprogram",
        inputs=[
            ct.TensorType(name=name, shape=tuple(tensor.shape), dtype=np.float32)
            for name, tensor in zip(request.input_names, request.example_inputs, strict=True)
        ],
        outputs=[ct.TensorType(name=spec.name, dtype=np.float32) for spec in torch_outputs],
        compute_precision=ct.precision.FLOAT16,
        minimum_deployment_target=ct.target[settings.minimum_deployment_target],
        compute_units=ct.ComputeUnit[settings.compute_units],
        skip_model_load=True,
    )


def _int8_weights(mlmodel: Any) -> Any:
    from coremltools.optimize.coreml import OpLinearQuantizerConfig, OptimizationConfig, linear_quantize_weights

    config = OpLinearQuantizerConfig(mode="linear_symmetric", dtype="int8", weight_threshold=WEIGHT_THRESHOLD)
    return linear_quantize_weights(mlmodel, OptimizationConfig(global_config=config))


class CoreMLExporter(ExportTarget):
    name = "coreml"
    runtime_backend = "coreml"
    precisions = (Precision.FP16, Precision.INT8_WEIGHTS)

    def runs_with(self, profile: Profile | None) -> tuple[str, str | None]:
        """Core ML places each operation at load, within the compute units the profile asks for."""
        section = profile.coreml if profile is not None else None
        return self.runtime_backend, accelerator_for(section.compute_units) if section is not None else None

    def export(self, request: ExportRequest) -> ExportedModel:
        if request.precision not in self.precisions:
            valid = ", ".join(p.value for p in self.precisions)
            raise ExportError(f"coreml cannot export {request.precision.value}; valid: {valid}")
        settings = _settings(request)
        mlmodel = _convert(request, settings)
        if request.precision is Precision.INT8_WEIGHTS:
            mlmodel = _int8_weights(mlmodel)
        mlmodel.user_defined_metadata[COMPUTE_UNITS_KEY] = settings.compute_units
        package = request.out_dir / MODEL_FILE
        mlmodel.save(str(package))
        spec = read_spec(package)
        check_package(spec, request, settings, package)
        on_mac = sys.platform == "darwin"
        return ExportedModel(
            model_file=MODEL_FILE,
            runtime_backend=self.runtime_backend,
            runtime=RuntimeRequirement(package="coremltools", min_version=version("coremltools")),
            input_names=request.input_names,
            placement=_placement(program_ops(spec), settings.compute_units, request.precision),
            tool_versions={"coremltools": version("coremltools"), "torch": version("torch")},
            verification=Verification(backend="coreml") if on_mac else Verification(backend=None, reason=NOT_HERE),
            inputs=_tensor_specs(spec.description.input, "input"),
            outputs=_tensor_specs(spec.description.output, "output"),
        )
