"""A package's names loaded on first use: the module ``__getattr__`` and ``__dir__`` of ``edgeline`` and of
``edgeline.device_profiles``, over a table of name -> the module that defines it.

    _HOMES = {"load_profile": "edgeline.device_profiles.loader", ...}

    def __getattr__(name: str) -> Any:
        return load_name(globals(), _HOMES, name)

It lives in the lowest folder so both packages share it; ``edgeline`` imports it inside its ``__getattr__``, on the
first name asked for, so that ``import edgeline`` imports nothing at all.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, MutableMapping
from typing import Any

__all__ = ["load_name", "names"]


def load_name(namespace: MutableMapping[str, Any], homes: Mapping[str, str], name: str) -> Any:
    """``name`` from its module in ``homes``, kept in ``namespace`` (the package's ``globals()``) so the next use
    is a plain attribute; AttributeError for a name the table lacks, as Python words it."""
    home = homes.get(name)
    if home is None:
        raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    namespace[name] = value
    return value


def names(namespace: Mapping[str, Any], homes: Mapping[str, str]) -> list[str]:
    """What ``dir(package)`` lists: its attributes and the names it loads on first use."""
    return sorted({*namespace, *homes})
