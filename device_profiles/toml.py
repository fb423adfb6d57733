"""``tomllib``, on every Python edgeline supports: the standard library's from 3.11, ``tomli`` (the same parser,
in the base install's dependencies for Python < 3.11) on 3.10. The one place that chooses; every reader of TOML
imports it from here:

    >>> from edgeline.device_profiles.toml import tomllib
    >>> tomllib.loads('id = "rpi5"')
    {'id': 'rpi5'}
"""

from __future__ import annotations

import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

__all__ = ["tomllib"]
