"""edgeline's device side: verified bundles, torch-free runtimes, floats in and floats out.

    >>> import edge_runtime
    >>> model = edge_runtime.load("bundles/digits")
    >>> outputs = model.predict(image)              # one float array per input, batch 1
    >>> model.interpret([image], outputs).label

Importing this package imports numpy and pydantic, nothing heavier; runtime backends load on first use.
"""

from edge_runtime.bundle import Bundle, read_bundle
from edge_runtime.errors import (
    BackendUnavailableError,
    BundleError,
    EdgelineError,
    IntegrityError,
    PayloadError,
    ProfileError,
)
from edge_runtime.manifest import Manifest
from edge_runtime.model import Model, load

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
