"""The device profile schema: what a device is and how to export a model for it.

A profile is read from one TOML file and never changed afterwards (every model is frozen). Numbers are
strict: ``cores = "4"`` or ``max_latency_ms = true`` is refused rather than quietly converted, and
unknown keys are refused rather than ignored, so a typo never turns into a silently dropped setting.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, model_validator
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

from edgeline.device_profiles.precision import Precision

__all__ = [
    "ID_PATTERN",
    "Budgets",
    "CoreML",
    "Cpu",
    "EthosU",
    "Microcontroller",
    "OnnxRuntime",
    "Precision",
    "Profile",
    "Qnn",
    "Target",
]

ID_PATTERN = r"^[a-z0-9][a-z0-9-]*$"

PositiveInt = Annotated[int, Strict(), Field(gt=0)]
PositiveFloat = Annotated[float, Strict(), Field(gt=0)]
Name = Annotated[str, Field(min_length=1)]
Share = Annotated[float, Strict(), Field(ge=0, le=1)]


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Cpu(_Frozen):
    """The device's CPU, as far as export decisions need it."""

    name: Name = Field(description="Core name, e.g. 'Cortex-A76'.")
    arch: Literal["aarch64", "armv7l", "x86_64", "armv8.1-m", "armv7e-m"] = Field(
        description="Machine architecture (uname -m; for a microcontroller its Arm architecture: 'armv8.1-m' for a "
        "Cortex-M55, 'armv7e-m' for a Cortex-M4 or M7)."
    )
    cores: PositiveInt
    isa_features: tuple[Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9._]*$")], ...] = Field(
        description="Instruction-set features kernels may use, e.g. ['neon', 'dotprod']."
    )
    max_freq_mhz: PositiveInt | None = None


class Target(_Frozen):
    """One way to export for the device: a backend at a precision, run with a number of threads."""

    # Only the shape of the name is checked here; the export side checks it against its backend registry.
    backend: Annotated[str, Field(pattern=ID_PATTERN)] = Field(
        description="Export backend registry name, e.g. 'litert' or 'executorch-xnnpack'."
    )
    precision: Precision
    threads: PositiveInt = Field(description="CPU threads the runtime uses on the device.")


class Budgets(_Frozen):
    """Limits an exported model must meet to be accepted for the device."""

    max_model_bytes: PositiveInt | None = None
    max_accuracy_drop: Annotated[float, Strict(), Field(ge=0, le=100)] = Field(
        description="Largest accepted accuracy loss against the float model, in percentage points."
    )
    min_cosine: Annotated[float, Strict(), Field(ge=0, le=1)] | None = Field(
        default=None,
        description="Smallest accepted cosine similarity of outputs to the float model, used without labels.",
    )
    max_map_drop: Annotated[float, Strict(), Field(ge=0, le=100)] = Field(
        default=2.0,
        description="A detector's largest accepted loss of mAP@0.5 against the float model, in points (of 100): "
        "against the validation images' objects when labelled, else against the float model's own detections.",
    )
    max_latency_ms: PositiveFloat | None = Field(
        default=None,
        description="Largest accepted latency per inference ON THE DEVICE, checked by on-device "
        "verification, never by timing on the host.",
    )
    max_memory_mb: PositiveInt | None = None
    max_arena_bytes: PositiveInt | None = Field(
        default=None,
        description="Largest accepted tensor arena, in bytes: the SRAM a microcontroller's firmware reserves for "
        "TFLite Micro (the C sources' EDGELINE_ARENA_BYTES, margin included), checked at export.",
    )
    min_accelerator_share: Share | None = Field(
        default=None,
        description="Smallest accepted share of the model's operators on the target's accelerator (0-1); "
        "applies to targets whose bundle names an accelerator.",
    )
    min_quantized_share: Share | None = Field(
        default=None,
        description="Smallest accepted share of the model's operators computing in the declared integer "
        "precision (0-1); applies to integer precisions (int8-*).",
    )


class CoreML(_Frozen):
    """Apple Core ML: what the exported package asks of the device."""

    compute_units: Literal["ALL", "CPU_AND_NE", "CPU_AND_GPU", "CPU_ONLY"] = Field(
        description="coremltools.ComputeUnit the package is saved for ('ALL' lets Core ML use the Neural Engine)."
    )
    minimum_deployment_target: Annotated[str, Field(pattern=r"^(iOS|macOS)[0-9]+$")] = Field(
        description="coremltools.target name, e.g. 'iOS17' or 'macOS14'."
    )


class Qnn(_Frozen):
    """Qualcomm Hexagon NPU through ONNX Runtime's QNN execution provider (HTP backend)."""

    soc_model: PositiveInt = Field(description="QNN SoC model id (onnxruntime-qnn provider option soc_model).")
    htp_arch: PositiveInt = Field(description="Hexagon HTP architecture version, e.g. 75 for V75.")


