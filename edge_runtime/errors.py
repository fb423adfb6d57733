"""Errors of the runtime side; the tree is drawn in ``device_profiles.errors``."""

from device_profiles.errors import (
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
