"""LiteRT models that are valid flatbuffers, signable like any other, and hostile to the runtime that opens them:
what a build gone wrong or a stolen targets key could ship. Each rewrites a copy of a committed tiny model.

    recursive   a WHILE whose body holds that WHILE again: LiteRT's allocate_tensors prepares the body, which
                prepares the body, ... until the stack overflows (SIGSEGV)
    endless     a WHILE whose condition is a constant true: the first invoke never returns
    huge        a BROADCAST_TO into a 1 GiB float tensor nobody reads: the arena takes 1 GiB at the first invoke
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["HOSTILE", "rewrite"]


def _schema() -> Any:
    from ai_edge_litert import schema_py_generated as schema

    return schema


def _opcode(model: Any, op: int, version: int = 1) -> int:
    schema = _schema()
    code = schema.OperatorCodeT()
    code.builtinCode = op
    code.deprecatedBuiltinCode = min(op, schema.BuiltinOperator.PLACEHOLDER_FOR_GREATER_OP_CODES)
    code.version = version
    model.operatorCodes.append(code)
    return len(model.operatorCodes) - 1


def _buffer(model: Any, data: np.ndarray | None = None) -> int:
    buffer = _schema().BufferT()
    if data is not None:
        buffer.data = data.view(np.uint8).reshape(-1)
    model.buffers.append(buffer)
    return len(model.buffers) - 1


def _tensor(model: Any, name: bytes, shape: list[int], kind: int, data: np.ndarray | None = None) -> Any:
    tensor = _schema().TensorT()
    tensor.name, tensor.shape, tensor.type, tensor.buffer = name, shape, kind, _buffer(model, data)
    return tensor


def _while(model: Any, graph: Any, source: int, cond: int, body: int) -> Any:
    """A WHILE on tensor ``source`` of ``graph`` into a new tensor like it (nobody reads it)."""
    schema = _schema()
    looped = copy.deepcopy(graph.tensors[source])
    looped.name, looped.buffer = b"looped", _buffer(model)
    graph.tensors.append(looped)
    op = schema.OperatorT()
    op.opcodeIndex = _opcode(model, schema.BuiltinOperator.WHILE)
    op.inputs, op.outputs = [source], [len(graph.tensors) - 1]
    op.builtinOptionsType = schema.BuiltinOptions.WhileOptions
    op.builtinOptions = schema.WhileOptionsT()
    op.builtinOptions.condSubgraphIndex, op.builtinOptions.bodySubgraphIndex = cond, body
    return op


def _copy_of(model: Any, tensor: Any) -> Any:
    """A tensor like ``tensor``, with a buffer of its own."""
    copied = copy.deepcopy(tensor)
    copied.buffer = _buffer(model)
    return copied


def _loop(model: Any, body_name: bytes) -> tuple[Any, Any, int]:
    """A WHILE on the main graph's input: a condition subgraph answering a constant true, and an empty body subgraph
    named ``body_name`` for the caller to fill. Returns (main graph, body, the body's index)."""
    schema = _schema()
    graph = model.subgraphs[0]
    (source,) = graph.inputs
    cond = schema.SubGraphT()
    truth = _tensor(model, b"true", [], schema.TensorType.BOOL, np.array([1], np.uint8))
    cond.name, cond.tensors, cond.inputs, cond.outputs = (
        b"always",
        [_copy_of(model, graph.tensors[source]), truth],
        [0],
        [1],
    )
    cond.operators = []
    body = schema.SubGraphT()
    body.name, body.tensors, body.inputs, body.operators = body_name, [_copy_of(model, graph.tensors[source])], [0], []
    model.subgraphs += [cond, body]
    body_index = len(model.subgraphs) - 1
    graph.operators.insert(0, _while(model, graph, source, body_index - 1, body_index))
    return graph, body, body_index


def _recursive(model: Any) -> None:
    _, body, index = _loop(model, b"itself")
    body.operators = [_while(model, body, 0, index - 1, index)]  # the body runs the loop again
    body.outputs = [1]


def _endless(model: Any) -> None:
    _, body, _ = _loop(model, b"same")
    body.outputs = [0]  # the identity, for ever


HUGE_SHAPE = [256, 1024, 1024]


def _huge(model: Any) -> None:
    schema = _schema()
    graph = model.subgraphs[0]
    kinds = schema.TensorType
    one = _tensor(model, b"one", [1], kinds.FLOAT32, np.array([1.0], np.float32))
    shape = _tensor(model, b"huge-shape", [3], kinds.INT32, np.array(HUGE_SHAPE, np.int32))
    huge = _tensor(model, b"huge", HUGE_SHAPE, kinds.FLOAT32)
    graph.tensors += [one, shape, huge]
    op = schema.OperatorT()
    op.opcodeIndex = _opcode(model, schema.BuiltinOperator.BROADCAST_TO, version=2)
    n = len(graph.tensors)
    op.inputs, op.outputs = [n - 3, n - 2], [n - 1]
    graph.operators.append(op)


HOSTILE: dict[str, Callable[[Any], None]] = {"recursive": _recursive, "endless": _endless, "huge": _huge}


def rewrite(model_file: Path, kind: str) -> None:
    """Rewrite the LiteRT model at ``model_file`` in place as the ``kind`` of ``HOSTILE``."""
    import flatbuffers

    schema = _schema()
    model = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(model_file.read_bytes(), 0))
    HOSTILE[kind](model)
    builder = flatbuffers.Builder(1024)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    model_file.write_bytes(bytes(builder.Output()))
