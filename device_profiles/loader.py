"""Finding, reading and validating profile files.

Every failure becomes a ``ProfileError`` whose message names the file, the field (as a dotted path such
as ``targets[1].precision``) and, where the choice is closed, the valid values.
"""

from __future__ import annotations

import os
import sys
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from edgeline.device_profiles.errors import ProfileError
from edgeline.device_profiles.schema import Profile
from edgeline.device_profiles.toml import tomllib
from edgeline.device_profiles.validation import describe_validation_error

if TYPE_CHECKING:
    if sys.version_info >= (3, 11):
        from importlib.resources.abc import Traversable
    else:
        from importlib.abc import Traversable

__all__ = ["list_profiles", "load_profile", "profile_ids", "profile_json_schema"]

_SUFFIX = ".toml"


def load_profile(id_or_path: str | os.PathLike[str]) -> Profile:
    """Load a bundled profile by id (``"rpi5"``) or a profile file by path (``"my/board.toml"``).

    Anything ending in ``.toml`` or containing a path separator is a path; anything else is an id.
    """
    text = os.fspath(id_or_path)
    if text.endswith(_SUFFIX) or os.sep in text or (os.altsep is not None and os.altsep in text):
        return _load_file(Path(text))
    return _load_bundled(text)


def list_profiles() -> list[Profile]:
    """Every bundled profile, sorted by id."""
    return [_load_bundled(profile_id) for profile_id in profile_ids()]


def profile_ids() -> list[str]:
    """The ids of the bundled profiles, sorted."""
    return sorted(
        entry.name.removesuffix(_SUFFIX) for entry in _bundled_dir().iterdir() if entry.name.endswith(_SUFFIX)
    )


def profile_json_schema() -> dict[str, Any]:
    """The JSON Schema of a profile file."""
    return Profile.model_json_schema()


def _bundled_dir() -> Traversable:
    return resources.files("edgeline.device_profiles").joinpath("profiles")


def _load_bundled(profile_id: str) -> Profile:
    entry = _bundled_dir().joinpath(profile_id + _SUFFIX)
    if not entry.is_file():
        valid = ", ".join(profile_ids())
        raise ProfileError(f"unknown profile '{profile_id}'; valid profiles: {valid} (or --profile path/to/file.toml)")
    source = str(entry)
    profile = _parse(entry.read_bytes(), source)
    if profile.id != profile_id:
        raise ProfileError(
            f"invalid profile {source}: id: '{profile.id}' does not match the file name; "
            f"a bundled profile's id must be '{profile_id}'"
        )
    return profile


def _load_file(path: Path) -> Profile:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        hint = ""
        if path.name == str(path) and path.stem in profile_ids():
            hint = f" (for the bundled profile, use '{path.stem}' without {_SUFFIX})"
        raise ProfileError(f"profile file not found: {path}{hint}") from None
    except OSError as exc:
        raise ProfileError(f"cannot read profile file {path}: {exc.strerror or exc}") from exc
    return _parse(data, str(path))


def _parse(data: bytes, source: str) -> Profile:
    try:
        document = tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ProfileError(f"invalid profile {source}: not UTF-8 text (byte {exc.start})") from exc
    except tomllib.TOMLDecodeError as exc:
        # The message carries "(at line L, column C)".
        raise ProfileError(f"invalid profile {source}: not valid TOML: {exc}") from exc
    # ``Profile.source`` records where the file was found; the file itself may not set it.
    if "source" in document:
        keys = ", ".join(name for name, field in Profile.model_fields.items() if not field.exclude)
        raise ProfileError(f"invalid profile {source}: source: unknown key; valid keys: {keys}")
    try:
        return Profile.model_validate({**document, "source": source})
    except ValidationError as exc:
        raise ProfileError(describe_validation_error(exc, Profile, f"invalid profile {source}")) from exc
