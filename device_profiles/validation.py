"""The one way a pydantic validation error becomes a message: profiles, manifests and daemon configurations.

Each problem names its field as a path (``targets[1].precision``), an unknown key lists the valid keys of its
table, and a value outside a set of choices lists them.
"""

from __future__ import annotations

import re
import typing
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

__all__ = ["describe_validation_error"]


def describe_validation_error(exc: ValidationError, model: type[BaseModel], what: str) -> str:
    """``what`` (e.g. "invalid profile FILE") with every problem of ``exc``, which validating ``model`` raised:
    one on the same line, several one per line."""
    problems = [_describe(error, model) for error in exc.errors()]
    if len(problems) == 1:
        return f"{what}: {problems[0]}"
    return f"{what} ({len(problems)} problems):" + "".join(f"\n  {problem}" for problem in problems)


def _describe(error: ErrorDetails, model: type[BaseModel]) -> str:
    loc = error["loc"]
    if not loc:  # a check across fields: its message names the fields itself
        return error["msg"]
    where = _dotted(loc)
    kind = error["type"]
    value = error.get("input")
    if kind == "missing":
        return f"{where}: required field is missing"
    if kind == "extra_forbidden":
        table = _table(model, loc[:-1])
        if table is None:
            return f"{where}: unknown key"
        keys = [name for name, field in table.model_fields.items() if not field.exclude]
        return f"{where}: unknown key; valid keys: {', '.join(keys)}"
    if kind in ("enum", "literal_error"):
        choices = re.findall(r"'([^']*)'", str(error.get("ctx", {}).get("expected", "")))
        return f"{where}: {value!r} is not valid; valid: {', '.join(choices)}"
    got = "" if isinstance(value, dict | list) else f" (got {_short(value)})"
    return f"{where}: {error['msg'][0].lower()}{error['msg'][1:]}{got}"


def _dotted(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    return path.lstrip(".")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _table(model: type[BaseModel], loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The model validating the table at ``loc`` (list indexes and dict keys pass through), or None."""
    current: type[BaseModel] | None = model
    for part in loc:
        if current is None:
            return None
        if isinstance(part, int):
            continue
        field = current.model_fields.get(part)
        current = _model_in(field.annotation) if field is not None else None
    return current


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The BaseModel inside an annotation such as ``Cpu``, ``list[Target]`` or ``Budgets | None``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for argument in typing.get_args(annotation):
        found = _model_in(argument)
        if found is not None:
            return found
    return None
