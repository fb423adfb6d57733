"""Errors of the runtime side; the tree is drawn in ``edgeline.device_profiles.errors``, and its ``__all__`` is the
one list of their names: every name it lists is re-exported here, and nothing else."""

from edgeline.device_profiles import errors as _tree
from edgeline.device_profiles.errors import *  # noqa: F403 - the names of _tree.__all__, the one list

__all__ = list(_tree.__all__)
