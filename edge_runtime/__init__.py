"""edgeline: verified bundles, torch-free runtimes, floats in and floats out.

    >>> import edgeline
    >>> model = edgeline.load("bundles/digits")
    >>> outputs = model.predict(image)              # one float array per input, batch 1
    >>> model.interpret([image], outputs).label

This package is the device side (the ``edge_runtime/`` folder); the workstation side lives in its subpackages
``edgeline.export`` (needs the ``export`` extra), ``edgeline.device_profiles``, ``edgeline.sim`` and
``edgeline.firmware_bridge``. Importing ``edgeline`` imports nothing: the names below load their module (numpy,
pydantic) on first use, and runtime backends load when a bundle asks for one, so ``edgeline --help`` and
``import edgeline.device_profiles`` stay light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edgeline.bundle import Bundle, read_bundle
    from edgeline.errors import (
        BackendUnavailableError,
        BundleError,
        EdgelineError,
        IntegrityError,
        PayloadError,
        ProfileError,
    )
    from edgeline.manifest import Manifest
    from edgeline.model import Model, load

_HOMES = {
    "Bundle": "edgeline.bundle",
    "read_bundle": "edgeline.bundle",
    "BackendUnavailableError": "edgeline.errors",
    "BundleError": "edgeline.errors",
    "EdgelineError": "edgeline.errors",
    "IntegrityError": "edgeline.errors",
    "PayloadError": "edgeline.errors",
    "ProfileError": "edgeline.errors",
    "Manifest": "edgeline.manifest",
    "Model": "edgeline.model",
    "load": "edgeline.model",
}

__all__ = [
    "BackendUnavailableError",
    "Bundle",
    "BundleError",
    "EdgelineError",
    "IntegrityError",
    "Manifest",
    "Model",
    "PayloadError",
    "ProfileError",
    "load",
    "read_bundle",
]


def __getattr__(name: str) -> Any:
    from edgeline.device_profiles.lazy import load_name  # here, not above: `import edgeline` imports nothing

    return load_name(globals(), _HOMES, name)


def __dir__() -> list[str]:
    from edgeline.device_profiles.lazy import names

    return names(globals(), _HOMES)