class EthosU(_Frozen):
    """Arm Ethos-U NPU, compiled by vela with the profile's configuration (never vela's defaults)."""

    accelerator_config: Annotated[str, Field(pattern=r"^ethos-u(55|65|85)-[0-9]+$")] = Field(
        description="vela --accelerator-config, e.g. 'ethos-u55-128'."
    )
    system_config: Name = Field(description="vela --system-config (a section of the vela configuration file).")
    memory_mode: Name = Field(description="vela --memory-mode (a section of the vela configuration file).")
    clock_mhz: PositiveInt = Field(description="NPU core clock the estimates are given at.")


class Microcontroller(_Frozen):
    """A microcontroller's on-chip memories, in bytes: a Cortex-M4's 192 KiB of SRAM is no whole number of MiB
    (``memory_mb``). The budgets that share them out (``max_model_bytes`` of the flash for the model array,
    ``max_arena_bytes`` of the SRAM for the tensor arena) must fit in them."""

    part: Name = Field(description="The part the figures are from, e.g. 'STM32F407VG'.")
    flash_bytes: PositiveInt = Field(description="On-chip flash: the firmware, the model array among it.")
    sram_bytes: PositiveInt = Field(description="On-chip SRAM: the firmware's data, the tensor arena among it.")
    largest_sram_block_bytes: PositiveInt = Field(
        description="The largest contiguous SRAM block: the tensor arena is one array, so it must fit in one."
    )


class OnnxRuntime(_Frozen):
    """ONNX Runtime on the device: the execution providers to try, in order, the CPU provider last."""

    providers: tuple[Name, ...] = Field(min_length=1, description="e.g. ['CUDAExecutionProvider', 'CPU...'].")


class Profile(_Frozen):
    """A device: its CPU and memory, ordered export targets and the budgets a model must meet."""

    id: Annotated[str, Field(pattern=ID_PATTERN)]
    name: Name
    description: str
    cpu: Cpu
    memory_mb: PositiveInt | None = Field(
        default=None, description="The device's memory in MiB; required unless a [microcontroller] section gives it."
    )
    os: Name = Field(description="Operating system, e.g. 'Raspberry Pi OS bookworm 64-bit'.")
    targets: tuple[Target, ...] = Field(min_length=1, description="Export targets, tried first to last.")
    budgets: Budgets
    daemon: bool = Field(
        default=True,
        description="Whether edgeline's daemon runs on the device (false for phones and microcontrollers, where "
        "the bundle goes into an app or firmware).",
    )
    coreml: CoreML | None = None
    qnn: Qnn | None = None
    ethos_u: EthosU | None = None
    onnxruntime: OnnxRuntime | None = None
    microcontroller: Microcontroller | None = None
    # Set by the loader to the file the profile came from; not part of the file format.
    source: SkipJsonSchema[str] = Field(default="", exclude=True)

    @model_validator(mode="after")
    def _check_consistency(self) -> Profile:
        seen: set[tuple[str, Precision]] = set()
        for index, target in enumerate(self.targets):
            if target.threads > self.cpu.cores:
                raise PydanticCustomError(
                    "threads_exceed_cores",
                    "targets[{index}].threads: {threads} is more than cpu.cores ({cores})",
                    {"index": index, "threads": target.threads, "cores": self.cpu.cores},
                )
            key = (target.backend, target.precision)
            if key in seen:
                raise PydanticCustomError(
                    "duplicate_target",
                    "targets[{index}]: {backend} {precision} is listed twice",
                    {"index": index, "backend": target.backend, "precision": target.precision.value},
                )
            seen.add(key)
        self._check_memories()
        max_memory = self.budgets.max_memory_mb
        if max_memory is not None and self.memory_mb is not None and max_memory > self.memory_mb:
            raise PydanticCustomError(
                "budget_exceeds_memory",
                "budgets.max_memory_mb: {budget} is more than the device's memory_mb ({memory})",
                {"budget": max_memory, "memory": self.memory_mb},
            )
        return self

    def _check_memories(self) -> None:
        """The device's memory is given (in MiB, or a microcontroller's bytes), and the byte budgets fit in it."""
        mcu = self.microcontroller
        if mcu is None:
            if self.memory_mb is None:
                raise PydanticCustomError(
                    "memory_missing", "memory_mb: required field is missing (or a [microcontroller] section)", {}
                )
            return
        if mcu.largest_sram_block_bytes > mcu.sram_bytes:
            raise PydanticCustomError(
                "block_exceeds_sram",
                "microcontroller.largest_sram_block_bytes: {block} is more than its sram_bytes ({sram})",
                {"block": mcu.largest_sram_block_bytes, "sram": mcu.sram_bytes},
            )
        for name, budget, where, limit in (
            ("max_model_bytes", self.budgets.max_model_bytes, "flash_bytes", mcu.flash_bytes),
            ("max_arena_bytes", self.budgets.max_arena_bytes, "largest_sram_block_bytes", mcu.largest_sram_block_bytes),
        ):
            if budget is not None and budget > limit:
                raise PydanticCustomError(
                    "budget_exceeds_memory",
                    "budgets.{name}: {budget} is more than microcontroller.{where} ({limit})",
                    {"name": name, "budget": budget, "where": where, "limit": limit},
                )
