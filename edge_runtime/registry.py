"""Name -> "module:attribute" registries, resolved on first use: runtime and export backends, codecs, sources.

The one lazy loader of ``edgeline``: ``resolve`` for a registry's entry, ``import_optional`` for a module an entry
needs in turn (a codec's parser). Both turn a module this install left out into a ``BackendUnavailableError`` that
names what is missing, so that nothing is imported before it is asked for and a device without an extra gets a
sentence, not a traceback.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from edgeline.errors import BackendUnavailableError, EdgelineError

__all__ = ["import_optional", "resolve"]


def resolve(registry: Mapping[str, str], name: str, kind: str, error: type[EdgelineError]) -> Any:
    """Import and return what ``registry[name]`` points at; an unknown name raises ``error`` listing the valid ones."""
    target = registry.get(name)
    if target is None:
        raise error(f"unknown {kind} {name!r}; valid: {', '.join(sorted(registry))}")
    module_name, _, attribute = target.partition(":")
    return getattr(import_optional(module_name, f"the {kind} {name!r}"), attribute)


def import_optional(module: str, needed_by: str, install: str | None = None) -> ModuleType:
    """Import ``module``, which ``needed_by`` (``"the cbor codec"``) needs. One this install left out (a folder, or an
    optional package) raises ``BackendUnavailableError`` naming the missing module and, when given, how to
    ``install`` it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        missing = exc.name or module
        hint = f" ({install})" if install else ""
        text = f"{needed_by} is not available in this install: {missing} is missing{hint}"
        raise BackendUnavailableError(text) from exc
