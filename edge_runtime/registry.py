"""Name -> "module:attribute" registries, resolved on first use (the runtime and export backends use it)."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from edgeline.errors import EdgelineError

__all__ = ["resolve"]


def resolve(registry: Mapping[str, str], name: str, kind: str, error: type[EdgelineError]) -> Any:
    """Import and return what ``registry[name]`` points at; an unknown name raises ``error`` listing the valid ones."""
    target = registry.get(name)
    if target is None:
        raise error(f"unknown {kind} {name!r}; valid: {', '.join(sorted(registry))}")
    module_name, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module_name), attribute)
