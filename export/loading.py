"""MODEL (``file.py:function``, ``package.module:function`` or a ``.pt2`` file) to a torch module."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgeline.export.errors import ModelLoadError

__all__ = ["LoadedModel", "default_name", "load_model"]

GENERIC_FUNCTION_NAMES = {"model", "build", "create", "main", "get_model", "make_model"}


@dataclass(frozen=True)
class LoadedModel:
    module: Any  # torch.nn.Module, in eval mode
    source: str
    default_name: str
    forward_parameters: tuple[str, ...] | None  # None when the signature does not name them (e.g. *args)
    input_shape: tuple[int, ...] | None = None
    """Input 0's shape where the model says it before it runs: a .pt2's example input, a module's ``INPUT_SHAPE``
    (an image's (C, H, W) or (H, W, C) without the batch gets 1 in front)."""
    image: dict[str, object] | None = None
    """The image pre-processing the model's module declares (``IMAGE_PREPROCESS``: ``--preprocess`` text or a
    dict of its keys), as the reference image models do; None: none declared."""


def _declared(module: Any, where: str) -> tuple[tuple[int, ...] | None, dict[str, object] | None]:
    """A model module's ``INPUT_SHAPE`` (batch first, 1) and ``IMAGE_PREPROCESS`` keys, where it declares them."""
    from edgeline.errors import EdgelineError
    from edgeline.imaging import parse_preprocess, preprocess_table

    shape = getattr(module, "INPUT_SHAPE", None)
    valid = isinstance(shape, tuple) and all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)
    declared = getattr(module, "IMAGE_PREPROCESS", None)
    image = None
    try:
        if isinstance(declared, str):
            image = parse_preprocess(declared, f"{where}.IMAGE_PREPROCESS")
        elif isinstance(declared, dict):
            image = preprocess_table(declared, f"{where}.IMAGE_PREPROCESS")
        elif declared is not None:
            raise ModelLoadError(f"{where}.IMAGE_PREPROCESS: expected --preprocess text or a dict of its keys")
    except EdgelineError as exc:
        raise ModelLoadError(str(exc)) from exc
    if not valid or not shape:
        return None, image
    return ((1, *shape) if len(shape) == 3 else shape), image


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    last = frames[-1]
    return f" (at {last.filename}:{last.lineno})"


def default_name(spec: str) -> str:
    """A bundle name from MODEL: the function name, or the file's stem when the function name is generic."""
    if spec.endswith(".pt2"):
        path = Path(spec)
        return path.parent.name if path.stem == "model" and path.parent.name else path.stem
    location, _, function = spec.rpartition(":")
    if function and function not in GENERIC_FUNCTION_NAMES:
        return function
    return Path(location).stem if location.endswith(".py") else location.rpartition(".")[2]


def _importable(folder: Path) -> None:
    """``folder`` on ``sys.path`` (first), as Python puts a script's folder there and uvicorn, gunicorn and pytest
    put the current one for ``module:function``: the model's own imports of its sibling modules then work."""
    entry = str(folder.resolve())
    if entry not in sys.path:
        sys.path.insert(0, entry)


def _import_file(path: Path) -> Any:
    if not path.is_file():
        raise ModelLoadError(f"model file {path}: no such file")
    _importable(path.parent)
    module_name = "edgeline_user_model_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ModelLoadError(f"model file {path}: cannot be imported as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise ModelLoadError(f"importing {path} failed: {type(exc).__name__}: {exc}{_where(exc)}") from exc
    return module


def _import_module(name: str) -> Any:
    _importable(Path.cwd())
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        raise ModelLoadError(f"cannot import module {name!r}: {exc}") from exc
    except Exception as exc:
        raise ModelLoadError(f"importing {name} failed: {type(exc).__name__}: {exc}{_where(exc)}") from exc


def _forward_parameters(module: Any) -> tuple[str, ...] | None:
    import inspect

    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    names = []
    for parameter in parameters:
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            return None
        names.append(parameter.name)
    return tuple(names)


def load_model(spec: str) -> LoadedModel:
    import torch

    if spec.endswith(".pt2"):
        path = Path(spec)
        if not path.is_file():
            raise ModelLoadError(f"model file {path}: no such file")
        try:
            program = torch.export.load(str(path))
        except Exception as exc:
            raise ModelLoadError(f"{path}: not a program saved with torch.export.save ({exc})") from exc
        inputs = [s.arg.name for s in program.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
        examples: tuple[Any, ...] = program.example_inputs[0] if program.example_inputs else ()
        shape = (
            tuple(int(d) for d in examples[0].shape) if len(examples) == 1 and hasattr(examples[0], "shape") else None
        )
        return LoadedModel(program.module(), str(path), default_name(spec), tuple(inputs), input_shape=shape)

    location, sep, function_name = spec.rpartition(":")
    if not sep or not location or not function_name:
        raise ModelLoadError(
            f"MODEL {spec!r}: expected path/to/file.py:function, package.module:function or a .pt2 file"
        )
    module = _import_file(Path(location)) if location.endswith(".py") else _import_module(location)
    factory = getattr(module, function_name, None)
    if factory is None or not callable(factory):
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise ModelLoadError(
            f"{location} has no function {function_name!r}; callables there: {', '.join(public) or 'none'}"
        )
    try:
        result = factory()
    except TypeError as exc:
        raise ModelLoadError(f"{spec}: calling it with no arguments failed: {exc}") from exc
    except Exception as exc:
        raise ModelLoadError(f"{spec} raised {type(exc).__name__}: {exc}{_where(exc)}") from exc
    if not isinstance(result, torch.nn.Module):
        raise ModelLoadError(f"{spec} returned {type(result).__name__}, expected a torch.nn.Module")
    result.eval()
    shape, image = _declared(module, location)
    return LoadedModel(result, spec, default_name(spec), _forward_parameters(result), input_shape=shape, image=image)
