"""A detector's pixel boxes divided by the input size inside the model, before they meet the scores.

A YOLO head concatenates its boxes (cx, cy, w, h in input pixels: 0 to 640) and its class scores (0 to 1) into one
output tensor. Integer quantization gives a tensor one scale: 640 / 255 = 2.5 per step, and every score rounds to
0 or 2.5 (ultralytics #7371, #17327: int8 detectors with mAP 0). Dividing the box rows by the input's width and
height *before* the concatenation puts all of it in [0, 1], one step 1/255 of the image for the boxes and of the
scores both; the head then says ``box_space = "normalised"`` and decoding multiplies them back.

``normalise_boxes`` finds the concatenation that makes output 0 (``torch.fx``: a copy of the model's own forward is
traced symbolically, each child module called whole; where a child makes output 0, as a YOLO model's head module
does, that child's forward is traced, and so on; the module whose forward makes it keeps its class, its place and
its children, so that the layer report and mixed precision name every layer as the original's; a ``.pt2``
program's module already is a flat graph), multiplies each of its inputs that holds box rows by a constant, and
checks on a sample that the result is the original output with its box rows divided and nothing else changed.
Where the output is not made that way, the model is left as it is and the reason returned: the mAP budget then
judges what int8 does to it.
"""

from __future__ import annotations

import copy
import types
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgeline.detection import Head

__all__ = ["BoxScaling", "normalise_boxes"]


@dataclass(frozen=True)
class BoxScaling:
    module: Any
    """The rewritten module: a copy of the original with the traced graph as its forward (or, for a ``.pt2``'s
    graph, the graph rewritten)."""
    inputs: int
    """How many of the concatenation's inputs were scaled."""


MAX_DEPTH = 8
"""How many modules deep the concatenation that makes output 0 is looked for (a YOLO model returns its head
module's output; the head concatenates)."""


def _cat_targets() -> tuple[Any, ...]:
    import torch

    return (torch.cat, torch.concat, torch.concatenate, torch.ops.aten.cat.default, torch.ops.aten.concat.default)


def normalise_boxes(module: Any, head: Head, input_size: tuple[int, int], example: tuple[Any, ...]) -> BoxScaling | str:
    """``module`` with output 0's box rows divided by ``input_size`` (height, width) before the concatenation that
    makes it, or why that cannot be done (a sentence)."""
    import torch
    from torch import fx

    if head.layout == "end2end" or head.box_space != "pixels":
        return "the head's boxes are not in pixels beside its scores"
    rewritten = copy.deepcopy(module)
    owner, owner_inputs = rewritten, example
    for _ in range(MAX_DEPTH):
        try:  # the owner's own forward, its children whole (a .pt2's module already is a flat graph)
            graph_module = owner if isinstance(owner, fx.GraphModule) else _trace_own_forward(owner)
        except Exception as exc:  # control flow on values, an untraceable call: the model stays as it is
            return f"torch.fx cannot trace the model ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
        first = _output_maker(graph_module)
        if isinstance(first, fx.Node) and first.op == "call_module" and not isinstance(owner, fx.GraphModule):
            target = str(first.target)
            owner = owner.get_submodule(target)  # that module returns output 0: look inside it
            found = _inputs_of(owner, rewritten, example)
            if found is None:
                return f"the module {target} that makes output 0 takes keyword arguments"
            owner_inputs = found
            continue
        break
    else:
        return f"output 0 is made more than {MAX_DEPTH} modules deep"
    axis = 1 if head.layout == "attributes-first" else 2
    height, width = input_size
    per_row = [1 / width, 1 / height] * 2 if head.box_format in ("xywh", "xyxy") else [1 / height, 1 / width] * 2
    scaled = _scale_concatenation(graph_module, first, owner_inputs, axis, per_row)
    if isinstance(scaled, str):
        return scaled
    if graph_module is not owner:
        # the owner keeps its class, its place and its children (torch.export and the converters name its layers
        # as the original's: the layer report ties deployed tensors to torch layers by those names) and computes
        # the rewritten graph, which reaches every child, parameter and buffer by the same attribute paths
        for name, buffer in graph_module.named_buffers(recurse=False):
            if name.startswith("edgeline_box_scale_"):
                owner.register_buffer(name, buffer, persistent=False)
        owner.forward = types.MethodType(type(graph_module).forward, owner)
    with torch.no_grad():
        before = _first(module(*example))
        after = _first(rewritten(*example))
    divisor = torch.ones(before.shape[axis])
    divisor[:4] = torch.tensor([1 / f for f in per_row])
    expected = before / (divisor.reshape(1, -1, 1) if axis == 1 else divisor.reshape(1, 1, -1))
    if after.shape != before.shape or not torch.allclose(after, expected, rtol=1e-5, atol=1e-6):
        return "the rewritten model's output is not the original's with its boxes divided (left as it was)"
    return BoxScaling(rewritten, scaled)


