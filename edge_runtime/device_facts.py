"""What this machine is and what it has to run bundles with: its facts, gathered once (``gather``), for whoever asks.

``Facts``: the machine (``edgeline.machine``'s CPU and emulation), cores, memory, OS and SoC; the runtime backends
found or imported here with their versions (onnxruntime's providers, OpenVINO's devices, which ExecuTorch runtime and
its delegates); the Ethos-U delegate and the QNN HTP; and, when it was looked at, the daemon's state directory
(``StateFacts``: its file system and what the outbox may take of it). Tests build ``Facts`` for other machines.

Each runtime backend's facts are its class's (``RuntimeBackend.probe``, ``edgeline.backends.base``, where the facts'
types live, imported by every backend); the Ethos-U delegate and the QNN HTP are the machine's. Whether a bundle runs
on the machine of such facts is ``edgeline.verdicts``; ``edgeline doctor`` prints both.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import platform
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING

from edgeline.backends.base import Facts, RuntimeFacts, RuntimeInfo, StateFacts

if TYPE_CHECKING:
    from edgeline.machine import Machine

__all__ = [
    "ARM_FEATURES",
    "RUNTIMES",  # noqa: F822 - computed by __getattr__ on first use
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


def __getattr__(name: str) -> dict[str, RuntimeInfo]:
    """``RUNTIMES``: the runtime backends by the package and module they run on and how a device gets them, as this
    module listed them before each backend's class declared it (``edgeline.backends.base.RuntimeBackend``)."""
    if name != "RUNTIMES":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from edgeline.backends import runtime_backends

    return {found: backend.info() for found, backend in runtime_backends().items()}


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


def has_openvino_device(runtime: RuntimeFacts, device: str) -> bool:
    """Whether OpenVINO found ``device`` (``GPU``, ``NPU``) among its devices here."""
    from edgeline.backends.openvino import has_device  # imports nothing of openvino's

    return has_device(runtime.devices, device)


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
    from edgeline.backends import runtime_backends
    from edgeline.machine import this_machine

    known = runtime_backends()
    wanted = list(known) if backends is None else [name for name in backends if name in known]
    runtimes = {name: known[name].probe(try_import=try_import) for name in wanted}
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
