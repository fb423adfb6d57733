"""What this machine is and what it has to run bundles with: its facts, gathered once (``gather``), for whoever asks.

``Facts``: the machine (``edgeline.machine``'s CPU and emulation), cores, memory, OS and SoC; the runtime backends
found or imported here with their versions (onnxruntime's providers, OpenVINO's devices, which ExecuTorch runtime and
its delegates); the Ethos-U delegate and the QNN HTP; and, when it was looked at, the daemon's state directory
(``StateFacts``: its file system and what the outbox may take of it). Tests build ``Facts`` for other machines.

Whether a bundle runs on the machine of such facts is ``edgeline.verdicts``; ``edgeline doctor`` prints both.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import platform
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edgeline.machine import Machine

__all__ = [
    "ARM_FEATURES",
    "RUNTIMES",
    "X86_FEATURES",
    "Facts",
    "RuntimeFacts",
    "RuntimeInfo",
    "StateFacts",
    "cpu_features",
    "gather",
    "has_openvino_device",
    "read_cpuinfo",
    "state_facts",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RuntimeInfo:
    """A runtime backend's distribution, the module it runs on, and how a device gets it."""

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


def has_openvino_device(runtime: RuntimeFacts, device: str) -> bool:
    """Whether OpenVINO found ``device`` (``GPU``, ``NPU``) among its devices here."""
    from edgeline.backends.openvino import has_device  # imports nothing of openvino's

    return has_device(runtime.devices, device)


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


def read_cpuinfo() -> str:
    """``/proc/cpuinfo`` (empty where there is none): what ``cpu_features`` reads."""
    return _read("/proc/cpuinfo")
