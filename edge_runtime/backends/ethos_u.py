"""Models compiled by vela for an Arm Ethos-U NPU, on whatever machine opens them.

vela replaces what the NPU runs with ``ethos-u`` custom operators: only the NPU's driver runs those (TFLite Micro's
Ethos-U kernel in a microcontroller's firmware, NXP's external delegate for LiteRT on an i.MX 93). Where the driver
is absent, an ethos-u bundle still carries the int8 model vela compiled (``model_int8.tflite``): the sessions run that
on the CPU and say so, loudly, rather than fail on a device that merely lacks the NPU or pretend the NPU ran it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from edgeline.errors import BundleError

__all__ = [
    "CPU_MODEL",
    "DELEGATE_ENV",
    "DELEGATE_PATHS",
    "ETHOS_U",
    "cpu_model_for",
    "find_delegate",
    "is_vela_model",
    "operator_names",
]

logger = logging.getLogger(__name__)

ETHOS_U = "ethos-u"
"""The custom operator vela writes, and the accelerator name in an ethos-u bundle's placement."""
CPU_MODEL = "model_int8.tflite"
"""The int8 model vela compiled, shipped beside the compiled one in every ethos-u bundle."""
DELEGATE_ENV = "EDGELINE_ETHOSU_DELEGATE"
"""Path of the Ethos-U external delegate for LiteRT, where the device's image puts it elsewhere."""
DELEGATE_PATHS = (Path("/usr/lib/libethosu_delegate.so"),)
"""Where NXP's Linux images for the i.MX 93 install the Ethos-U external delegate (eIQ's tflite package)."""


def operator_names(model_path: Path) -> list[str]:
    """The operators of a LiteRT flatbuffer, in order, read without preparing it (a vela model cannot be
    prepared without the NPU's driver)."""
    from ai_edge_litert.interpreter import Interpreter

    try:
        interpreter = Interpreter(model_path=str(model_path))
        # the only listing of a model's operators in ai-edge-litert's Python API
        return [str(op["op_name"]) for op in interpreter._get_ops_details()]
    except (ValueError, RuntimeError) as exc:
        raise BundleError(f"{model_path}: not a readable LiteRT model: {exc}") from exc


def is_vela_model(model_path: Path) -> bool:
    return ETHOS_U in operator_names(model_path)


def find_delegate() -> tuple[Path | None, str]:
    """The Ethos-U external delegate library, or None and where it was looked for."""
    configured = os.environ.get(DELEGATE_ENV)
    candidates = (Path(configured),) if configured else DELEGATE_PATHS
    for candidate in candidates:
        if candidate.is_file():
            return candidate, ""
    if configured:
        return None, f"no Ethos-U delegate at {DELEGATE_ENV}={configured}"
    looked = ", ".join(map(str, DELEGATE_PATHS))
    return None, f"no Ethos-U delegate at {looked} ({DELEGATE_ENV} unset)"


def cpu_model_for(model_path: Path, why: str) -> Path:
    """The bundle's int8 model beside the vela model ``model_path``, to run on the CPU because ``why``; refused,
    naming the file, when the bundle has none."""
    twin = model_path.with_name(CPU_MODEL)
    if model_path.name == CPU_MODEL or not twin.is_file():
        raise BundleError(
            f"{model_path}: compiled by vela for an Ethos-U NPU, which runs its {ETHOS_U} operators; {why}, and the "
            f"bundle has no {CPU_MODEL} to run on the CPU instead"
        )
    logger.warning(
        "%s: built for the Ethos-U NPU, but %s: running the int8 model %s on the CPU instead (slower; the NPU "
        "is not used)",
        model_path,
        why,
        CPU_MODEL,
    )
    return twin
