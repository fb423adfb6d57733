"""Is this machine of the kind a bundle was exported for? A device budget (latency, memory) is a figure on the device:
``edgeline verify`` holds what it measures against one only where the answer is yes.

The bundle names its device as its profile does (``manifest.device``: ``arch`` like ``aarch64``, ``cpu`` like
``Cortex-A76``). This machine is of that kind when

- its architecture is the device's (``platform.machine()``, with ``arm64`` read as ``aarch64`` and ``AMD64`` as
  ``x86_64``), and nothing emulates it: under qemu-user, ``uname`` and even ``/proc/cpuinfo`` (QEMU 8.1 on) describe
  the emulated CPU, but ``/proc/sys/kernel/arch`` is the kernel's, so a difference between the two is an emulator;
  a macOS process translated by Rosetta 2 says so in ``sysctl.proc_translated``;
- and its CPU is the device's: on Arm, a core named by the profile's cpu name (``Cortex-A78 + Cortex-A55``) is one
  of the cores ``/proc/cpuinfo`` lists by part number; for an ``x86-64-vN`` profile, the CPU has every feature of
  that level; otherwise (``Apple M2``) the profile's name is part of the CPU's brand string.

Reading the facts (``this_machine``) is I/O at the edge; ``from_facts`` and ``mismatch`` are pure, and tested with
cpuinfo texts of other machines.
"""

from __future__ import annotations

import functools
import os
import platform
import re
import subprocess
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edgeline.manifest import Device

__all__ = [
    "ARM_CORES",
    "EMULATOR_ENV",
    "X86_64_LEVELS",
    "Machine",
    "from_facts",
    "mismatch",
    "normalise_arch",
    "this_machine",
]

EMULATOR_ENV = "EDGELINE_EMULATOR"
"""What emulates this process, as its emulator's wrapper names it (scripts/arm64.sh)."""
ARM_IMPLEMENTER = 0x41
"""``CPU implementer`` of Arm Ltd's own cores in ``/proc/cpuinfo`` (MIDR_EL1.Implementer 'A')."""
ARM_CORES: dict[int, str] = {
    0xD03: "Cortex-A53",
    0xD04: "Cortex-A35",
    0xD05: "Cortex-A55",
    0xD07: "Cortex-A57",
    0xD08: "Cortex-A72",
    0xD09: "Cortex-A73",
    0xD0A: "Cortex-A75",
    0xD0B: "Cortex-A76",
    0xD0D: "Cortex-A77",
    0xD0E: "Cortex-A76AE",
    0xD41: "Cortex-A78",
    0xD42: "Cortex-A78AE",
    0xD44: "Cortex-X1",
    0xD46: "Cortex-A510",
    0xD47: "Cortex-A710",
    0xD48: "Cortex-X2",
    0xD4B: "Cortex-A78C",
    0xD4C: "Cortex-X1C",
    0xD4D: "Cortex-A715",
    0xD4E: "Cortex-X3",
    0xD80: "Cortex-A520",
    0xD81: "Cortex-A720",
    0xD82: "Cortex-X4",
    0xD85: "Cortex-X925",
    0xD87: "Cortex-A725",
}
"""``CPU part`` (MIDR_EL1.PartNum) of Arm's cores, as each core's Technical Reference Manual gives it (the same
numbers as Linux's arch/arm64/include/asm/cputype.h)."""

_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"})
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe"}  # abm: how Linux names LZCNT
X86_64_LEVELS: dict[str, frozenset[str]] = {
    "x86-64": frozenset(),
    "x86-64-v2": _V2,
    "x86-64-v3": _V3,
    "x86-64-v4": _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
}
"""The x86-64 micro-architecture levels (psABI), as the ``flags`` of ``/proc/cpuinfo`` name their features."""

_ARCH_ALIASES = {"arm64": "aarch64", "amd64": "x86_64", "x64": "x86_64"}
_DARWIN_FLAGS = {"sse4.1": "sse4_1", "sse4.2": "sse4_2", "avx1.0": "avx", "lahf": "lahf_lm", "lzcnt": "abm"}
"""macOS's names (``sysctl machdep.cpu.*features``) of the x86 features Linux names otherwise."""


def normalise_arch(name: str) -> str:
    """``uname -m`` spelling: ``arm64`` (macOS) is ``aarch64``, ``AMD64`` (Windows) is ``x86_64``."""
    lowered = name.strip().lower()
    return _ARCH_ALIASES.get(lowered, lowered)


@dataclass(frozen=True)
class Machine:
    """This machine, in the terms a device profile uses."""

    arch: str
    cpu: str
    """What the CPU is, for people: ``AMD EPYC``, ``Raspberry Pi 5 Model B Rev 1.0: 4 x Cortex-A76``."""
    cores: frozenset[str] = field(default_factory=frozenset)
    """The Arm cores present, by name (``ARM_CORES``)."""
    flags: frozenset[str] = field(default_factory=frozenset)
    """x86 CPU features, as ``/proc/cpuinfo`` names them."""
    emulated: str | None = None
    """What emulates this machine's CPU (qemu-user, Rosetta 2), or None."""

    def describe(self) -> str:
        emulated = f", emulated by {self.emulated}" if self.emulated else ""
        return f"{self.arch} ({self.cpu}{emulated})"


