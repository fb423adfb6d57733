"""Device profiles: what each device is, how to export for it and the budgets a model must meet.

    >>> from edgeline.device_profiles import load_profile
    >>> profile = load_profile("rpi5")
    >>> [(t.backend, t.precision.value) for t in profile.targets][0]
    ('litert', 'int8-static')

Profiles are TOML files: one per device bundled in ``device_profiles/profiles/``, or any file given by
path. This package imports nothing else of edgeline.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edgeline.device_profiles.errors import ProfileError
    from edgeline.device_profiles.loader import list_profiles, load_profile, profile_ids, profile_json_schema
    from edgeline.device_profiles.precision import Precision
    from edgeline.device_profiles.schema import Budgets, Cpu, Profile, Target

# Names load their module on first use: the error tree and Precision import no pydantic, so ``edgeline --help``
# (whose errors module re-exports the tree from here) stays light.
_HOMES = {
    "Budgets": "edgeline.device_profiles.schema",
    "Cpu": "edgeline.device_profiles.schema",
    "Precision": "edgeline.device_profiles.precision",
    "Profile": "edgeline.device_profiles.schema",
    "ProfileError": "edgeline.device_profiles.errors",
    "Target": "edgeline.device_profiles.schema",
    "list_profiles": "edgeline.device_profiles.loader",
    "load_profile": "edgeline.device_profiles.loader",
    "profile_ids": "edgeline.device_profiles.loader",
    "profile_json_schema": "edgeline.device_profiles.loader",
}

__all__ = [
    "Budgets",
    "Cpu",
    "Precision",
    "Profile",
    "ProfileError",
    "Target",
    "list_profiles",
    "load_profile",
    "profile_ids",
    "profile_json_schema",
]


def __getattr__(name: str) -> Any:
    from edgeline.device_profiles.lazy import load_name  # the loader edgeline's own __getattr__ uses

    return load_name(globals(), _HOMES, name)


def __dir__() -> list[str]:
    from edgeline.device_profiles.lazy import names

    return names(globals(), _HOMES)
