"""The resident memory a model adds to a process: what ``verify`` measures here and export records in the manifest.

The figure is the process's resident set size (``VmRSS`` in ``/proc/self/status``) after the model was loaded and
run once, minus the same figure before, the model still referenced at the second reading: its weights, arena and
runtime (a runtime library not loaded before counts too: the device's process pays for it as well). Not
``getrusage().ru_maxrss``: that is the process's peak since it started, so in a process that had already peaked
higher (export, after its conversions) loading a model adds nothing to it and the difference reads 0. A transient
peak inside the load, freed before the second reading, is not part of the figure. Linux only (no ``/proc``
elsewhere): None there, and ``UNMEASURABLE`` says why.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path

__all__ = ["UNMEASURABLE", "available_mb", "cgroup_room_mb", "proc_fields", "resident_mb", "resident_mb_added"]

STATUS = Path("/proc/self/status")
MEMINFO = Path("/proc/meminfo")
PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")
UNLIMITED = 1 << 62
"""cgroup v1 says "no limit" with a number near 2**63 (rounded down to a page): anything this large is none."""
UNMEASURABLE = "this system has no /proc/self/status to read the resident set size from (Linux has)"


def proc_fields(path: str | Path) -> dict[str, int]:
    """The ``KEY:  N kB`` lines of a /proc file (``status``, ``meminfo``), in bytes; empty where it cannot be read
    (a process that is gone)."""
    try:
        with open(path, encoding="ascii", errors="replace") as handle:
            text = handle.read(65536)
    except OSError:
        return {}
    fields: dict[str, int] = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        parts = value.split()
        if len(parts) == 2 and parts[1].lower() == "kb" and parts[0].isdigit():
            fields[name] = int(parts[0]) * 1024
    return fields


def _mb_field(path: Path, key: str) -> float | None:
    """A ``KEY:  N kB`` line of a /proc file, in MB; None where the file or the line cannot be read."""
    value = proc_fields(path).get(key)
    return None if value is None else value / 2**20


def resident_mb(status: Path = STATUS) -> float | None:
    """The process's resident set size in MB (MiB, as profiles count ``memory_mb``), or None where unreadable."""
    return _mb_field(status, "VmRSS")


def resident_mb_added(load_and_run: Callable[[], object]) -> float | None:
    """MB of resident memory that ``load_and_run()`` (load a model, run it once, return it) adds to this process
    while what it returns is alive; None where the resident set size cannot be read (``UNMEASURABLE``). Never
    negative: memory the collector happened to free meanwhile is not the model's."""
    gc.collect()
    before = resident_mb()
    if before is None:
        return None
    kept = load_and_run()
    after = resident_mb()
    del kept
    return None if after is None else max(0.0, after - before)


def available_mb(meminfo: Path = MEMINFO, cgroup: Path = PROC_CGROUP, cgroup_root: Path = CGROUP_ROOT) -> float | None:
    """The memory this process can still take without swapping or being killed, in MB: the machine's
    (``MemAvailable`` in ``/proc/meminfo``: free memory plus the caches the kernel would drop), or less where its
    memory cgroup is limited (a systemd unit's ``MemoryMax=``: ``cgroup_room_mb``); None where neither is readable."""
    figures = [f for f in (_mb_field(meminfo, "MemAvailable"), cgroup_room_mb(cgroup, cgroup_root)) if f is not None]
    return min(figures) if figures else None


def cgroup_room_mb(cgroup: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> float | None:
    """MB the memory cgroups of this process still allow (its limit less its usage, at the tightest of its cgroup
    and their parents); None where no limit is set or none can be read. cgroup v2 (``memory.max``,
    ``memory.current``; mounted at ``root`` or, on a hybrid system, ``root/unified``) and v1 (``memory/``:
    ``memory.limit_in_bytes``, ``memory.usage_in_bytes``)."""
    try:
        lines = cgroup.read_text(encoding="ascii", errors="replace").splitlines()
    except OSError:
        return None
    rooms: list[int] = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, relative = fields
        if controllers == "":
            base = root if (root / "cgroup.controllers").is_file() else root / "unified"
            names = ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            base, names = root / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        rooms += _limits_up_to(base, relative, names)
    return min(rooms) / (1 << 20) if rooms else None


def _limits_up_to(base: Path, relative: str, names: tuple[str, str]) -> list[int]:
    """``limit - usage`` of each cgroup from ``base/relative`` up to ``base`` that has a limit (a level this
    namespace cannot see is skipped)."""
    rooms = []
    parts = [p for p in relative.strip().split("/") if p]
    for depth in range(len(parts), -1, -1):
        directory = base.joinpath(*parts[:depth])
        try:
            limit_text = (directory / names[0]).read_text(encoding="ascii").strip()
            usage = int((directory / names[1]).read_text(encoding="ascii").strip())
        except (OSError, ValueError):
            continue
        if limit_text == "max" or not limit_text.isdigit() or int(limit_text) >= UNLIMITED:
            continue
        rooms.append(max(0, int(limit_text) - usage))
    return rooms
