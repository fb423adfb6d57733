"""Errors of the runtime side; the tree is drawn in ``device_profiles.errors``."""

from device_profiles.errors import (
    BackendUnavailableError,
    BundleError,
    EdgelineError,
    IntegrityError,
    PayloadError,
    ProfileError,
)

__all__ = [
    "BackendUnavailableError",
    "BundleError",
    "EdgelineError",
    "IntegrityError",
    "PayloadError",
    "ProfileError",
]
