"""Affine (de)quantization at the model's edge. Pure functions; callers always speak float."""

from __future__ import annotations

import numpy as np

from edgeline.manifest import Quantization

__all__ = ["dequantize", "quantize"]


def quantize(values: np.ndarray, params: Quantization, dtype: np.dtype) -> np.ndarray:
    """Round ``values / scale + zero_point`` to nearest (ties to even), saturating to ``dtype``."""
    info = np.iinfo(dtype)
    scaled = np.rint(np.asarray(values, dtype=np.float32) / np.float32(params.scale)) + params.zero_point
    return np.clip(scaled, info.min, info.max).astype(dtype)


def dequantize(values: np.ndarray, params: Quantization) -> np.ndarray:
    """``(q - zero_point) * scale`` as float32."""
    return (values.astype(np.float32) - np.float32(params.zero_point)) * np.float32(params.scale)
