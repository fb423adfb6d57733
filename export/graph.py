"""Reading a torch.export graph back as the model's modules: which module made a node, which module a LiteRT
tensor's location names, each module's last node. Shared by conversion (naming a culprit), the per-layer report and
the targets that read their model's layers; it imports nothing of ``edgeline.export``, so anything may import it."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["export_node_modules", "export_program", "last_nodes", "module_of_location", "module_path"]


def module_path(node: Any) -> str | None:
    """The path of the innermost module whose code made the torch.fx ``node`` (``features.2``), from torch.export's
    ``nn_module_stack``; older torch wrote it ``L['self'].features[2]``."""
    stack = (getattr(node, "meta", {}) or {}).get("nn_module_stack") or {}
    if not stack:
        return None
    path, _ = list(stack.values())[-1]
    path = re.sub(r"^L\['self'\]\.?", "", str(path))
    return re.sub(r"\[(\d+)\]", r".\1", re.sub(r"\['([^']+)'\]", r".\1", path)).lstrip(".") or None


def _segment(child: Any, attribute: str) -> str:
    kind = type(child)
    return f"{kind.__module__}.{kind.__qualname__}_{attribute}"


def module_of_location(location: str, root: Any) -> str | None:
    """``__main__.Net/torch.nn.modules.container.Sequential_features/torch.nn.modules.conv.Conv2d_2`` -> ``features.2``:
    each segment after the root's is a child's class and its attribute name; the root's alone is ``""``."""
    segments = location.split("/")
    kind = type(root)
    if segments[0] != f"{kind.__module__}.{kind.__qualname__}":
        return None
    module, path = root, []
    for segment in segments[1:]:
        children = dict(module.named_children())
        found = next((name for name, child in children.items() if _segment(child, name) == segment), None)
        if found is None:
            return None
        module = children[found]
        path.append(found)
    return ".".join(path)


def export_program(module: Any, arrays: Sequence[np.ndarray]) -> Any:
    """torch.export's program of ``module`` on one sample: the graph the layer report reads its modules from (export
    once, pass it to each reader)."""
    import torch

    return torch.export.export(module, tuple(torch.from_numpy(a) for a in arrays))


def last_nodes(program: Any) -> dict[str, Any]:
    """Module path -> its last operator in the graph: the node whose value is the module's output."""
    last: dict[str, Any] = {}
    for node in program.graph.nodes:
        path = module_path(node) if node.op == "call_function" else None
        if path is not None:
            last[path] = node
    return last


def export_node_modules(program: Any) -> dict[str, str]:
    """torch.export node name -> the module path whose output it is (the module's last node)."""
    return {node.name: path for path, node in last_nodes(program).items()}
