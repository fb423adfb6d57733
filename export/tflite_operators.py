"""The TFLite operators litert-torch does not emit from torch, for the int8 kernels that exist: PRELU and ELU.

litert-torch lowers ``nn.PReLU`` to RELU, MUL, MUL and SUB and ``nn.ELU`` to GREATER_EQUAL, EXP, SUB and SELECT, and
its converter leaves those pieces float between a DEQUANTIZE and a QUANTIZE: 16 of 25 operators float in a small
CNN, five NPU pieces on an Ethos-U, and SELECT (v1), which TFLite Micro lacks, so no microcontroller took the model.
TFLite has int8 kernels for both, in LiteRT and in TFLite Micro, and vela maps PRELU to the NPU.

- ``operator_forms()``: while litert-torch converts, ``aten._prelu_kernel`` (and ``aten.elu`` with its default
  constants, when asked) are lowered to ``tfl.prelu`` and ``tfl.elu`` themselves, through the carrier litert-torch's
  own TFLite-operator lowerings use (a StableHLO ``custom_call`` named after the TFLite operator), and nothing else
  changes. The converter quantizes PRELU from the DEQUANTIZE/QUANTIZE around it; ELU it leaves float.
- ``fuse_int8_islands()``: in the written model, an ELU between a DEQUANTIZE of an int8 tensor and a QUANTIZE to
  one becomes the int8 ELU of those two tensors (its kernel is a lookup table built from their quantization);
  and, for TFLite Micro, a SELECT whose condition has the shape of its operands becomes SELECT_V2 (the same
  function; TFLite Micro has only SELECT_V2).

litert-torch's lowering registry and decomposition tables are its internals, not its public API: they are checked
before use (``forms_available``), each change is undone when the conversion ends, and without them the model
converts as it did before (its PReLU and ELU then in float, which the report names).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ETHOS_U_KERNELS",
    "LITERT_KERNELS",
    "TFLITE_MICRO_KERNELS",
    "Int8Kernels",
    "forms_available",
    "fuse_int8_islands",
    "micro_kernel_probe",
    "operator_forms",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Int8Kernels:
    """The int8 kernels a target runs that decide an operator's form: what runs the model (or the NPU part of it)
    has int8 GELU, EXP and LOG (lookup tables) and ELU, or not. Tried on one-operator models: LiteRT has them all;
    TFLite Micro has int8 ELU but neither EXP, LOG nor GELU; vela maps GELU, EXP and LOG to the Ethos-U's lookup
    tables and has no ELU. (All three run DIV of two activations in int8: vela leaves it to the CPU.)"""

    runtime: str
    gelu: bool
    exp_log: bool
    elu: bool

    @property
    def float_only(self) -> frozenset[str]:
        """The TFLite operators the target runs in float only."""
        return frozenset(({"EXP", "LOG"} if not self.exp_log else set()) | ({"GELU"} if not self.gelu else set()))


LITERT_KERNELS = Int8Kernels("LiteRT", gelu=True, exp_log=True, elu=True)
TFLITE_MICRO_KERNELS = Int8Kernels("TFLite Micro", gelu=False, exp_log=False, elu=True)
ETHOS_U_KERNELS = Int8Kernels("the Ethos-U NPU", gelu=True, exp_log=True, elu=False)


def _internals() -> tuple[Any, Any, Any, Any, Any] | None:
    """litert-torch's lowering registry, lowering utilities, decomposition tables, and the MLIR bindings it lowers
    with, if they are what this module was written against; None otherwise."""
    try:
        import torch
        from litert_converter.mlir import ir
        from litert_converter.mlir.dialects import stablehlo
        from litert_torch import fx_infra
        from litert_torch.backend.lowerings import registry
        from litert_torch.backend.lowerings import utils as lowering_utils
    except ImportError as exc:
        logger.info("litert-torch internals not found (%s): PReLU and ELU convert as litert-torch lowers them", exc)
        return None
    decomp: Any = getattr(fx_infra, "decomp", None)
    expected = (
        callable(getattr(registry, "lower", None))
        and hasattr(getattr(registry, "global_registry", None), "registered_ops")
        and callable(getattr(lowering_utils, "node_meta_to_ir_types", None))
        and all(
            callable(getattr(decomp, name, None))
            for name in ("pre_convert_decomp", "pre_lower_decomp", "remove_pre_lower_decomp", "add_pre_convert_decomp")
        )
        and callable(getattr(stablehlo, "custom_call", None))
        # PReLU's own decomposition, which the PRELU lowering stands in for
        and torch.ops.aten._prelu_kernel.default in decomp.pre_convert_decomp()
    )
    if not expected:
        logger.info("litert-torch's lowering internals changed: PReLU and ELU convert as litert-torch lowers them")
        return None
    return registry, lowering_utils, decomp, ir, stablehlo


def forms_available() -> bool:
    """Whether litert-torch's internals are as ``operator_forms`` expects (a test keeps this True)."""
    return _internals() is not None


