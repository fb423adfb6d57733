"""Device profiles: what each device is, how to export for it and the budgets a model must meet.

    >>> from edgeline.device_profiles import load_profile
    >>> profile = load_profile("rpi5")
    >>> [(t.backend, t.precision.value) for t in profile.targets][0]
    ('litert', 'int8-static')

Profiles are TOML files: one per device bundled in ``device_profiles/profiles/``, or any file given by
path. This package imports nothing else of edgeline.
"""

from edgeline.device_profiles.errors import ProfileError
from edgeline.device_profiles.loader import list_profiles, load_profile, profile_ids, profile_json_schema
from edgeline.device_profiles.schema import Budgets, Cpu, Precision, Profile, Target

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