def _cpuinfo_fields(text: str) -> list[tuple[str, str]]:
    pairs = []
    for line in text.splitlines():
        key, colon, value = line.partition(":")
        if colon:
            pairs.append((key.strip().lower(), value.strip()))
    return pairs


def _arm_cores(pairs: list[tuple[str, str]]) -> Counter[str]:
    """Arm's cores by name, one count per processor (a part of another implementer is not Arm's core)."""
    cores: Counter[str] = Counter()
    implementer: int | None = None
    for key, value in pairs:
        try:
            number = int(value, 16)
        except ValueError:
            continue
        if key == "cpu implementer":
            implementer = number
        elif key == "cpu part" and implementer == ARM_IMPLEMENTER and number in ARM_CORES:
            cores[ARM_CORES[number]] += 1
    return cores


def from_facts(
    machine: str,
    cpuinfo: str = "",
    *,
    kernel_arch: str | None = None,
    brand: str | None = None,
    translated: bool = False,
    emulator: str | None = None,
) -> Machine:
    """This machine from what it says of itself: ``platform.machine()``, the text of ``/proc/cpuinfo``, the kernel's
    architecture (``/proc/sys/kernel/arch``), a CPU brand string (macOS ``machdep.cpu.brand_string``), whether
    Rosetta 2 translates the process, and what the emulator says it is (``EDGELINE_EMULATOR``, which
    scripts/arm64.sh sets: ``qemu-user 10.0.2 -cpu cortex-a72``): believed only when the kernel's architecture
    shows an emulator, so a stray variable never makes a real device "emulated"."""
    arch = normalise_arch(machine)
    pairs = _cpuinfo_fields(cpuinfo)
    cores = _arm_cores(pairs)
    flags: set[str] = set()
    names: list[str] = []
    for key, value in pairs:
        if key == "flags":
            flags.update(value.split())
        elif (key == "model name" or (key == "model" and not value.isdigit())) and value not in names:
            names.append(value)  # x86's "model name"; a Raspberry Pi's board "Model" (x86's "model" is a number)
    if brand:
        names.insert(0, brand.strip())
    summary = ", ".join(f"{count} x {name}" for name, count in sorted(cores.items()))
    cpu = ": ".join(part for part in (names[0] if names else "", summary) if part) or "CPU not identified"
    emulated = None
    if translated:
        emulated = "Rosetta 2"
    elif kernel_arch and normalise_arch(kernel_arch) != arch:
        kernel = normalise_arch(kernel_arch)
        emulated = (
            f"{emulator} (the kernel is {kernel})"
            if emulator
            else f"qemu-user or another emulator (the kernel is {kernel})"
        )
    return Machine(arch=arch, cpu=cpu, cores=frozenset(cores), flags=frozenset(flags), emulated=emulated)


def _names(cpu: str, name: str) -> bool:
    """Whether ``name`` is a whole name in ``cpu``: ``Cortex-A78`` is not in ``Cortex-A78AE``."""
    return re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", cpu, flags=re.IGNORECASE) is not None


def mismatch(device: Device, machine: Machine) -> str | None:
    """None when ``machine`` is of the kind of ``device``; else why not, as a phrase: ``measured on x86_64 (AMD
    EPYC), not on an aarch64 Cortex-A76``."""
    where = f"measured on {machine.describe()}, not on an {device.arch} {device.cpu}"
    if machine.emulated is not None or normalise_arch(device.arch) != machine.arch:
        return where
    level = X86_64_LEVELS.get(device.cpu.lower())
    if level is not None:
        missing = sorted(level - machine.flags)
        return f"{where} (this CPU lacks {', '.join(missing)})" if missing else None
    if machine.cores:
        return None if any(_names(device.cpu, core) for core in machine.cores) else where
    return None if _names(machine.cpu, device.cpu) else where


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def _sysctl(name: str) -> str | None:
    try:
        done = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else None


@functools.cache
def this_machine() -> Machine:
    """The machine this process runs on (read once)."""
    if platform.system() == "Darwin":
        features = " ".join(
            filter(None, (_sysctl(f"machdep.cpu.{key}") for key in ("features", "leaf7_features", "extfeatures")))
        ).lower()
        flags = " ".join(_DARWIN_FLAGS.get(name, name) for name in features.split())
        return from_facts(
            platform.machine(), f"flags: {flags}\n" if flags else "", brand=_sysctl("machdep.cpu.brand_string"),
            translated=_sysctl("sysctl.proc_translated") == "1",
        )  # fmt: skip
    kernel_arch = _read("/proc/sys/kernel/arch").strip() or None
    emulator = os.environ.get(EMULATOR_ENV, "").strip() or None
    return from_facts(platform.machine(), _read("/proc/cpuinfo"), kernel_arch=kernel_arch, emulator=emulator)