def _tfl(ir: Any, stablehlo: Any, name: str, results: list[Any], operands: list[Any]) -> Any:
    """The TFLite operator ``name`` in the carrier litert-torch's converter legalizes: a StableHLO custom call."""
    return stablehlo.custom_call(
        result=results,
        inputs=operands,
        call_target_name=ir.StringAttr.get(name),
        has_side_effect=ir.BoolAttr.get(False),
        backend_config=ir.StringAttr.get(str(ir.DictAttr.get({}))),
    )


@contextlib.contextmanager
def operator_forms(*, elu: bool) -> Iterator[bool]:
    """While converting: PReLU as TFLite's PRELU, and (``elu``) ``nn.ELU()`` as TFLite's ELU. Yields whether the
    forms are in place; everything is as it was after."""
    found = _internals()
    if found is None:
        yield False
        return
    registry, lowering_utils, decomp, ir, stablehlo = found
    import torch

    aten = torch.ops.aten
    prelu, elu_op = aten._prelu_kernel.default, aten.elu.default

    def lower_prelu(lctx: Any, x: Any, weight: Any) -> Any:
        # TFLite's alpha has one dimension less than the input, and broadcasts against its last ones
        rank = len(lctx.node.meta["val"].shape)
        shape = list(lctx.node.args[1].meta["val"].shape)
        full = [1] * (rank - len(shape)) + shape
        if full[0] != 1:
            raise ValueError(f"PReLU's weight {tuple(shape)} varies along the batch axis")
        alpha_type = ir.RankedTensorType.get(full[1:], ir.RankedTensorType(weight.type).element_type)
        alpha = stablehlo.reshape(alpha_type, weight)
        return _tfl(ir, stablehlo, "tfl.prelu", lowering_utils.node_meta_to_ir_types(lctx.node), [x, alpha])

    def lower_elu(lctx: Any, x: Any, alpha: float = 1.0, scale: float = 1.0, input_scale: float = 1.0) -> Any:
        if (alpha, scale, input_scale) != (1.0, 1.0, 1.0):
            raise AssertionError("only ELU(alpha=1) is lowered to TFLite's ELU")  # see _native_elu
        return _tfl(ir, stablehlo, "tfl.elu", lowering_utils.node_meta_to_ir_types(lctx.node), [x])

    ops = registry.global_registry.registered_ops
    lowered = {prelu: lower_prelu, **({elu_op: lower_elu} if elu else {})}
    saved_lowerings = {op: ops.get(op) for op in lowered}
    # (torch's decomposition table is a mapping whose get() misses entries it holds: index it)
    convert_table, lower_table = decomp.pre_convert_decomp(), decomp.pre_lower_decomp()
    saved_decomps = {op: convert_table[op] if op in convert_table else None for op in lowered}  # noqa: SIM401
    saved_lower_decomps = {op: lower_table[op] if op in lower_table else None for op in lowered}  # noqa: SIM401
    layout = _layout_noop(elu_op) if elu else contextlib.nullcontext()
    try:
        for op, lowering in lowered.items():
            decomp.remove_pre_lower_decomp(op)  # and from the pre-convert table: the operator reaches lowering
            registry.lower(op)(lowering)
        with layout:
            yield True
    finally:
        for op, previous in saved_lowerings.items():
            if previous is None:
                ops.pop(op, None)
            else:
                ops[op] = previous
        for op in lowered:
            if saved_decomps[op] is not None:
                decomp.add_pre_convert_decomp(op, saved_decomps[op])
            if saved_lower_decomps[op] is not None and saved_lower_decomps[op] is not saved_decomps[op]:
                decomp.add_pre_lower_decomp(op, saved_lower_decomps[op])


