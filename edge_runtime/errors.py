"""Errors of the runtime side; the tree is drawn in ``edgeline.device_profiles.errors``."""

from edgeline.device_profiles.errors import (
    PAYLOAD_CODES,
    BackendUnavailableError,
    BundleError,
    EdgelineError,
    IntegrityError,
    PayloadError,
    ProfileError,
)

__all__ = [
    "PAYLOAD_CODES",
    "BackendUnavailableError",
    "BundleError",
    "EdgelineError",
    "IntegrityError",
    "PayloadError",
    "ProfileError",
]
