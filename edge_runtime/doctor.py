"""``edgeline doctor [BUNDLE]``: what this machine is and what it can run, and whether a bundle runs here.

Two parts, both read from facts gathered once (``Facts``) and decided by pure functions tested with other machines'
facts:

- ``report(facts)``: the machine (architecture, CPU and its features, cores, memory, OS, whether an emulator runs
  it), the runtimes that import here with their versions, the accelerators present, the device profiles this
  machine is of the kind of (its figures may be held against their budgets) or can run bundles of, and the state
  directory: its file system (type, mount point), its free space and the outbox budget that leads to
  (``edgeline.disk``: the smaller of ``[outbox] max_bytes`` and a share of the file system).
- ``verdict(manifest, files, facts)``: will this bundle run here, on which runtime and accelerator, with which
  fallback, or why not. ``edgeline.model.load`` asks the same question before it opens a bundle, so ``run``,
  ``verify`` and ``infer`` refuse what cannot run here (a Core ML model on Linux, a vela model with neither an
  Ethos-U delegate nor a CPU copy, a QNN context binary for another SoC with no QDQ copy) with the verdict's reason,
  exit code 2, before any model byte is parsed; a fallback is said once, loudly, by the session that takes it.

The verdict is a prediction from the bundle's manifest and files; the session that opens the model then does what
it says (a test holds the two together on every bundle it has).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import os
import platform
import sys
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, field, replace
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgeline.errors import BackendUnavailableError

if TYPE_CHECKING:
    from edgeline.device_profiles import Profile
    from edgeline.machine import Machine
    from edgeline.manifest import Manifest

__all__ = [
    "RUNTIMES",
    "TARGET_RUNTIMES",
    "Facts",
    "RuntimeFacts",
    "StateFacts",
    "Verdict",
    "cpu_features",
    "gather",
    "register",
    "report",
    "runtime_refusal",
    "state_facts",
    "verdict",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RuntimeInfo:
    package: str
    module: str
    install: str
    """How to get it on a device."""


RUNTIMES: dict[str, RuntimeInfo] = {
    "litert": RuntimeInfo("ai-edge-litert", "ai_edge_litert.interpreter", "the base install (pip install edgeline)"),
    "tflite-runtime": RuntimeInfo(
        "tflite-runtime", "tflite_runtime.interpreter", "pip install tflite-runtime (2.14: Python <= 3.11, numpy < 2)"
    ),
    "onnxruntime": RuntimeInfo("onnxruntime", "onnxruntime", "pip install 'edgeline[onnx]'"),
    "openvino": RuntimeInfo("openvino", "openvino", "pip install 'edgeline[openvino]'"),
    "executorch": RuntimeInfo(
        "executorch",
        "executorch.runtime",
        "edgeline doctor --install executorch (its C++ runtime, no torch)",
    ),
    "tflite-micro": RuntimeInfo(
        "tflite-micro", "tflite_micro", "pip install 'edgeline[ethos-u]' (an x86-64 Linux wheel only)"
    ),
    "coreml": RuntimeInfo("coremltools", "coremltools", "macOS with pip install 'edgeline[coreml]'"),
}
"""The runtime backends (``edgeline.backends.RUNTIME_BACKENDS``) by the package and module they run on."""

TARGET_RUNTIMES: dict[str, tuple[str, str | None]] = {
    "litert": ("litert", None),
    "executorch-xnnpack": ("executorch", None),
    "executorch-coreml": ("executorch", "coreml"),
    "onnxruntime": ("onnxruntime", None),
    "qnn-htp": ("onnxruntime", "qnn-htp"),
    "ethos-u": ("litert", "ethos-u"),
    "tflite-micro": ("tflite-micro", None),
    "coreml": ("coreml", "coreml"),
    "openvino": ("openvino", None),
    "openvino-gpu": ("openvino", "GPU"),
    "openvino-npu": ("openvino", "NPU"),
}
"""A profile target's export backend -> the runtime backend its bundles name and the accelerator they ask for
(None: the CPU; an onnxruntime target asks for the profile's first provider). The device side cannot import the
exporters; a test holds this table to their ``runtime_backend``."""

QNN_CONTEXT_SUFFIX = "_qnn.bin"
"""The context binary a qnn-htp bundle's EP-context model points at (``model.onnx`` -> ``model_qnn.bin``)."""
ETHOS_U_CPU_MODEL = "model_int8.tflite"  # edgeline.backends.ethos_u.CPU_MODEL, without importing the backend
COREML_ACCELERATORS = frozenset({"neural-engine", "gpu", "coreml"})
CPU_PROVIDER = "CPUExecutionProvider"


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


def state_facts(directory: Path, max_bytes: int | None) -> StateFacts:
    """Measure the state directory's file system (it may not exist yet: its nearest ancestor is measured)."""
    from edgeline.disk import file_system, files_bytes

    found = file_system(directory)
    outboxes: dict[str, int] = {}
    try:
        databases = sorted(directory.glob("*/outbox.sqlite"))
    except OSError:
        databases = []
    for database in databases:
        outboxes[database.parent.name] = files_bytes(database, Path(f"{database}-wal"))
    return StateFacts(
        directory=str(directory), mount_point=found.mount_point, fs_type=found.fs_type, device=found.device,
        total_bytes=found.total_bytes, free_bytes=found.free_bytes, max_bytes=max_bytes, outboxes=outboxes,
    )  # fmt: skip


@dataclass(frozen=True)
class Facts:
    """What this machine says of itself. Gathered by ``gather``; tests build them for other machines."""

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
    python: str = field(default_factory=platform.python_version)
    state: StateFacts | None = None
    """The daemon's state directory, when it was looked at."""


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _executorch_facts(*, try_import: bool) -> RuntimeFacts:
    """The torch-free runtime when there is one (loaded, with ``try_import``: its shim built if need be), the Python
    runtime's facts otherwise; each names the other when both are here."""
    from edgeline.executorch_native import NativeRuntime, built_shim, compiler, runtimes

    python = _runtime_facts("executorch", try_import=False, native=False)
    python_there = python.version is not None and importlib.util.find_spec("torch") is not None
    also = f"ExecuTorch's Python runtime {python.version} (imports torch)" if python_there else None
    found = runtimes()
    if not found:
        if python.version is None:
            return python
        python = _runtime_facts("executorch", try_import=try_import, native=False)
        return replace(python, kind="python", fallback=None)
    runtime = found[0]
    where = f"{runtime.root} ({runtime.origin})"
    missing = runtime.missing()
    if missing is None and built_shim(runtime) is None and compiler() is None:
        missing = "a C++ compiler to build edgeline's shim (apt install g++, or set CXX)"
    if missing is not None:
        error = f"the torch-free runtime at {where} lacks {missing}"
        return RuntimeFacts(runtime.version, False, error, kind="torch-free", location=where, fallback=also)
    if not try_import:
        delegates = tuple(runtime.delegate_libraries())
        return RuntimeFacts(
            runtime.version, None, kind="torch-free", location=where, delegates=delegates, fallback=also
        )
    try:
        loaded = NativeRuntime.get()
    except Exception as exc:  # a library that does not load (another architecture, a missing libstdc++) is a fact
        return RuntimeFacts(runtime.version, False, f"{exc}", kind="torch-free", location=where, fallback=also)
    return RuntimeFacts(
        loaded.version, True, kind="torch-free", location=where, delegates=loaded.backends(), fallback=also
    )


def _openvino_has(runtime: RuntimeFacts, device: str) -> bool:
    from edgeline.backends.openvino import has_device  # imports nothing of openvino's

    return has_device(runtime.devices, device)


def _openvino_device(facts: Facts, device: str) -> dict[str, Any]:
    runtime = facts.runtimes.get("openvino")
    if runtime is None or not runtime.imports:
        return {"present": False, "detail": "openvino is not installed (pip install 'edgeline[openvino]')"}
    return {
        "present": _openvino_has(runtime, device),
        "detail": "OpenVINO devices: " + (", ".join(runtime.devices) or "none"),
    }


def _runtime_facts(backend: str, *, try_import: bool, native: bool = True) -> RuntimeFacts:
    if backend == "executorch" and native:
        return _executorch_facts(try_import=try_import)
    info = RUNTIMES[backend]
    version = _version(info.package)
    found = version is not None or importlib.util.find_spec(info.module.partition(".")[0]) is not None
    if not found:
        return RuntimeFacts(version=None, imports=False, error=f"{info.package} is not installed")
    if not try_import:
        return RuntimeFacts(version=version, imports=None)
    from edgeline.native_output import capture_native_output

    logging.disable(logging.WARNING)  # coremltools, torchao and torch warn about their own setups on import
    try:
        with capture_native_output() as captured:
            module = importlib.import_module(info.module)
    except Exception as exc:  # an import can fail any way (a missing shared library, a numpy ABI mismatch)
        return RuntimeFacts(version=version, imports=False, error=f"{type(exc).__name__}: {exc}")
    finally:
        logging.disable(logging.NOTSET)
    if captured.text.strip():
        log.debug("importing %s printed:\n%s", info.module, captured.text.strip())
    providers: tuple[str, ...] = ()
    if backend == "executorch":
        registry = module.Runtime.get().backend_registry
        return RuntimeFacts(version, True, kind="python", delegates=tuple(registry.registered_backend_names))
    if backend == "openvino":
        try:
            devices = tuple(module.Core().available_devices)
        except Exception as exc:  # a plugin that fails to load is reported, not raised
            return RuntimeFacts(version=version, imports=False, error=f"Core().available_devices: {exc}")
        return RuntimeFacts(version=version, imports=True, devices=devices)
    if backend == "onnxruntime":
        try:
            providers = tuple(module.get_available_providers())
        except Exception as exc:  # onnxruntime's errors derive from Exception only
            return RuntimeFacts(version=version, imports=False, error=f"get_available_providers: {exc}")
    return RuntimeFacts(version=version, imports=True, providers=providers)


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def _meminfo() -> tuple[int, int] | None:
    values: dict[str, int] = {}
    for line in _read("/proc/meminfo").splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[key] = int(parts[0]) // 1024  # kB -> MiB
    if "MemTotal" not in values:
        return None
    return values["MemTotal"], values.get("MemAvailable", values["MemTotal"])


def _os_name() -> str:
    for line in _read("/etc/os-release").splitlines():
        if line.startswith("PRETTY_NAME="):
            return line.partition("=")[2].strip().strip('"')
    return f"{platform.system()} {platform.release()}".strip()


def _soc() -> str | None:
    name = _read("/sys/devices/soc0/machine").strip()
    return name or None


def gather(
    backends: Collection[str] | None = None,
    *,
    try_import: bool = True,
    qnn: bool = True,
    state: StateFacts | None = None,
) -> Facts:
    """This machine's facts. ``backends``: the runtimes to look at (all by default); ``try_import``: import them
    (what ``edgeline doctor`` reports) rather than only look for them (the check before a model is opened, which
    imports its runtime right after); ``qnn``: ask onnxruntime-qnn for the HTP (it registers its provider library,
    process-wide, so only when a bundle wants the HTP). onnxruntime is imported whenever it is wanted: its
    providers are what it offers."""
    from edgeline.machine import this_machine

    wanted = list(RUNTIMES) if backends is None else [name for name in backends if name in RUNTIMES]
    runtimes = {name: _runtime_facts(name, try_import=try_import or name == "onnxruntime") for name in wanted}
    qnn_missing: str | None = "onnxruntime is not installed"
    ort = runtimes.get("onnxruntime")
    if not qnn:
        qnn_missing = "not looked for"
    elif ort is not None and ort.imports:
        if importlib.util.find_spec("onnxruntime_qnn") is None:
            qnn_missing = "onnxruntime-qnn is not installed (pip install 'edgeline[qnn]')"
        else:
            from edgeline.backends.onnxruntime import qnn_unavailable

            qnn_missing = qnn_unavailable()
    delegate, ethos_u_missing = _find_ethos_u_delegate()
    cpus: int | None
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count()
    return Facts(
        system=platform.system(),
        machine=this_machine(),
        runtimes=runtimes,
        ethos_u_delegate=delegate,
        ethos_u_missing=ethos_u_missing,
        qnn_missing=qnn_missing,
        soc=_soc(),
        cpu_count=cpus,
        memory_mb=_meminfo(),
        os_name=_os_name(),
        kernel=platform.release(),
        state=state,
    )


def _find_ethos_u_delegate() -> tuple[str | None, str]:
    from edgeline.backends.ethos_u import find_delegate  # imports nothing heavy until a model is read

    path, why = find_delegate()
    return (str(path) if path is not None else None), why


# ---------------------------------------------------------------------------------------------------------------
# The machine


ARM_FEATURES = {
    "neon": "asimd",
    "fp16": "asimdhp",
    "dotprod": "asimddp",
    "i8mm": "i8mm",
    "bf16": "bf16",
    "sve": "sve",
    "sve2": "sve2",
    "sme": "sme",
}
"""What profiles and people call an Arm feature -> its name in /proc/cpuinfo's ``Features``."""
X86_FEATURES = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8")


def cpu_features(machine: Machine, cpuinfo: str) -> dict[str, bool]:
    """The features that decide which kernels a runtime may use: Arm's by their profile names, x86's by Linux's."""
    if machine.arch == "aarch64":
        listed: set[str] = set()
        for line in cpuinfo.splitlines():
            key, _, value = line.partition(":")
            if key.strip().lower() == "features":
                listed.update(value.split())
        return {name: flag in listed for name, flag in ARM_FEATURES.items()}
    if machine.arch == "x86_64":
        return {name: name in machine.flags for name in X86_FEATURES}
    return {}


def _profile_runs(profile: Profile, facts: Facts) -> list[str]:
    """The targets of ``profile`` whose bundles run here (on their accelerator or with a fallback)."""
    runs = []
    for target in profile.targets:
        backend, accelerator = TARGET_RUNTIMES.get(target.backend, (target.backend, None))
        if target.backend == "onnxruntime" and profile.onnxruntime is not None:
            first = profile.onnxruntime.providers[0]
            accelerator = None if first == CPU_PROVIDER else first
        runtime = facts.runtimes.get(backend)
        if runtime is None or runtime.version is None or runtime.imports is False:
            continue
        if (backend == "coreml" or accelerator == "coreml") and facts.system != "Darwin":
            continue
        if accelerator == "qnn-htp" and facts.qnn_missing is not None:
            continue  # an EP-context model runs only on the HTP (its QDQ copy is a fallback, not this target)
        label = f"{target.backend} {target.precision.value}"
        if accelerator == "ethos-u" and facts.ethos_u_delegate is None:
            label += " (CPU fallback)"
        elif backend == "openvino" and accelerator is not None:
            if not _openvino_has(runtime, accelerator):
                label += " (CPU fallback)"
        elif accelerator is not None and accelerator.endswith("ExecutionProvider"):
            ort = facts.runtimes["onnxruntime"]
            if accelerator not in ort.providers:
                label += " (CPU fallback)"
        runs.append(label)
    return runs


def report(facts: Facts, profiles: list[Profile], cpuinfo: str = "") -> dict[str, Any]:
    """The machine, its runtimes and accelerators, and the profiles it matches or can run: the ``--json``
    document of ``edgeline doctor``."""
    from edgeline.machine import mismatch
    from edgeline.manifest import Device

    machine = facts.machine
    ort = facts.runtimes.get("onnxruntime")
    providers = ort.providers if ort is not None else ()
    accelerators = {
        "ethos-u": {
            "present": facts.ethos_u_delegate is not None,
            "detail": facts.ethos_u_delegate or facts.ethos_u_missing,
        },
        "qnn-htp": {
            "present": facts.qnn_missing is None,
            "detail": facts.qnn_missing
            or ("the HTP emulator of the x86-64 wheel" if machine.arch == "x86_64" else "Qualcomm's HTP libraries"),
        },
        "cuda": {
            "present": "CUDAExecutionProvider" in providers,
            "detail": "onnxruntime providers: " + (", ".join(providers) or "onnxruntime not installed"),
        },
        "tensorrt": {
            "present": "TensorrtExecutionProvider" in providers,
            "detail": "onnxruntime providers: " + (", ".join(providers) or "onnxruntime not installed"),
        },
        "intel-gpu": _openvino_device(facts, "GPU"),
        "intel-npu": _openvino_device(facts, "NPU"),
        "coreml": {
            "present": facts.system == "Darwin",
            "detail": "macOS" if facts.system == "Darwin" else f"Core ML runs on macOS only (this is {facts.system})",
        },
    }
    matches, emulates, runs = [], [], {}
    for profile in profiles:
        device = Device(arch=profile.cpu.arch, cpu=profile.cpu.name)
        if mismatch(device, machine) is None:
            matches.append(profile.id)
        elif machine.emulated is not None:
            from dataclasses import replace

            if mismatch(device, replace(machine, emulated=None)) is None:
                emulates.append(profile.id)
        targets = _profile_runs(profile, facts)
        if targets:
            runs[profile.id] = targets
    return {
        "machine": {
            "arch": machine.arch,
            "cpu": machine.cpu,
            "cores": sorted(machine.cores),
            "cpus": facts.cpu_count,
            "features": cpu_features(machine, cpuinfo),
            "memory_mb": None
            if facts.memory_mb is None
            else {"total": facts.memory_mb[0], "available": facts.memory_mb[1]},
            "os": facts.os_name,
            "system": facts.system,
            "kernel": facts.kernel,
            "python": facts.python,
            "soc": facts.soc,
            "emulated": machine.emulated,
        },
        "runtimes": {name: asdict(runtime) for name, runtime in facts.runtimes.items()},
        "accelerators": accelerators,
        "profiles": {
            "matches": matches,
            "emulates": emulates,
            "runs": runs,
        },
        "state_dir": None if facts.state is None else _state_report(facts.state),
    }


def _state_report(state: StateFacts) -> dict[str, Any]:
    """The state directory's file system and the outbox budget it leads to (a new outbox's, and each one's there)."""
    from edgeline.disk import DISK_SHARE, budget, wal_share

    def outbox_budget(held: int) -> int | None:
        return None if state.max_bytes is None else budget(state.max_bytes, state.free_bytes, held)

    total = outbox_budget(0)
    return {
        "directory": state.directory,
        "mount_point": state.mount_point,
        "fs_type": state.fs_type,
        "device": state.device,
        "total_bytes": state.total_bytes,
        "free_bytes": state.free_bytes,
        "outbox": {
            "in_memory": state.max_bytes is None,
            "max_bytes": state.max_bytes,
            "share": DISK_SHARE,
            "budget_bytes": total,
            "wal_bytes": None if total is None else wal_share(total),
            "existing": {
                name: {"disk_bytes": held, "budget_bytes": outbox_budget(held)}
                for name, held in sorted(state.outboxes.items())
            },
        },
    }


# ---------------------------------------------------------------------------------------------------------------
# A bundle


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


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("."):
        digits = "".join(ch for ch in piece if ch.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def _runtime_problem(info: RuntimeInfo, runtime: RuntimeFacts, needs: str | None) -> str | None:
    if runtime.version is None and runtime.imports is not True:
        return f"its runtime {info.package} is not installed here: {info.install}"
    if runtime.imports is False:
        return f"its runtime {info.package} does not import here ({runtime.error}): {info.install}"
    if needs and runtime.version and _version_tuple(runtime.version) < _version_tuple(needs):
        return f"it needs {info.package} >= {needs}; this machine has {runtime.version}"
    return None


def runtime_refusal(backend: str, package: str, min_version: str | None, *, try_import: bool = False) -> str | None:
    """Why a bundle for runtime ``backend`` (needing ``package`` >= ``min_version``) cannot run on this machine, as
    far as its runtime alone tells; None when it can. The rule ``verdict`` applies, for a signed update's metadata
    before its archive is fetched."""
    info = RUNTIMES.get(backend)
    if info is None:
        return f"unknown runtime backend {backend!r}; valid: {', '.join(sorted(RUNTIMES))}"
    facts = gather([backend], try_import=try_import, qnn=False)
    if backend == "coreml" and facts.system != "Darwin":
        return f"Core ML runs on macOS only (this is {facts.system})"
    if backend == "tflite-micro" and facts.machine.arch != "x86_64":
        return "tflite-micro's Python wheel exists for x86-64 Linux only"
    runtime = facts.runtimes.get(backend) or RuntimeFacts(None, None)
    return _runtime_problem(info, runtime, min_version if package == info.package else None)


def _refused(backend: str, model: str, reason: str, **extra: Any) -> Verdict:
    return Verdict(runs=False, backend=backend, model=model, accelerator=None, fallback=None, reason=reason, **extra)


def verdict(
    manifest: Manifest,
    files: Collection[str],
    facts: Facts,
    *,
    backend: str | None = None,
    profile: Profile | None = None,
) -> Verdict:
    """Whether the bundle of ``manifest`` (holding ``files``) runs on the machine of ``facts``, with ``backend``
    instead of its own runtime if given. ``profile``: the bundle's profile where this install knows it (its QNN SoC)."""
    from edgeline.machine import mismatch

    name = backend or manifest.backend
    model = manifest.model
    machine = facts.machine
    device = "the bundle does not name its device" if manifest.device is None else mismatch(manifest.device, machine)
    info = RUNTIMES.get(name)
    if info is None:
        return _refused(name, model, f"unknown runtime backend {name!r}; valid: {', '.join(sorted(RUNTIMES))}")
    runtime = facts.runtimes.get(name) or RuntimeFacts(version=None, imports=None)
    needs = manifest.runtime.min_version if backend is None and manifest.runtime.package == info.package else None
    described = {"package": info.package, "version": runtime.version, "needs": needs}
    common: dict[str, Any] = {"runtime": described, "device": device, "emulated": machine.emulated}
    accelerator = manifest.placement.accelerator if manifest.placement else None

    if (name == "coreml" or accelerator in COREML_ACCELERATORS) and facts.system != "Darwin":
        return _refused(name, model, f"Core ML runs on macOS only (this is {facts.system})", **common)
    problem = _runtime_problem(info, runtime, needs)
    if problem is not None:
        return _refused(name, model, problem, **common)
    if name == "tflite-micro" and machine.arch != "x86_64":
        return _refused(name, model, "tflite-micro's Python wheel exists for x86-64 Linux only", **common)

    if accelerator == "ethos-u":
        if facts.ethos_u_delegate is not None:
            why = f"the Ethos-U delegate {facts.ethos_u_delegate} runs the NPU's operators"
            return Verdict(True, name, model, "ethos-u", None, why, **common)
        missing = "the Python TFLite Micro has no Ethos-U driver" if name == "tflite-micro" else facts.ethos_u_missing
        if ETHOS_U_CPU_MODEL in files and model != ETHOS_U_CPU_MODEL:
            why = f"{missing}: the int8 model {ETHOS_U_CPU_MODEL} runs on the CPU instead (slower)"
            return Verdict(True, name, ETHOS_U_CPU_MODEL, None, why, "vela's model needs the Ethos-U NPU", **common)
        return _refused(
            name, model, f"a vela model for the Ethos-U NPU, {missing}, and no {ETHOS_U_CPU_MODEL} "
            "to run on the CPU", **common,
        )  # fmt: skip
    if accelerator == "qnn-htp" and name == "onnxruntime":
        htp_missing = facts.qnn_missing
        other_soc = htp_missing is None and profile and facts.soc and facts.soc.lower() not in profile.name.lower()
        if other_soc:
            assert profile is not None
            soc = f"soc_model {profile.qnn.soc_model}, " if profile.qnn is not None else ""
            htp_missing = f"the context binary is for {soc}{profile.name}; this SoC is {facts.soc}"
        if htp_missing is None:
            emulated = "the QNN HTP emulator (x86-64)" if machine.arch == "x86_64" else machine.emulated
            common["emulated"] = emulated
            return Verdict(True, name, model, "qnn-htp", None, "the QNN provider runs the context binary", **common)
        stem = model.removesuffix(".onnx")
        copy = f"{stem}.qdq.onnx"
        if copy in files:
            why = f"{htp_missing}; the QDQ model {copy} runs on the CPU provider instead"
            common["cpu_instead"] = bool(other_soc)
            return Verdict(True, name, copy, None, why, "the context binary runs only on Qualcomm's HTP", **common)
        if any(path.endswith(QNN_CONTEXT_SUFFIX) for path in files):
            return _refused(
                name, model, f"a QNN context binary for Qualcomm's HTP ({htp_missing}), and the bundle keeps no QDQ "
                f"copy ({copy}) for the CPU", **common,
            )  # fmt: skip
        return Verdict(True, name, model, None, htp_missing, "a QDQ model the CPU provider runs too", **common)
    if accelerator is not None and accelerator.endswith("ExecutionProvider") and name == "onnxruntime":
        providers = runtime.providers
        if accelerator in providers:
            return Verdict(True, name, model, accelerator, None, f"onnxruntime has {accelerator}", **common)
        why = f"{accelerator} is not in this onnxruntime (it has {', '.join(providers) or 'no providers listed'})"
        return Verdict(True, name, model, None, why, "the CPU provider runs any ONNX model", **common)
    if name == "executorch":
        return _executorch_verdict(model, accelerator, runtime, common)
    if name == "openvino" and accelerator is not None:
        if _openvino_has(runtime, accelerator):
            return Verdict(True, name, model, accelerator, None, f"OpenVINO has its {accelerator} device", **common)
        if runtime.imports:  # devices known: the plugin found none
            has = ", ".join(runtime.devices) or "no device"
            why = f"OpenVINO has no {accelerator} device here (it has {has})"
            return Verdict(True, name, model, None, why, "the CPU plugin runs any IR", **common)
    if accelerator is not None and accelerator not in COREML_ACCELERATORS:
        return Verdict(
            True, name, model, accelerator, None, f"{info.package} is installed; the accelerator {accelerator} is "
            "not checked ahead (the runtime says at load)", **common,
        )  # fmt: skip
    on = "on macOS" if name == "coreml" else "on the CPU"
    installed = f"{info.package} {runtime.version}" if runtime.version else info.package
    return Verdict(True, name, model, accelerator, None, f"{installed} runs it {on}", **common)


def _executorch_verdict(model: str, accelerator: str | None, runtime: RuntimeFacts, common: dict[str, Any]) -> Verdict:
    """A .pte runs where the runtime that will open it carries the delegate it was lowered to."""
    from edgeline.backends.executorch import DELEGATE_BACKENDS

    needed = DELEGATE_BACKENDS.get(accelerator or "")
    which = "the torch-free ExecuTorch runtime" if runtime.kind == "torch-free" else "ExecuTorch's Python runtime"
    label = f"{which} {runtime.version or ''}".rstrip()
    if needed is not None and runtime.delegates is not None and needed not in runtime.delegates:
        has = ", ".join(runtime.delegates) or "none"
        return _refused("executorch", model, f"the program is delegated to {needed}, which {label} lacks (it has: "
                        f"{has})", **common)  # fmt: skip
    why = label + (f" with its {needed} delegate" if needed else "") + " runs it"
    if runtime.kind == "python":
        why += " (it imports torch: `edgeline doctor --install executorch` gives the torch-free one)"
    return Verdict(True, "executorch", model, accelerator, None, why, **common)


def bundle_verdict(path: Path, *, backend: str | None = None, try_import: bool = True) -> Verdict:
    """``verdict`` for the bundle at ``path`` on this machine (its integrity checked first)."""
    from edgeline.bundle import read_bundle

    bundle = read_bundle(path)
    return verdict_for(bundle.manifest, backend=backend, try_import=try_import)


def verdict_for(manifest: Manifest, *, backend: str | None = None, try_import: bool = False) -> Verdict:
    """``verdict`` for a bundle already read, on this machine: the check ``edgeline.model.load`` makes first."""
    name = backend or manifest.backend
    wants_htp = manifest.placement is not None and manifest.placement.accelerator == "qnn-htp"
    facts = gather([name], try_import=try_import, qnn=wants_htp)
    profile = _known_profile(manifest.profile) if wants_htp else None
    return verdict(manifest, {entry.path for entry in manifest.files}, facts, backend=backend, profile=profile)


def _known_profile(profile_id: str) -> Profile | None:
    from edgeline.device_profiles import ProfileError, load_profile

    try:
        return load_profile(profile_id)
    except ProfileError:
        return None


# ---------------------------------------------------------------------------------------------------------------
# The command


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "doctor",
        help="what this machine is and can run; with BUNDLE, whether that bundle runs here",
        description=(
            "Print this machine's architecture, CPU and features, memory, OS, the runtimes that import, the "
            "accelerators present and the device profiles it matches or can run. With BUNDLE: whether it runs here, "
            "on which runtime and accelerator, with which fallback, or why not (exit code 1: it cannot). "
            "`run`, `verify` and `infer` make the same check before they open a bundle."
        ),
    )
    parser.add_argument(
        "bundle", metavar="BUNDLE", type=Path, nargs="?", help="a bundle directory (written by `edgeline export`)"
    )
    parser.add_argument("--backend", metavar="RUNTIME", choices=sorted(RUNTIMES),
                        help="ask about this runtime backend instead of the bundle's: %(choices)s")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument(
        "--install", choices=["executorch"], metavar="RUNTIME",
        help="install a runtime into this environment instead: executorch (its torch-free C++ runtime, from the "
        "executorch wheel without its dependencies, and edgeline's shim built against it with the host's g++)",
    )  # fmt: skip
    parser.add_argument(
        "--from", dest="install_from", type=Path, metavar="PATH",
        help="with --install: an executorch wheel file or package directory instead of downloading (pip download "
        "--no-deps)",
    )  # fmt: skip
    parser.add_argument(
        "--state-dir", type=Path, metavar="DIR",
        help="the daemon's state directory to measure (default: as `edgeline run`: [daemon] state_dir, "
        "$STATE_DIRECTORY, else ~/.local/state/edgeline)",
    )  # fmt: skip
    parser.add_argument("--config", type=Path, metavar="daemon.toml",
                        help="the daemon's configuration: its [outbox] and [daemon] state_dir")  # fmt: skip
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from edgeline.device_profiles import list_profiles

    if args.install is not None:
        return _install(args)
    if args.install_from is not None:
        raise BackendUnavailableError("--from goes with --install executorch")

    if args.bundle is not None:
        found = bundle_verdict(args.bundle, backend=args.backend)
        if args.json:
            print(json.dumps({"bundle": str(args.bundle), **found.as_dict()}, indent=2))
        else:
            from edgeline.bundle import read_bundle

            manifest = read_bundle(args.bundle).manifest
            print(f"{manifest.name} v{manifest.version} ({manifest.profile}, {manifest.backend} {manifest.precision})")
            for line in found.describe():
                print(f"  {line}")
        return 0 if found.runs else 1
    facts = gather(state=_state_of(args))
    document = report(facts, list_profiles(), _read("/proc/cpuinfo"))
    document["cameras"] = camera_report()
    if args.json:
        print(json.dumps(document, indent=2))
        return 0
    for line in _describe_report(document):
        print(line)
    return 0


def _install(args: argparse.Namespace) -> int:
    """``--install executorch``: the torch-free runtime into this environment, then what it is."""
    from edgeline.executorch_native import install

    if args.bundle is not None:
        raise BackendUnavailableError("--install takes no BUNDLE")
    source = args.install_from
    if source is not None and not source.exists():
        raise BackendUnavailableError(f"--from {source}: no such file or directory")
    runtime = install(source=source, say=lambda line: print(f"doctor: {line}", file=sys.stderr))
    delegates = runtime.backends()
    found = {"installed": str(runtime.runtime.root), "version": runtime.version, "delegates": list(delegates),
             "shim": str(runtime.shim)}  # fmt: skip
    if args.json:
        print(json.dumps(found, indent=2))
    else:
        print(f"executorch: torch-free C++ runtime {runtime.version} in {runtime.runtime.root}")
        print(f"  delegates: {', '.join(delegates) or 'none'}")
        print(f"  shim: {runtime.shim}")
    return 0


def _state_of(args: argparse.Namespace) -> StateFacts:
    """The state directory ``edgeline run`` would use with the same ``--state-dir`` and ``--config``, measured."""
    from edgeline.daemon.config import load_config
    from edgeline.daemon.state import default_state_dir

    config = load_config(args.config)
    directory = args.state_dir or config.daemon.state_dir or default_state_dir()
    return state_facts(directory, config.outbox.max_bytes if config.outbox.enabled else None)


def _size(count: int | None) -> str:
    if count is None:
        return "unknown"
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("kB", 1 << 10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} bytes"


def _describe_state(state: dict[str, Any]) -> list[str]:
    where = state["fs_type"] or "file system of unknown type"
    if state["device"]:
        where += f" {state['device']}"
    if state["mount_point"]:
        where += f" mounted at {state['mount_point']}"
    lines = [
        f"state dir:    {state['directory']} ({where}): {_size(state['free_bytes'])} free of "
        f"{_size(state['total_bytes'])}"
    ]
    outbox = state["outbox"]
    if outbox["in_memory"]:
        lines.append("outbox:       in memory ([outbox] enabled = false): no budget on the disk")
        return lines
    share = f"{outbox['share']:.0%}"
    lines.append(
        f"outbox:       a budget of {_size(outbox['budget_bytes'])} on the disk, its WAL at most "
        f"{_size(outbox['wal_bytes'])} of it (the smaller of [outbox] max_bytes, {_size(outbox['max_bytes'])}, and "
        f"{share} of the free space and the outbox's own, at least {_size(_min_budget(outbox['max_bytes']))})"
    )
    for name, existing in outbox["existing"].items():
        lines.append(
            f"  {name:15} its outbox takes {_size(existing['disk_bytes'])}: a budget of "
            f"{_size(existing['budget_bytes'])}"
        )
    return lines


def _min_budget(max_bytes: int) -> int:
    from edgeline.disk import MIN_BUDGET

    return min(MIN_BUDGET, max_bytes)


def camera_report() -> dict[str, Any]:
    """The camera extra (PyAV) and the cameras this machine shows (``/dev/video*``, picamera2)."""
    from edgeline.video import camera_extra, cameras_seen

    version = camera_extra()
    return {
        "extra": version,
        "install": None if version is not None else "pip install 'edgeline[camera]'",
        "devices": cameras_seen(),
    }


def _describe_cameras(cameras: dict[str, Any]) -> list[str]:
    extra = cameras["extra"]
    lines = [f"cameras:      camera extra {'PyAV ' + extra if extra else 'not installed: ' + cameras['install']}"]
    devices = [device for device in cameras["devices"] if device.get("kind") == "v4l2"]
    for device in devices:
        lines.append(f"  {device['source']:15} {device.get('name') or 'V4L2 device'}")
    if not devices:
        lines.append("  no /dev/video* device")
    for device in cameras["devices"]:
        if device.get("kind") == "picamera2":
            state = "importable" if device.get("importable") else "not installed (Raspberry Pi OS: python3-picamera2)"
            lines.append(f"  {'picamera2':15} {state}")
    return lines


def _describe_report(document: dict[str, Any]) -> list[str]:
    machine = document["machine"]
    features = ", ".join(f"{name} {'yes' if on else 'no'}" for name, on in machine["features"].items())
    memory = machine["memory_mb"]
    lines = [
        f"machine:      {machine['arch']}, {machine['cpu']}",
        f"emulated:     {machine['emulated'] or 'no'}",
        f"features:     {features or 'not known for this architecture'}",
        f"cpus:         {machine['cpus']} usable by this process",
        "memory:       "
        + ("unknown" if memory is None else f"{memory['total']} MiB ({memory['available']} available)"),
        f"os:           {machine['os']} (kernel {machine['kernel']}, Python {machine['python']})",
    ]
    if machine["soc"]:
        lines.append(f"soc:          {machine['soc']}")
    lines.append("runtimes:")
    for name, runtime in document["runtimes"].items():
        package = RUNTIMES[name].package
        if runtime.get("kind") == "torch-free" and runtime["imports"] is not False:
            state = f"torch-free C++ runtime {runtime['version'] or '(version unknown)'} at {runtime['location']}"
            if runtime["delegates"] is not None:
                state += f"; delegates: {', '.join(runtime['delegates']) or 'none'}"
            if runtime["fallback"]:
                state += f"; fallback: {runtime['fallback']}"
        elif runtime["imports"]:
            state = f"{package} {runtime['version']}"
            if runtime["providers"]:
                state += f" ({', '.join(runtime['providers'])})"
            if runtime.get("devices"):
                state += f" (devices: {', '.join(runtime['devices'])})"
            if runtime.get("kind") == "python":
                state += f" (Python runtime, imports torch; delegates: {', '.join(runtime['delegates'] or ())}; the "
                state += "torch-free one: edgeline doctor --install executorch)"
        elif runtime["version"] is None and runtime["imports"] is False:
            state = f"not installed: {RUNTIMES[name].install}"
        else:
            state = f"{package} {runtime['version']} does not import: {runtime['error']}"
        lines.append(f"  {name:15} {state}")
    lines.append("accelerators:")
    for name, accelerator in document["accelerators"].items():
        lines.append(f"  {name:15} {'present' if accelerator['present'] else 'absent'}: {accelerator['detail']}")
    profiles = document["profiles"]
    lines.append(
        "profiles:     this machine is of the kind of "
        + (", ".join(profiles["matches"]) or "none of the profiles")
        + " (a profile's device budgets are checked only on its kind)"
    )
    if profiles["emulates"]:
        lines.append(f"              it emulates the CPU of {', '.join(profiles['emulates'])} (timings are not theirs)")
    for profile_id, targets in profiles["runs"].items():
        lines.append(f"  runs {profile_id:20} {', '.join(targets)}")
    if document.get("cameras"):
        lines += _describe_cameras(document["cameras"])
    if document.get("state_dir"):
        lines += _describe_state(document["state_dir"])
    return lines