@contextlib.contextmanager
def _layout_noop(op: Any) -> Iterator[None]:
    """litert-torch's layout pass moves tensors to NHWC around operators it knows to be element-wise; ELU is one it
    does not list, and the TRANSPOSE it puts after it would sit between ELU and its QUANTIZE."""
    try:
        from litert_torch._convert.fx_passes.optimize_layout_transposes_pass import layout_rewrite
    except ImportError:
        yield
        return
    rewriters = getattr(layout_rewrite, "rewriters", None)
    noop = getattr(layout_rewrite, "noop", None)
    if rewriters is None or not callable(noop) or not callable(getattr(rewriters, "register", None)):
        yield
        return
    if op in rewriters:  # a litert-torch that knows it already
        yield
        return
    rewriters.register(op)(noop)
    try:
        yield
    finally:
        rewriters.pop(op, None)


def fuse_int8_islands(
    path: Path,
    *,
    select_v2: bool,
    float_only: frozenset[str] = frozenset(),
    kept_float: Callable[[str], bool] = lambda name: False,
) -> dict[str, int]:
    """Rewrites the LiteRT model ``path`` in place (see the module): each float ELU between a DEQUANTIZE of an int8
    tensor and a QUANTIZE to one, as the int8 ELU of those two; with ``select_v2``, each SELECT whose condition has
    its operands' shape as SELECT_V2; each int8 operator named in ``float_only`` (what the target has no int8
    kernel for: TFLite Micro's EXP and LOG, which the converter quantizes wherever a DEQUANTIZE and a QUANTIZE
    surround them) computed in float between a DEQUANTIZE and a QUANTIZE. An ELU whose output tensor's name
    ``kept_float`` says belongs to a layer mixed precision keeps float stays float. What it changed, by
    operator."""
    from ai_edge_litert import schema_py_generated as schema
    from ai_edge_litert.tools import flatbuffer_utils

    model = flatbuffer_utils.read_model(str(path))
    builtin = schema.BuiltinOperator
    changed: dict[str, int] = {}

    def code_of(op: Any) -> int:
        return _builtin(model.operatorCodes[op.opcodeIndex])

    for graph in model.subgraphs:
        producer = {out: op for op in graph.operators for out in op.outputs}
        readers: dict[int, list[Any]] = {}
        for op in graph.operators:
            for index in op.inputs:
                readers.setdefault(int(index), []).append(op)
        outputs = {int(i) for i in graph.outputs}
        gone: set[int] = set()
        for op in graph.operators:
            if code_of(op) != builtin.ELU or len(op.inputs) != 1 or len(op.outputs) != 1:
                continue
            source, result = int(op.inputs[0]), int(op.outputs[0])
            dequantize = producer.get(source)
            after = readers.get(result, [])
            if dequantize is None or code_of(dequantize) != builtin.DEQUANTIZE or len(after) != 1:
                continue
            quantize = after[0]
            if code_of(quantize) != builtin.QUANTIZE or result in outputs:
                continue
            int8_in, int8_out = int(dequantize.inputs[0]), int(quantize.outputs[0])
            if {graph.tensors[int8_in].type, graph.tensors[int8_out].type} != {schema.TensorType.INT8}:
                continue
            if len(readers.get(source, [])) != 1 or source in outputs:
                continue
            name = graph.tensors[result].name
            if kept_float(name.decode() if isinstance(name, bytes) else str(name)):
                continue
            op.inputs, op.outputs = [int8_in], [int8_out]
            gone |= {id(dequantize), id(quantize)}
            changed["ELU"] = changed.get("ELU", 0) + 1
        graph.operators = [op for op in graph.operators if id(op) not in gone]
        if float_only:
            names = {value: key for key, value in vars(builtin).items() if not key.startswith("_")}
            for op in list(graph.operators):
                name = names.get(code_of(op))
                if name in float_only and _computes_in_int8(graph, op, schema):
                    _in_float(model, graph, op, schema)
                    changed[f"{name} in float"] = changed.get(f"{name} in float", 0) + 1
        if select_v2:
            for op in graph.operators:
                if code_of(op) != builtin.SELECT or len(op.inputs) != 3:
                    continue
                shapes = {tuple(graph.tensors[int(i)].shape) for i in op.inputs}
                if len(shapes) != 1:
                    continue  # SELECT's rank-1 condition picks rows: not SELECT_V2's broadcast
                op.opcodeIndex = _opcode(model, schema, builtin.SELECT_V2)
                op.builtinOptionsType = schema.BuiltinOptions.SelectV2Options
                op.builtinOptions = schema.SelectV2OptionsT()
                changed["SELECT"] = changed.get("SELECT", 0) + 1
    if changed:
        flatbuffer_utils.write_model(model, str(path))
    return changed


