"""Errors of the runtime side; the tree is drawn in ``edgeline.device_profiles.errors``."""

from edgeline.device_profiles.errors import (
    CAMERA_REASONS,
    DAEMON_CODES,
    PAYLOAD_CODES,
    REFUSAL_REASONS,
    BackendUnavailableError,
    BundleError,
    CameraError,
    EdgelineError,
    IntegrityError,
    PayloadError,
    ProfileError,
    UpdateError,
    UpdateRefused,
)

__all__ = [
    "CAMERA_REASONS",
    "DAEMON_CODES",
    "PAYLOAD_CODES",
    "REFUSAL_REASONS",
    "BackendUnavailableError",
    "BundleError",
    "CameraError",
    "EdgelineError",
    "IntegrityError",
    "PayloadError",
    "ProfileError",
    "UpdateError",
    "UpdateRefused",
]
