"""A runtime backend is one class: ``RuntimeBackend``, subclassed once per backend and registered in
``edgeline.backends.RUNTIME_BACKENDS`` (name -> "module:Class", imported on first use).

The class declares what the backend runs on (its distribution, the module it imports, how a device gets it, the
model files it opens, whether the base install carries it) and implements its parts, which every other module asks:

- ``probe``: its facts on this machine (version, whether it imports; onnxruntime's providers, OpenVINO's devices,
  ExecuTorch's runtime and delegates), for ``edgeline.device_facts.gather``;
- ``refusal`` and ``verdict``: whether a bundle it runs can run on a machine of given facts, from the bundle's
  manifest alone (``edgeline.verdicts`` applies the rules every backend shares, then asks the class);
- ``target_here``: whether a profile's target (one of its accelerators) runs here, without a bundle (``doctor``);
- ``accelerators``: the accelerators it finds, for ``doctor``'s report;
- ``open``: the session that runs a model file.

This module also holds the vocabulary those parts speak: the machine's facts (``Facts``, ``RuntimeFacts``,
``StateFacts``, re-exported by ``edgeline.device_facts``) and the answer (``Verdict``, re-exported by
``edgeline.verdicts``). It imports nothing of ``edgeline`` at import time, so that every backend module, the facts
and the verdicts can import it without a circle.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    import numpy as np

    from edgeline.device_profiles import Profile
    from edgeline.machine import Machine
    from edgeline.manifest import TensorSpec

__all__ = [
    "Asked",
    "Facts",
    "RuntimeBackend",
    "RuntimeFacts",
    "RuntimeInfo",
    "Session",
    "StateFacts",
    "Verdict",
]

log = logging.getLogger(__name__)


class Session(Protocol):
    """An opened model, ready to run: model-native numpy arrays in (already quantized where the model wants integers),
    in the order of the manifest's inputs; the outputs in manifest order."""

    accelerator: str | None
    """What really runs the model here: the accelerator asked for, or None when the CPU runs it (a fallback when
    an accelerator was asked for: the model says so loudly)."""

    def input_specs(self) -> list[TensorSpec]: ...

    def output_specs(self) -> list[TensorSpec]: ...

    def run(self, inputs: Sequence[np.ndarray]) -> list[np.ndarray]: ...


# -- the facts a backend is asked with ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RuntimeInfo:
    """A runtime backend's distribution, the module it runs on, and how a device gets it."""

    package: str
    module: str
    install: str
    """How to get it on a device."""


@dataclass(frozen=True)
class RuntimeFacts:
    version: str | None
    """The installed distribution's version, or None when it is not installed."""
    imports: bool | None
    """Whether its module imported (None: not tried, only looked for)."""
    error: str | None = None
    providers: tuple[str, ...] = ()
    """onnxruntime's execution providers."""
    devices: tuple[str, ...] = ()
    """OpenVINO's devices (``Core().available_devices``: CPU, GPU, GPU.1, NPU): the plugins that found one."""
    kind: str | None = None
    """ExecuTorch: which runtime runs its programs, ``torch-free`` (its C++ runtime through edgeline's shim) or
    ``python`` (its Python runtime, which imports torch)."""
    location: str | None = None
    """Where that runtime is (the torch-free one's directory, and how it was found)."""
    delegates: tuple[str, ...] | None = None
    """ExecuTorch: the delegates that runtime carries (registered when it was loaded, else its libraries); None: not
    known without importing it."""
    fallback: str | None = None
    """ExecuTorch: the other runtime, when both are here (the Python runtime behind the torch-free one)."""


@dataclass(frozen=True)
class StateFacts:
    """The daemon's state directory: the file system it is on and what the outbox may take of it."""

    directory: str
    mount_point: str | None
    fs_type: str | None
    device: str | None
    total_bytes: int | None
    free_bytes: int | None
    max_bytes: int | None
    """``[outbox] max_bytes``; None: the outbox is kept in memory (``[outbox] enabled = false``)."""
    outboxes: Mapping[str, int] = field(default_factory=dict)
    """The outboxes already there (``DIR/<bundle name>/outbox.sqlite``), by bundle name: the bytes their files take."""


def _python_version() -> str:
    import platform

    return platform.python_version()


