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

__all__ = ["ID_PATTERN", "Budgets", "Cpu", "Precision", "Profile", "Target"]

ID_PATTERN = r"^[a-z0-9][a-z0-9-]*$"

PositiveInt = Annotated[int, Strict(), Field(gt=0)]
PositiveFloat = Annotated[float, Strict(), Field(gt=0)]
Name = Annotated[str, Field(min_length=1)]


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Cpu(_Frozen):
    """The device's CPU, as far as export decisions need it."""

    name: Name = Field(description="Core name, e.g. 'Cortex-A76'.")
    arch: Literal["aarch64", "armv7l", "x86_64"] = Field(description="Machine architecture (uname -m).")
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
    max_latency_ms: PositiveFloat | None = Field(
        default=None,
        description="Largest accepted latency per inference ON THE DEVICE, checked by on-device "
        "verification, never by timing on the host.",
    )
    max_memory_mb: PositiveInt | None = None


class Profile(_Frozen):
    """A device: its CPU and memory, ordered export targets and the budgets a model must meet."""

    id: Annotated[str, Field(pattern=ID_PATTERN)]
    name: Name
    description: str
    cpu: Cpu
    memory_mb: PositiveInt
    os: Name = Field(description="Operating system, e.g. 'Raspberry Pi OS bookworm 64-bit'.")
    targets: tuple[Target, ...] = Field(min_length=1, description="Export targets, tried first to last.")
    budgets: Budgets
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
        max_memory = self.budgets.max_memory_mb
        if max_memory is not None and max_memory > self.memory_mb:
            raise PydanticCustomError(
                "budget_exceeds_memory",
                "budgets.max_memory_mb: {budget} is more than the device's memory_mb ({memory})",
                {"budget": max_memory, "memory": self.memory_mb},
            )
        return self