def micro_kernel_probe(path: Path, npu_only: frozenset[str]) -> None:
    """Rewrites the LiteRT model ``path`` (a copy) so that TFLite Micro can load it but for the kernels it lacks for
    the other operators: each int8 operator in ``npu_only`` (what vela maps to the Ethos-U's lookup tables, GELU,
    EXP, LOG, which TFLite Micro has no int8 kernel for) in float, GELU, which it has no kernel for at all, as TANH.
    Only loading it means anything: the numbers are not the model's."""
    from ai_edge_litert import schema_py_generated as schema
    from ai_edge_litert.tools import flatbuffer_utils

    fuse_int8_islands(path, select_v2=False, float_only=npu_only)
    model = flatbuffer_utils.read_model(str(path))
    for graph in model.subgraphs:
        for op in graph.operators:
            if _builtin(model.operatorCodes[op.opcodeIndex]) == schema.BuiltinOperator.GELU:
                op.opcodeIndex = _opcode(model, schema, schema.BuiltinOperator.TANH)
                op.builtinOptionsType, op.builtinOptions = schema.BuiltinOptions.NONE, None
    flatbuffer_utils.write_model(model, str(path))


def _computes_in_int8(graph: Any, op: Any, schema: Any) -> bool:
    tensors = [graph.tensors[int(i)] for i in (*op.inputs, *op.outputs) if int(i) >= 0]
    return bool(tensors) and all(tensor.type == schema.TensorType.INT8 for tensor in tensors)


def _in_float(model: Any, graph: Any, op: Any, schema: Any) -> None:
    """``op``, an int8 operator of ``graph``, computing in float: a DEQUANTIZE of each input before it, a QUANTIZE
    of each output after it, into new float tensors of the same shapes."""

    def float_twin(index: int) -> int:
        tensor = graph.tensors[index]
        twin = schema.TensorT()
        twin.shape, twin.type = list(tensor.shape), schema.TensorType.FLOAT32
        name = tensor.name.decode() if isinstance(tensor.name, bytes) else str(tensor.name)
        twin.name = f"{name}/float"
        model.buffers.append(schema.BufferT())
        twin.buffer = len(model.buffers) - 1
        graph.tensors.append(twin)
        return len(graph.tensors) - 1

    def conversion(code: int, source: int, result: int) -> Any:
        made = schema.OperatorT()
        made.opcodeIndex = _opcode(model, schema, code)
        made.inputs, made.outputs = [source], [result]
        return made

    position = graph.operators.index(op)
    inputs = [float_twin(int(i)) if int(i) >= 0 else int(i) for i in op.inputs]
    outputs = [float_twin(int(i)) for i in op.outputs]
    dequantize, quantize = schema.BuiltinOperator.DEQUANTIZE, schema.BuiltinOperator.QUANTIZE
    before = [conversion(dequantize, int(i), f) for i, f in zip(op.inputs, inputs, strict=True) if int(i) >= 0]
    after = [conversion(quantize, f, int(o)) for o, f in zip(op.outputs, outputs, strict=True)]
    op.inputs, op.outputs = inputs, outputs
    graph.operators[position : position + 1] = [*before, op, *after]


def _builtin(opcode: Any) -> int:
    """An operator code's builtin operator: the schema keeps codes over 127 in a second field."""
    return max(int(opcode.builtinCode), int(opcode.deprecatedBuiltinCode))


def _opcode(model: Any, schema: Any, code: int) -> int:
    """The index of ``code``'s entry in ``model``'s operator codes, added when it has none."""
    for index, opcode in enumerate(model.operatorCodes):
        if _builtin(opcode) == code:
            return index
    entry = schema.OperatorCodeT()
    entry.builtinCode = code
    entry.deprecatedBuiltinCode = min(code, 127)
    entry.version = 1
    model.operatorCodes.append(entry)
    return len(model.operatorCodes) - 1
