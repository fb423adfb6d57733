"""What mixed precision's kept layers really compute in, read from the converted model file.

Mixed precision asks the quantizer to leave a group of modules in float (``ExportRequest.keep_float``); the
converter may still compute some of them in integer. Seen with litert-torch 0.10 (ai-edge-litert 2.3): a lone float
operator between a dequantize and a quantize (a ReLU kept float whose convolution stays int8) comes out int8, and a
kept group holding a max pool whose output an int8 layer reads comes out int8 whole, its convolutions' weights
quantized by the converter (the pool's scale carried back through the group). ONNX Runtime fuses a
DequantizeLinear, a node left out of quantization and a QuantizeLinear into one integer kernel. So the manifest's
``kept_float`` is checked against the file, module by module:

- a module tied to operators of the file, none of which computes in float, is not listed (``Verified.int8``);
- a module no operator of the file is tied to keeps its claim, its reason saying it was not verified in the file;
- the others stand as they are.

Ties: a LiteRT operator to the module whose torch operator made it (``ModelSources.name``, as the placement's
``fallback_sources``), and also to each module its tensor's name places it in that has no operator of its own in
the file (a ReLU fused into the convolution before it computes in that convolution's kernel); an ONNX node to the
modules of its ``name_scopes``. Which operators compute in float is the file's to say: ``tflite_records``, and
for ONNX the nodes ONNX Runtime's CPU provider fuses into integer kernels (``quantized_nodes``, ``cpu_float_nodes``).
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgeline.device_profiles import Precision
from edgeline.manifest import KeptFloat

__all__ = ["FileOperator", "Verified", "file_operators", "verify_kept"]

NOT_VERIFIED = "not verified in the file: no operator of the converted model is named after it"


@dataclass(frozen=True)
class FileOperator:
    """One operator of a converted model file: its kind (``MAX_POOL_2D``), the modules it is tied to, and whether it
    computes in float."""

    kind: str
    modules: tuple[str, ...]
    in_float: bool


@dataclass(frozen=True)
class Verified:
    """``kept``: the kept layers the file bears out (or cannot tell); ``int8``: each module dropped, with the kinds
    of its operators, all of which compute in integer."""

    kept: tuple[KeptFloat, ...]
    int8: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def said(self) -> str:
        """``pool1 (MAX_POOL_2D)``: the dropped modules, for a message; "" when none was."""
        return ", ".join(f"{module} ({', '.join(kinds)})" for module, kinds in self.int8)


def _inside(path: str, module: str) -> bool:
    return path == module or path.startswith(module + ".")


def verify_kept(kept: Sequence[KeptFloat], operators: Sequence[FileOperator] | None) -> Verified:
    """``kept`` as the file's ``operators`` bear it out (see the module); None: a file edgeline does not read, every
    claim as it was."""
    if operators is None or not kept:
        return Verified(tuple(kept))
    left: list[KeptFloat] = []
    int8: list[tuple[str, tuple[str, ...]]] = []
    for layer in kept:
        its = [op for op in operators if any(_inside(module, layer.module) for module in op.modules)]
        if not its:
            if NOT_VERIFIED not in layer.reason:
                layer = layer.model_copy(update={"reason": f"{layer.reason}; {NOT_VERIFIED}"})
            left.append(layer)
        elif any(op.in_float for op in its):
            left.append(layer)
        else:
            int8.append((layer.module, tuple(dict.fromkeys(op.kind for op in its))))
    return Verified(tuple(left), tuple(int8))


def file_operators(
    path: Path, precision: Precision, program: Any, root: Any, cpu_fusions: bool = False
) -> list[FileOperator] | None:
    """The operators of the model file ``path`` with their modules (``program``: the torch.export program of the
    torch module ``root`` it was converted from); None for a format edgeline does not read here. ``cpu_fusions``:
    an ONNX model ONNX Runtime's CPU provider runs (``cpu_float_nodes``), not QNN's context binary."""
    if path.suffix == ".tflite":
        return _tflite_operators(path, precision, program, root)
    if path.suffix == ".onnx":
        return _onnx_operators(path, {name for name, _ in root.named_modules() if name}, cpu_fusions)
    return None


def _tflite_operators(path: Path, precision: Precision, program: Any, root: Any) -> list[FileOperator]:
    from ai_edge_litert.interpreter import Interpreter

    from edgeline.export.placement import ModelSources, tflite_records

    sources = ModelSources.of(program, root)
    records = tflite_records(Interpreter(model_path=str(path)), precision)
    named = sources.name(records)
    made = [_module_of(record.source) for record in named]
    own = {module for module in made if module}
    operators = []
    for record, module in zip(named, made, strict=True):
        fused = tuple(m for m in sources.modules(record.output) if m and m not in own)
        tied = tuple(dict.fromkeys((module, *fused) if module else fused))
        operators.append(FileOperator(record.name, tied, not record.quantized))
    return operators


def _module_of(source: str) -> str:
    """``pool1 (model.py:14)`` -> ``pool1``; "" for code outside every module or no source."""
    module = source.split(" (", 1)[0]
    return "" if module in ("", "forward()") else module


def _onnx_operators(path: Path, modules: set[str], cpu_fusions: bool) -> list[FileOperator]:
    """The ONNX graph's nodes, tied to the module paths among their ``name_scopes`` (which also hold the torch
    operators' own names, ``conv2d_1``)."""
    import onnx

    from edgeline.export.backends.onnxruntime import cpu_float_nodes, quantized_nodes

    graph = onnx.load(str(path), load_external_data=False).graph
    quantized, left_in_float = quantized_nodes(graph)
    # a node between a DequantizeLinear and QuantizeLinears is an integer kernel where ONNX Runtime's CPU provider
    # fuses it (even with float weights of its own: it quantizes them itself, tests/test_onnx_qdq_counts.py), and
    # float where it has no kernel to fuse it into (cpu_float_nodes)
    unfused = cpu_float_nodes(path) if cpu_fusions else set()  # QNN's file is its context binary: the HTP runs it
    floating = {id(node) for node in left_in_float} | {id(node) for node in quantized if node.name in unfused}
    operators = []
    for node in (*quantized, *left_in_float):
        scopes = next((p.value for p in node.metadata_props if p.key == "pkg.torch.onnx.name_scopes"), None)
        names = tuple(str(name) for name in (ast.literal_eval(scopes) if scopes else []) if str(name) in modules)
        operators.append(FileOperator(node.op_type, names, id(node) in floating))
    return operators
