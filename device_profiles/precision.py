"""The precisions a model is exported in: a plain enum, so `edgeline export --help` lists them without pydantic."""

from __future__ import annotations

from enum import Enum

__all__ = ["Precision"]


class Precision(str, Enum):
    """Numeric precision of an exported model."""

    FP32 = "fp32"
    FP16 = "fp16"
    INT8_DYNAMIC = "int8-dynamic"
    INT8_STATIC = "int8-static"
    INT8_WEIGHTS = "int8-weights"
    """Weights stored as int8, computed in float (Core ML's weight compression)."""

    @property
    def integer(self) -> bool:
        """Whether the precision declares integer computation or storage (the quantized-share budget applies)."""
        return self in (Precision.INT8_DYNAMIC, Precision.INT8_STATIC, Precision.INT8_WEIGHTS)