@dataclass(frozen=True)
class Facts:
    """What this machine says of itself. Gathered by ``edgeline.device_facts.gather``; tests build them for other
    machines."""

    system: str
    machine: Machine
    runtimes: Mapping[str, RuntimeFacts]
    ethos_u_delegate: str | None = None
    """The Ethos-U external delegate's path, or None."""
    ethos_u_missing: str = ""
    qnn_missing: str | None = "not looked for"
    """Why the QNN HTP provider cannot be used here, or None when it can."""
    soc: str | None = None
    """The SoC's name (``/sys/devices/soc0/machine`` on Qualcomm's Linux: ``QCS6490``), or None."""
    cpu_count: int | None = None
    memory_mb: tuple[int, int] | None = None
    """(total, available) MiB, from /proc/meminfo."""
    os_name: str = ""
    kernel: str = ""
    python: str = field(default_factory=_python_version)
    state: StateFacts | None = None
    """The daemon's state directory, when it was looked at."""


# -- the answer ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """Will a bundle run here, and how."""

    runs: bool
    backend: str
    model: str
    """The bundle's file the runtime will open."""
    accelerator: str | None
    """What will run it (None: the CPU)."""
    fallback: str | None
    """Why it will not run on the accelerator it was built for, or None."""
    reason: str
    """Why it runs as it does, or why it cannot run here."""
    emulated: str | None = None
    """What emulates the accelerator or the machine here: its timings are not the device's."""
    device: str | None = None
    """Why this machine's figures are not the device's (``edgeline.machine.mismatch``), or None when they are."""
    runtime: dict[str, str | None] = field(default_factory=dict)
    cpu_instead: bool = False
    """Open ``model`` on the CPU: a fallback the session cannot see for itself (a context binary for another SoC
    would be handed to the HTP)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> list[str]:
        on = self.accelerator or "the CPU"
        first = (
            f"runs here: {self.backend} opens {self.model} on {on}" if self.runs else f"cannot run here: {self.reason}"
        )
        lines = [first]
        if self.runs:
            lines.append(f"why: {self.reason}")
        if self.fallback:
            lines.append(f"FALLBACK: {self.fallback}")
        if self.runtime:
            needs = self.runtime.get("needs")
            lines.append(
                f"runtime: {self.runtime.get('package')} {self.runtime.get('version') or 'not installed'}"
                + (f" (the bundle needs >= {needs})" if needs else "")
            )
        if self.emulated:
            lines.append(f"emulated: {self.emulated}: timings here are not the device's")
        lines.append(
            "device: this machine is of the bundle's device kind: its budgets are checked here"
            if self.device is None
            else f"device: budgets not checked here: {self.device}"
        )
        return lines


@dataclass(frozen=True)
class Asked:
    """A bundle a backend is asked about (``RuntimeBackend.verdict``): what its manifest says, on what machine."""

    model: str
    """The bundle's model file."""
    files: Collection[str]
    """Every file of the bundle."""
    accelerator: str | None
    """What the bundle was built for (its ``placement.accelerator``; None: the CPU)."""
    facts: Facts
    runtime: RuntimeFacts
    """This backend's facts on that machine."""
    common: dict[str, Any]
    """The verdict's fields every answer carries (``runtime``, ``device``, ``emulated``)."""
    profile: Profile | None = None
    """The bundle's profile, where this install knows it (a QNN context binary's SoC)."""

    def runs(
        self, backend: str, model: str, accelerator: str | None, fallback: str | None, reason: str, **extra: Any
    ) -> Verdict:
        return Verdict(True, backend, model, accelerator, fallback, reason, **{**self.common, **extra})

    def refused(self, backend: str, reason: str, **extra: Any) -> Verdict:
        return Verdict(False, backend, self.model, None, None, reason, **{**self.common, **extra})


# -- the class -------------------------------------------------------------------------------------------------------


