"""Name -> "module:attribute" registries, resolved on first use: runtime and export backends, codecs, sources."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from edgeline.errors import BackendUnavailableError, EdgelineError

__all__ = ["resolve"]


def resolve(registry: Mapping[str, str], name: str, kind: str, error: type[EdgelineError]) -> Any:
    """Import and return what ``registry[name]`` points at; an unknown name raises ``error`` listing the valid ones."""
    target = registry.get(name)
    if target is None:
        raise error(f"unknown {kind} {name!r}; valid: {', '.join(sorted(registry))}")
    module_name, _, attribute = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:  # a folder or optional package this install left out
        missing = exc.name or module_name
        raise BackendUnavailableError(
            f"the {kind} {name!r} is not available in this install: {missing} is missing"
        ) from exc
    return getattr(module, attribute)