def _output_maker(graph_module: Any) -> Any:
    """The node whose value is output 0 of ``graph_module``."""
    output = next(node for node in graph_module.graph.nodes if node.op == "output")
    results = output.args[0]
    return results[0] if isinstance(results, tuple | list) else results


def _inputs_of(owner: Any, root: Any, example: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The positional inputs ``owner`` (a module inside ``root``) takes when ``root`` runs on ``example``; None when
    it takes keyword arguments, or never runs."""
    import torch

    seen: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    handle = owner.register_forward_pre_hook(lambda _m, args, kwargs: seen.append((args, kwargs)), with_kwargs=True)
    try:
        with torch.no_grad():
            root(*example)
    finally:
        handle.remove()
    if not seen or seen[-1][1]:
        return None
    return tuple(seen[-1][0])


def _scale_concatenation(
    graph_module: Any, first: Any, inputs: tuple[Any, ...], axis: int, per_row: list[float]
) -> int | str:
    """Multiply the box rows of ``first``, the concatenation that makes output 0 of ``graph_module``, by ``per_row``
    (the graph recompiled): how many of its inputs were scaled, or why it cannot be done."""
    import torch
    from torch import fx
    from torch.fx.passes.shape_prop import ShapeProp

    if not isinstance(first, fx.Node) or first.op != "call_function" or first.target not in _cat_targets():
        return "output 0 is not made by a concatenation (torch.cat) in the model's forward"
    parts: Any = first.args[0] if first.args else first.kwargs.get("tensors")
    dim: Any = first.args[1] if len(first.args) > 1 else first.kwargs.get("dim", 0)
    listed = isinstance(parts, list | tuple) and all(isinstance(p, fx.Node) for p in parts)
    if not listed or not isinstance(dim, int):
        return "output 0's concatenation takes something other than a list of tensors"
    with torch.no_grad():
        try:
            ShapeProp(graph_module).propagate(*inputs)
        except Exception as exc:
            return f"the traced model does not run on a sample ({type(exc).__name__})"
    shapes = [tuple(part.meta["tensor_meta"].shape) for part in parts]
    if any(len(shape) != 3 for shape in shapes) or dim % 3 != axis:
        return f"output 0's concatenation joins along axis {dim}, not the attributes' axis {axis}"
    if sum(shape[axis] for shape in shapes) < 5:
        return "output 0 has no scores beside its boxes"
    graph, scaled, start = graph_module.graph, 0, 0
    for index, (part, shape) in enumerate(zip(parts, shapes, strict=True)):
        rows = shape[axis]
        if start < 4:
            factors = np.ones(rows, dtype=np.float32)
            covered = min(rows, 4 - start)
            factors[:covered] = per_row[start : start + covered]
            view = (1, rows, 1) if axis == 1 else (1, 1, rows)
            name = f"edgeline_box_scale_{index}"
            graph_module.register_buffer(name, torch.from_numpy(factors.reshape(view)), persistent=False)
            with graph.inserting_before(first):
                constant = graph.get_attr(name)
                product = graph.call_function(torch.mul, (part, constant))
            first.replace_input_with(part, product)
            scaled += 1
        start += rows
    graph.lint()
    graph_module.recompile()
    return scaled


def _trace_own_forward(module: Any) -> Any:
    """``module``'s own forward as a graph, each child module called whole (a leaf): its layers keep their code,
    their names and their nesting, and control flow inside them is never traced."""
    from torch import fx

    class OwnForward(fx.Tracer):
        def is_leaf_module(self, m: Any, module_qualified_name: str) -> bool:
            return True

    return fx.GraphModule(module, OwnForward().trace(module))


def _first(outputs: Any) -> Any:
    return outputs[0] if isinstance(outputs, tuple | list) else outputs