class RuntimeBackend:
    """One runtime backend: subclass it, declare what it runs on, implement ``open`` (and whichever other part has
    something of its own to say), and register it in ``edgeline.backends.RUNTIME_BACKENDS``. The defaults are a
    backend that runs its model files on the CPU wherever its module imports."""

    name: ClassVar[str]
    """Its registry name: what a bundle's manifest names as its ``backend`` (``litert``)."""
    package: ClassVar[str]
    """The distribution it runs on (``ai-edge-litert``): its version is what a manifest's ``runtime`` asks for."""
    module: ClassVar[str]
    """The module that distribution is imported as (``ai_edge_litert.interpreter``)."""
    install: ClassVar[str]
    """How a device gets it (``pip install 'edgeline[onnx]'``), said when it is missing."""
    file_suffixes: ClassVar[tuple[str, ...]]
    """The model files it opens (``.tflite``)."""
    base_install: ClassVar[bool] = False
    """Whether ``pip install edgeline`` (no extras: what a device runs) runs it, its runtime a dependency of the base
    install that needs no torch."""
    firmware: ClassVar[bool] = False
    """Whether its bundles go into a microcontroller's firmware (TFLite Micro's): export writes the model as C
    sources with them, and their memory is the interpreter's tensor arena."""
    runs_on: ClassVar[str] = "on the CPU"
    """Where it runs a model that asks for no accelerator, in a verdict's reason."""

    @classmethod
    def info(cls) -> RuntimeInfo:
        return RuntimeInfo(cls.package, cls.module, cls.install)

    # -- its facts

    def probe(self, *, try_import: bool) -> RuntimeFacts:
        """Its facts here: looked for (``try_import`` False: the check before a model is opened, which imports the
        runtime right after) or imported (what ``edgeline doctor`` reports)."""
        version = _version(self.package)
        found = version is not None or importlib.util.find_spec(self.module.partition(".")[0]) is not None
        if not found:
            return RuntimeFacts(version=None, imports=False, error=f"{self.package} is not installed")
        if not try_import:
            return RuntimeFacts(version=version, imports=None)
        from edgeline.native_output import capture_native_output

        logging.disable(logging.WARNING)  # coremltools, torchao and torch warn about their own setups on import
        try:
            with capture_native_output() as captured:
                module = importlib.import_module(self.module)
        except Exception as exc:  # an import can fail any way (a missing shared library, a numpy ABI mismatch)
            return RuntimeFacts(version=version, imports=False, error=f"{type(exc).__name__}: {exc}")
        finally:
            logging.disable(logging.NOTSET)
        if captured.text.strip():
            log.debug("importing %s printed:\n%s", self.module, captured.text.strip())
        return self.imported(module, version)

    def imported(self, module: Any, version: str | None) -> RuntimeFacts:
        """Its facts once its module imported: what it says of itself beyond its version (providers, devices)."""
        return RuntimeFacts(version=version, imports=True)

    def accelerators(self, facts: Facts) -> dict[str, dict[str, Any]]:
        """The accelerators it runs models on, each as ``{"present": bool, "detail": str}``: ``doctor``'s report."""
        return {}

    # -- whether a bundle runs here

    def refusal(self, accelerator: str | None, facts: Facts) -> str | None:
        """Why it cannot run a model built for ``accelerator`` on the machine of ``facts`` at all, whatever is
        installed (Core ML off macOS), or None."""
        return None

    def verdict(self, asked: Asked) -> Verdict | None:
        """Its own rules for a bundle whose runtime is installed and imports (an accelerator it can or cannot reach,
        a file the bundle keeps for the CPU): a verdict, or None when the rules every backend shares decide
        (``edgeline.verdicts``: the CPU runs it, or an accelerator it names is not checked ahead)."""
        return None

    def target_here(self, accelerator: str | None, facts: Facts) -> bool | None:
        """Whether a profile's target that asks it for ``accelerator`` runs here, its runtime installed: True on
        that accelerator (or the CPU, when it asks for none), False with a fallback to the CPU, None not at all."""
        return True

    # -- running a model

    def open(
        self, model_path: Path, *, threads: int, input_names: Sequence[str] | None, accelerator: str | None
    ) -> Session:
        """Open ``model_path`` (one of its ``file_suffixes``) to run on ``accelerator`` where it can."""
        raise NotImplementedError(f"{type(self).__name__} does not implement open()")

    def cache_compiled_models(self, directory: Path | None) -> None:
        """Where it may keep the models it compiles when it opens them, so that a restart loads them instead of
        compiling again (the daemon gives a folder of its state directory); the default compiles nothing worth
        keeping."""


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
