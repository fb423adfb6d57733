"""The one finite check: every input, output and sample set goes through it."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["all_finite"]

_vdot = np.vdot


def all_finite(array: np.ndarray) -> bool:
    """Whether ``array`` holds no NaN and no Inf (integer arrays always do).

    The cheapest full scan is one BLAS dot product: NaN or Inf anywhere makes it non-finite. Huge finite values can
    overflow it too, so only then is every element looked at.
    """
    if array.dtype.kind not in "fc":
        return True
    return math.isfinite(abs(_vdot(array, array))) or bool(np.isfinite(array).all())
